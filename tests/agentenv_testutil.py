"""Shared helpers for the agentenv tests: skip where namespaces are unavailable, leak checks."""
import os
import shutil
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


@pytest.fixture
def spawn_path(request, monkeypatch):
  """How sandbox commands start (agentenv/_spawn.py), for tests run both ways with
  @pytest.mark.parametrize("spawn_path", SPAWN_PATHS, indirect=True): "helper" checks that this process's hub uses
  the compiled spawn helper (skips only where no C compiler exists at all); "fork" gives the test a hub of its own
  with AGENTENV_SPAWN=fork (one hub start, ~0.3 s), closed after. Unparametrised: the process-wide hub as it is."""
  want = getattr(request, "param", None)
  if want is None:
    yield None
    return
  require_namespaces()
  from moonshot_jax import agentenv
  from moonshot_jax.agentenv.sandbox import _Hub
  if want == "helper":
    st = agentenv.hub_stats()
    if st["spawn"] != "helper" and shutil.which("cc", path="/usr/bin:/bin") is None:
      pytest.skip(f"no C compiler for the spawn helper here ({st['spawn_why']})")
    assert st["spawn"] == "helper", st["spawn_why"]
    yield want
    return
  monkeypatch.setenv("AGENTENV_SPAWN", want)
  monkeypatch.setattr(_Hub, "_inst", None)
  assert agentenv.hub_stats()["spawn"] == want
  yield want
  hub = _Hub._inst
  if hub is not None:
    hub.sock.close()  # EOF: the hub closes its sandboxes and exits
    hub.proc.wait(timeout=30)


SPAWN_PATHS = ["helper", "fork"]
