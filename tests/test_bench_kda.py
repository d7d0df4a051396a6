"""launch/bench_kda.py end to end at a toy size: one JSON row per (T, mode, device count), in a fresh
process (--devices sets the CPU device count before the backend starts)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the script sets its own devices
  cmd = [sys.executable, "launch/bench_kda.py", "--T=128", "--H=2", "--K=16", "--repeats=1",
         "--impls=xla,recurrent", *args]
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_rows_for_each_device_count():
  p = _run("--devices=1,2", "--json")
  assert p.returncode == 0, p.stderr[-2000:]
  rows = json.loads(p.stdout.strip().splitlines()[-1])["rows"]
  assert sorted((r["mode"], r["devices"]) for r in rows) == [
      ("fwd", 1), ("fwd", 2), ("fwd_bwd", 1), ("fwd_bwd", 2)]
  for r in rows:
    assert r["xla"] > 0 and r["recurrent"] > 0 and r["gflops"] > 0 and r["x_vs_recurrent"] > 0
  assert "| 128 | fwd | 2 |" in p.stdout


def test_devices_must_divide_heads():
  p = _run("--devices=3")
  assert p.returncode != 0 and "--devices" in p.stderr
