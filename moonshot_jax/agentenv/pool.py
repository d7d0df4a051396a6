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

  def acquire(self, timeout: float | None = None):
    """Lease a sandbox (blocks FIFO while max_sandboxes are out). Returns (sandbox, pristine snapshot)."""
    ticket = object()
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._cv:
      if self._closed:
        raise SandboxError("SandboxPool is closed")
      self._queue.append(ticket)
      try:
        while not (self._queue[0] is ticket and (self._idle or self._live < self.max_sandboxes)):
          left = None if deadline is None else deadline - time.monotonic()
          if left is not None and left <= 0:
            raise TimeoutError(f"no sandbox free within {timeout}s ({self.max_sandboxes} leased)")
          self._cv.wait(left)
          if self._closed:
            raise SandboxError("SandboxPool is closed")
      finally:
        self._queue.remove(ticket)
        self._cv.notify_all()
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
