"""SandboxPool: a hard bound on live sandboxes, a FIFO queue of waiters, warm reuse and health checks.

A released sandbox is reset to its pristine snapshot (restore: O(1)) and handed to the next waiter instead of
being rebuilt; one that fails its health check (ping) or its reset is closed and replaced. Processes / mounts
are cleaned up by the hub even if this process is SIGKILLed (see _hub).
"""
from __future__ import annotations

import collections
import contextlib
import threading
import time

from .sandbox import Limits, SandboxError, create


class SandboxPool:
  def __init__(self, max_sandboxes: int, template: str = "python", *, limits: Limits | None = None,
        files=None, hidden_files=None, warm: int = 0):
    if isinstance(max_sandboxes, bool) or not isinstance(max_sandboxes, int) or max_sandboxes < 1:
      raise ValueError(f"max_sandboxes must be an int >= 1, got {max_sandboxes!r}")
    if not isinstance(warm, int) or not 0 <= warm <= max_sandboxes:
      raise ValueError(f"warm must be an int in [0, max_sandboxes], got {warm!r}")
    self.max_sandboxes = max_sandboxes
    self._kw = dict(template=template, limits=limits, files=files, hidden_files=hidden_files)
    self._cv = threading.Condition()
    self._idle = []                  # (sandbox, pristine snapshot id)
    self._live = 0                   # sandboxes that exist (idle + leased); never exceeds max_sandboxes
    self._queue = collections.deque()  # FIFO tickets of waiters
    self._closed = False
    self.stats = collections.Counter()
    for _ in range(warm):
      self._idle.append(self._new())
      self._live += 1

  def _new(self):
    sb = create(**self._kw)
    return sb, sb.snapshot()

  def _wait_turn(self, ready, timeout, what):
    """Under self._cv: queue FIFO until ready() holds for the head of the queue."""
    ticket = object()
    deadline = None if timeout is None else time.monotonic() + timeout
    if self._closed:
      raise SandboxError("SandboxPool is closed")
    self._queue.append(ticket)
    try:
      while not (self._queue[0] is ticket and ready()):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
          raise TimeoutError(f"no room for {what} within {timeout}s (max_sandboxes={self.max_sandboxes})")
        self._cv.wait(left)
        if self._closed:
          raise SandboxError("SandboxPool is closed")
    finally:
      self._queue.remove(ticket)
      self._cv.notify_all()

  def acquire(self, timeout: float | None = None):
    """Lease a sandbox (blocks FIFO while max_sandboxes are out). Returns (sandbox, pristine snapshot)."""
    with self._cv:
      self._wait_turn(lambda: self._idle or self._live < self.max_sandboxes, timeout, "a sandbox")
      item = self._idle.pop() if self._idle else None
      if item is None:
        self._live += 1  # reserve the slot before the (slow) create outside the lock
    if item is not None and not item[0].ping():
      self.stats["unhealthy"] += 1
      item[0].close()
      item = None
    if item is None:
      try:
        item = self._new()
        self.stats["created"] += 1
      except BaseException:
        with self._cv:
          self._live -= 1
          self._cv.notify_all()
        raise
    self.stats["leased"] += 1
    return item

  def release(self, item) -> None:
    sb, pristine = item
    ok = False
    if not sb.closed and not self._closed:
      try:
        sb.restore(pristine)
        ok = sb.ping()
      except SandboxError:
        ok = False
    if not ok:
      sb.close()
    with self._cv:
      if ok and not self._closed:
        self._idle.append(item)
      else:
        self._live -= 1
      self._cv.notify_all()

  @contextlib.contextmanager
  def forked(self, sb, n: int, timeout: float | None = None):
    """n forks of a leased sandbox (e.g. a GRPO group) that count against max_sandboxes like leases do:
    waits FIFO for room (closing idle sandboxes to make it) and closes the forks when the block ends."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.max_sandboxes:
      raise ValueError(f"n must be an int in [1, max_sandboxes={self.max_sandboxes}], got {n!r}")
    with self._cv:
      self._wait_turn(lambda: self._live - len(self._idle) + n <= self.max_sandboxes, timeout, f"{n} forks")
      evict = [self._idle.pop() for _ in range(max(0, self._live + n - self.max_sandboxes))]
      self._live += n - len(evict)
    for idle_sb, _ in evict:
      idle_sb.close()
    kids = []
    try:
      kids = sb.fork(n)
      self.stats["forked"] += n
      yield kids
    finally:
      for k in kids:
        k.close()
      with self._cv:
        self._live -= n
        self._cv.notify_all()

  @contextlib.contextmanager
  def sandbox(self, timeout: float | None = None):
    item = self.acquire(timeout)
    try:
      yield item[0]
    finally:
      self.release(item)

  @property
  def live(self) -> int:
    return self._live

  def close(self) -> None:
    with self._cv:
      self._closed = True
      idle, self._idle = self._idle, []
      self._live -= len(idle)
      self._cv.notify_all()
    for sb, _ in idle:
      sb.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
