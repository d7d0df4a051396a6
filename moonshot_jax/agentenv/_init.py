"""Sandbox init: pid 1 of a sandbox's PID namespace, root of its user namespace (uid 100000 on the host).

Forked from the hub; builds the sandbox root (a small tmpfs "shell" with the host userland bound read-only and
an overlay at /r for everything writable), pivot_roots into it and then serves requests from the host (exec,
files, service calls) and the hub (ping). The hub itself mounts / swaps the overlay at /r.
Each exec runs as uid 1000 in a child PID namespace so that nothing it starts outlives it.
A recycled init (create(recycle=True), see _hub.Hub._recycle) serves a later sandbox after Init.recycle.
"""
import errno
import fcntl
import os
import re
import resource
import select
import signal
import socket
import stat
import struct
import time
import traceback

from . import _pyrun
from . import _seccomp
from . import _sys as S
from . import _wire as W

WRITABLE = ("etc", "home", "tmp", "var", "opt", "run", "srv", "mnt")
HOST_TOP = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
DEVICES = ("null", "zero", "full", "random", "urandom")
USER_UID = 1000
HOME = "/home/user"
PATH = "/opt/agentenv/bin:/usr/local/bin:/usr/bin:/bin"
SVC_PREFIX = "\0agentenv-svc-"
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
# What `cat -- NAME` ("read") / `ls -1 -- NAME` ("list") print for a missing NAME: op -> (stderr before NAME, stderr
# after it, exit code), measured by the hub with the host's own binaries before it forks any init (_hub.probe_missing;
# empty: every miss runs the command). Only for names that neither tool quotes or escapes in its message.
MISSING = {}
PLAIN_NAME = re.compile(r"[A-Za-z0-9_./][A-Za-z0-9_./-]*")  # no leading "-", nothing a message quotes


def build_root(shell, layers):
  """Runs inside the fresh mount namespace (still seeing the hub's tree); ends with cwd=/ in the new root.
  /r stays empty: the hub mounts the overlay there (see _hub.Hub._mount_layers)."""
  S.mount("agentenv-root", shell, "tmpfs", S.MS_NOSUID | S.MS_NODEV, "size=1m,mode=0755")
  for d in ("r", "proc", "dev", ".old"):
    os.mkdir(f"{shell}/{d}")
  # The layer store must stay mounted in this namespace for later overlay mounts (the kernel only takes
  # layers from mounts of the caller's namespace). It is 0700 in-sandbox root: uid 1000 cannot enter it.
  os.mkdir(f"{shell}/.store", 0o700)
  S.mount(layers, f"{shell}/.store", None, S.MS_BIND)
  os.mkdir(f"{shell}/usr")
  S.mount("/usr", f"{shell}/usr", None, S.MS_BIND | S.MS_REC)
  S.mount(None, f"{shell}/usr", None, S.MS_REMOUNT | S.MS_BIND | S.MS_RDONLY | S.MS_NOSUID | S.MS_NODEV)
  for d in HOST_TOP:
    p = "/" + d
    if os.path.islink(p):
      os.symlink(os.readlink(p), f"{shell}/{d}")
    elif os.path.isdir(p):
      os.mkdir(f"{shell}/{d}")
      S.mount(p, f"{shell}/{d}", None, S.MS_BIND | S.MS_REC)
      S.mount(None, f"{shell}/{d}", None, S.MS_REMOUNT | S.MS_BIND | S.MS_RDONLY | S.MS_NOSUID | S.MS_NODEV)
  for d in WRITABLE:
    os.symlink(f"r/{d}", f"{shell}/{d}")
  for dev in DEVICES:
    open(f"{shell}/dev/{dev}", "w").close()
    S.mount(f"/dev/{dev}", f"{shell}/dev/{dev}", None, S.MS_BIND)
  for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
            ("stderr", "/proc/self/fd/2"), ("shm", "/tmp")):
    os.symlink(target, f"{shell}/dev/{name}")
  S.mount("proc", f"{shell}/proc", "proc", S.MS_NOSUID | S.MS_NODEV | S.MS_NOEXEC)
  S.pivot_root(shell, f"{shell}/.old")
  os.chdir("/")
  S.umount("/.old", S.MNT_DETACH)
  os.rmdir("/.old")
  S.mount(None, "/", None, S.MS_REMOUNT | S.MS_RDONLY | S.MS_NOSUID | S.MS_NODEV)


def loopback_up():
  s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
  try:
    ifr = struct.pack("16sH14x", b"lo", 0)
    flags = struct.unpack("16sH14x", fcntl.ioctl(s, _SIOCGIFFLAGS, ifr))[1]
    fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))
  finally:
    s.close()


# What exec resets to the default before the command starts (and the signal mask it empties): an ignored disposition
# survives exec, and init ignores what Python ignores (SIGPIPE, SIGXFSZ: `yes | head -1` would end with "Broken pipe"
# errors, a write past RLIMIT_FSIZE with EFBIG instead of the signal a shell's commands get) plus whatever the host
# process that started the hub ignored (nohup: SIGHUP; a background job of a non-interactive shell: SIGINT, SIGQUIT).
RESTORED_SIGNALS = tuple(sorted(signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}))
_HELPER_FDS = 5  # the spawn helper's fixed fds 0-4 (see _spawn.c); what init hands it must lie above


def _above_helper_fds(fd):
  """fd itself if it is >= _HELPER_FDS, else a close-on-exec copy above (the original closed): posix_spawn's dup2
  actions fill 0-4 in order, so a source among them could be overwritten before it is copied."""
  if fd < _HELPER_FDS:
    new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, _HELPER_FDS)
    os.close(fd)
    return new
  return fd


class Init:
  def __init__(self, host, hub, lifeline, limits, cgroups, agent_cg, spawn_fd=-1):
    self.agent_cg = agent_cg  # fd of the agent memory cgroup's v1 `tasks` / v2 cgroup.procs file (or -1)
    self._own_pidns = None  # fd of this process's PID namespace, the parent of its commands' (see exec)
    self.host, self.hub, self.lifeline = host, hub, lifeline
    self.limits, self.cgroups = limits, cgroups
    self.ns_used = False  # a command ran in this init's network / IPC namespaces since they were made (see recycle)
    # The compiled spawn helper (_spawn.py; -1: commands fork this process) and the seccomp program it installs
    self.spawn_fd = self.seccomp_fd = -1
    if spawn_fd >= 0:
      self.spawn_fd = _above_helper_fds(spawn_fd)
      if agent_cg >= 0:
        self.agent_cg = _above_helper_fds(agent_cg)
      if _seccomp.supported():
        self.seccomp_fd = _above_helper_fds(_seccomp.program_fd())

  # ---- exec -------------------------------------------------------------------------------------------
  def _child(self, argv, cwd, env, stdin_fd, out_w, err_w, python=False):
    """Runs in P (pid 1 of a fresh PID namespace): drop to uid 1000 and exec (python=True: run the Python file
    argv[0] in this interpreter instead, see _pyrun; only the check zygote's forks do that, never init's)."""
    if self.agent_cg >= 0:
      S.cg_join_self(self.agent_cg)  # join the agent memory cgroup
    # A /proc of the command's own PID namespace (ps & co. check that /proc/self is getpid()).
    S.unshare(S.CLONE_NEWNS)
    S.mount("proc", "/proc", "proc", S.MS_NOSUID | S.MS_NODEV | S.MS_NOEXEC)
    os.dup2(stdin_fd, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.closerange(3, 1 << 16)
    S.prctl(S.PR_SET_DUMPABLE, 1)  # after the userns switch /proc/self is root-owned until dumpable
    # A cgroup OOM must take the command, never init/services (raising needs no privilege; lowering init would need
    # CAP_SYS_RESOURCE). Plain syscalls: a text file object costs a check's P ~45 page faults (session 24).
    fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
    try:
      os.write(fd, b"1000")
    finally:
      os.close(fd)
    lim = self.limits
    resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_seconds"], lim["cpu_seconds"]))
    fs = lim["file_size_mb"] << 20
    resource.setrlimit(resource.RLIMIT_FSIZE, (fs, fs))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if "memory" not in self.cgroups:  # per-process fallback when there is no memory cgroup
      m = lim["memory_mb"] << 20
      resource.setrlimit(resource.RLIMIT_AS, (m, m))
    if "pids" not in self.cgroups:  # counted per uid inside this user namespace
      resource.setrlimit(resource.RLIMIT_NPROC, (lim["pids"], lim["pids"]))
    os.setgroups([])
    os.setresgid(USER_UID, USER_UID, USER_UID)
    os.setresuid(USER_UID, USER_UID, USER_UID)
    if python:  # the uid change cleared it again, and no exec will set it: /proc/self would stay init's
      S.prctl(S.PR_SET_DUMPABLE, 1)
    S.prctl(S.PR_SET_NO_NEW_PRIVS, 1)
    if _seccomp.supported():
      _seccomp.install()
    try:
      os.chdir(cwd)
    except OSError as e:
      os.write(2, f"agentenv: cannot chdir to {cwd}: {e.strerror}\n".encode())
      os._exit(126)
    if python:
      _pyrun.run(argv, env)
    for sig in RESTORED_SIGNALS:
      signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    try:
      os.execvpe(argv[0], argv, env)
    except OSError as e:
      os.write(2, f"agentenv: cannot exec {argv[0]}: {e.strerror}\n".encode())
      os._exit(127)

  def _spawn(self, argv, cwd, env, stdin_fd, out_w, err_w):
    """P by the compiled spawn helper (_spawn.c: Init._child's steps in C, then exec of argv), started with
    posix_spawn: a vfork-style clone of this process, no copy of its page tables. Returns P's pid, or a result
    dict for argv / env that no process can take (as _child reports them: exit 126)."""
    lim = self.limits
    args = ["agentenv-spawn", "-c", str(lim["cpu_seconds"]), "-f", str(lim["file_size_mb"] << 20)]
    if "memory" not in self.cgroups:
      args += ["-m", str(lim["memory_mb"] << 20)]
    if "pids" not in self.cgroups:
      args += ["-n", str(lim["pids"])]
    std = (stdin_fd, out_w, err_w)
    lifted = [fd if fd >= _HELPER_FDS else fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, _HELPER_FDS) for fd in std]
    acts = [(os.POSIX_SPAWN_DUP2, fd, i) for i, fd in enumerate(lifted)]
    if self.seccomp_fd >= 0:
      args.append("-s")
      acts.append((os.POSIX_SPAWN_DUP2, self.seccomp_fd, 3))
    if self.agent_cg >= 0:
      args.append("-g")
      acts.append((os.POSIX_SPAWN_DUP2, self.agent_cg, 4))
    args += ["-d", cwd, "--", *argv]
    try:
      return os.posix_spawn(f"/proc/self/fd/{self.spawn_fd}", args, env, file_actions=acts,
                            setsigdef=RESTORED_SIGNALS, setsigmask=())
    except ValueError as e:  # a NUL byte in argv / cwd / env, "=" in an env name: what execve refuses in _child
      return self._refused(f"agentenv: cannot start command: {e}", 126)
    except OSError as e:  # the helper's exec carries argv and env: too long for it is too long for the command
      if e.errno != errno.E2BIG:
        raise
      return self._refused(f"agentenv: cannot exec {argv[0]}: {e.strerror}", 127)
    finally:
      for fd, orig in zip(lifted, std):
        if fd != orig:
          os.close(fd)

  @staticmethod
  def _refused(message, code):
    return {"stdout": b"", "stderr": f"{message}\n".encode(), "exit_code": code, "timed_out": False,
            "truncated": False}

  def exec(self, argv, cwd, env, stdin, timeout, python=False):
    """Runs argv as the command P: pid 1 of a fresh PID namespace under this process's own, so that everything it
    starts dies with it. This process starts P itself and watches it through a pidfd: no helper process in between
    (a fork + exit of a Python process costs ~1-3 ms of CPU; the kernel only lets a process start a PID namespace
    under its own active one, so this needs no helper where the caller is in the PID namespace the command's belongs
    under, as init and the check zygote's W are). P is the compiled spawn helper (_spawn) where this init has it and
    argv is a binary; a fork of this process running _child otherwise (python=True, AGENTENV_SPAWN=fork, no C
    compiler, the check zygote's W)."""
    cap = self.limits["max_output_bytes"]
    self.ns_used = True
    if self._own_pidns is None:  # opened before any unshare below: this process's active PID namespace
      self._own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    if stdin is None:
      stdin_fd = os.open("/dev/null", os.O_RDONLY)
    else:
      stdin_fd = os.memfd_create("stdin")
      os.write(stdin_fd, stdin)
      os.lseek(stdin_fd, 0, 0)
    full_env = {"PATH": PATH, "HOME": HOME, "USER": "user", "LOGNAME": "user", "LANG": "C.UTF-8",
          "TERM": "dumb", "PWD": cwd, "PYTHONDONTWRITEBYTECODE": "1"}
    full_env.update(env or {})
    # Our next child starts a new PID namespace under our own (after a previous command, this process's children
    # would otherwise land in that command's namespace, which is gone); this process itself stays where it is.
    try:
      S.setns(self._own_pidns, S.CLONE_NEWPID)
      S.unshare(S.CLONE_NEWPID)
      if self.spawn_fd >= 0 and not python:
        p_pid = self._spawn(argv, cwd, full_env, stdin_fd, out_w, err_w)
      else:
        p_pid = os.fork()
    except BaseException:
      for fd in (out_r, out_w, err_r, err_w, stdin_fd):
        os.close(fd)
      raise
    if isinstance(p_pid, dict):  # refused before any process started
      for fd in (out_r, out_w, err_r, err_w, stdin_fd):
        os.close(fd)
      return p_pid
    if p_pid == 0:
      try:
        os.close(out_r), os.close(err_r)
        self._child(argv, cwd, full_env, stdin_fd, out_w, err_w, python)
      except BaseException as e:
        os.write(2, f"agentenv: cannot start command: {e}\n".encode())
      os._exit(126)
    os.close(out_w), os.close(err_w), os.close(stdin_fd)
    pidfd = os.pidfd_open(p_pid)
    bufs = {out_r: [], err_r: []}
    sizes = {out_r: 0, err_r: 0}
    truncated = timed_out = False
    status = None
    deadline = time.monotonic() + timeout
    poller = select.poll()
    for fd in (out_r, err_r, pidfd, self.lifeline):
      poller.register(fd, select.POLLIN)
    open_fds = {out_r, err_r, pidfd}
    try:
      while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
          timed_out = True
          signal.pidfd_send_signal(pidfd, signal.SIGKILL)  # pid 1 of its namespace: takes everything with it
          deadline = float("inf")
          continue
        for fd, _ in poller.poll(min(left, 3600) * 1000):
          if fd == self.lifeline:
            os._exit(0)  # hub died mid-command: pid 1 exits and the kernel kills the rest
          if fd == pidfd:  # P exited (its namespace is gone with it): reap it
            status = os.waitpid(p_pid, 0)[1]
            poller.unregister(fd)
            open_fds.discard(fd)
            continue
          chunk = os.read(fd, 1 << 16)
          if not chunk:
            poller.unregister(fd)
            open_fds.discard(fd)
            continue
          room = cap - sizes[fd]
          if room > 0:
            bufs[fd].append(chunk[:room])
          if len(chunk) > room:
            truncated = True
          sizes[fd] += min(len(chunk), max(room, 0))
    finally:
      os.close(out_r), os.close(err_r), os.close(pidfd)
      if status is None:  # (only on an error above) never leave P running or unreaped
        try:
          os.kill(p_pid, signal.SIGKILL)
          os.waitpid(p_pid, 0)
        except (ProcessLookupError, ChildProcessError):
          pass
    code = os.waitstatus_to_exitcode(status)
    return {"stdout": b"".join(bufs[out_r]), "stderr": b"".join(bufs[err_r]), "exit_code": code,
        "timed_out": timed_out, "truncated": truncated}

  # ---- files ------------------------------------------------------------------------------------------
  @staticmethod
  def _check(path):
    if not path.startswith("/") or "/../" in path + "/" or "\0" in path:
      raise ValueError(f"bad sandbox path {path!r}")

  def read(self, path, limit=64 << 20):
    self._check(path)
    with open(path, "rb") as f:
      data = f.read(limit + 1)
    if len(data) > limit:
      raise ValueError(f"{path} is larger than {limit} bytes")
    return data

  def write(self, path, data, mode):
    self._check(path)
    parent = os.path.dirname(path)
    missing = []
    while parent and not os.path.isdir(parent):
      missing.append(parent)
      parent = os.path.dirname(parent)
    for d in reversed(missing):
      os.mkdir(d, 0o755)
      os.chown(d, USER_UID, USER_UID)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
      view = memoryview(data)
      while view:
        view = view[os.write(fd, view):]
      os.fchown(fd, USER_UID, USER_UID)
      os.fchmod(fd, mode)
    finally:
      os.close(fd)

  def listdir(self, path):
    self._check(path)
    return sorted(os.listdir(path))

  # ---- agent file ops without a process ---------------------------------------------------------------
  # The shared tools' commonest calls (`cat FILE`, `ls -1 DIR`, `cat > FILE`) cost a fork / PID namespace /
  # exec chain (~5-8 ms) as commands. Here init does them itself with its filesystem uid and gid switched to
  # the agent's (the kernel then checks the agent's permissions and drops init's DAC-override capabilities),
  # but ONLY where the result is the command's, byte for byte: a regular file / directory on the sandbox's
  # overlay (/r: no /proc, /dev, host binds, layer store), plain names, within the output / file size
  # limits. Anything else (an error of any kind included) answers None and the caller runs the command.
  def _as_agent(self, fn, *args):
    groups = set(os.getgroups()) - {USER_UID}
    S.setfsgid(USER_UID)
    S.setfsuid(USER_UID)
    try:
      if S.setfsuid(USER_UID) != USER_UID or S.setfsgid(USER_UID) != USER_UID:
        return None  # the switch did not take: never act with init's rights
      return fn(os.stat("/r").st_dev, groups, *args)
    except OSError:
      return None
    finally:
      S.setfsuid(0)
      S.setfsgid(0)

  @staticmethod
  def _plain(st, dev, groups, kind):
    # init's supplementary groups are not the agent's (commands run with none): a file those would open is
    # left to the command
    return st.st_dev == dev and kind(st.st_mode) and not (st.st_gid in groups and st.st_gid != USER_UID)

  def agent_read(self, path, shown=None):
    """`cat -- path`'s stdout, or for a missing file its result dict (`shown`: the name as the agent wrote it, which
    the message repeats), or None."""
    def op(dev, groups, path):
      try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
      except FileNotFoundError:
        return self._missing("read", path, shown, dev, groups)
      try:
        st = os.fstat(fd)
        if not self._plain(st, dev, groups, stat.S_ISREG) or st.st_size > self.limits["max_output_bytes"]:
          return None
        data = os.read(fd, st.st_size + 1)
        return data if len(data) == st.st_size else None
      finally:
        os.close(fd)
    self._check(path)
    return self._as_agent(op, path)

  def _missing(self, op, path, shown, dev, groups):
    """The command's result for a name that does not exist in a plain overlay directory the agent can search (so
    the command's open / stat fails with ENOENT exactly here), or None. Never for a dangling symlink (its target
    could resolve differently in the command's mount namespace) or a name the tool would quote."""
    tmpl = MISSING.get(op)
    if tmpl is None or shown is None or not PLAIN_NAME.fullmatch(shown) or path.endswith("/"):
      return None
    try:
      os.lstat(path)
      return None  # the name exists (a dangling symlink, or it appeared meanwhile): leave it to the command
    except FileNotFoundError:
      pass
    if not self._plain(os.stat(os.path.dirname(path) or "/"), dev, groups, stat.S_ISDIR):
      return None
    before, after, code = tmpl
    return {"stdout": b"", "stderr": before + shown.encode() + after, "exit_code": code}

  def agent_list(self, path, shown=None):
    """`ls -1 -- path`'s stdout for a directory of plain names (LANG=C.UTF-8 sorts them by code point), its result
    dict for a missing name (as agent_read), or None."""
    def op(dev, groups, path):
      try:
        st = os.stat(path)
      except FileNotFoundError:
        return self._missing("list", path, shown, dev, groups)
      if not self._plain(st, dev, groups, stat.S_ISDIR):
        return None
      names = sorted(n for n in os.listdir(path) if not n.startswith("."))
      if not all(n.isascii() and n.isprintable() for n in names):
        return None  # ls may quote or escape these
      out = "".join(n + "\n" for n in names).encode()
      return out if len(out) <= self.limits["max_output_bytes"] else None
    self._check(path)
    return self._as_agent(op, path)

  def agent_write(self, path, data):
    """`cat > path` with `data` on stdin (creates it 0666 & ~umask, owned by the agent, or truncates an existing
    regular file); True, or None without touching anything."""
    def op(dev, groups, path, data):
      try:
        st = os.stat(path)
      except FileNotFoundError:
        st = None
        if not self._plain(os.stat(os.path.dirname(path)), dev, groups, stat.S_ISDIR):
          return None
      if st is not None and not self._plain(st, dev, groups, stat.S_ISREG):
        return None
      if len(data) > self.limits["file_size_mb"] << 20:
        return None
      # No O_TRUNC, and O_EXCL for a new file: a path swapped for a symlink since the stat (the agent's own
      # processes run meanwhile) must not truncate or create anything off the overlay; the fd is re-checked.
      flags = os.O_WRONLY | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if st is None else 0)
      fd = os.open(path, flags, 0o666)
      try:
        if not self._plain(os.fstat(fd), dev, groups, stat.S_ISREG):
          return None
        os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
          view = view[os.write(fd, view):]
      finally:
        os.close(fd)
      return True
    self._check(path)
    return self._as_agent(op, path, bytes(data))

  def call(self, name, request, timeout):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
      try:
        s.connect(SVC_PREFIX + name)
      except (ConnectionRefusedError, FileNotFoundError):
        raise LookupError(f"no service named {name!r} is running in this sandbox") from None
      s.sendall(struct.pack("<I", len(request)) + request)
      n = struct.unpack("<I", W._recv_exact(s, 4))[0]
      return W._recv_exact(s, n)
    finally:
      s.close()

  # ---- loop -------------------------------------------------------------------------------------------
  def handle(self, req):
    op = req[0]
    if op == "exec":
      argv, cwd, env, stdin, timeout = req[1:]  # (never python=True: see _child)
      return self.exec(argv, cwd, env, stdin, timeout)
    if op == "read":
      return self.read(req[1])
    if op == "write":
      return self.write(*req[1:])
    if op == "list":
      return self.listdir(req[1])
    if op == "agent_read":
      return self.agent_read(*req[1:])
    if op == "agent_list":
      return self.agent_list(*req[1:])
    if op == "agent_write":
      return self.agent_write(*req[1:])
    if op == "call":
      return self.call(*req[1:])
    if op == "ping":
      return "pong"
    raise ValueError(f"unknown op {op!r}")

  # ---- recycling (see _hub.Hub._recycle) -------------------------------------------------------------
  def recycle(self, deadline_s=2.0, ns_used=True):
    """Make this init fit for the sandbox's next user: kill everything else in its PID namespace (a check's W / P,
    anything a command's namespace did not take with it) and wait until /proc shows init alone; then fresh IPC and
    network namespaces for its future children (SysV objects, TIME_WAIT sockets and the like outlive processes),
    unless no process but init ever entered the current ones: no command of ours (self.ns_used) and, says the hub
    (ns_used), no service, image or exec_python (a hidden check takes namespaces of its own). Init itself only
    brought lo up in them and creates nothing there, so they are as they were made (a fresh network namespace
    costs ~0.6 ms of CPU here plus ~0.5 ms of a kernel worker tearing the old one down; most RL rollouts use only
    the file tools and checks). Raises (the hub then kills the sandbox instead) if something does not die in time."""
    deadline = time.monotonic() + deadline_s
    while True:
      try:
        os.kill(-1, signal.SIGKILL)  # as pid 1: every process of this PID namespace and those under it but us
      except ProcessLookupError:
        pass
      while True:  # orphans re-parented to us (e.g. a check's P whose W was killed) are ours to reap
        try:
          if os.waitpid(-1, os.WNOHANG)[0] == 0:
            break
        except ChildProcessError:
          break
      left = [p for p in os.listdir("/proc") if p.isdigit() and p != "1"]
      if not left:
        break
      if time.monotonic() > deadline:
        raise RuntimeError(f"recycle: processes {left[:8]} still exist after SIGKILL")
      time.sleep(0.001)
    if ns_used or self.ns_used:
      S.unshare(S.CLONE_NEWIPC | S.CLONE_NEWNET)
      loopback_up()
      self.ns_used = False

  def serve(self):
    poller = select.poll()
    socks = {self.host.fileno(): self.host, self.hub.fileno(): self.hub}
    for fd in socks:
      poller.register(fd, select.POLLIN)
    poller.register(self.lifeline, select.POLLIN)
    while True:
      for fd, ev in poller.poll():
        if fd == self.lifeline:
          os._exit(0)  # hub died: pid 1 exiting takes the whole sandbox down
        sock = socks.get(fd)
        if sock is None:  # the old host channel, replaced by a recycle earlier in this batch of events
          continue
        fds = []
        try:
          if sock is self.hub:
            req, fds = W.recv(sock, with_fds=True)
          else:
            req = W.recv(sock)
        except (EOFError, OSError):
          if sock is self.hub:
            os._exit(0)
          poller.unregister(fd)  # host side closed its channel; the hub decides our fate
          del socks[fd]
          continue
        try:
          if req[0] == "recycle":  # from the hub only: the host channel is not trusted with it
            if sock is not self.hub or len(fds) != 1:
              raise ValueError("recycle: expects the next user's host channel from the hub")
            self.recycle(ns_used=req[1:] != (False,))  # (hub: whether its own processes entered them)
            # The previous user's channel goes: a handle (or a copy of its fd) still holding it reads EOF
            old = self.host.fileno()
            if old in socks:
              poller.unregister(old)
              del socks[old]
            self.host.close()
            self.host = socket.socket(fileno=fds.pop())
            socks[self.host.fileno()] = self.host
            poller.register(self.host.fileno(), select.POLLIN)
            reply = ("ok", None)
          else:
            reply = ("ok", self.handle(req))
        except BaseException as e:  # report, never die on a bad request
          reply = ("err", type(e).__name__, str(e))
        finally:
          for f in fds:
            os.close(f)
        try:
          W.send(sock, reply)
        except OSError:
          pass


def run(host, hub, lifeline, layers, shell, limits, cgroups, agent_cg, spawn_fd=-1):
  """Entry point in the freshly forked pid-1 process. Never returns. spawn_fd: the spawn helper binary (or -1)."""
  try:
    S.set_name("agentenv-init")
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    build_root(shell, layers)
    if _seccomp.supported():
      _seccomp.prepare()
    S.sethostname("sandbox")
    loopback_up()
    Init(host, hub, lifeline, limits, cgroups, agent_cg, spawn_fd).serve()
  except BaseException:
    traceback.print_exc()
  os._exit(1)
