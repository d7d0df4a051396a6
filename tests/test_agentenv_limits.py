"""agentenv limits: process / memory / time / cpu / file-size / output caps stop the offender, not the host."""
import os
import subprocess
import time

import pytest

from moonshot_jax import agentenv
from tests.agentenv_testutil import agentenv_procs, require_namespaces

FORK_COUNT = r"""
import os, time
n = 0
try:
    while n < 1000:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError as e:
    print(n, e.errno)
else:
    print(n, 0)
"""


@pytest.fixture
def make():
  require_namespaces()
  made = []

  def _make(**kw):
    made.append(agentenv.create(limits=agentenv.Limits(**kw)))
    return made[-1]

  yield _make
  for sb in made:
    sb.close()


def test_fork_bomb_stops_at_pids_limit(make):
  sb = make(pids=24)
  r = sb.exec(["python3", "-c", FORK_COUNT], timeout=20)
  n, err = map(int, r.text.split())
  assert err == 11 and 5 < n < 24, r  # EAGAIN at the limit, counted with init/services
  bomb = sb.exec(["bash", "-c", ":(){ :|:& };:; sleep 1; echo alive"], timeout=10)
  assert b"Resource temporarily unavailable" in bomb.stderr and not bomb.timed_out
  assert sb.exec("echo ok").text == "ok\n"  # the bomb's processes died with its exec
  with agentenv.create() as other:
    assert other.exec("echo fine").ok
  assert subprocess.run(["true"]).returncode == 0  # the host can still start processes


def test_memory_bomb_dies_at_limit(make):
  sb = make(memory_mb=64)
  r = sb.exec(["python3", "-c", "x = []\nwhile True: x.append(bytearray(1 << 20))"], timeout=20)
  assert not r.timed_out and r.exit_code != 0, r
  assert r.exit_code == -9 or b"MemoryError" in r.stderr, r
  assert sb.exec("echo ok").text == "ok\n"  # pid 1 survived the OOM kill
  # files written count against the same limit: filling it starves the agent's commands, not the sandbox
  snap = sb.snapshot()
  r = sb.exec("head -c 200000000 /dev/zero > big", timeout=20)
  assert r.exit_code != 0
  assert sb.ping() and sb.list_dir(".") == ["big"]
  sb.restore(snap)  # dropping the upper layer frees the memory again
  assert sb.exec("echo ok").ok


def test_endless_loop_dies_at_timeout(make):
  sb = make(timeout=30.0)
  t0 = time.monotonic()
  r = sb.exec("sleep 100 & while true; do :; done", timeout=0.5)
  assert r.timed_out and r.exit_code == -9
  assert time.monotonic() - t0 < 5
  hub = agentenv.sandbox._Hub.get().hub_pid  # background child went with it (seen from the host)
  assert not [c for _, c in agentenv_procs(hub) if c == "sleep"]


def test_cpu_file_size_and_output_caps(make):
  sb = make(cpu_seconds=1, file_size_mb=1, max_output_bytes=1000)
  r = sb.exec(["python3", "-c", "while True: pass"], timeout=20)
  assert not r.timed_out and r.exit_code in (-24, -9), r  # SIGXCPU at the soft/hard cpu limit
  r = sb.exec("head -c 2000000 /dev/zero > f; echo $?; stat -c %s f")
  assert r.text.split() == ["153", "1048576"] or r.text.split()[1] == "1048576", r  # SIGXFSZ
  r = sb.exec("head -c 100000 /dev/zero | tr '\\0' x")
  assert r.truncated and r.stdout == b"x" * 1000
