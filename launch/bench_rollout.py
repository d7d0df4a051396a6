"""Batched vs one-at-a-time multi-turn rollouts: the same held-out tasks, tokens/s side by side.

    python -m launch.bench_rollout --config=experiments/agent_tiny_grpo.py --workdir=/tmp/agent_sft --tasks=8

Rolls out --tasks tasks x rl.group_size rollouts (fork of one reset env per task) twice: all rows in
one batch (rl/rollout.py's per-row decode loop: observations fed alongside other rows' sampling,
env steps in a thread pool overlapping the decoding) and one row at a time (same code, batch of 1). Weights: the workdir's newest
checkpoint (--workdir, e.g. the SFT run: realistic actions) or the seed's initial weights. A warm-up
pass per mode compiles first and is not timed. Prints a table: sampled / observation tokens,
seconds, sampled tokens/s, env wait seconds (the driver idle, waiting for an env step: env time on
the critical path), env busy seconds (summed latency of all env steps, mostly overlapped with
decoding in batched mode), decode-loop calls (host round trips), and the speed-up.
"""
from __future__ import annotations

import concurrent.futures as cf
import time
from pathlib import Path

from absl import app, flags, logging
from ml_collections import config_flags

from moonshot_jax import experiment

_CONFIG = config_flags.DEFINE_config_file("config", None, "Agent experiment config.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "", "Checkpoint to roll out (default: initial weights).")
_TASKS = flags.DEFINE_integer("tasks", 8, "Tasks (groups of rl.group_size rollouts).")
flags.mark_flags_as_required(["config"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import jax

  from moonshot_jax.rl import rollout as ro
  from moonshot_jax.rl import source
  from moonshot_jax.train import loop
  from moonshot_jax.train import state as state_lib

  cfg = _CONFIG.value
  trainer = loop.build(cfg)
  if _WORKDIR.value:
    init = source.restore_params(Path(_WORKDIR.value).expanduser() / "checkpoints", trainer.setup.abstract)
  else:
    st = state_lib.create_train_state(trainer.setup, trainer.init_fn, int(cfg.train.seed))
    init = {"params": st.params, "moe_state": st.moe_state}
  variables = trainer.model.to_model_layout(init)
  sampler = source.make_sampler(cfg, trainer)
  fams = source.families(cfg)
  tok = sampler.tok
  pool = cf.ThreadPoolExecutor(int(cfg.rl.env_workers))

  def groups(first: int, n: int):
    return [source.start_group(cfg, *source.task(cfg, fams, k, source.HELDOUT_SEED + 900_000), k, tok)
            for k in range(first, first + n)]

  def run(rows, one_at_a_time: bool, key):
    t0 = time.perf_counter()
    tot = {"sampled_tokens": 0, "obs_tokens": 0, "env_s": 0.0, "env_busy_s": 0.0, "decode_calls": 0}
    batches = [[r] for r in rows] if one_at_a_time else [rows]
    for i, b in enumerate(batches):
      info = ro.run_rollouts(sampler, variables, b, jax.random.fold_in(key, i), pool)
      for k in tot:
        tot[k] += info[k]
    for r in rows:
      r.env.close()
    return dict(tot, seconds=time.perf_counter() - t0, episodes=len(rows))

  key = jax.random.key(0)
  results = {}
  for mode, single in (("batched", False), ("one-at-a-time", True)):
    warm = [r for g in groups(10_000, _TASKS.value) for r in g]  # same batch shape as the timed run
    run(warm, single, key)  # compiles (prefill / sample / extend buckets) untimed
    rows = [r for g in groups(0, _TASKS.value) for r in g]
    results[mode] = run(rows, single, key)
  base = results["one-at-a-time"]
  print(f"{'mode':<14} {'episodes':>8} {'sampled':>8} {'obs':>7} {'seconds':>8} {'tok/s':>8} {'env wait s':>10} "
        f"{'env busy s':>10} {'calls':>6} {'speed-up':>8}")
  for mode, r in results.items():
    tps = r["sampled_tokens"] / r["seconds"]
    up = tps / (base["sampled_tokens"] / base["seconds"])
    print(f"{mode:<14} {r['episodes']:>8} {r['sampled_tokens']:>8} {r['obs_tokens']:>7} {r['seconds']:>8.2f} "
          f"{tps:>8.1f} {r['env_s']:>10.2f} {r['env_busy_s']:>10.2f} {r['decode_calls']:>6} {up:>7.2f}x")
  pool.shutdown()


if __name__ == "__main__":
  app.run(main, flags_parser=experiment.parse_flags)
