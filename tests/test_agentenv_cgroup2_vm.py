"""Real cgroup v2 memory.max / pids.max enforcement, in a nested VM whose kernel has a cgroup2-only hierarchy
with every controller (this machine's v1 hierarchies hold memory and pids, so its cgroup2 mount cannot offer
them). virtme-ng boots a Debian kernel with the host's root filesystem shared read-only over 9p and runs
tests/agentenv_v2_guest.py inside.

Needs: qemu-system-x86_64 (apt qemu-system-x86), a kernel image /boot/vmlinuz-* with its /lib/modules
(apt linux-image-amd64) and `vng` (PyPI virtme-ng) on PATH or in AGENTENV_VNG. Skips naming what is missing.
Runs under TCG by default: this dev box's /dev/kvm is PVM (kvm-pvm), which boots only PVM-built guest kernels
(a stock kernel hangs before its first console line); AGENTENV_VM_KVM=1 uses KVM where it works."""
import glob
import json
import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _need():
  if os.geteuid() != 0:
    pytest.skip("needs root")
  qemu = shutil.which("qemu-system-x86_64")
  vng = os.environ.get("AGENTENV_VNG") or shutil.which("vng")
  kernels = sorted(k for k in glob.glob("/boot/vmlinuz-*") if os.path.isdir(f"/lib/modules/{k[14:]}"))
  missing = [what for what, ok in (("qemu-system-x86_64 (apt qemu-system-x86)", qemu),
                                   ("vng (pip virtme-ng)", vng),
                                   ("a /boot/vmlinuz-* with /lib/modules (apt linux-image-amd64)", kernels)) if not ok]
  if missing:
    pytest.skip("nested-VM cgroup v2 test needs " + ", ".join(missing))
  return vng, kernels[-1]


@pytest.mark.slow
def test_v2_memory_and_pids_limits_in_a_vm(tmp_path):
  vng, kernel = _need()
  cmd = [vng, "--run", kernel, "--memory", "2G", "--cpus", "2", "--force-9p", "--cwd", REPO,
         "--exec", f"PYTHONPATH={REPO} /usr/bin/python3 tests/agentenv_v2_guest.py"]
  if os.environ.get("AGENTENV_VM_KVM") != "1":
    cmd.insert(1, "--disable-kvm")
  env = dict(os.environ, PATH=os.path.dirname(vng) + ":" + os.environ.get("PATH", ""), TMPDIR=str(tmp_path))
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, stdin=subprocess.DEVNULL)
  lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
  assert out.returncode == 0 and lines, (out.returncode, out.stdout[-3000:], out.stderr[-3000:])
  res = json.loads(lines[-1][7:])
  info, v2 = res["info"], res["info"]["cgroup_v2"]
  # The guest's v2 hierarchy owns memory and pids: both limits are cgroups, nothing falls back.
  assert info["cgroups"] == {"memory": f"v2 {v2}", "pids": f"v2 {v2}"} and info["rlimit_fallback"] == {}, info
  assert res["cmd_cgroup"] == f"0::{v2[len('/sys/fs/cgroup'):]}/agent", res
  # Memory bomb: OOM-killed by memory.max below 64 MiB (no MemoryError: no RLIMIT_AS), counted in memory.events.
  assert res["mem_exit"] == -9 and 0 < res["mem_last"] < 64 and res["agent_oom_kill"] >= 1, res
  # Fork counter: EAGAIN at pids.max (24, with init and the shell counted), counted in pids.events.
  n, err = map(int, res["forks"])
  assert err == 11 and 10 < n < 24 and res["pids_events_max"] >= 1, res
  assert res["memory_max"] == str(64 << 20) and res["pids_max"] == "24", res
  assert res["after"] == res["other"] == "ok\n" and res["frozen"] == "1" and res["thawed_call"] == "1", res
  assert res["alive_after_close"] == [] and not res["sb_cgroup_left"] and res["agentenv_cgroups_left"] == [], res
