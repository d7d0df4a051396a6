"""Agent SFT / GRPO through launch/train.py (the pretraining loop), on the test double env. Slow:
each run compiles the train step, the rollout sampler and the extend buckets in a subprocess."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--config.rl.env_module=tests.rl_doubles", "--config.data.seq_len=64", "--config.data.batch_size=8",
         "--config.rl.group_size=4", "--config.rl.max_action_tokens=8", "--config.rl.max_turns=3",
         "--config.rl.families=kv,kv_long", "--config.logging.tensorboard=False"]


def _cmd(config, workdir, *extra):
  return [sys.executable, "-m", "launch.train", f"--config=experiments/{config}.py", f"--workdir={workdir}",
          *SMALL, *extra]


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _run(cmd):
  r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
  assert r.returncode == 0, r.stderr[-3000:]
  return r


@pytest.mark.slow
def test_sft_then_grpo_from_its_checkpoint(tmp_path):
  sft, rl = tmp_path / "sft", tmp_path / "grpo"
  _run(_cmd("agent_tiny_sft", sft, "--config.train.steps=6", "--config.train.log_every=1",
            "--config.checkpoint.every_steps=3"))
  rows = _rows(sft)
  assert rows[-1]["oracle_reward"] == 1.0 and rows[-1]["loss"] < rows[0]["loss"]
  # dynamic sampling off: a 6-step SFT policy gives groups without reward spread, which DAPO would drop,
  # leaving the mismatch below measured over no token at all
  r = _run(_cmd("agent_tiny_grpo", rl, "--config.train.steps=3", f"--config.rl.init_workdir={sft}",
                "--config.rl.kl_coef=0.1", "--config.rl.eval_every=3", "--config.rl.eval_episodes=4",
                "--config.rl.dynamic_sampling=False"))
  assert "[rl] initial weights: step 6" in r.stdout
  rows = _rows(rl)
  assert [x["step"] for x in rows] == [1, 2, 3]
  for x in rows:  # update 1 of a rollout batch: the policy that sampled it (ratio 1, no mismatch)
    assert x["kl"] >= 0 and x["ppo_update"] in (1, 2)
    if x["ppo_update"] == 1:
      assert x["episodes"] >= 8 and x["trained_episodes"] >= 8 and 0 <= x["reward"] <= 1
      assert 0 < x["logp_mismatch"] < 1e-3  # > 0: measured over real tokens (float rounding differs)
  assert "heldout_success" in rows[-1]


KEYS = ("loss", "pg_loss", "clip_fraction", "grad_norm", "ppo_update")
ROLLOUT_KEYS = ("reward", "success_rate", "episodes", "pending_groups", "response_tokens", "dropped_groups")


@pytest.mark.slow
def test_kill9_during_rl_and_restart_reproduces(tmp_path):
  """Partial rollouts on (1 turn per step): groups in flight are in the checkpoints; two updates per
  rollout batch: the step-3 checkpoint holds a half-used rollout batch. A run killed with SIGKILL
  after that checkpoint and restarted logs the uninterrupted run's numbers."""
  extra = ["--config.train.steps=7", "--config.checkpoint.every_steps=3", "--config.rl.turns_per_iteration=1",
           "--config.rl.families=kv,parity", "--config.rl.ppo_epochs=2", "--config.rl.dynamic_sampling=True"]
  a, b = tmp_path / "a", tmp_path / "b"
  _run(_cmd("agent_tiny_grpo", a, *extra))
  p = subprocess.Popen(_cmd("agent_tiny_grpo", b, *extra), cwd=ROOT, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
  try:
    deadline = time.time() + 1200
    while time.time() < deadline and p.poll() is None:
      if os.path.exists(b / "metrics.jsonl") and any(r["step"] >= 4 for r in _rows(b)):
        break
      time.sleep(0.2)
    assert p.poll() is None, "the run ended before it could be killed"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
  finally:
    if p.poll() is None:
      p.kill()
  assert max(r["step"] for r in _rows(b)) < 7
  r = _run(_cmd("agent_tiny_grpo", b, *extra))
  assert "resumed from step 3" in r.stdout
  ra, rb = _rows(a), _rows(b)
  assert [x["step"] for x in rb] == [x["step"] for x in ra] == list(range(1, 8))
  assert [x["ppo_update"] for x in ra] == [1, 2, 1, 2, 1, 2, 1]
  assert any(x.get("pending_groups", 0) > 0 for x in ra) and any(x.get("episodes", 0) > 0 for x in ra)
  assert any(x["grad_norm"] > 0 for x in ra[2:])  # real updates after the restart point
  for x, y in zip(ra, rb):
    keys = KEYS + (ROLLOUT_KEYS if x["ppo_update"] == 1 else ())
    assert {k: x[k] for k in keys} == {k: y[k] for k in keys}, x["step"]
