"""Host-side AgentEnv API: Limits, ExecResult, Sandbox, create().

Each host process lazily starts one hub (a root helper in its own mount namespace, see _hub) over a unix
socket; lifecycle calls (create / snapshot / restore / fork / close / services) go to the hub, while exec and
file calls go straight to the sandbox's init over a per-sandbox socket.
"""
from __future__ import annotations

import dataclasses
import os
import posixpath
import socket
import subprocess
import threading

from . import _wire as W

HOME = "/home/user"
TEMPLATE_PYTHON = "/usr/bin/python3"
WRITABLE = ("etc", "home", "tmp", "var", "opt", "run", "srv", "mnt")


class SandboxError(RuntimeError):
  """Anything that went wrong inside or around a sandbox."""


class SandboxClosedError(SandboxError):
  """A call on a sandbox after close() (or after its hub went away)."""


class SnapshotNotFoundError(SandboxError, KeyError):
  """restore / drop_snapshot with an id that was never issued, was dropped, or whose owner closed."""

  def __str__(self):
    return str(self.args[0]) if self.args else ""


_REMOTE_ERRORS = {"FileNotFoundError": FileNotFoundError, "IsADirectoryError": IsADirectoryError,
         "NotADirectoryError": NotADirectoryError, "PermissionError": PermissionError,
         "FileExistsError": FileExistsError, "ValueError": ValueError, "KeyError": SnapshotNotFoundError,
         "LookupError": LookupError, "TimeoutError": TimeoutError}


def _raise(reply):
  _, kind, msg = reply
  raise _REMOTE_ERRORS.get(kind, SandboxError)(msg)


@dataclasses.dataclass(frozen=True)
class Limits:
  """Per-sandbox resource limits. memory covers processes and files written (tmpfs) when cgroups exist."""
  memory_mb: int = 512
  pids: int = 128
  cpu_seconds: int = 60
  file_size_mb: int = 256
  timeout: float = 30.0          # default wall-clock limit per exec
  max_output_bytes: int = 1 << 20  # per stream; the rest is dropped and ExecResult.truncated set

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      kinds = (int, float) if f.name == "timeout" else (int,)
      if isinstance(v, bool) or not isinstance(v, kinds):
        raise ValueError(f"Limits.{f.name} must be {'a number' if f.name == 'timeout' else 'an int'},"
                f" got {v!r}")
      if v <= 0:
        raise ValueError(f"Limits.{f.name} must be > 0, got {v!r}")
    if self.memory_mb < 16:
      raise ValueError(f"Limits.memory_mb must be >= 16, got {self.memory_mb}")
    if self.pids < 4:
      raise ValueError(f"Limits.pids must be >= 4, got {self.pids}")

  def to_wire(self):
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ExecResult:
  stdout: bytes
  stderr: bytes
  exit_code: int      # negative: killed by that signal (timeouts are -9)
  timed_out: bool
  truncated: bool = False

  @property
  def ok(self) -> bool:
    return self.exit_code == 0 and not self.timed_out

  @property
  def text(self) -> str:
    return self.stdout.decode("utf-8", "replace")


class _Hub:
  """Connection to this process's hub (restarted after os.fork in the host)."""
  _lock = threading.Lock()
  _inst: "_Hub | None" = None

  def __init__(self):
    ours, theirs = socket.socketpair()
    # The hub, and so every service forked from it, runs the template's own interpreter: a service's later
    # imports must resolve inside the sandbox, where only the host's /usr is visible.
    python = TEMPLATE_PYTHON
    if not os.access(python, os.X_OK):
      raise SandboxError(f"template 'python' needs {python} on the host (the sandbox's userland is the host /usr)")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    boot = (f"import sys; sys.path.insert(0, {repo!r}); from moonshot_jax.agentenv import _hub; "
        f"_hub.main({theirs.fileno()})")
    # A scrubbed environment: inits and services are forks of the hub, and the host's variables (tokens,
    # keys) must not be readable from a service that runs agent-supplied code.
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    env.update({k: v for k, v in os.environ.items() if k in ("AGENTENV_CGROUPS", "AGENTENV_CGROUP_PARENT",
                                                            "AGENTENV_SQUASH_AT", "AGENTENV_RECYCLE_MAX",
                                                            "AGENTENV_SPAWN", "AGENTENV_SPAWN_CACHE", "AGENTENV_CC")})
    self.proc = subprocess.Popen([python, "-I", "-S", "-c", boot], pass_fds=[theirs.fileno()],
                  stdin=subprocess.DEVNULL, close_fds=True, env=env)
    theirs.close()
    self.sock = ours
    self.pid_owner = os.getpid()
    self.lock = threading.Lock()
    ours.settimeout(120)
    try:
      msg = W.recv(ours)
    except (EOFError, OSError) as e:
      raise SandboxError(f"agentenv hub failed to start ({e}); needs root with user+mount namespaces") from e
    if msg[0] != "ready":
      self.proc.wait()
      ours.close()
      raise SandboxError(f"agentenv hub failed to start: {msg[1]}: {msg[2]}")
    self.hub_pid = msg[1]

  @classmethod
  def get(cls) -> "_Hub":
    with cls._lock:
      if cls._inst is None or cls._inst.pid_owner != os.getpid() or cls._inst.proc.poll() is not None:
        cls._inst = _Hub()
      return cls._inst

  def call(self, *req):
    with self.lock:
      try:
        W.send(self.sock, req)
        reply, fds = W.recv(self.sock, with_fds=True)
      except (EOFError, OSError) as e:
        raise SandboxError(f"agentenv hub connection lost: {e}") from e
    if reply[0] != "ok":
      for fd in fds:
        os.close(fd)
      _raise(reply)
    return reply[1], fds


def _norm_files(files, what):
  if files is None:
    return {}
  if not isinstance(files, dict):
    raise TypeError(f"{what} must be a dict {{path: bytes | str}}, got {type(files).__name__}")
  out = {}
  for path, data in files.items():
    if not isinstance(path, str) or not path:
      raise ValueError(f"{what}: bad path {path!r}")
    p = _resolve(HOME, path)
    top = p.strip("/").split("/")[0]
    if top not in WRITABLE or p.strip("/") == top:
      raise ValueError(f"{what}: {path!r} must be a file under one of /{', /'.join(WRITABLE)}")
    if isinstance(data, str):
      data = data.encode()
    if not isinstance(data, (bytes, bytearray)):
      raise TypeError(f"{what}[{path!r}] must be bytes or str, got {type(data).__name__}")
    out[p] = bytes(data)
  return out


def _resolve(cwd: str, path: str) -> str:
  if not isinstance(path, str) or not path or "\0" in path:
    raise ValueError(f"bad sandbox path {path!r}")
  if ".." in path.split("/"):
    raise ValueError(f"sandbox path {path!r} may not contain '..'")
  return posixpath.normpath(posixpath.join(cwd, path))


class Sandbox:
  """One isolated sandbox. Thread-safe (calls on one sandbox are serialised)."""

  def __init__(self, hub: _Hub, sid: str, fd: int, limits: Limits, hidden_files: dict, cwd: str = HOME):
    self._hub, self.id, self.limits = hub, sid, limits
    self._sock = socket.socket(fileno=fd)
    self._hidden = hidden_files
    self._lock = threading.RLock()
    self._closed = False
    self._paused = False
    self.cwd = cwd

  # ---- plumbing ---------------------------------------------------------------------------------------
  def _live(self):
    if self._closed:
      raise SandboxClosedError(f"sandbox {self.id} is closed")
    if self._hub.pid_owner != os.getpid():
      raise SandboxClosedError(f"sandbox {self.id} belongs to the parent process")

  def _init(self, *req):
    with self._lock:
      self._live()
      if self._paused:  # its init is frozen: the call would hang until resume()
        raise SandboxError(f"sandbox {self.id} is paused; resume() it first")
      try:
        W.send(self._sock, req)
        reply = W.recv(self._sock)
      except (EOFError, OSError) as e:
        raise SandboxError(f"sandbox {self.id} died ({e})") from e
    if reply[0] != "ok":
      _raise(reply)
    return reply[1]

  def _hubcall(self, *req):
    with self._lock:
      self._live()
      return self._hub.call(*req)

  # ---- commands and files -----------------------------------------------------------------------------
  def _timeout(self, timeout) -> float:
    """A command's timeout: the sandbox's limit if None, else a positive number."""
    if timeout is None:
      timeout = self.limits.timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
      raise ValueError(f"timeout must be a positive number, got {timeout!r}")
    return timeout

  @staticmethod
  def _argv(cmd) -> list:
    if isinstance(cmd, str):
      return ["/bin/sh", "-c", cmd]
    if isinstance(cmd, (list, tuple)) and cmd and all(isinstance(a, str) for a in cmd):
      if not cmd[0]:
        raise ValueError(f"cmd[0] must name a program, got {cmd!r}")
      return list(cmd)
    raise TypeError(f"cmd must be a str or a non-empty list of str, got {cmd!r}")

  def exec(self, cmd, *, stdin=None, timeout=None, cwd=None, env=None) -> ExecResult:
    """Run `cmd` (str: via /bin/sh -c; list: argv) as uid 1000; everything it starts dies with it."""
    argv = self._argv(cmd)
    timeout = self._timeout(timeout)
    if isinstance(stdin, str):
      stdin = stdin.encode()
    if stdin is not None and not isinstance(stdin, (bytes, bytearray)):
      raise TypeError(f"stdin must be bytes, str or None, got {type(stdin).__name__}")
    env = {str(k): str(v) for k, v in (env or {}).items()}
    r = self._init("exec", argv, _resolve(self.cwd, cwd or "."), env,
           None if stdin is None else bytes(stdin), float(timeout))
    return ExecResult(**r)

  _AGENT_OPS = ("read", "list", "write")

  def agent_op(self, op: str, path: str, data=None) -> ExecResult | None:
    """What `cat -- path` ("read"), `ls -1 -- path` ("list") or `cat > path` with `data` on stdin ("write")
    return as commands, answered by the sandbox's init without starting a process, with the agent's file
    permissions, a missing plain name included (its error message and exit code, as the host's own `cat` / `ls`
    print them); None where only the command gives the exact result (other errors, special files, odd names, ...):
    then run it. Saves the ~5-12 ms of CPU of a command's process chain on the commonest tool calls."""
    if op not in self._AGENT_OPS:
      raise ValueError(f"agent_op: op {op!r}; expected one of {self._AGENT_OPS}")
    if op != "list" and (path == "-" or path.endswith("/")):
      return None  # stdin for cat; "not a directory" errors that normalising the path would hide
    try:
      p = _resolve(self.cwd, path)
    except ValueError:
      return None
    if op == "write":
      data = data.encode() if isinstance(data, str) else data
      if not isinstance(data, (bytes, bytearray)):
        raise TypeError(f"data must be bytes or str, got {type(data).__name__}")
      done = self._init("agent_write", p, bytes(data))
      out = b"" if done else None
    else:
      out = self._init("agent_" + op, p, path)
    if out is None:
      return None
    if isinstance(out, dict):  # a missing file: the command's error message and exit code
      return ExecResult(stdout=out["stdout"], stderr=out["stderr"], exit_code=out["exit_code"], timed_out=False)
    return ExecResult(stdout=out, stderr=b"", exit_code=0, timed_out=False, truncated=False)

  def read_file(self, path: str) -> bytes:
    return self._init("read", _resolve(self.cwd, path))

  def write_file(self, path: str, data, mode: int = 0o644) -> None:
    if isinstance(data, str):
      data = data.encode()
    if not isinstance(data, (bytes, bytearray)):
      raise TypeError(f"data must be bytes or str, got {type(data).__name__}")
    self._init("write", _resolve(self.cwd, path), bytes(data), int(mode))

  def list_dir(self, path: str = ".") -> list:
    return self._init("list", _resolve(self.cwd, path))

  def ping(self) -> bool:
    try:
      return self._init("ping") == "pong"
    except SandboxError:
      return False

  # ---- services ---------------------------------------------------------------------------------------
  def start_service(self, name: str, source: str) -> None:
    """Start a long-lived Python service (source defines handle(request: str) -> str)."""
    if not isinstance(source, str):
      raise TypeError("service source must be a str of Python code")
    self._hubcall("start_service", self.id, name, source)

  def stop_service(self, name: str) -> None:
    self._hubcall("stop_service", self.id, name)

  def call_service(self, name: str, request, timeout: float = 10.0) -> str:
    if isinstance(request, str):
      request = request.encode()
    return self._init("call", name, bytes(request), float(timeout)).decode("utf-8", "replace")

  # ---- snapshot / restore / fork ----------------------------------------------------------------------
  def snapshot(self) -> str:
    return self._hubcall("snapshot", self.id)[0]

  def restore(self, snapshot_id: str) -> None:
    self._hubcall("restore", self.id, snapshot_id)

  def drop_snapshot(self, snapshot_id: str) -> None:
    self._hubcall("drop_snapshot", snapshot_id)

  def fork(self, n: int = 1) -> list:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise ValueError(f"fork(n) needs an int n >= 1, got {n!r}")
    sids, fds = self._hubcall("fork", self.id, n)
    return [Sandbox(self._hub, s, fd, self.limits, dict(self._hidden), self.cwd) for s, fd in zip(sids, fds)]

  def exec_python(self, path: str, args=(), *, timeout=None, cwd=None, env=None) -> ExecResult:
    """What exec(["python3", "-I", "-S", path, *args]) returns, with the same isolation (uid 1000, this sandbox's
    files, no network, its cgroups and limits, timeout -> killed, nothing outlives it), but run by a fork of a
    pre-started interpreter (the hub's check zygote), so no interpreter start (~30 ms of CPU). Differences a
    program could notice: the zygote's hash seed and already-imported modules (see _pyrun)."""
    if isinstance(args, str) or not all(isinstance(a, str) for a in args):
      raise TypeError(f"args must be a sequence of str, got {args!r}")
    timeout = self._timeout(timeout)
    env = {str(k): str(v) for k, v in (env or {}).items()}  # on top of exec's environment (_init.Init.exec)
    with self._lock:
      _, fds = self._hubcall("exec_python", self.id, [_resolve(self.cwd, path), *args],
                 _resolve(self.cwd, cwd or "."), env, float(timeout))
      return self._check_result(fds[0], timeout)

  def _check_result(self, fd: int, timeout: float) -> ExecResult:
    """The result dict a check process (the hub's check zygote's fork) sends on socket fd."""
    sock = socket.socket(fileno=fd)
    sock.settimeout(timeout + 30)  # the check's own watcher kills it at `timeout`; this only guards the channel
    try:
      reply = W.recv(sock)
    except (EOFError, OSError) as e:
      raise SandboxError(f"sandbox {self.id}: check lost ({e})") from e
    finally:
      sock.close()
    if reply[0] != "ok":
      _raise(reply)
    return ExecResult(**reply[1])

  def exec_hidden(self, cmd, *, timeout=None, files=None, python=False) -> ExecResult:
    """Run a verifier command (as exec: uid 1000, this sandbox's cgroups and limits, timeout -> killed, nothing
    outlives it) where the hidden files (and `files`) exist but this sandbox never sees them or anything the
    command does: in a private copy of its file tree (an overlay whose lower layer is this sandbox's files and
    whose upper layer, holding the hidden files and every write, is a fresh tmpfs that goes with the command)
    and fresh network / IPC namespaces. python=True: `cmd` is the path of a Python file, run as exec_python
    runs it. A sandbox with services runs it in a throwaway fork instead, which gets copies of them."""
    hidden = dict(self._hidden)
    hidden.update(_norm_files(files, "files"))
    timeout = self._timeout(timeout)
    argv = [_resolve(self.cwd, cmd)] if python else self._argv(cmd)
    with self._lock:
      _, fds = self._hubcall("exec_hidden", self.id, hidden, argv, _resolve(self.cwd, "."), {}, float(timeout),
                             bool(python))
      if fds:
        return self._check_result(fds[0], timeout)
    return self._exec_hidden_forked(cmd, timeout, hidden, python)

  def _exec_hidden_forked(self, cmd, timeout, hidden, python) -> ExecResult:
    """exec_hidden in a throwaway fork that also holds the hidden files."""
    (child,) = self.fork(1)
    try:
      for p, data in hidden.items():
        child.write_file(p, data)
      return child.exec_python(cmd, timeout=timeout) if python else child.exec(cmd, timeout=timeout)
    finally:
      child.close()

  # ---- pause / introspection --------------------------------------------------------------------------
  def pause(self) -> None:
    """Freeze every process of the sandbox (its v2 cgroup, else the v1 freezer): memory and files stay, CPU use
    stops. Other calls fail until resume(); close() works. Needs a freezer cgroup (info()["freezer"]); a clear
    error otherwise."""
    self._hubcall("pause", self.id, True)
    self._paused = True

  def resume(self) -> None:
    self._hubcall("pause", self.id, False)
    self._paused = False

  @property
  def paused(self) -> bool:
    return self._paused

  def info(self) -> dict:
    """Where this sandbox's limits live: `cgroups` {controller: "v1 DIR" | "v2 DIR"}, `cgroup_v2` (its v2
    cgroup or None), `freezer` ("v1 DIR" | "v2 DIR" | None: what pause() uses), `rlimit_fallback` {controller:
    why rlimits stand in for a missing cgroup}; plus paused, services, snapshots, layers."""
    return self._hubcall("info", self.id)[0]

  # ---- lifetime ---------------------------------------------------------------------------------------
  @property
  def closed(self) -> bool:
    return self._closed

  def close(self) -> None:
    with self._lock:
      if self._closed:
        return
      self._closed = True
      self._sock.close()
      if self._hub.pid_owner == os.getpid():
        try:
          self._hub.call("close", self.id)
        except SandboxError:
          pass

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def __repr__(self):
    return f"Sandbox({self.id}{', closed' if self._closed else ''})"


def create(template: str = "python", *, limits: Limits | None = None, files=None, hidden_files=None,
           recycle: bool = False, backend: str = "local", **backend_kw) -> Sandbox:
  """A new sandbox from `template` ("python"), with optional task `files` (read-only layer, copy-on-write)
  and `hidden_files` (kept outside; see Sandbox.exec_hidden). backend="ray": the same API served by a
  sandbox-host actor on a Ray node (ray_backend.py; Ray imported only then; `node_id=` picks the node).

  recycle=True (opt-in; the RL rollouts use it): this sandbox and its forks may be served by a recycled init, and
  go back to the hub's pool on close() unless paused (or, on a hub without cgroups, AGENTENV_CGROUPS=0, if they
  ever ran a service): everything in them is killed (services, their snapshot images and whatever they left
  running: found through the sandbox's cgroups), their files dropped, their IPC / network namespaces (a service's
  socket name with them; kept if no process but init ever entered them) and host channel replaced, and the next
  user gets a new id (a handle of the previous user cannot reach it). A rollout's sandbox life cycle (create, fork,
  close) then costs ~1-3 ms of CPU instead of ~12-18 (measured, sessions 23-24). What the users of one recycled
  init share: its cgroup directories (named by the first user's id; cumulative counters) and its hostname / mount
  namespace (neither changeable by uid 1000). The pool keeps at most AGENTENV_RECYCLE_MAX idle inits (default 512,
  ~2 MB each). See _hub.Hub._recycle; agentenv.drop_recycled() frees the pool."""
  if not isinstance(recycle, bool):
    raise TypeError(f"recycle must be a bool, got {type(recycle).__name__}")
  if backend == "ray":
    from . import ray_backend
    if recycle:
      backend_kw["recycle"] = True  # (served by the node's local hub)
    return ray_backend.create(template, limits=limits, files=files, hidden_files=hidden_files, **backend_kw)
  if backend != "local" or backend_kw:
    raise ValueError(f"backend={backend!r} (options {sorted(backend_kw)}); expected 'local' or 'ray'")
  if not isinstance(template, str):
    raise ValueError(f"template must be a str, got {template!r}")
  if template != "python":
    raise ValueError(f"unknown template {template!r} (available: 'python')")
  if limits is None:
    limits = Limits()
  if not isinstance(limits, Limits):
    raise TypeError(f"limits must be agentenv.Limits, got {type(limits).__name__}")
  task = _norm_files(files, "files")
  hidden = _norm_files(hidden_files, "hidden_files")
  hub = _Hub.get()
  sid, fds = hub.call("create", template, task, limits.to_wire(), recycle)
  return Sandbox(hub, sid, fds[0], limits, hidden)


def hub_stats() -> dict:
  """Bookkeeping counters of this process's hub (sandboxes, snapshots, layers, pending cleanup; `pooled`: idle
  recycled inits, `recycled`: sandboxes served by one so far; `spawn`: "helper" where commands start through the
  compiled spawn helper, "fork" where they fork init, with `spawn_why` saying why: see agentenv/_spawn.py)."""
  return _Hub.get().call("stats")[0]


def drop_recycled() -> int:
  """Kill the idle recycled inits this process's hub keeps (create(recycle=True)) and return how many: ~2 MB of
  memory each, and processes a leak check would count. The hub kills them anyway when it exits."""
  return _Hub.get().call("drop_recycled")[0]
