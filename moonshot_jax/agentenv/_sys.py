"""Thin ctypes wrappers for the Linux namespace/mount syscalls that Python 3.11's os module lacks."""
import ctypes
import os

_libc = ctypes.CDLL(None, use_errno=True)

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NAME = 15
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36

_SYS_PIVOT_ROOT = 155  # x86_64
# Resolved once here: CDLL resolves a function on its first attribute access and caches it on itself, and in a
# forked process (the check zygote's W and P) a first access is new objects on copy-on-write pages.
for _name in ("unshare", "setns", "mount", "umount2", "syscall", "prctl", "setfsuid", "setfsgid", "sethostname"):
  getattr(_libc, _name)


def _check(ret, what):
  if ret != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
  _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def setns(fd: int, nstype: int = 0) -> None:
  _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), "setns")


def mount(source, target, fstype=None, flags=0, data=None) -> None:
  enc = lambda s: s.encode() if isinstance(s, str) else s
  ret = _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))
  _check(ret, f"mount {fstype or ''} {source!r} -> {target!r} ({data})")


def umount(target, flags=0) -> None:
  _check(_libc.umount2(target.encode(), ctypes.c_int(flags)), f"umount {target}")


def pivot_root(new_root: str, put_old: str) -> None:
  _check(_libc.syscall(_SYS_PIVOT_ROOT, new_root.encode(), put_old.encode()), "pivot_root")


def prctl(option: int, arg: int = 0) -> None:
  _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), 0, 0, 0), f"prctl {option}")


def set_name(name: str) -> None:
  """Process name shown by ps (comm, 15 bytes max)."""
  buf = ctypes.create_string_buffer(name.encode()[:15])
  _libc.prctl(PR_SET_NAME, buf, 0, 0, 0)


def set_name_cheap(name: str) -> None:
  """set_name through /proc/self/comm: two plain syscalls, no ctypes objects (a fresh fork's first ctypes call is
  ~40 page faults of copy-on-write, session 24)."""
  fd = os.open("/proc/self/comm", os.O_WRONLY)
  try:
    os.write(fd, name.encode()[:15])
  finally:
    os.close(fd)


def setfsuid(uid: int) -> int:
  """Filesystem uid of the calling thread (the uid the kernel checks file permissions against; going from 0 to
  non-zero also drops CAP_DAC_OVERRIDE & co. from the effective set, back to 0 restores them). Returns the
  previous one (the call itself reports no error: callers check with a second call)."""
  return _libc.setfsuid(ctypes.c_uint(uid))


def setfsgid(gid: int) -> int:
  return _libc.setfsgid(ctypes.c_uint(gid))


def sethostname(name: str) -> None:
  b = name.encode()
  _check(_libc.sethostname(b, ctypes.c_size_t(len(b))), "sethostname")


def cg_join_self(fd):
  """Move the calling thread, i.e. the whole process (every caller is single-threaded), into the cgroup whose
  v1 `tasks` file (or v2 cgroup.procs file, which takes the lock described next) `fd` is. Writing "0" there moves just the caller, which the kernel does without the global
  threadgroup lock that a cgroup.procs write (a pid or "0") takes: that lock's writer waits out an RCU grace
  period when it was idle (5-18 ms on the dev box, measured), the old tail of restores and commands."""
  os.write(fd, b"0")


# ---- process setup shared by the hub's helpers and the check zygote (which imports only the low modules) ----
_NS_ORDER = (CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWIPC, CLONE_NEWUTS)


def close_except(keep):
  """Close every fd from 3 up except those in `keep`."""
  lo = 3
  for fd in sorted(k for k in keep if k >= 3):
    os.closerange(lo, fd)
    lo = fd + 1
  os.closerange(lo, 1 << 16)


def enter_userns(userns_fd):
  """Join the sandboxes' user namespace as its uid / gid 0."""
  setns(userns_fd, CLONE_NEWUSER)
  os.setgroups([])
  os.setresgid(0, 0, 0)
  os.setresuid(0, 0, 0)


def join_namespaces(ns_fds):
  """Enter a sandbox's mount/net/ipc/uts namespaces (fds in that order, closed here; the caller is already uid 0
  of the shared user ns)."""
  for fd, kind in zip(ns_fds, _NS_ORDER):
    setns(fd, kind)
    os.close(fd)
  os.chdir("/")
