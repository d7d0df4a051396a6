"""agentenv limits: process / memory / time / cpu / file-size / output caps stop the offender, not the host."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from moonshot_jax import agentenv
from tests.agentenv_programs import BOMB, FORK_COUNT
from tests.agentenv_testutil import SPAWN_PATHS, agentenv_procs, require_namespaces, spawn_path  # noqa: F401


@pytest.fixture
def make(spawn_path):
  require_namespaces()
  made = []

  def _make(**kw):
    made.append(agentenv.create(limits=agentenv.Limits(**kw)))
    return made[-1]

  yield _make
  for sb in made:
    sb.close()


@pytest.mark.parametrize("spawn_path", SPAWN_PATHS, indirect=True)
def test_fork_bomb_stops_at_pids_limit(make):
  sb = make(pids=24)
  r = sb.exec(["python3", "-c", FORK_COUNT], timeout=20)
  n, err = map(int, r.text.split())
  assert err == 11 and 5 < n < 24, r  # EAGAIN at the limit, counted with init/services
  t0 = time.monotonic()
  bomb = sb.exec(["bash", "-c", ":(){ :|:& };:; sleep 1; echo alive"], timeout=3)
  assert b"Resource temporarily unavailable" in bomb.stderr  # held at the limit (bash retries until killed)
  assert time.monotonic() - t0 < 8
  assert sb.exec("echo ok").text == "ok\n"  # the bomb's processes died with its exec
  with agentenv.create() as other:
    assert other.exec("echo fine").ok
  assert subprocess.run(["true"]).returncode == 0  # the host can still start processes


def test_memory_bomb_dies_at_limit(make):
  sb = make(memory_mb=64)
  r = sb.exec(["python3", "-c", BOMB], timeout=20)
  assert not r.timed_out and r.exit_code != 0, r
  assert r.exit_code == -9 or b"MemoryError" in r.stderr, r
  assert 20 < int(r.text.split()[-1]) < 64  # MiB it got before dying at the 64 MiB limit
  assert sb.exec("echo ok").text == "ok\n"  # pid 1 survived the OOM kill
  # files written count against the same limit: filling it starves the agent's commands, not the sandbox
  snap = sb.snapshot()
  r = sb.exec("head -c 200000000 /dev/zero > big", timeout=20)
  assert r.exit_code != 0
  assert sb.ping() and sb.list_dir(".") == ["big"]
  sb.restore(snap)  # dropping the upper layer frees the memory again
  assert sb.exec("echo ok").ok


@pytest.mark.parametrize("spawn_path", SPAWN_PATHS, indirect=True)
def test_endless_loop_dies_at_timeout(make):
  sb = make(timeout=30.0)
  t0 = time.monotonic()
  r = sb.exec("sleep 100 & while true; do :; done", timeout=0.5)
  assert r.timed_out and r.exit_code == -9
  assert time.monotonic() - t0 < 5
  hub = agentenv.sandbox._Hub.get().hub_pid  # background child went with it (seen from the host)
  assert not [c for _, c in agentenv_procs(hub) if c == "sleep"]


@pytest.mark.parametrize("spawn_path", SPAWN_PATHS, indirect=True)
def test_cpu_file_size_and_output_caps(make):
  sb = make(cpu_seconds=1, file_size_mb=1, max_output_bytes=1000)
  r = sb.exec(["python3", "-c", "while True: pass"], timeout=20)
  assert not r.timed_out and r.exit_code in (-24, -9), r  # SIGXCPU at the soft/hard cpu limit
  r = sb.exec("head -c 2000000 /dev/zero > f; echo $?; stat -c %s f")
  assert r.text.split() == ["153", "1048576"], r  # killed by SIGXFSZ (128 + 25): exec restores its default
  r = sb.exec("head -c 100000 /dev/zero | tr '\\0' x")
  assert r.truncated and r.stdout == b"x" * 1000


RLIMIT_ONLY = r"""
from moonshot_jax import agentenv
import json
sb = agentenv.create(limits=agentenv.Limits(pids=24, memory_mb=64))
mem = sb.exec(["python3", "-c", BOMB], timeout=20)
forks = sb.exec(["python3", "-c", FORK_COUNT], timeout=20)
st = agentenv.hub_stats()
print(json.dumps({"cgroups": st["cgroups"], "fallback": sorted(sb.info()["rlimit_fallback"]),
                  "cgroup_v2": st["cgroup_v2"], "v2_dir": sb.info()["cgroup_v2"], "mem_exit": mem.exit_code,
                  "mem_last": mem.text.split()[-1] if mem.text else "", "mem_err": "MemoryError" in mem.stderr.decode(),
                  "forks": forks.text.split(), "after": sb.exec("echo ok").text, "spawn": st["spawn"]}))
sb.close()
"""


# What a cgroup-v2-only host looks like to the hub: in a private mount namespace, this machine's (real) cgroup2
# hierarchy mounted at /sys/fs/cgroup over the v1 mounts. memory and pids stay bound to the host's v1
# hierarchies (the kernel cannot give a controller to v2 while a v1 hierarchy with child cgroups holds it), so the
# v2 mount offers neither, exactly like a v2 host that does not delegate them: the hub must fall back to rlimits.
V2_VIEW = r"""
import os
from moonshot_jax.agentenv import _sys as S
S.unshare(S.CLONE_NEWNS)
S.mount(None, "/", None, S.MS_REC | S.MS_PRIVATE)
S.mount("cgroup2", "/sys/fs/cgroup", "cgroup2", 0)
assert os.path.exists("/sys/fs/cgroup/cgroup.controllers") and not os.path.exists("/sys/fs/cgroup/memory")
"""


@pytest.mark.parametrize("spawn", ["auto", "fork"])
@pytest.mark.parametrize("how", ["AGENTENV_CGROUPS=0", "cgroup2-only host"])
def test_rlimit_fallback_without_cgroups(how, spawn):
  """Where cgroups are unavailable (AGENTENV_CGROUPS=0 forces it; a cgroup2-only view of this machine without
  memory / pids controllers): RLIMIT_AS per process, RLIMIT_NPROC for uid 1000 of the (hub-wide) user
  namespace."""
  require_namespaces()
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=repo, AGENTENV_SPAWN=spawn)  # (auto: the helper where it builds)
  code = f"FORK_COUNT = {FORK_COUNT!r}\nBOMB = {BOMB!r}\n" + RLIMIT_ONLY
  if how == "AGENTENV_CGROUPS=0":
    env["AGENTENV_CGROUPS"] = "0"
  else:
    if not os.path.exists("/sys/fs/cgroup/memory/cgroup.procs"):
      pytest.skip("needs this machine's cgroup v1 layout to hide")
    code = V2_VIEW + code
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  res = json.loads(out.stdout.strip().split("\n")[-1])
  assert res["cgroups"] == [] and res["fallback"] == ["memory", "pids"] and res["after"] == "ok\n", res
  assert res["spawn"] == ("fork" if spawn == "fork" or not shutil.which("cc", path="/usr/bin:/bin") else "helper")
  if how == "cgroup2-only host":  # the sandbox still gets its own v2 cgroup (kill / freeze), just no limits there
    assert res["v2_dir"].startswith(res["cgroup_v2"] + "/sb-"), res
  assert res["mem_err"] and res["mem_exit"] == 1 and int(res["mem_last"]) < 64, res
  n, err = map(int, res["forks"])
  assert err == 11 and n < 24, res


PID_SERVICE = "import os\ndef handle(request):\n  return str(os.getpid())\n"


def test_services_stay_in_their_sandboxs_cgroups(make):
  """A service counts against its own sandbox's memory and pids limits after start, restore, fork, and a fork's
  restore to its parent's snapshot (restore skips the cgroup move when the copy already starts there)."""
  sb = make()
  hub = agentenv.sandbox._Hub.get().hub_pid
  if not agentenv.hub_stats()["cgroup_v1"]:
    pytest.skip("no cgroup v1 limits on this machine (the v2 placement is in test_agentenv_cgroup2.py)")

  def cgroups(box):
    pid = int(box.call_service("pid", "?"))
    lines = dict(line.split(":", 2)[1:] for line in open(f"/proc/{pid}/cgroup").read().splitlines())
    return pid, {c: lines[c].strip() for c in agentenv.hub_stats()["cgroup_v1"]}

  def expect(box):
    return {c: f"/agentenv-{hub}/{box.id}" for c in agentenv.hub_stats()["cgroup_v1"]}

  sb.start_service("pid", PID_SERVICE)
  pid0, cg = cgroups(sb)
  assert cg == expect(sb), cg
  snap = sb.snapshot()
  sb.restore(snap)
  pid1, cg = cgroups(sb)
  assert pid1 != pid0 and cg == expect(sb), cg
  kid = sb.fork(1)[0]
  try:
    assert cgroups(kid)[1] == expect(kid)
    kid.restore(snap)  # the snapshot's image lives in the parent's cgroups: the copy must be moved
    assert cgroups(kid)[1] == expect(kid)
    assert cgroups(sb)[1] == expect(sb)
  finally:
    kid.close()
