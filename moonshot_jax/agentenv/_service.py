"""In-sandbox services: long-lived Python processes whose in-memory state survives snapshot / restore / fork.

A service lives in the hub's PID namespace (so the agent cannot see or signal it) but in the sandbox's user
(uid 0 there), mount, network, IPC and UTS namespaces, and listens on the abstract unix socket
"@agentenv-svc-<name>" of the sandbox's network namespace. Frames are 4-byte little-endian length + bytes.

Snapshot = the service forks an *image* (a frozen copy that only waits on its control socket). Restore / fork
asks the image for a live copy (a pre-forked spare where it has one); the copy joins the target sandbox's
namespaces and starts serving, on its predecessor's listening socket where it replaces one (restore).
Only plain data crosses the control socket (see _wire); handler code is trusted environment code.

Services fork from the service zygote (main below): a fresh interpreter the hub starts by exec (see _zygote), not a
fork of the hub, so a service never holds other sandboxes' task files or service sources, and each service, image
and copy forks an interpreter that imports only this module's few dependencies (no threading: its at-fork hook alone
is ~130 page faults per fork; random is needed, services reseed it on fork).
"""
import errno
import os
import random
import select
import signal
import socket
import struct
import traceback

from . import _cgroup
from . import _sys as S
from . import _wire as W
from . import _zygote

SVC_PREFIX = "\0agentenv-svc-"
# A handler that runs longer is interrupted (a source may set its own REQUEST_SECONDS), so a snapshot, which
# queues behind the request in progress, never waits on a hung service for long.
REQUEST_SECONDS = 10.0


def _alarm(signum, frame):
  raise TimeoutError("service request ran longer than its REQUEST_SECONDS")


join = S.join_namespaces  # (in _sys: the check zygote uses it and must not import this module, see _check)


def listen(name):
  """Bind @agentenv-svc-<name> in the current net namespace. Only a service starting in a fresh namespace, or
  after stop_service waited for its predecessor, binds: a restored copy takes over its predecessor's listening
  socket instead, so the name is never free in between (and no agent process can take it meanwhile)."""
  ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  try:
    ls.bind(SVC_PREFIX + name)
  except OSError as e:
    ls.close()
    if e.errno == errno.EADDRINUSE:
      raise RuntimeError(f"service name {name!r} is taken by another socket in this sandbox") from e
    raise
  ls.listen(64)
  return ls


def ready(ctl, listener):
  """Tell the hub we serve; it keeps the listening socket so that a restore can hand it to our successor."""
  W.send(ctl, ("ok", os.getpid()), fds=[listener.fileno()])


class Service:
  def __init__(self, name, ns, ctl, lifeline, listener):
    self.name, self.ns, self.ctl, self.lifeline, self.listener = name, ns, ctl, lifeline, listener

  def _answer(self, conn):
    conn.settimeout(5.0)  # a client that never finishes its request must not wedge the service
    try:
      n = struct.unpack("<I", W._recv_exact(conn, 4))[0]
      req = W._recv_exact(conn, n).decode("utf-8", "replace")
      signal.setitimer(signal.ITIMER_REAL, float(self.ns.get("REQUEST_SECONDS", REQUEST_SECONDS)))
      try:
        resp = str(self.ns["handle"](req))
      except Exception:
        resp = "ERROR " + traceback.format_exc(limit=3)
      finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
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
    signal.signal(signal.SIGALRM, _alarm)
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
  """A frozen copy of a service. Each spawn request gets a live copy; after one that says more will follow
  (restore: the snapshot stays; fork: children still to go) the image pre-forks a spare copy blocked on its
  control socket, so the next restore (or child) costs a wake-up, not a fork: the fork and the child's first
  page faults happen off the caller's path."""

  def __init__(self, name, ns, ctl, lifeline):
    self.name, self.ns, self.ctl, self.lifeline = name, ns, ctl, lifeline
    self.spare = None  # hub-side end of the spare's control socket

  def loop(self):
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # copies (live or spare) are reaped by the kernel
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
          os._exit(0)  # snapshot dropped (a spare sees its socket close and follows)
        if req[0] != "spawn":
          os._exit(0)
        a = self.spare or self._fork_copy()
        self.spare = None
        try:
          W.send(a, ("go",) + tuple(req[2:]), fds=fds)
        finally:
          for f in fds:
            os.close(f)
        W.send(self.ctl, ("ok",), fds=[a.fileno()])  # the hub reads the copy's ("ok", pid) from here on
        a.close()
        if req[1]:  # more copies will be asked for (restore: the snapshot stays; fork: children to go)
          try:
            self.spare = self._fork_copy()
          except OSError:  # e.g. the sandbox's pids limit: the next spawn forks on demand
            self.spare = None

  def _fork_copy(self):
    """Fork a copy that waits for ("go", reseed, n_cg, has_listener) + fds on its control socket; returns our
    end. fds: the target sandbox's mnt / net / ipc / uts namespaces, n_cg cgroup files to join (v1 `tasks`, v2 cgroup.procs), and the
    listening socket to take over (restore) if has_listener."""
    a, b = socket.socketpair()
    state = random.getstate()
    pid = os.fork()
    if pid == 0:
      try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the image auto-reaps; the live service must not
        random.setstate(state)  # restore = exact state; fork (reseed) draws fresh entropy below
        a.close()
        self.ctl.close()
        if self.spare is not None:
          self.spare.close()
        S.set_name("agentenv-spare")
        self._copy_main(b)
      except BaseException:
        try:
          W.send(b, ("err", "RuntimeError", traceback.format_exc(limit=4)))
        except OSError:
          pass
      finally:
        os._exit(1)
    b.close()
    return a

  def _copy_main(self, b):
    poller = select.poll()
    poller.register(b.fileno(), select.POLLIN)
    poller.register(self.lifeline, select.POLLIN)
    if b.fileno() not in dict(poller.poll()):
      os._exit(0)  # lifeline broke: the hub is gone
    try:
      (_, reseed, n_cg, has_listener), fds = W.recv(b, with_fds=True)
    except (EOFError, OSError):
      os._exit(0)  # our image went away before using us
    S.set_name("agentenv-svc")
    join(fds[:4])
    for fd in fds[4:4 + n_cg]:  # the target sandbox's cgroups (fork / a fork's restore)
      S.cg_join_self(fd)
      os.close(fd)
    if reseed:
      random.seed()
      if "on_fork" in self.ns:
        self.ns["on_fork"]()
    ls = socket.socket(fileno=fds[4 + n_cg]) if has_listener else listen(self.name)
    ready(b, ls)
    Service(self.name, self.ns, b, self.lifeline, ls).loop()


def main(ctl_fd, lifeline):
  """The service zygote's entry point (never returns). First request: ("setup",) with the sandboxes' user namespace
  fd (made after the zygote starts); it answers ("ready", pid), then forks a service per ("start", name, source, cg)
  request until the hub's lifeline breaks."""
  _zygote.serve("agentenv-zyg", "service zygote", ctl_fd, lifeline, _preload, _zygote_loop)


def _preload():
  import json  # noqa: F401  (before any fork: what the task mix's service sources import, see tasks.KV_SERVICE)


def _zygote_loop(ctl, lifeline, userns):
  signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # services are our children; the kernel reaps them
  for (_, name, source, cg), ns_fds in W.requests(ctl, lifeline):
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:
      try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        _cgroup.join(cg)
        S.close_except(set(ns_fds) | {b.fileno(), lifeline, userns, 2})
        S.enter_userns(userns)
        os.close(userns)
      except BaseException:
        traceback.print_exc()
        os._exit(1)
      start(name, source, ns_fds, b, lifeline)
    for f in ns_fds:
      os.close(f)
    b.close()
    W.send(ctl, ("ok", pid), fds=[a.fileno()])
    a.close()


def start(name, source, ns_fds, ctl, lifeline):
  """In a process freshly forked from the service zygote (already uid 0 of the user ns): compile + serve. No
  return."""
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
    ready(ctl, ls)
    Service(name, ns, ctl, lifeline, ls).loop()
  except BaseException as e:
    try:
      W.send(ctl, ("err", type(e).__name__, f"{e}\n{traceback.format_exc(limit=4)}"))
    except OSError:
      pass
  os._exit(1)
