"""A seccomp filter for agent commands (x86_64): no namespaces, mounts, keyrings, bpf, io_uring, modules.

User namespaces nested inside the sandbox would hand the agent every capability over fresh namespaces (mount,
netfilter, ...), the usual way container escapes reach kernel bugs; the rest are large attack surfaces an agent
never needs. Denied calls fail with EPERM (clone3 with ENOSYS so that glibc falls back to clone, whose flags
a classic BPF filter can inspect). Foreign ABIs (i386, x32) are refused outright: their numbers differ.
"""
import ctypes
import os
import platform
import struct

_LD_W_ABS, _JEQ_K, _JSET_K, _RET_K, _JGE_K = 0x20, 0x15, 0x45, 0x06, 0x35
_ALLOW, _ERRNO, _KILL = 0x7FFF0000, 0x00050000, 0x80000000
_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_BIT = 0x40000000
_SYS_CLONE, _SYS_CLONE3 = 56, 435
CLONE_NEW_ANY = 0x7E020080  # NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
DENIED = {  # x86_64 numbers
    "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442, "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321,
    "perf_event_open": 298, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "kexec_load": 246, "kexec_file_load": 320, "init_module": 175,
    "finit_module": 313, "delete_module": 176,
}
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


class _Filter(ctypes.Structure):
  _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class _Prog(ctypes.Structure):
  _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


def program():
  """The BPF program as (code, jt, jf, k) tuples."""
  eperm = _ERRNO | 1
  p = [(_LD_W_ABS, 0, 0, 4),                    # arch
       (_JEQ_K, 1, 0, _AUDIT_ARCH_X86_64),
       (_RET_K, 0, 0, _KILL),
       (_LD_W_ABS, 0, 0, 0),                    # syscall number
       (_JGE_K, 0, 1, _X32_BIT),
       (_RET_K, 0, 0, _KILL)]
  for nr in sorted(DENIED.values()):
    p += [(_JEQ_K, 0, 1, nr), (_RET_K, 0, 0, eperm)]
  p += [(_JEQ_K, 0, 1, _SYS_CLONE3), (_RET_K, 0, 0, _ERRNO | 38),  # ENOSYS
        (_JEQ_K, 1, 0, _SYS_CLONE), (_RET_K, 0, 0, _ALLOW),
        (_LD_W_ABS, 0, 0, 16),                  # clone flags (low 32 bits of args[0])
        (_JSET_K, 0, 1, CLONE_NEW_ANY), (_RET_K, 0, 0, eperm),
        (_RET_K, 0, 0, _ALLOW)]
  return p


def program_fd() -> int:
  """A memfd holding program() as the kernel's struct sock_filter array (u16 code, u8 jt, u8 jf, u32 k), for the
  compiled spawn helper (_spawn.c), which installs it exactly as install() does: one definition of the filter."""
  fd = os.memfd_create("agentenv-seccomp", os.MFD_CLOEXEC)
  os.write(fd, b"".join(struct.pack("=HBBI", *insn) for insn in program()))
  return fd


_SUPPORTED = platform.machine() == "x86_64"


def supported() -> bool:
  return _SUPPORTED


_compiled = []  # (program, filter array, libc's prctl): built once in init, reused by every forked command


def prepare() -> None:
  if not _compiled:
    insns = program()
    arr = (_Filter * len(insns))(*[_Filter(*i) for i in insns])
    # (prctl resolved now, not by the first install in each forked command: see _sys's CDLL note)
    _compiled.append((_Prog(len(insns), arr), arr, ctypes.CDLL(None, use_errno=True).prctl))


def install() -> None:
  """Install the filter on the calling process (needs no_new_privs set first); inherited across exec."""
  prepare()
  prog, _, prctl = _compiled[0]
  if prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"seccomp: {os.strerror(err)}")
