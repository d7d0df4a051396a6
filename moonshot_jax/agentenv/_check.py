"""The check zygote: the process that python_fn's checks (Sandbox.exec_python / exec_hidden, see _hub.Hub._start_check)
fork from.

It is a fresh interpreter started by exec at hub start (`python3 -I -S -c BOOT`, see _zygote), not a fork of the hub,
and imports only this module's few dependencies (_cgroup, _init, _pyrun, _sys, _wire; the packages' __init__ files
are not run: they import the host side). Two reasons:
- Isolation: it never held any of the hub's memory, so no task file, service source or hidden file of any sandbox
  that passed the hub can be in it or in a check forked from it. It sees check requests only (paths, env, ns fds;
  exec_hidden's files reach W through a memfd it forwards unread).
- Cost: every fork of an interpreter pays copy-on-write faults for what it touches, and Python's at-fork hooks run in
  each child before any of our code: threading's alone (imported by the hub's package) is ~130 page faults per fork,
  random's ~40 (session 24, /tmp/check/forktax.py). A check forks twice (W, then P), so the zygote must import
  neither: test_agentenv_pycheck checks that a check sees no such module.

Per request it forks W straight into the sandbox's PID namespace (setns of its own pid_ns_for_children first: the
kernel puts a process into the namespace its parent named, and only a process whose ACTIVE namespace is the sandbox's
can later start one under it, as W must for the check). W joins the sandbox's cgroups, user, mount, net, IPC and UTS
namespaces (exec_hidden: a private copy of its mount namespace with the hidden files, see _private_tree, and fresh net
/ IPC ones), then runs the file exactly as init runs a command (_init.Init.exec: P in a child PID namespace, uid 1000,
agent cgroup, rlimits, seccomp, timeout -> SIGKILL) with _pyrun in place of exec (exec_hidden of a command: exec
itself), and sends the result dict on the socket the hub passed to the host. Nothing outlives the sandbox: W and P are
in its cgroups and under its PID namespace, so closing it (init's death, the cgroup kill) takes them; with the last of
them goes the private mount namespace. (Until session 22, W stayed in the hub's PID namespace and forked a W2 into the
sandbox's to do this: one more fork + exit of an interpreter, ~3 ms of CPU, per check.)
"""
import os
import select
import socket
import stat
import traceback

from . import _cgroup
from . import _init
from . import _pyrun  # noqa: F401  (imported before any fork: its PRELOADED modules come with it)
from . import _sys as S
from . import _wire as W
from . import _zygote


def main(ctl_fd, lifeline):
  """The zygote's entry point (never returns). First request: ("setup",) with the sandboxes' user namespace fd (made
  after the zygote starts); it answers ("ready", pid) and then serves checks until the hub's lifeline breaks."""
  # (os.environ.clear: a check replaces it whole, _pyrun.run; clearing an empty one costs its P nothing)
  _zygote.serve("agentenv-pyz", "check zygote", ctl_fd, lifeline, os.environ.clear, _loop)


def _requests(ctl, lifeline, children):
  """W.requests that also reaps the W processes of `children` (pidfd -> pid, added by the caller) when they exit."""
  poller = select.poll()
  for fd in (ctl.fileno(), lifeline):
    poller.register(fd, select.POLLIN)
  polled = set()
  while True:
    for fd in children.keys() - polled:
      poller.register(fd, select.POLLIN)
      polled.add(fd)
    for fd, _ in poller.poll():
      if fd == lifeline:
        return
      if fd in polled:
        os.waitpid(children.pop(fd), 0)
        poller.unregister(fd)
        polled.discard(fd)
        os.close(fd)
        continue
      try:
        yield W.recv(ctl, with_fds=True)
      except (EOFError, OSError):
        return


def _loop(ctl, lifeline, userns):
  if _init._seccomp.supported():
    _init._seccomp.prepare()
  # The compiler's first use in a process sets up state that every later compile reuses; done here once, the
  # checks (which compile their file) share it instead of each building it: ~95 fewer page faults per check (session
  # 24, /tmp/check/mfprof.sh: P's compile 133 -> 38).
  compile("def f(x):\n  return [x, {x: (x,)}]\n", "<warmup>", "exec")
  _pyrun.premake_stdio()
  own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
  # W processes are reaped here as soon as they exit (a pidfd each), not by the kernel (SIGCHLD ignored): SIGCHLD then
  # stays at its default, which W needs for its own child P (restoring it in W, signal.signal's enum machinery in a
  # fresh fork, was ~25 page faults per check, session 24).
  children = {}  # pidfd -> pid of a running W
  for (_, cg, limits, cgroups, argv, cwd, env, timeout, python, hidden), ns_fds in _requests(ctl, lifeline, children):
    a, b = socket.socketpair()
    pid_ns = ns_fds[-2] if hidden else ns_fds[-1]
    try:
      S.setns(pid_ns, S.CLONE_NEWPID)  # our next child is born in the sandbox's PID namespace
      pid = os.fork()
    except OSError as e:  # e.g. the sandbox closed meanwhile: its namespace takes no new process
      pid = -1
      W.send(b, ("err", "SandboxError", f"check setup failed: {type(e).__name__}: {e}"))
    finally:
      if pid != 0:
        S.setns(own_pidns, S.CLONE_NEWPID)  # hold no reference to a sandbox's namespace between requests
    if pid == 0:
      try:
        S.set_name_cheap("agentenv-check")
        _cgroup.join(cg)
        agent = _cgroup.agent_file(cg)
        agent_cg = os.open(agent, os.O_WRONLY) if agent else -1
        S.close_except(set(ns_fds) | {b.fileno(), lifeline, userns, agent_cg, 2})
        files_fd = ns_fds.pop() if hidden else -1
        os.close(ns_fds.pop())  # the PID namespace: we are in it already
        if hidden:  # exec_hidden: a private copy of the sandbox's files with the hidden ones (op_exec_hidden)
          files = W.loads(_read_all(files_fd))
          os.close(files_fd)
          mnt, net, ipc, uts = ns_fds
          _private_tree(mnt)
          S.enter_userns(userns)
          os.close(userns)
          try:  # as init writes files (uid 0 of the user namespace), so the check sees what a fork's write gives
            for path, data in files.items():
              _init.Init(None, None, None, None, None, -1).write(path, data, 0o644)
          except BaseException as e:
            W.send(b, ("err", type(e).__name__, str(e)))
            os._exit(0)
          del files
          S.unshare(S.CLONE_NEWNET | S.CLONE_NEWIPC)  # the sandbox's services / IPC objects stay out of reach
          _init.loopback_up()
          S.setns(uts, S.CLONE_NEWUTS)
          for fd in (net, ipc, uts):
            os.close(fd)
        else:
          S.enter_userns(userns)
          os.close(userns)
          S.join_namespaces(ns_fds)
        init = _init.Init(None, None, lifeline, limits, cgroups, agent_cg)
        try:
          reply = ("ok", init.exec(argv, cwd, env, None, timeout, python=python))
        except BaseException as e:
          reply = ("err", type(e).__name__, str(e))
        W.send(b, reply)
      except BaseException as e:
        traceback.print_exc()
        try:
          W.send(b, ("err", "SandboxError", f"check setup failed: {type(e).__name__}: {e}"))
        except OSError:
          pass
      os._exit(0)
    for f in ns_fds:
      os.close(f)
    b.close()
    W.send(ctl, ("ok", pid), fds=[a.fileno()])
    a.close()
    if pid > 0:
      children[os.pidfd_open(pid)] = pid  # (W is our unreaped child: its pid stays valid until we wait for it)


def _read_all(fd):
  """The whole content of the memfd `fd` (at offset 0), with plain reads: no file object."""
  size = os.fstat(fd).st_size
  chunks, got = [], 0
  while got < size:
    c = os.pread(fd, size - got, got)
    if not c:
      break
    chunks.append(c)
    got += len(c)
  return b"".join(chunks)


def _private_tree(mnt_fd):
  """Enter a sandbox's mount namespace (fd), then a private copy of it in which /r, the sandbox's files, is an
  overlay: lower layer the sandbox's own /r, upper layer a fresh tmpfs (over /.store, the layer store, which the
  copy does not need) whose root takes /r's owner, mode and times. Writes land in the tmpfs, the sandbox's tree
  is never touched, and the copy with its tmpfs ends with the last process in it. Runs as host root, as the hub
  mounts the sandboxes' own overlays (privileged overlayfs: no dependence on user-namespace overlay support)."""
  S.setns(mnt_fd, S.CLONE_NEWNS)
  os.close(mnt_fd)
  S.unshare(S.CLONE_NEWNS)
  S.mount(None, "/", None, S.MS_REC | S.MS_PRIVATE)  # nothing mounted here propagates back
  st = os.stat("/r")
  S.mount("agentenv-check", "/.store", "tmpfs", S.MS_NOSUID | S.MS_NODEV, "mode=0700")
  os.mkdir("/.store/u")
  os.chown("/.store/u", st.st_uid, st.st_gid)
  os.chmod("/.store/u", stat.S_IMODE(st.st_mode))
  os.utime("/.store/u", ns=(st.st_atime_ns, st.st_mtime_ns))
  os.mkdir("/.store/w", 0o700)
  S.mount("overlay", "/r", "overlay", 0, "lowerdir=/r,upperdir=/.store/u,workdir=/.store/w")
  os.chdir("/")
