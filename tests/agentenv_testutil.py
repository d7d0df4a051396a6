"""Shared helpers for the agentenv tests: skip where namespaces are unavailable, leak checks."""
import os
import subprocess

import pytest


def require_namespaces():
  """agentenv needs root (user+mount+pid+net namespaces, overlayfs); skip cleanly elsewhere."""
  if os.geteuid() != 0 or not os.path.exists("/proc/self/ns/user"):
    pytest.skip("agentenv needs root with user/mount/pid/net namespaces")


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
  return [d for d in (f"/sys/fs/cgroup/memory/agentenv-{hub_pid}", f"/sys/fs/cgroup/pids/agentenv-{hub_pid}")
          if os.path.exists(d)]
