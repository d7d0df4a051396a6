"""agentenv pause / resume through the cgroup v1 freezer (the default on hosts whose v1 hierarchies hold the
limits, as this dev box): frozen processes use no CPU, calls fail clearly until resume, close() of a paused
sandbox and SIGKILL of its hub still clean up. The v2 freezer is covered in test_agentenv_cgroup2.py."""
import os
import time

import pytest

from moonshot_jax import agentenv
from moonshot_jax.agentenv import _cgroup
from moonshot_jax.agentenv.sandbox import _Hub
from tests.agentenv_testutil import hub_cgroup_dirs, require_namespaces
from tests.test_agentenv_cgroup2 import LEAK_SERVICE, PID_SERVICE, SPIN_SERVICE, _cpu_ticks


def _v1_freezer_sandbox():
  require_namespaces()
  sb = agentenv.create()
  kind = (sb.info()["freezer"] or "none").split()[0]
  if kind != "v1":
    sb.close()
    pytest.skip(f"this hub's freezer is {kind}, not the v1 freezer")
  return sb, sb.info()["freezer"].split(" ", 1)[1]


def test_v1_pause_freezes_and_resume_thaws():
  sb, d = _v1_freezer_sandbox()
  with sb:
    sb.start_service("spin", SPIN_SERVICE)
    pid = int(sb.call_service("spin", "?"))
    assert str(pid) in _cgroup.read(d, "cgroup.procs").split()
    sb.pause()
    assert _cgroup.read(d, "freezer.state").strip() == "FROZEN" and sb.paused and sb.info()["paused"]
    t0 = _cpu_ticks(pid)
    time.sleep(0.3)
    assert _cpu_ticks(pid) == t0  # a spinning thread uses no CPU while frozen
    for call in (lambda: sb.exec("true"), sb.snapshot, lambda: sb.call_service("spin", "?")):
      with pytest.raises(agentenv.SandboxError, match="paused"):
        call()
    sb.resume()
    assert _cgroup.read(d, "freezer.state").strip() == "THAWED" and not sb.paused
    time.sleep(0.3)
    assert _cpu_ticks(pid) > t0
    assert sb.exec("echo ok").text == "ok\n" and sb.call_service("spin", "?") == str(pid)


def test_v1_close_of_a_paused_sandbox_kills_everything_and_removes_its_cgroups():
  """A frozen v1 task ignores SIGKILL until thawed: close() must kill, then thaw."""
  sb, d = _v1_freezer_sandbox()
  sb.start_service("pid", PID_SERVICE)
  sb.start_service("leak", LEAK_SERVICE)
  orphan = int(sb.call_service("leak", "go"))
  snap = sb.snapshot()
  sb.restore(snap)  # images and a spare copy too
  procs = [int(p) for p in _cgroup.read(d, "cgroup.procs").split()]
  assert len(procs) >= 7 and orphan in procs, procs  # init, 2 services, 2 images, spare, sleep
  dirs = [v.split(" ", 1)[1] for v in sb.info()["cgroups"].values()] + [d]
  sb.pause()
  sb.close()
  deadline = time.monotonic() + 5
  while time.monotonic() < deadline and (any(map(os.path.exists, dirs))
                                         or any(os.path.exists(f"/proc/{p}") for p in procs)):
    time.sleep(0.02)
  assert [p for p in procs if os.path.exists(f"/proc/{p}")] == [] and not any(map(os.path.exists, dirs))


def test_v1_hub_sigkill_with_a_paused_sandbox_leaves_nothing(monkeypatch):
  """Frozen processes never see their lifeline break: the reaper must thaw them after its kill."""
  monkeypatch.setattr(_Hub, "_inst", None)  # a hub of our own (the process-wide one stays)
  sb, d = _v1_freezer_sandbox()
  sb.start_service("pid", PID_SERVICE)
  pid = int(sb.call_service("pid", "?"))
  sb.pause()
  hub = _Hub._inst
  assert os.path.dirname(d) in hub_cgroup_dirs(hub.hub_pid)
  hub.proc.kill()
  hub.proc.wait()
  deadline = time.monotonic() + 10
  while time.monotonic() < deadline and (hub_cgroup_dirs(hub.hub_pid) or os.path.exists(f"/proc/{pid}")):
    time.sleep(0.05)
  sb._closed = True  # its hub is gone; nothing left to close
  assert not os.path.exists(f"/proc/{pid}") and hub_cgroup_dirs(hub.hub_pid) == []
