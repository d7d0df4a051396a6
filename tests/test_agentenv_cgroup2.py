"""agentenv's cgroup v2 backend on this machine's real unified hierarchy (AGENTENV_CGROUPS=v2): process placement,
freeze / thaw (pause / resume), cgroup.kill on close, cleanup, and the recorded rlimit fallback for controllers
that v2 does not offer. Real memory.max / pids.max enforcement needs a v2 hierarchy that owns those
controllers: see test_agentenv_cgroup2_vm.py."""
import os
import time

import pytest

from moonshot_jax import agentenv
from moonshot_jax.agentenv import _cgroup
from moonshot_jax.agentenv.sandbox import _Hub
from tests.agentenv_testutil import require_namespaces

PID_SERVICE = "import os\ndef handle(request):\n  return str(os.getpid())\n"
# A service that burns CPU in a thread, so freezing it is visible in its CPU time.
# A service that leaves a detached child running (its own session): no kill of a known pid reaches it.
LEAK_SERVICE = ("import subprocess\n"
                "def handle(request):\n  return str(subprocess.Popen(['sleep', '1000'], start_new_session=True).pid)\n")
SPIN_SERVICE = ("import os, threading\n"
                "def _spin():\n  while True:\n    pass\n"
                "threading.Thread(target=_spin, daemon=True).start()\n"
                "def handle(request):\n  return str(os.getpid())\n")


def _v2_parent_or_skip():
  require_namespaces()
  _, v2 = _cgroup.mounts()
  if v2 is None:
    pytest.skip("no cgroup2 mount on this machine")
  parent = _cgroup.v2_parent(v2)
  if parent is None:
    pytest.skip(f"the cgroup2 mount at {v2[0]} does not show this process's cgroup")
  probe = f"{parent}/agentenv-probe-{os.getpid()}"
  try:
    os.mkdir(probe)
    os.rmdir(probe)
  except OSError as e:
    pytest.skip(f"cgroup2 at {parent} is not writable here: {e.strerror}")
  return parent


@pytest.fixture
def v2hub(monkeypatch):
  """A hub of our own in forced-v2 mode (the process-wide hub stays as it is)."""
  parent = _v2_parent_or_skip()
  monkeypatch.setenv("AGENTENV_CGROUPS", "v2")
  monkeypatch.setattr(_Hub, "_inst", None)
  made = []

  def make(**kw):
    made.append(agentenv.create(limits=agentenv.Limits(**kw)))
    return made[-1]

  make.parent = parent
  yield make
  for sb in made:
    sb.close()
  if _Hub._inst is not None:
    hub = _Hub._inst
    hub.sock.close()  # EOF: the hub tears down and removes its cgroups
    hub.proc.wait(timeout=30)
    assert not os.path.exists(f"{parent}/agentenv-{hub.hub_pid}")


def _cg2(pid):
  return next(ln[3:] for ln in open(f"/proc/{pid}/cgroup").read().splitlines() if ln.startswith("0::"))


def _rel(make, path):
  return path[len(make.parent.rstrip("/")):] if make.parent != "/" else path


def test_v2_placement_info_and_fallback(v2hub):
  """init, services (started, restored, forked) and commands live in the sandbox's own v2 cgroup; info() and
  hub_stats() name it and record why memory / pids fall back to rlimits where v2 lacks those controllers."""
  sb = v2hub(memory_mb=64, pids=32)
  info = sb.info()
  hub = _Hub._inst.hub_pid
  d = info["cgroup_v2"]
  assert d == f"{v2hub.parent.rstrip('/')}/agentenv-{hub}/{sb.id}", info
  st = agentenv.hub_stats()
  assert st["cgroup_v2"] == os.path.dirname(d) and st["cgroup_v1"] == []
  for c in ("memory", "pids"):
    if c in st["cgroup_v2_controllers"]:
      assert info["cgroups"][c] == f"v2 {d}" and c not in info["rlimit_fallback"], info
    else:
      assert c not in info["cgroups"] and "cgroup v2" in info["rlimit_fallback"][c], info
  sys_cg = _rel(v2hub, d) + "/sys"
  procs = [int(p) for p in open(f"{d}/sys/cgroup.procs").read().split()]
  assert procs and all(_cg2(p) == sys_cg for p in procs)  # init
  cmd = sb.exec("cat /proc/self/cgroup").text
  leaf = "agent" if "memory" in st["cgroup_v2_controllers"] else "sys"
  assert f"0::{_rel(v2hub, d)}/{leaf}\n" in cmd, cmd
  sb.start_service("pid", PID_SERVICE)
  assert _cg2(int(sb.call_service("pid", "?"))) == sys_cg
  snap = sb.snapshot()
  sb.restore(snap)
  assert _cg2(int(sb.call_service("pid", "?"))) == sys_cg
  (kid,) = sb.fork(1)
  kid_cg = _rel(v2hub, kid.info()["cgroup_v2"]) + "/sys"
  assert kid_cg != sys_cg and _cg2(int(kid.call_service("pid", "?"))) == kid_cg
  kid.restore(snap)  # the snapshot's image lives in sb's cgroup: the copy must move itself into kid's
  assert _cg2(int(kid.call_service("pid", "?"))) == kid_cg


def _cpu_ticks(pid):
  f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
  return int(f[11]) + int(f[12])  # utime + stime


def test_v2_pause_freezes_and_resume_thaws(v2hub):
  sb = v2hub()
  sb.start_service("spin", SPIN_SERVICE)
  pid = int(sb.call_service("spin", "?"))
  d = sb.info()["cgroup_v2"]
  sb.pause()
  assert "frozen 1" in _cgroup.read(d, "cgroup.events").splitlines() and sb.paused and sb.info()["paused"]
  t0 = _cpu_ticks(pid)
  time.sleep(0.3)
  assert _cpu_ticks(pid) == t0  # a spinning thread uses no CPU while frozen
  with pytest.raises(agentenv.SandboxError, match="paused"):
    sb.exec("true")
  with pytest.raises(agentenv.SandboxError, match="paused"):
    sb.snapshot()
  sb.resume()
  assert "frozen 0" in _cgroup.read(d, "cgroup.events").splitlines() and not sb.paused
  time.sleep(0.3)
  assert _cpu_ticks(pid) > t0
  assert sb.exec("echo ok").text == "ok\n" and sb.call_service("spin", "?") == str(pid)


@pytest.mark.parametrize("paused", [False, True], ids=["running", "paused"])
def test_v2_close_kills_every_process_and_removes_the_cgroup(v2hub, paused):
  """close() ends init, services, snapshot images, spare copies and a service's detached child through
  cgroup.kill, frozen or not."""
  sb = v2hub()
  sb.start_service("pid", PID_SERVICE)
  sb.start_service("leak", LEAK_SERVICE)
  orphan = int(sb.call_service("leak", "go"))  # the services share the host's PID namespace
  snap = sb.snapshot()
  sb.restore(snap)  # leaves a pre-forked spare copy next to the image
  d = sb.info()["cgroup_v2"]
  procs = [int(p) for p in open(f"{d}/sys/cgroup.procs").read().split()]
  assert len(procs) >= 7 and orphan in procs, procs  # init, 2 services, 2 images, spare, sleep
  if paused:
    sb.pause()
  sb.close()
  deadline = time.monotonic() + 5
  while time.monotonic() < deadline and (os.path.exists(d) or any(os.path.exists(f"/proc/{p}") for p in procs)):
    time.sleep(0.02)
  assert [p for p in procs if os.path.exists(f"/proc/{p}")] == [] and not os.path.exists(d)


def test_v2_hub_sigkill_leaves_no_cgroup(v2hub):
  """The reaper kills what is left in the hub's v2 cgroups and removes them when the hub dies by SIGKILL."""
  sb = v2hub()
  sb.start_service("pid", PID_SERVICE)
  hub = _Hub._inst
  d = f"{v2hub.parent.rstrip('/')}/agentenv-{hub.hub_pid}"
  assert os.path.isdir(d)
  hub.proc.kill()
  hub.proc.wait()
  deadline = time.monotonic() + 10
  while time.monotonic() < deadline and os.path.exists(d):
    time.sleep(0.05)
  assert not os.path.exists(d)
  sb._closed = True  # its hub is gone; nothing left to close


def test_pause_without_v2_cgroup_is_a_clear_error(monkeypatch):
  require_namespaces()
  monkeypatch.setenv("AGENTENV_CGROUPS", "0")
  monkeypatch.setattr(_Hub, "_inst", None)
  try:
    with agentenv.create() as sb:
      assert set(sb.info()["rlimit_fallback"]) == {"memory", "pids"}
      with pytest.raises(agentenv.SandboxError, match="pause / resume need a freezer cgroup"):
        sb.pause()
      assert not sb.paused and sb.exec("echo ok").text == "ok\n"
  finally:
    if _Hub._inst is not None:
      _Hub._inst.sock.close()
      _Hub._inst.proc.wait(timeout=30)


def test_bad_cgroup_mode_is_a_clear_error(monkeypatch):
  with pytest.raises(_cgroup.CgroupError, match="AGENTENV_CGROUPS='v3'"):
    _cgroup.Cgroups(os.getpid(), mode="v3")
