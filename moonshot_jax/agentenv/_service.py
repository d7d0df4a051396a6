"""In-sandbox services: long-lived Python processes whose in-memory state survives snapshot / restore / fork.

A service lives in the hub's PID namespace (so the agent cannot see or signal it) but in the sandbox's user
(uid 0 there), mount, network, IPC and UTS namespaces, and listens on the abstract unix socket
"@agentenv-svc-<name>" of the sandbox's network namespace. Frames are 4-byte little-endian length + bytes.

Snapshot = the service forks an *image* (a frozen copy that only waits on its control socket). Restore / fork
asks the image to fork again; the new copy joins the target sandbox's namespaces and starts serving.
Only plain data crosses the control socket (see _wire); handler code is trusted environment code.
"""
import errno
import os
import random
import select
import socket
import struct
import sys
import time
import traceback

from . import _sys as S
from . import _wire as W

SVC_PREFIX = "\0agentenv-svc-"
_NS_ORDER = (S.CLONE_NEWNS, S.CLONE_NEWNET, S.CLONE_NEWIPC, S.CLONE_NEWUTS)


def join(ns_fds):
  """Enter a sandbox's mount/net/ipc/uts namespaces (caller is already uid 0 of the shared user ns)."""
  for fd, kind in zip(ns_fds, _NS_ORDER):
    S.setns(fd, kind)
    os.close(fd)
  os.chdir("/")


def listen(name):
  """Bind @agentenv-svc-<name>; a predecessor killed by restore may take a moment to let go of the name."""
  ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  deadline = time.monotonic() + 2.0
  while True:
    try:
      ls.bind(SVC_PREFIX + name)
      break
    except OSError as e:
      if e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
        raise
      time.sleep(0.002)
  ls.listen(64)
  return ls


class Service:
  def __init__(self, name, ns, ctl, lifeline, listener):
    self.name, self.ns, self.ctl, self.lifeline, self.listener = name, ns, ctl, lifeline, listener

  def _answer(self, conn):
    conn.settimeout(5.0)  # a client that never finishes its request must not wedge the service
    try:
      n = struct.unpack("<I", W._recv_exact(conn, 4))[0]
      req = W._recv_exact(conn, n).decode("utf-8", "replace")
      try:
        resp = str(self.ns["handle"](req))
      except Exception:
        resp = "ERROR " + traceback.format_exc(limit=3)
      data = resp.encode()
      conn.sendall(struct.pack("<I", len(data)) + data)
    except (OSError, EOFError, struct.error):
      pass
    finally:
      conn.close()

  def _image(self):
    """Fork a frozen copy of this process; returns (pid, hub-side control socket)."""
    a, b = socket.socketpair()
    state = random.getstate()  # CPython reseeds `random` in every fork child; the image must keep ours
    pid = os.fork()
    if pid == 0:
      random.setstate(state)
      try:
        a.close()
        self.listener.close()
        self.ctl.close()
        S.set_name("agentenv-img")
        Image(self.name, self.ns, b, self.lifeline).loop()
      finally:
        os._exit(0)
    b.close()
    return pid, a

  def loop(self):
    poller = select.poll()
    poller.register(self.listener.fileno(), select.POLLIN)
    poller.register(self.ctl.fileno(), select.POLLIN)
    poller.register(self.lifeline, select.POLLIN)
    while True:
      for fd, _ in poller.poll():
        if fd == self.lifeline:
          os._exit(0)
        if fd == self.listener.fileno():
          try:
            conn, _ = self.listener.accept()
          except OSError:
            continue
          self._answer(conn)
          continue
        try:
          req = W.recv(self.ctl)
        except (EOFError, OSError):
          os._exit(0)  # hub dropped us (stop_service / close)
        if req[0] == "image":
          pid, sock = self._image()
          W.send(self.ctl, ("ok", pid), fds=[sock.fileno()])
          sock.close()
        else:
          W.send(self.ctl, ("err", "ValueError", f"unknown service op {req[0]!r}"))


class Image:
  def __init__(self, name, ns, ctl, lifeline):
    self.name, self.ns, self.ctl, self.lifeline = name, ns, ctl, lifeline

  def loop(self):
    poller = select.poll()
    poller.register(self.ctl.fileno(), select.POLLIN)
    poller.register(self.lifeline, select.POLLIN)
    while True:
      for fd, _ in poller.poll():
        if fd == self.lifeline:
          os._exit(0)
        try:
          req, fds = W.recv(self.ctl, with_fds=True)
        except (EOFError, OSError):
          os._exit(0)  # snapshot dropped
        if req[0] != "spawn":
          os._exit(0)
        self._spawn(fds, reseed=req[1])

  def _spawn(self, ns_fds, reseed):
    a, b = socket.socketpair()
    state = random.getstate()
    pid = os.fork()
    if pid == 0:
      try:
        if os.fork():  # double fork: the live copy is re-parented to the hub (a subreaper)
          os._exit(0)
        random.setstate(state)  # restore = exact state; fork (reseed) draws fresh entropy below
        a.close()
        self.ctl.close()
        S.set_name("agentenv-svc")
        join(ns_fds)
        if reseed:
          random.seed()
          if "on_fork" in self.ns:
            self.ns["on_fork"]()
        ls = listen(self.name)
        W.send(b, ("ok", os.getpid()))
        Service(self.name, self.ns, b, self.lifeline, ls).loop()
      except BaseException:
        try:
          W.send(b, ("err", "RuntimeError", traceback.format_exc(limit=4)))
        except OSError:
          pass
      finally:
        os._exit(1)
    for fd in ns_fds:
      os.close(fd)
    b.close()
    os.waitpid(pid, 0)
    W.send(self.ctl, ("ok",), fds=[a.fileno()])
    a.close()


def start(name, source, ns_fds, ctl, lifeline):
  """In a process freshly forked from the hub (already uid 0 of the user ns): compile + serve. No return."""
  try:
    S.set_name("agentenv-svc")
    join(ns_fds)
    ns = {"__name__": f"agentenv_service_{name}"}
    exec(compile(source, f"<service {name}>", "exec"), ns)
    if not callable(ns.get("handle")):
      raise ValueError(f"service {name!r}: source must define handle(request: str) -> str")
    if callable(ns.get("init")):
      ns["init"]()
    ls = listen(name)
    W.send(ctl, ("ok", os.getpid()))
    Service(name, ns, ctl, lifeline, ls).loop()
  except BaseException as e:
    try:
      W.send(ctl, ("err", type(e).__name__, f"{e}\n{traceback.format_exc(limit=4)}"))
    except OSError:
      pass
  os._exit(1)
