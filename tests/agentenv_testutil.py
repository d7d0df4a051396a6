"""Shared helpers for the agentenv tests: skip where namespaces are unavailable, leak checks."""
import os
import subprocess
import sys

import pytest


_PROBE = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
# user | mount | pid | net | ipc | uts, as a sandbox needs them
if libc.unshare(0x10000000 | 0x00020000 | 0x20000000 | 0x40000000 | 0x08000000 | 0x04000000):
    raise SystemExit(os.strerror(ctypes.get_errno()))
"""
_probed = []


def require_namespaces():
  """agentenv needs root and user/mount/pid/net namespaces; skip (with the reason) where the machine lacks
  them, e.g. a container whose seccomp profile forbids unshare. Anything beyond that is a real failure."""
  if not _probed:
    if os.geteuid() != 0:
      _probed.append("agentenv needs root")
    elif not os.access("/usr/bin/python3", os.X_OK):
      _probed.append("agentenv's python template needs /usr/bin/python3 on the host")
    else:
      r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True)
      _probed.append(None if r.returncode == 0 else f"no namespaces here: {r.stderr.strip()[-200:]}")
  if _probed[0]:
    pytest.skip(_probed[0])


def host_mounts() -> str:
  return subprocess.run(["findmnt", "-rn", "-o", "TARGET,FSTYPE"], capture_output=True, text=True).stdout


def agentenv_procs(hub_pid: int | None = None) -> list:
  """(pid, comm) of agentenv processes; with hub_pid, only those in that hub's cgroups or the hub itself."""
  out = []
  for p in os.listdir("/proc"):
    if not p.isdigit():
      continue
    try:
      comm = open(f"/proc/{p}/comm").read().strip()
      cg = open(f"/proc/{p}/cgroup").read()
    except OSError:
      continue
    if hub_pid is None:
      if comm.startswith("agentenv-"):
        out.append((int(p), comm))
    elif f"agentenv-{hub_pid}/" in cg or int(p) == hub_pid:
      out.append((int(p), comm))
  return out


def hub_cgroup_dirs(hub_pid: int) -> list:
  """The hub's cgroup dirs on this layout: v1 memory / pids / freezer, the unified (v2) hierarchy, a pure-v2 root."""
  return [d for d in (f"/sys/fs/cgroup/{h}/agentenv-{hub_pid}" for h in ("memory", "pids", "freezer", "unified", "."))
          if os.path.exists(d)]
