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
