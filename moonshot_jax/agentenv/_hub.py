"""The hub: one root process per host Python process that owns every sandbox of that process.

It lives in a private mount namespace with a tmpfs layer store (so no sandbox mount or file is ever visible
on the host, and all of it vanishes with the last process), creates one user namespace shared by all its
sandboxes (in-sandbox uid 0 -> host 100000, uid 1000 -> host 101000), forks sandbox inits and services, keeps
the layer / snapshot bookkeeping, and per-sandbox cgroups (v1 or v2, see _cgroup) when the machine offers them.

Lifetimes: host socket EOF or parent change -> hub kills everything and exits. Hub death (even SIGKILL) ->
every init / service / image sees EOF on the lifeline pipe and exits; inits are pid 1 so their whole PID
namespace goes with them; a small reaper process kills what is left in the hub's v2 cgroups (cgroup.kill) and
removes the cgroup directories once they are empty.

Swapping a sandbox's overlay (snapshot, restore) moves the old mount aside (MS_MOVE) instead of unmounting it:
an unmount waits for an RCU grace period in the kernel (namespace_unlock), 0.05 ms on an idle box and up to
several ms on a busy one, which was the restore tail. A helper process (the unmounter) detaches the parked
mounts off the request path; the layers they use stay referenced until it has.
"""
import errno
import gc
import os
import pickle
import resource
import secrets
import select
import shutil
import signal
import stat
import socket
import sys
import time
import traceback

from . import _cgroup
from . import _init
from . import _spawn
from . import _sys as S
from . import _wire as W
from . import _zygote

ROOT_UID, USER_UID = 100000, 101000  # host uids of in-sandbox uid 0 and 1000
SQUASH_AT = int(os.environ.get("AGENTENV_SQUASH_AT", "64"))  # layer stack depth that triggers a squash
# Most closed sandboxes this hub keeps for reuse (create(recycle=True), see Hub._recycle): each is one idle init
# (~2 MB of private memory: PSS 2.0 MB, the rest shared with the other inits), its cgroup dirs and its namespaces.
# The pool only ever holds inits that were alive at once before (recycling is opt-in), so the bound caps that peak,
# it reserves nothing. RL's default GRPO recipe has up to 256 sandboxes alive (two sampling rounds of 8 groups x 8
# closing while the next two rounds are prefetched, rl.source.sandboxes_in_flight); with a bound of 64 about half of
# each batch's sandboxes were new inits and the env's share of a GRPO step's CPU stayed at ~35% (session 24: 24%
# with the pool large enough).
RECYCLE_MAX = int(os.environ.get("AGENTENV_RECYCLE_MAX", "512"))
SVC_CLIENT = r'''#!/usr/bin/python3
"""svc NAME [REQUEST...]: send REQUEST (or stdin) to the in-sandbox service NAME and print the reply."""
import socket, struct, sys
if len(sys.argv) < 2:
  sys.exit("usage: svc NAME [REQUEST...]")
req = (" ".join(sys.argv[2:]) if len(sys.argv) > 2 else sys.stdin.read()).encode()
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
  s.connect("\0agentenv-svc-" + sys.argv[1])
except OSError:
  sys.exit(f"svc: no service named {sys.argv[1]!r}")
s.sendall(struct.pack("<I", len(req)) + req)
def rd(n):
  b = b""
  while len(b) < n:
    c = s.recv(n - len(b))
    if not c:
      sys.exit("svc: service closed the connection")
    b += c
  return b
print(rd(struct.unpack("<I", rd(4))[0]).decode())
'''


class HubError(Exception):
  pass


def _service_reply(fd, name, what):
  """(pid, control socket, listener fd) of a service process that just started or resumed on the socket
  `fd`: its first message is ("ok", pid) with its listening socket attached, or an error naming why."""
  sock = socket.socket(fileno=fd)
  sock.settimeout(20)
  reply, fds = W.recv(sock, with_fds=True)
  if reply[0] != "ok" or len(fds) != 1:
    for f in fds:
      os.close(f)
    sock.close()
    raise HubError(f"service {name!r} failed to {what}: {reply[2] if reply[0] == 'err' else reply}")
  return reply[1], sock, fds[0]


class Hub:
  def __init__(self, host: socket.socket):
    self.host = host
    # Commands start through the compiled spawn helper where it builds (first, so that a bad AGENTENV_SPAWN or a
    # missing compiler under AGENTENV_SPAWN=helper fails the hub's start, before any process exists)
    self.spawn_fd, self.spawn, self.spawn_why = _spawn.open_helper()
    if self.spawn == "fork" and _spawn.mode() == "auto":
      print(f"agentenv: warning: sandbox commands fork init's interpreter (~2x their CPU), the spawn helper is "
            f"unavailable: {self.spawn_why}", file=sys.stderr, flush=True)
    self.parent = os.getppid()
    self.n = 0
    self.sandboxes = {}      # sid -> dict
    self.snapshots = {}      # snap id -> dict(owner, lowers, images={name: (pid, sock)})
    self.refs = {}           # layer name -> refcount
    self.garbage = []        # layer dirs to delete when idle
    self.pending_cg = []     # cgroup dirs to rmdir once their tasks are gone
    self.parked = {}         # park dir name -> layers of an old overlay moved there, until it is unmounted
    self.pool = {}           # limits key -> [idle recycled init: dict(pid, ctl, cg, host_end)] (see _recycle)
    self.recycled = 0        # sandboxes handed out from the pool
    self.draining = False    # shutdown: nothing goes back to the pool
    self.squashes = 0
    self.lr, self.lw = os.pipe()  # lifeline: only the hub holds lw
    os.set_inheritable(self.lr, True)
    self.cg = _cgroup.Cgroups(os.getpid())
    self._start_reaper()
    S.prctl(S.PR_SET_CHILD_SUBREAPER, 1)
    # The exec'd zygotes (see _zygote): started before the store's mount could hide the package's files
    self.check_zygote = self._start_exec_zygote("_check")
    self.zygote = self._start_exec_zygote("_service")  # services fork from it
    S.unshare(S.CLONE_NEWNS)
    S.mount(None, "/", None, S.MS_REC | S.MS_PRIVATE)
    self.root = next(p for p in ("/mnt", "/tmp", "/run", "/srv") if os.path.isdir(p))
    S.mount("agentenv-store", self.root, "tmpfs", S.MS_NOSUID | S.MS_NODEV, "mode=0755")
    self.layers = f"{self.root}/L"
    self.shell = f"{self.root}/R"
    os.mkdir(self.layers, 0o700)  # host root only: not even in-sandbox root can enter (see _init.build_root)
    os.mkdir(self.shell)
    _init.MISSING.update(probe_missing(f"{self.root}/P"))  # before any init is forked: they inherit it
    self.own_mnt = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    self.userns = self._make_userns()
    for z in (self.check_zygote, self.zygote):
      W.send(z, ("setup",), fds=[self.userns])
    self._build_base()
    # Inits fork from this helper, forked before any sandbox exists, not from the hub: an init (a copy of its parent's
    # memory) then holds nothing of what the hub's heap still holds of other sandboxes' task files. Same CPU as forking
    # the hub (a fork costs its parent about what it costs the child: copy-on-write faults, session 22).
    self.spawner = self._start_helper("agentenv-spwn", _spawn_loop(self.layers, self.shell, self.spawn_fd),
                                      self.userns, self.spawn_fd)
    self.unmounter = self._start_unmounter()
    for what, z in (("check", self.check_zygote), ("service", self.zygote)):
      try:  # (their interpreters started meanwhile)
        reply = W.recv(z)
      except (EOFError, OSError) as e:
        raise HubError(f"the {what} zygote failed to start ({type(e).__name__}: {e}; its traceback is on "
                       f"stderr)") from e
      if reply[0] != "ready":
        raise HubError(f"the {what} zygote failed to start: {reply}")

  # ---- setup ------------------------------------------------------------------------------------------
  def _fork(self):
    pid = os.fork()
    if pid == 0:
      os.close(self.lw)
    return pid

  def _start_reaper(self):
    """Outlives the hub: once the lifeline breaks, waits for this hub's cgroups to empty and removes them."""
    hub_pid = os.getpid()
    pid = os.fork()
    if pid:
      return
    try:
      os.close(self.lw)
      S.set_name("agentenv-reap")
      os.setsid()
      os.closerange(0, self.lr)
      os.closerange(self.lr + 1, 1 << 16)
      select.select([self.lr], [], [])
      deadline = time.monotonic() + 30
      while time.monotonic() < deadline and _cgroup.sweep(self.cg.bases, hub_pid):
        time.sleep(0.05)
    finally:
      os._exit(0)

  def _start_helper(self, name, loop, keep_fd, also_keep=-1):
    """Fork a helper process (zygote, unmounter) that serves requests on a socket and dies with the hub."""
    ours, theirs = socket.socketpair()
    pid = self._fork()
    if pid == 0:
      try:
        S.set_name(name)
        S.close_except({theirs.fileno(), self.lr, keep_fd, also_keep, 2})
        loop(theirs, self.lr, keep_fd)
      finally:
        os._exit(0)
    theirs.close()
    ours.settimeout(30)
    return ours

  def _start_exec_zygote(self, module):
    """The zygote `module` (_check: checks fork from it; _service: services do): a fresh interpreter, exec'd from a
    fork of the hub that keeps only its control socket, the lifeline and stderr. It answers ("ready", pid) to a first
    ("setup",) request carrying the user namespace fd."""
    ours, theirs = socket.socketpair()
    argv = _zygote.command(module, theirs.fileno(), self.lr)
    pid = self._fork()
    if pid == 0:
      try:
        S.close_except({theirs.fileno(), self.lr, 2})
        os.set_inheritable(theirs.fileno(), True)
        os.execv(argv[0], argv)
      except BaseException:
        traceback.print_exc()
      finally:
        os._exit(127)
    theirs.close()
    ours.settimeout(30)
    return ours

  def _start_unmounter(self):
    return self._start_helper("agentenv-umnt", _unmount_loop, self.own_mnt)

  def _make_userns(self):
    r, w = os.pipe()
    pid = self._fork()
    if pid == 0:
      S.unshare(S.CLONE_NEWUSER)
      os.write(w, b"x")
      time.sleep(3600)
      os._exit(0)
    os.read(r, 1)
    for f, m in (("uid_map", f"0 {ROOT_UID} 1\n1000 {USER_UID} 1\n"), ("setgroups", "allow"),
          ("gid_map", f"0 {ROOT_UID} 1\n1000 {USER_UID} 1\n")):
      with open(f"/proc/{pid}/{f}", "w") as fh:
        fh.write(m)
    fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(r), os.close(w)
    return fd

  def _mk(self, path, mode=0o755, uid=ROOT_UID):
    os.mkdir(path, mode)
    os.chmod(path, mode)  # mkdir honours the umask
    os.chown(path, uid, uid)

  def _put(self, path, data, mode=0o644, uid=ROOT_UID):
    with open(path, "wb") as f:
      f.write(data)
    os.chmod(path, mode)
    os.chown(path, uid, uid)

  def _build_base(self):
    """Template "python": /etc essentials, home, tmp and the svc client; /usr etc. come from the host."""
    b = f"{self.layers}/b"
    self._mk(b)
    for d, mode in (("etc", 0o755), ("home", 0o755), ("tmp", 0o1777), ("var", 0o755), ("var/tmp", 0o1777),
            ("opt", 0o755), ("opt/agentenv", 0o755), ("opt/agentenv/bin", 0o755), ("run", 0o755),
            ("srv", 0o755), ("mnt", 0o755), ("etc/ld.so.conf.d", 0o755)):
      self._mk(f"{b}/{d}", mode)
    self._mk(f"{b}/home/user", 0o755, USER_UID)
    etc = {
      "passwd": "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/bash\n"
           "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
      "group": "root:x:0:\nuser:x:1000:\nnogroup:x:65534:\n",
      "hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n",
      "hostname": "sandbox\n",
      "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files dns\n",
      "resolv.conf": "",
    }
    for name, text in etc.items():
      self._put(f"{b}/etc/{name}", text.encode())
    for name in ("ld.so.cache", "ld.so.conf"):
      if os.path.isfile(f"/etc/{name}"):
        self._put(f"{b}/etc/{name}", open(f"/etc/{name}", "rb").read())
    if os.path.isdir("/etc/ld.so.conf.d"):
      for name in os.listdir("/etc/ld.so.conf.d"):
        p = f"/etc/ld.so.conf.d/{name}"
        if os.path.isfile(p):
          self._put(f"{b}/etc/ld.so.conf.d/{name}", open(p, "rb").read())
    # The writable dirs really live under /r (see _init.build_root): links back to the read-only parts keep
    # relative symlinks such as /etc/os-release -> ../usr/lib/os-release working.
    for d in ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "proc", "dev"):
      if d in ("proc", "dev", "usr") or os.path.lexists(f"/{d}"):
        os.symlink(f"/{d}", f"{b}/{d}")
        os.lchown(f"{b}/{d}", ROOT_UID, ROOT_UID)
    # Debian resolves awk, editor, pager, ... through /etc/alternatives; a few more files tools expect.
    self._mk(f"{b}/etc/alternatives")
    for sub, names in (("alternatives", _listdir("/etc/alternatives")),
                       ("", ("localtime", "os-release", "debian_version", "bash.bashrc", "profile", "inputrc",
                             "shells", "mime.types", "gai.conf"))):
      for name in names:
        src, dst = os.path.join("/etc", sub, name), os.path.join(b, "etc", sub, name)
        if os.path.islink(src):
          os.symlink(os.readlink(src), dst)
          os.lchown(dst, ROOT_UID, ROOT_UID)
        elif os.path.isfile(src) and os.path.getsize(src) < (1 << 20):
          self._put(dst, open(src, "rb").read())
    self._put(f"{b}/opt/agentenv/bin/svc", SVC_CLIENT.encode(), 0o755)
    os.symlink("/usr/bin/python3", f"{b}/opt/agentenv/bin/python")
    os.lchown(f"{b}/opt/agentenv/bin/python", ROOT_UID, ROOT_UID)
    self.refs["b"] = 1  # never freed

  # ---- layers -----------------------------------------------------------------------------------------
  def _new_name(self, prefix):
    self.n += 1
    return f"{prefix}{self.n:x}"

  def _incref(self, names):
    for n in names:
      self.refs[n] = self.refs.get(n, 0) + 1

  def _decref(self, names):
    for n in names:
      self.refs[n] -= 1
      if self.refs[n] == 0:
        del self.refs[n]
        self.garbage.append(n)

  def _fresh_upper(self):
    u = self._new_name("u")
    w = "w" + u[1:]
    self._mk(f"{self.layers}/{u}")
    self._mk(f"{self.layers}/{w}", 0o700)
    return u, w

  def _task_layer(self, files):
    t = self._new_name("t")
    base = f"{self.layers}/b"
    self._mk(f"{self.layers}/{t}")
    for rel, data in files.items():
      parts = rel.strip("/").split("/")
      for i in range(1, len(parts)):
        d = "/".join(parts[:i])
        if not os.path.isdir(f"{self.layers}/{t}/{d}"):
          if os.path.isdir(f"{base}/{d}"):  # mirror the template's dir so /tmp stays 1777 etc.
            st = os.stat(f"{base}/{d}")
            self._mk(f"{self.layers}/{t}/{d}", st.st_mode & 0o7777, st.st_uid)
          else:
            self._mk(f"{self.layers}/{t}/{d}", 0o755, USER_UID)
      self._put(f"{self.layers}/{t}/{rel.strip('/')}", data, 0o644, USER_UID)
    self.refs[t] = 0
    return t

  def _collect(self, budget_s=0.02, yield_to_host=True):
    """Free dead layers / cgroups / zombies a little at a time, so close() never waits on big trees. Between
    requests it stops as soon as the host has sent one (yield_to_host): a request never waits for more than one
    rmtree / rmdir of this background work."""
    self._drain_unmounter()
    while True:
      try:
        pid, _ = os.waitpid(-1, os.WNOHANG)
      except ChildProcessError:
        break
      if pid == 0:
        break
    waiting = self._host_waiting if yield_to_host else lambda: False
    t_end = time.monotonic() + budget_s
    while self.garbage and time.monotonic() < t_end and not waiting():
      self._rm_layer(self.garbage.pop())
    keep = []
    for i, p in enumerate(self.pending_cg):
      if waiting():
        keep.extend(self.pending_cg[i:])
        break
      try:
        os.rmdir(p)
      except FileNotFoundError:
        pass
      except OSError as e:
        keep.append(p)
        if e.errno == errno.EBUSY:  # a process forked while close() killed: kill again
          try:
            _cgroup.kill(p, walk=False)
          except OSError:
            pass
    self.pending_cg = keep

  def _free_own(self, g0, budget_s):
    """Delete the layers that the request being answered dropped (garbage[g0:]), so their memory is back before
    the caller's next command; nothing else: older garbage (e.g. the layers a squash replaced, released when the
    unmounter answers) and cgroup dirs wait for the background collector, which gives way to requests."""
    own, self.garbage[g0:] = self.garbage[g0:], []
    t_end = time.monotonic() + budget_s
    while own and time.monotonic() < t_end:
      self._rm_layer(own.pop())
    self.garbage.extend(own)

  def _rm_layer(self, n):
    shutil.rmtree(f"{self.layers}/{n}", ignore_errors=True)
    if n.startswith("u"):
      shutil.rmtree(f"{self.layers}/w{n[1:]}", ignore_errors=True)

  def _host_waiting(self):
    return bool(select.select([self.host], [], [], 0)[0])

  def _drain_unmounter(self):
    """Release the layers of overlays the unmounter has detached (non-blocking)."""
    while self.parked and select.select([self.unmounter], [], [], 0)[0]:
      try:
        (park,) = W.recv(self.unmounter)
      except (EOFError, OSError):  # killed from outside: what it left parked goes with its sandbox's namespace
        for park in list(self.parked):
          self._unpark(park)
        return
      self._unpark(park)

  def _unpark(self, park):
    try:
      os.rmdir(f"{self.layers}/{park}")
    except OSError:
      pass
    self._decref(self.parked.pop(park))

  # ---- sandboxes --------------------------------------------------------------------------------------
  def _spawn(self, lowers, limits, recycle=False):
    if recycle:
      got = self._take(lowers, limits)
      if got:
        return got
    sid = self._new_name("sb-")
    cg = self.cg.make(sid, limits)
    agent = _cgroup.agent_file(cg)
    if agent and "memory" in cg:
      os.chown(agent, ROOT_UID, ROOT_UID)  # v1: commands move themselves in (see _init)
    upper, work = self._fresh_upper()
    hub_end, init_hub = socket.socketpair()
    host_end, init_host = socket.socketpair()
    try:
      W.send(self.spawner, ("init", cg, agent, limits, self.cg.limited()), fds=[init_hub.fileno(), init_host.fileno()])
    finally:
      init_hub.close(), init_host.close()
    reply = W.recv(self.spawner)
    if reply[0] != "ok":
      hub_end.close(), host_end.close()
      self.pending_cg.extend(_cgroup.dirs(cg))
      self.garbage.append(upper)
      raise HubError("sandbox init failed to start (see stderr)")
    ipid = reply[1]
    hub_end.settimeout(30)
    self._incref(lowers + [upper])
    self.sandboxes[sid] = dict(pid=ipid, ctl=hub_end, cg=cg, lowers=list(lowers), upper=upper, work=work,
                 limits=limits, services={}, snaps=set(), paused=False, recycle=recycle, served=False,
                 ns_used=False)
    return sid, host_end

  # ---- recycling --------------------------------------------------------------------------------------
  # A sandbox created with recycle=True (and its forks) is not killed on close if it is fit for another user: it is not
  # paused, the pool has room (RECYCLE_MAX inits in all), and if it ever ran a service, the hub has cgroups for it (see
  # _clear_outside; without them, AGENTENV_CGROUPS=0, such a sandbox is killed as before). Its init kills everything
  # else in its PID namespace, waits until /proc shows init alone, takes fresh IPC and network namespaces if any process
  # but init entered the old ones (SysV objects and TIME_WAIT sockets outlive their processes; a service's abstract
  # socket name stays bound in the old one, which dies with the last process in it) and a NEW host channel (the old one
  # is closed: a copy of the previous user's handle reads EOF); the hub parks its overlay (unmounted off the request
  # path, layers freed) and keeps the init idle with /r empty. A later create / fork with recycle=True and the same
  # Limits takes it under a NEW sid (the old one is unknown to the hub from the close on) and mounts the task's layers
  # as a restore does: a rollout's sandbox life cycle costs ~2-3 ms of CPU instead of ~12-18 with new inits (two
  # interpreter forks, five namespaces, a root built from scratch). What carries over: the init process, its user /
  # mount / UTS namespaces (uid 1000 can change none of them), and its cgroup dirs, still named by the sid of the
  # sandbox's first user (v2 cannot rename a cgroup), with their cumulative counters (memory peak, failcnt, events:
  # nothing in the API reports them). Hub shutdown kills pooled inits as it kills live ones; a pooled init also exits on
  # its own when the hub's lifeline or its control socket breaks, and the reaper sweeps its cgroups.
  @staticmethod
  def _limits_key(limits):
    return tuple(sorted(limits.items()))

  def _recycle(self, sid, sb):
    """Second life for a closing sandbox (see above); False: it must be killed instead."""
    key = self._limits_key(sb["limits"])
    if (self.draining or not sb["recycle"] or sb["paused"] or (sb["served"] and not sb["cg"])
        or sum(map(len, self.pool.values())) >= RECYCLE_MAX):
      return False
    host_end, init_host = socket.socketpair()
    try:
      for snap in list(sb["snaps"]):  # (their images, if any, live in our cgroups: _clear_outside waits for them)
        sb["snaps"].discard(snap)
        self.op_drop_snapshot(snap)
      if sb["served"]:
        self._clear_outside(sb)
      sb["ctl"].settimeout(5)  # init is idle unless a request raced the close: then kill rather than wait
      W.send(sb["ctl"], ("recycle", sb["served"] or sb["ns_used"]), fds=[init_host.fileno()])
      reply = W.recv(sb["ctl"])
      sb["ctl"].settimeout(30)
      if reply[0] != "ok":
        raise HubError(f"sandbox {sid}: recycle failed: {reply[2]}")
      self._park(sb)  # the old overlay goes; its layers are released once it is unmounted
    except BaseException:
      host_end.close()
      traceback.print_exc()
      return False
    finally:
      init_host.close()
    self._decref(sb["lowers"] + [sb["upper"]])
    self.pool.setdefault(key, []).append(dict(pid=sb["pid"], ctl=sb["ctl"], cg=sb["cg"], host_end=host_end, sid=sid))
    return True

  def _clear_outside(self, sb):
    """Before init's own clean-up (Init.recycle) of a sandbox that ran services: kill its services, what is left of
    the images of its snapshots (dropped by the caller; they and their pre-forked spares live in the snapshot
    owner's cgroups, i.e. ours) and whatever else lives outside init's PID namespace, which only its cgroups list
    (a service's detached children, say), and wait until each has exited: the cgroups then hold init alone (what is
    under init dies too, and Init.recycle reaps it). Their memory is uncharged as they exit (measured: the memory
    cgroup is back at init's own ~2 MB when close() returns); files they wrote are in the sandbox's overlay, parked
    and freed as for any recycled sandbox. The hub holds each service's listening socket: closed here, so nothing
    keeps the service's name bound (it lives in init's old network namespace, replaced by Init.recycle: the next
    user can neither reach it nor find it taken). Raises if something survives (_recycle then kills the sandbox)."""
    pidfds = []
    try:
      for name in list(sb["services"]):
        pid, sock, listener = sb["services"].pop(name)
        try:  # (before the close: a service whose control socket closes exits, and its pid may then be reused)
          pidfds.append(os.pidfd_open(pid))
        except ProcessLookupError:
          pass
        finally:
          sock.close()
          os.close(listener)
      _cgroup.kill_members(sb["cg"], sb["pid"], pidfds)
    finally:
      for fd in pidfds:
        os.close(fd)

  def _take(self, lowers, limits):
    """(sid, host end) of a pooled init with these limits, made a new sandbox over `lowers` (mounted by _finish,
    as for a new init) under a NEW sid (p["sid"], its last one, is only for debugging); None if the pool has none."""
    idle = self.pool.get(self._limits_key(limits))
    while idle:
      p = idle.pop()
      if not select.select([p["ctl"]], [], [], 0)[0]:  # an idle init never writes: readable = EOF, it died
        break
      self._kill_pooled(p)
    else:
      return None
    sid = self._new_name("sb-")
    upper, work = self._fresh_upper()
    self._incref(lowers + [upper])
    self.sandboxes[sid] = dict(pid=p["pid"], ctl=p["ctl"], cg=p["cg"], lowers=list(lowers), upper=upper, work=work,
                 limits=limits, services={}, snaps=set(), paused=False, recycle=True, served=False,
                 ns_used=False)
    self.recycled += 1
    return sid, p["host_end"]

  def _kill_pooled(self, p):
    try:
      _cgroup.kill_sandbox(p["cg"])
    except OSError:
      pass
    try:
      os.kill(p["pid"], signal.SIGKILL)
    except ProcessLookupError:
      pass
    p["ctl"].close()
    p["host_end"].close()
    self.pending_cg.extend(_cgroup.dirs(p["cg"]))

  def _finish(self, sid, host_end):
    """Second half of a spawn: wait for init's root, mount the overlay. Split from _spawn so that fork(n)
    can start all n inits first and let them build their roots while the hub forks the next."""
    sb = self.sandboxes[sid]
    try:
      self._ask_init(sid, ("ping",))  # its root is built once it answers
      self._mount_layers(sid, sb["lowers"], sb["upper"], sb["work"], replace=False)
    except BaseException:
      host_end.close()
      self.op_close(sid)
      raise

  def _park(self, sb):
    """Move the sandbox's overlay off /r (a recycled init keeps /r empty until its next user, _take)."""
    self._mount_layers(None, None, None, None, replace=True, sb=sb)

  def _mount_layers(self, sid, lowers, upper, work, replace, sb=None):
    """Mount (or swap) the sandbox's overlay at /r from inside its mount namespace. Replacing first makes the
    old mount read-only, so nothing still holding it can scribble on a layer that is now frozen; the old mount
    then moves to /.store/<park> (0700 host root: out of the sandbox's reach) and the unmounter detaches it.
    lowers=None: only move the old one away (sb: the sandbox's dict, for one no longer in self.sandboxes)."""
    sb = sb if sb is not None else self.sandboxes[sid]
    ns = os.open(f"/proc/{sb['pid']}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
      park = None
      S.setns(ns, S.CLONE_NEWNS)
      try:
        if replace:
          try:
            S.mount(None, "/r", None, S.MS_REMOUNT | S.MS_BIND | S.MS_RDONLY)
          except OSError as e:
            if e.errno == errno.EBUSY:
              raise HubError(f"sandbox {sid}: a service holds a file open for writing; cannot freeze") from e
            raise
          park = self._new_name("p")
          os.mkdir(f"/.store/{park}", 0o700)
          S.mount("/r", f"/.store/{park}", None, S.MS_MOVE)  # no grace period: only an unmount waits for one
        if lowers is not None:
          os.chdir("/.store")  # relative layer names keep the option string short (one page max)
          S.mount("overlay", "/r", "overlay", 0, f"lowerdir={':'.join(lowers)},upperdir={upper},workdir={work}")
      finally:
        S.setns(self.own_mnt, S.CLONE_NEWNS)
        os.chdir("/")
      if park:
        old = sb["lowers"] + [sb["upper"]]
        self._incref(old)
        self.parked[park] = old
        try:
          W.send(self.unmounter, (park,), fds=[ns])
        except OSError:  # unmounter gone (see _drain_unmounter)
          self._unpark(park)
    finally:
      os.close(ns)

  def _ask_init(self, sid, req):
    sb = self.sandboxes[sid]
    W.send(sb["ctl"], req)
    reply = W.recv(sb["ctl"])
    if reply[0] != "ok":
      raise HubError(f"sandbox {sid}: {reply[2]}")
    return reply[1]

  def _ns_fds(self, sid):
    pid = self.sandboxes[sid]["pid"]
    return [os.open(f"/proc/{pid}/ns/{n}", os.O_RDONLY | os.O_CLOEXEC) for n in ("mnt", "net", "ipc", "uts")]

  def _sb(self, sid, paused_ok=False):
    if sid not in self.sandboxes:
      raise HubError(f"unknown or closed sandbox {sid!r}")
    if self.sandboxes[sid]["paused"] and not paused_ok:
      raise HubError(f"sandbox {sid} is paused; resume() it first")
    return self.sandboxes[sid]

  # ---- services ---------------------------------------------------------------------------------------
  def op_start_service(self, sid, name, source):
    sb = self._sb(sid)
    if name in sb["services"]:
      raise HubError(f"service {name!r} is already running in {sid}")
    if not name or not all(c.isalnum() or c in "-_." for c in name):
      raise ValueError(f"bad service name {name!r} (letters, digits, - _ . only)")
    fds = self._ns_fds(sid)
    try:
      W.send(self.zygote, ("start", name, source, sb["cg"]), fds=fds)
    finally:
      for fd in fds:
        os.close(fd)
    _, got = W.recv(self.zygote, with_fds=True)
    sb["served"] = True  # (see _recycle; stays so after stop_service: a service's orphans may remain)
    sb["services"][name] = _service_reply(got[0], name, "start")
    return sb["services"][name][0]

  # ---- python checks ----------------------------------------------------------------------------------
  def op_exec_python(self, sid, argv, cwd, env, timeout):
    """Start `python3 -I -S argv...` as a command of sandbox sid would run, but as a fork of the check zygote,
    a Python that was started (and imported _pyrun.PRELOADED) before any sandbox existed: a check then costs
    forks, not an interpreter start (~30 ms of CPU). Not a fork of init: init, a fork of the hub, holds other
    sandboxes' task files in its memory. Returns the socket on which the result dict arrives (the hub does not
    wait for it)."""
    self._sb(sid)["ns_used"] = True  # it runs in the sandbox's network / IPC namespaces (see Init.recycle)
    return self._start_check(sid, argv, cwd, env, timeout, True, None)

  def op_exec_hidden(self, sid, files, argv, cwd, env, timeout, python):
    """Start a verifier command (python: a Python file, as op_exec_python) where the hidden `files` exist, without
    a throwaway sandbox: the check process makes a private copy of sandbox sid's mount namespace with an overlay
    over its files (upper layer: a fresh tmpfs holding `files` and whatever the check writes), fresh network and
    IPC namespaces, and otherwise runs as op_exec_python (see _check). Nothing of the sandbox changes: no
    snapshot, no new layer, no mount in its namespace. Returns the result socket, or None when the sandbox runs
    services (the check must then see copies of them, which a throwaway fork gives: the host makes one)."""
    if self._sb(sid)["services"]:
      return None
    return self._start_check(sid, argv, cwd, env, timeout, bool(python), dict(files))

  def _start_check(self, sid, argv, cwd, env, timeout, python, files):
    sb = self._sb(sid)
    fds = self._ns_fds(sid) + [os.open(f"/proc/{sb['pid']}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)]
    if files is not None:  # through a memfd: the zygote forwards it unread (it must never hold task data)
      fds.append(os.memfd_create("agentenv-hidden", os.MFD_CLOEXEC))
      data = memoryview(pickle.dumps(files, protocol=pickle.HIGHEST_PROTOCOL))
      while data:
        data = data[os.write(fds[-1], data):]
      os.lseek(fds[-1], 0, os.SEEK_SET)
    try:
      W.send(self.check_zygote, ("check", sb["cg"], sb["limits"], self.cg.limited(), list(argv), cwd, dict(env),
                                 float(timeout), bool(python), files is not None), fds=fds)
      reply, got = W.recv(self.check_zygote, with_fds=True)
    except (EOFError, OSError) as e:
      raise HubError(f"sandbox {sid}: the check zygote is gone ({type(e).__name__}: {e})") from e
    finally:
      for fd in fds:
        os.close(fd)
    if reply[0] != "ok" or len(got) != 1:
      for fd in got:
        os.close(fd)
      raise HubError(f"sandbox {sid}: the check zygote failed to start a check: {reply}")
    return socket.socket(fileno=got[0])

  def _kill_service(self, pid, sock, listener=-1, wait=False):
    """SIGKILL a service or image (through a pidfd: they are not our children); wait=True until it is gone."""
    sock.close()
    if listener >= 0:
      os.close(listener)
    try:
      pidfd = os.pidfd_open(pid)  # works for non-children too (live services are their image's children)
    except ProcessLookupError:
      return
    try:
      signal.pidfd_send_signal(pidfd, signal.SIGKILL)
      if wait:
        p = select.poll()
        p.register(pidfd, select.POLLIN)
        p.poll(5000)
    except ProcessLookupError:
      pass
    finally:
      os.close(pidfd)

  def op_stop_service(self, sid, name):
    sb = self._sb(sid)
    if name not in sb["services"]:
      raise HubError(f"no service {name!r} in {sid}")
    self._kill_service(*sb["services"].pop(name), wait=True)  # a later start binds its name afresh

  def _spawn_services(self, sid, images, reseed, move_cg, listeners=None, more=True):
    """Live copies of `images` in sandbox sid; a copy replacing a predecessor takes over its listening socket
    (`listeners`: name -> fd, given away here). A copy starts in its image's cgroups, i.e. those of the
    snapshot's owner; with move_cg it moves itself into sid's (restore to the owner's own snapshot needs no
    move). more=False: no further copy of these images will be asked for, so they keep no spare."""
    sb = self.sandboxes[sid]
    listeners = dict(listeners or {})
    try:
      for name, (_, img) in images.items():
        fds = self._ns_fds(sid)
        cg_fds = [os.open(p, os.O_WRONLY | os.O_CLOEXEC) for p in _cgroup.join_files(sb["cg"])] if move_cg else []
        fds += cg_fds  # the copy moves itself (see _sys.cg_join_self)
        has_listener = name in listeners
        if has_listener:
          fds.append(listeners.pop(name))
        try:
          W.send(img, ("spawn", more, reseed, len(cg_fds), has_listener), fds=fds)
        finally:
          for fd in fds:
            os.close(fd)
        sb["served"] = True
        reply, fds = W.recv(img, with_fds=True)
        if reply[0] != "ok" or not fds:
          raise HubError(f"service {name!r}: image failed to spawn")
        sb["services"][name] = _service_reply(fds[0], name, "resume")
    finally:
      for fd in listeners.values():
        os.close(fd)

  # ---- snapshot / restore / fork ----------------------------------------------------------------------
  def _freeze(self, sid):
    """Make the current upper a read-only layer and give the sandbox a fresh upper; returns the lowers."""
    sb = self.sandboxes[sid]
    if not os.listdir(f"{self.layers}/{sb['upper']}"):
      return list(sb["lowers"])  # nothing written since the last freeze: nothing to stack
    lowers = [sb["upper"]] + sb["lowers"]
    squashed = self._squash(lowers) if len(lowers) > SQUASH_AT else None
    upper, work = self._fresh_upper()
    self._mount_layers(sid, [squashed] if squashed else lowers, upper, work, replace=True)
    self._incref([upper])  # the old upper keeps the sandbox's reference, now as its top lower
    if squashed:
      self._incref([squashed])
      self._decref(lowers)
      lowers = [squashed]
    sb["lowers"], sb["upper"], sb["work"] = lowers, upper, work
    return list(lowers)

  def _squash(self, lowers):
    """Deep stacks make every path miss walk every layer (and overlay caps the depth): copy the merged view of
    `lowers` into one new self-contained layer. O(files in the writable tree), once per SQUASH_AT snapshots
    of changes; layers still referenced by older snapshots or other sandboxes stay as they are."""
    m = self._new_name("m")
    mnt = f"{self.root}/squash"
    os.makedirs(mnt, exist_ok=True)
    os.chdir(self.layers)
    try:
      S.mount("overlay", mnt, "overlay", S.MS_RDONLY, f"lowerdir={':'.join(lowers)}")
    finally:
      os.chdir("/")
    try:
      _copy_tree(mnt, f"{self.layers}/{m}")
    except BaseException:
      shutil.rmtree(f"{self.layers}/{m}", ignore_errors=True)
      raise
    finally:
      S.umount(mnt, S.MNT_DETACH)
    self.refs[m] = 0
    self.squashes += 1
    return m

  def op_snapshot(self, sid):
    sb = self._sb(sid)
    lowers = self._freeze(sid)
    images = {}
    try:
      for name, (_, sock, _) in list(sb["services"].items()):
        try:
          W.send(sock, ("image",))
          reply, fds = W.recv(sock, with_fds=True)
        except (OSError, EOFError) as e:  # dead or hung: its control stream is out of step for good
          self._kill_service(*sb["services"].pop(name))
          raise HubError(f"service {name!r} did not answer the snapshot ({e}); it was stopped") from e
        if reply[0] != "ok" or not fds:
          raise HubError(f"service {name!r} could not snapshot: {reply}")
        img = socket.socket(fileno=fds[0])
        img.settimeout(20)
        images[name] = (reply[1], img)
    except BaseException:
      for p, s in images.values():
        self._kill_service(p, s)
      raise
    snap = "snap-" + secrets.token_hex(8)
    self._incref(lowers)
    self.snapshots[snap] = dict(owner=sid, lowers=lowers, images=images)
    sb["snaps"].add(snap)
    return snap

  def _snap(self, snap):
    if not isinstance(snap, str) or snap not in self.snapshots:
      raise KeyError(f"unknown snapshot id {snap!r} (never taken, dropped, or its sandbox was closed)")
    return self.snapshots[snap]

  def op_restore(self, sid, snap):
    sb = self._sb(sid)
    sn = self._snap(snap)
    upper, work = self._fresh_upper()
    self._mount_layers(sid, sn["lowers"], upper, work, replace=True)
    self._incref(sn["lowers"] + [upper])
    self._decref(sb["lowers"] + [sb["upper"]])
    sb["lowers"], sb["upper"], sb["work"] = list(sn["lowers"]), upper, work
    # Predecessors are killed without waiting: their successors take over their listening sockets, and a
    # name the snapshot has no service for is free once it is gone (start_service binds after that).
    listeners = {}
    for name in list(sb["services"]):
      pid, sock, lfd = sb["services"].pop(name)
      keep = name in sn["images"]
      self._kill_service(pid, sock, -1 if keep else lfd, wait=not keep)
      if keep:
        listeners[name] = lfd
    self._spawn_services(sid, sn["images"], reseed=False, move_cg=sn["owner"] != sid, listeners=listeners)

  def op_drop_snapshot(self, snap):
    sn = self._snap(snap)
    del self.snapshots[snap]
    self.sandboxes[sn["owner"]]["snaps"].discard(snap) if sn["owner"] in self.sandboxes else None
    for pid, sock in sn["images"].values():
      self._kill_service(pid, sock)
    self._decref(sn["lowers"])

  def op_create(self, template, files, limits, recycle=False):
    if template != "python":
      raise ValueError(f"unknown template {template!r} (available: 'python')")
    lowers = ["b"]
    if files:
      lowers = [self._task_layer(files)] + lowers
    sid, host_end = self._spawn(lowers, limits, bool(recycle))
    self._finish(sid, host_end)
    return sid, host_end

  def op_fork(self, sid, n, reseed=True):
    sb = self._sb(sid)
    snap = self.op_snapshot(sid)
    out = []
    try:
      for _ in range(n):
        out.append(self._spawn(self.snapshots[snap]["lowers"], sb["limits"], sb["recycle"]))
      for i, (child, host_end) in enumerate(out):
        self._finish(child, host_end)
        self._spawn_services(child, self.snapshots[snap]["images"], reseed=reseed, move_cg=True, more=i < n - 1)
    except BaseException:
      for child, h in out:
        h.close()
        self.op_close(child)
      raise
    finally:
      self.op_drop_snapshot(snap)
    return out

  def op_close(self, sid):
    sb = self.sandboxes.pop(sid, None)
    if sb is None:
      return False
    if self._recycle(sid, sb):
      return True
    try:  # init, services, images, spares, commands, and whatever they left running
      _cgroup.kill_sandbox(sb["cg"])
    except OSError:
      pass  # (v2 before Linux 5.14: no cgroup.kill; the kills below and the collector's retries remain)
    try:
      os.kill(sb["pid"], signal.SIGKILL)
    except ProcessLookupError:
      pass
    sb["ctl"].close()
    for svc in sb["services"].values():
      self._kill_service(*svc)
    for snap in list(sb["snaps"]):
      self.op_drop_snapshot(snap)
    self._decref(sb["lowers"] + [sb["upper"]])
    self.pending_cg.extend(_cgroup.dirs(sb["cg"]))
    return True

  def op_drop_recycled(self):
    idle = [p for ps in self.pool.values() for p in ps]
    self.pool.clear()
    for p in idle:
      self._kill_pooled(p)
    return len(idle)

  def op_info(self, sid):
    sb = self._sb(sid, paused_ok=True)
    return dict(id=sid, paused=sb["paused"], services=sorted(sb["services"]), snapshots=len(sb["snaps"]),
                layers=len(sb["lowers"]) + 1, **self.cg.info(sb["cg"]))

  def op_pause(self, sid, paused):
    """Freeze (paused=True) or thaw every process of the sandbox: they keep their memory, use no CPU."""
    sb = self._sb(sid, paused_ok=True)
    if "v2" not in sb["cg"] and "freezer" not in sb["cg"]:
      raise HubError(f"pause / resume need a freezer cgroup (v1 freezer or v2) and sandbox {sid} has none (this "
                     f"hub: v1 {sorted(self.cg.v1) or 'none'}, v2 {self.cg.v2 or 'none'}, AGENTENV_CGROUPS="
                     f"{os.environ.get('AGENTENV_CGROUPS', '1')})")
    if sb["paused"] != paused:
      _cgroup.set_frozen(sb["cg"], paused)
      sb["paused"] = paused

  def op_stats(self):
    return dict(sandboxes=len(self.sandboxes), snapshots=len(self.snapshots), layers=len(self.refs),
          squashes=self.squashes, max_depth=max((len(b["lowers"]) for b in self.sandboxes.values()), default=0),
          garbage=len(self.garbage), pending_cgroups=len(self.pending_cg), parked=len(self.parked),
          pooled=sum(map(len, self.pool.values())), recycled=self.recycled,
          cgroups=self.cg.limited(), cgroup_v1=sorted(self.cg.v1), cgroup_v2=self.cg.v2, freezer=self.cg.freezer,
          cgroup_v2_controllers=list(self.cg.v2_ctrl), rlimit_fallback=dict(self.cg.fallback),
          spawn=self.spawn, spawn_why=self.spawn_why)

  # ---- main loop --------------------------------------------------------------------------------------
  def shutdown(self):
    self.draining = True
    for sid in list(self.sandboxes):
      self.op_close(sid)
    for snap in list(self.snapshots):
      self.op_drop_snapshot(snap)
    self.op_drop_recycled()
    deadline = time.monotonic() + 5
    self._collect(0, yield_to_host=False)  # (the host socket may be at EOF, i.e. always readable)
    while self.pending_cg and time.monotonic() < deadline:
      time.sleep(0.01)
      self._collect(0, yield_to_host=False)
    self.cg.teardown()

  def serve(self):
    gc.freeze()  # forks (inits, services) then share the hub's pages instead of dirtying them
    while True:
      busy = bool(self.garbage or self.pending_cg)
      r, _, _ = select.select([self.host] + ([self.unmounter] if self.parked else []), [], [], 0.05 if busy else 0.5)
      if os.getppid() != self.parent:
        return
      if self.host not in r:
        self._collect()
        continue
      try:
        req, _ = W.recv(self.host, with_fds=True)
      except (EOFError, OSError):
        return
      fds = []
      g0 = len(self.garbage)  # only ops append to it
      try:
        op = getattr(self, "op_" + req[0])
        val = op(*req[1:])
        if req[0] in ("exec_python", "exec_hidden"):
          val, fds = None, [val] if val is not None else []
        elif req[0] in ("create",):
          val, sock = val
          fds = [sock]
        elif req[0] == "fork":
          fds = [s for _, s in val]
          val = [c for c, _ in val]
        reply = ("ok", val)
        if req[0] in ("restore", "close", "drop_snapshot"):
          self._free_own(g0, 0.05)
      except BaseException as e:
        reply = ("err", type(e).__name__, str(e) if not isinstance(e, KeyError) else e.args[0])
      W.send(self.host, reply, fds=[s.fileno() for s in fds])
      for s in fds:
        s.close()
      self._collect(0.005)


def _listdir(path):
  try:
    return os.listdir(path)
  except OSError:
    return []


def _copy_tree(src, dst):
  """Copy a directory tree keeping owners, modes and times (files, dirs, symlinks, fifos; sockets skipped)."""
  st = os.lstat(src)
  os.mkdir(dst)
  for name in os.listdir(src):
    a, b = f"{src}/{name}", f"{dst}/{name}"
    ls = os.lstat(a)
    if stat.S_ISDIR(ls.st_mode):
      _copy_tree(a, b)
      continue
    if stat.S_ISLNK(ls.st_mode):
      os.symlink(os.readlink(a), b)
    elif stat.S_ISREG(ls.st_mode):
      shutil.copyfile(a, b, follow_symlinks=False)
    elif stat.S_ISFIFO(ls.st_mode):
      os.mkfifo(b)
    else:
      continue
    os.lchown(b, ls.st_uid, ls.st_gid)
    if not stat.S_ISLNK(ls.st_mode):
      os.chmod(b, stat.S_IMODE(ls.st_mode))
    os.utime(b, ns=(ls.st_atime_ns, ls.st_mtime_ns), follow_symlinks=False)
  os.chown(dst, st.st_uid, st.st_gid)
  os.chmod(dst, stat.S_IMODE(st.st_mode))
  os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))


def _spawn_loop(layers, shell, spawn_fd):
  """The init spawner's loop (see Hub._spawn). Per request: fork C, which joins the sandbox's cgroups and the shared
  user namespace, makes the sandbox's namespaces and forks its init (pid 1 there); C reports init's pid and exits.
  Init's parent then is the hub (the nearest subreaper), which reaps it as before."""
  def loop(ctl, lifeline, userns):
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # C processes; the kernel reaps them
    for (_, cg, agent, limits, cgroups), (init_hub, init_host) in W.requests(ctl, lifeline):
      rp, wp = os.pipe()
      try:
        pid = os.fork()
      except OSError:
        traceback.print_exc()
        pid = -1
      if pid == 0:  # C
        try:
          os.close(rp)
          _cgroup.join(cg)
          agent_cg = os.open(agent, os.O_WRONLY) if agent else -1
          S.close_except({init_hub, init_host, wp, lifeline, userns, agent_cg, spawn_fd, 2})
          S.enter_userns(userns)
          os.close(userns)
          S.unshare(S.CLONE_NEWNS | S.CLONE_NEWPID | S.CLONE_NEWNET | S.CLONE_NEWIPC | S.CLONE_NEWUTS)
          ipid = os.fork()
          if ipid == 0:
            os.close(wp)
            _init.run(socket.socket(fileno=init_host), socket.socket(fileno=init_hub), lifeline, layers, shell,
                      limits, cgroups, agent_cg, spawn_fd)
          os.write(wp, str(ipid).encode())
        except BaseException:
          traceback.print_exc()
        os._exit(0)
      os.close(wp), os.close(init_hub), os.close(init_host)
      data = b""
      while True:
        c = os.read(rp, 32)
        if not c:
          break
        data += c
      os.close(rp)
      W.send(ctl, ("ok", int(data)) if data else ("err", "HubError", "sandbox init failed to start"))
  return loop


def probe_missing(empty_dir):
  """{op: (stderr before the name, stderr after it, exit code)} of `cat -- NAME` ("read") and `ls -1 -- NAME` ("list")
  for a NAME that does not exist, run with a sandbox command's PATH and locale: the binaries and locale files are the
  host's, which every sandbox binds read-only, so a sandbox's commands print exactly this (init answers such misses
  without a process, _init.Init._missing). A tool whose output is not one message naming NAME once is left out."""
  import subprocess  # (only here: the hub forks inits and helpers, which need none of it)

  name = "agentenv-probe.missing_name"
  os.mkdir(empty_dir, 0o700)
  out = {}
  try:
    for op, argv in (("read", ["cat", "--", name]), ("list", ["ls", "-1", "--", name])):
      try:
        r = subprocess.run(argv, cwd=empty_dir, capture_output=True, timeout=30, stdin=subprocess.DEVNULL,
                           env={"PATH": _init.PATH, "HOME": _init.HOME, "LANG": "C.UTF-8", "TERM": "dumb"})
      except (OSError, subprocess.SubprocessError):
        continue
      parts = r.stderr.split(name.encode())
      if r.returncode > 0 and not r.stdout and len(parts) == 2 and r.stderr.endswith(b"\n"):
        out[op] = (parts[0], parts[1], r.returncode)
  finally:
    os.rmdir(empty_dir)
  return out


def _unmount_loop(ctl, lifeline, own_mnt):
  """Detach each parked overlay (request: park name + the sandbox's mount ns fd), then answer with the name.
  Back in our own mount namespace after each, so that we never keep a closed sandbox's mounts alive."""
  for (park,), fds in W.requests(ctl, lifeline):
    try:
      S.setns(fds[0], S.CLONE_NEWNS)
      S.umount(f"/.store/{park}", S.MNT_DETACH)
    except OSError:
      traceback.print_exc()
    finally:
      S.setns(own_mnt, S.CLONE_NEWNS)
      for f in fds:
        os.close(f)
    W.send(ctl, (park,))


def main(fd: int):
  S.set_name("agentenv-hub")
  _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # one control socket per sandbox / service / image
  signal.signal(signal.SIGPIPE, signal.SIG_IGN)
  host = socket.socket(fileno=fd)
  try:
    hub = Hub(host)
  except BaseException as e:  # e.g. AGENTENV_SPAWN=helper without a compiler: the host raises this message
    if not isinstance(e, _spawn.SpawnError):  # (a SpawnError says all there is to say)
      traceback.print_exc()
    W.send(host, ("err", type(e).__name__, str(e)))
    os._exit(1)
  W.send(host, ("ready", os.getpid()))
  try:
    hub.serve()
  finally:
    hub.shutdown()
    os._exit(0)
