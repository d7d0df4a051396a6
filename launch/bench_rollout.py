"""Batched vs one-at-a-time multi-turn rollouts: the same held-out tasks, tokens/s side by side.

    python -m launch.bench_rollout --config=experiments/agent_tiny_grpo.py --workdir=/tmp/agent_sft --tasks=8

Rolls out --tasks tasks x rl.group_size rollouts (a GRPO group per task: the reset env and its forks) in two modes:
all rows in one batch (rl/rollout.py's per-row decode loop: observations fed alongside other rows' sampling, only
the busy rows computed, env steps in a thread pool overlapping the decoding) and one row at a time (same code, batch
of 1). Row j samples with key j in both modes, so both generate the same rollouts (up to float ties). Weights: the
workdir's newest checkpoint (--workdir, e.g. the SFT run: realistic actions) or the seed's initial weights. A
warm-up pass per mode (and `Sampler.compile_buckets`) compiles first and is not timed. Each mode is timed --repeats
times, the two live modes alternating (the machine's speed drifts: on the 2-core dev box one run per mode swung
30-50%, session 25). Prints each mode's median run: sampled / observation tokens, seconds, sampled tokens/s, env
wait seconds (the driver idle, waiting for an env step: env time on the critical path), env busy seconds (summed
latency of all env steps: overlapping steps each count in full, so with 8 env threads on 2 cores it counts the same
env work several times over; not CPU), decode-loop calls (host round trips), decode steps, row use (fed tokens /
computed row-steps: the share of computed rows that were busy), CPU seconds of this process and its children (the
env hub; commands that ended in a live sandbox are not counted yet), host cpu s (every process's busy CPU on the
machine, /proc/stat: the sandboxes and the kernel's work for them included), the speed-up, and the seconds the envs
took to close once done (not in `seconds`: closing is not generating, and the GRPO trainer closes them off its critical
path). Then both modes again with every env step answered at once from what the first live batched run recorded
(same rollouts, env cost removed): the rollout engine's own speed-up. A line lists every run's seconds. A last table
puts the live and replayed ratios side by side with each mode's env cost (live minus replayed seconds: env work on
the critical path plus env CPU slowing the decode on the shared cores) and its share of the live run. The last line
is the cpu floor: the batched live run's host cpu s over the cores is the least wall time it can take, so the live
speed-up cannot exceed one-at-a-time live seconds over that floor on this machine.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import time
from pathlib import Path

from absl import app, flags, logging
from ml_collections import config_flags

from moonshot_jax import experiment

_CONFIG = config_flags.DEFINE_config_file("config", None, "Agent experiment config.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "", "Checkpoint to roll out (default: initial weights).")
_TASKS = flags.DEFINE_integer("tasks", 8, "Tasks (groups of rl.group_size rollouts).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed runs per mode; the tables show each mode's median run.")
MODES = ("batched", "one-at-a-time", "batched, replay", "one-at-a-time, replay")
flags.mark_flags_as_required(["config"])


class _Recorder:
  """Steps the wrapped env and appends (action, result) to `log`."""

  def __init__(self, env, log: list):
    self.env, self.log = env, log

  def step(self, action):
    out = self.env.step(action)
    self.log.append((action, out))
    return out

  def close(self):
    self.env.close()


class _Replay:
  """Returns a recorded env's results at once; a different action than recorded raises (the
  rollout then ends with an error, and the table counts it as differing)."""

  def __init__(self, log: list):
    self.log, self.i = log, 0

  def step(self, action):
    if self.i >= len(self.log) or self.log[self.i][0] != action:
      raise RuntimeError(f"replay: action {action!r} was not recorded at step {self.i}")
    self.i += 1
    return self.log[self.i - 1][1]

  def close(self):
    pass


def _tree_cpu_s() -> float:
  """CPU seconds of this process and its direct children (the env hub, whose reaped sandbox processes
  land in its cutime/cstime), from /proc (nan where there is none)."""
  me, tot = os.getpid(), 0.0
  try:
    hz = os.sysconf("SC_CLK_TCK")
    pids = [d for d in os.listdir("/proc") if d.isdigit()]
  except (OSError, ValueError):
    return float("nan")
  for d in pids:
    try:
      with open(f"/proc/{d}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # exited meanwhile
      continue
    if int(d) == me:
      tot += (int(fields[11]) + int(fields[12])) / hz
    elif int(fields[1]) == me:
      tot += sum(int(x) for x in fields[11:15]) / hz
  return tot


def _machine_busy_s() -> float:
  """CPU seconds every process of the machine spent busy (all cores, from /proc/stat; nan where there is none): the
  sandboxes' processes included, which _tree_cpu_s misses while they live, and the kernel's work for them."""
  try:
    with open("/proc/stat") as f:
      ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
  except (OSError, ValueError, IndexError):
    return float("nan")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import jax

  from moonshot_jax.rl import rollout as ro
  from moonshot_jax.rl import source
  from moonshot_jax.train import loop
  from moonshot_jax.train import state as state_lib

  if _REPEATS.value < 1 or _TASKS.value < 1:
    raise app.UsageError(f"--repeats={_REPEATS.value} and --tasks={_TASKS.value} must be >= 1")
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
    t0, c0, m0 = time.perf_counter(), _tree_cpu_s(), _machine_busy_s()
    tot = {"sampled_tokens": 0, "obs_tokens": 0, "env_s": 0.0, "env_busy_s": 0.0, "decode_calls": 0,
           "decode_steps": 0, "row_steps": 0}
    keys = jax.random.split(key, len(rows))
    batches = [[i] for i in range(len(rows))] if one_at_a_time else [list(range(len(rows)))]
    for b in batches:
      info = ro.run_rollouts(sampler, variables, [rows[i] for i in b], keys[b[0]:b[-1] + 1], pool)
      for k in tot:
        tot[k] += info[k]
    seconds, cpu_s, machine_s = time.perf_counter() - t0, _tree_cpu_s() - c0, _machine_busy_s() - m0
    t1 = time.perf_counter()  # closing the finished envs is not rollout generation (GRPO does it off its critical
    for r in rows:            # path, rl/source.py): timed apart
      r.env.close()
    return dict(tot, seconds=seconds, cpu_s=cpu_s, machine_s=machine_s, close_s=time.perf_counter() - t1,
                episodes=len(rows))

  key = jax.random.key(0)
  for mode, single in (("batched", False), ("one-at-a-time", True)):
    warm = [r for g in groups(10_000, _TASKS.value) for r in g]  # same batch shape as the timed runs
    sampler.compile_buckets(variables, 1 if single else len(warm))
    run(warm, single, key)  # compiles (prefill / sample / extend buckets) untimed
  runs: dict[str, list[dict]] = {m: [] for m in MODES}
  logs, live = [], []
  # live runs, the two modes alternating (slow drifts of the shared machine hit both alike); the first batched run
  # records every env step for the replayed runs
  for _ in range(_REPEATS.value):
    for mode, single in (("batched", False), ("one-at-a-time", True)):
      rows = [r for g in groups(0, _TASKS.value) for r in g]
      if not logs:
        logs = [[] for _ in rows]
        for r, log in zip(rows, logs):
          r.env = _Recorder(r.env, log)
        live = rows
      runs[mode].append(run(rows, single, key))
  # the same rollouts with the recorded env outputs returned at once: the engine's own speed-up
  for _ in range(_REPEATS.value):
    for mode, single in (("batched, replay", False), ("one-at-a-time, replay", True)):
      rows = [r for g in groups(0, _TASKS.value) for r in g]
      for r, log in zip(rows, logs):
        r.env.close()
        r.env = _Replay(log)
      runs[mode].append(dict(run(rows, single, key), differ=sum(a.tokens != b.tokens for a, b in zip(rows, live))))
  # each mode's median run by seconds (the token counts are the same in every run of a mode)
  results = {m: sorted(rs, key=lambda r: r["seconds"])[len(rs) // 2] for m, rs in runs.items()}
  print(f"{'mode':<22} {'episodes':>8} {'sampled':>8} {'obs':>7} {'seconds':>8} {'cpu s':>6} {'tok/s':>8} "
        f"{'host cpu s':>10} {'env wait s':>10} {'env busy s':>10} {'calls':>6} {'steps':>6} {'row use':>7} "
        f"{'speed-up':>8} {'close s':>7}")
  for mode, r in results.items():
    base = results["one-at-a-time" + (", replay" if "replay" in mode else "")]
    rate = r["sampled_tokens"] / r["seconds"]
    up = rate / (base["sampled_tokens"] / base["seconds"])
    print(f"{mode:<22} {r['episodes']:>8} {r['sampled_tokens']:>8} {r['obs_tokens']:>7} {r['seconds']:>8.2f} "
          f"{r['cpu_s']:>6.2f} {rate:>8.1f} {r['machine_s']:>10.2f} {r['env_s']:>10.2f} {r['env_busy_s']:>10.2f} "
          f"{r['decode_calls']:>6} {r['decode_steps']:>6} "
          f"{(r['sampled_tokens'] + r['obs_tokens']) / max(r['row_steps'], 1):>7.2f} "
          f"{up:>7.2f}x {r['close_s']:>7.2f}")
  differ = [r["differ"] for m in MODES if "replay" in m for r in runs[m]]
  print(f"replayed rollouts whose tokens differ from the live batched run: {differ} (float ties)")
  print("seconds of every run (the table shows the median): " + "; ".join(
      f"{m} " + " ".join(f"{r['seconds']:.2f}" for r in rs) for m, rs in runs.items()))
  # the goal's ratio (live batched vs live one at a time) beside the engine's own (replayed), and what the envs cost
  # each mode in wall time: live minus replayed seconds of the same rollouts (env CPU competing with the decode on
  # the same cores included, which env wait s does not see)
  print(f"{'mode':<14} {'live s':>7} {'replay s':>8} {'env cost s':>10} {'env share':>9} {'live speed-up':>13} "
        f"{'replay speed-up':>15}")
  def tokens_per_s(mode):
    return results[mode]["sampled_tokens"] / results[mode]["seconds"]

  for mode in ("batched", "one-at-a-time"):
    lv, rp = results[mode], results[mode + ", replay"]
    cost = lv["seconds"] - rp["seconds"]
    print(f"{mode:<14} {lv['seconds']:>7.2f} {rp['seconds']:>8.2f} {cost:>10.2f} {cost / lv['seconds']:>9.0%} "
          f"{tokens_per_s(mode) / tokens_per_s('one-at-a-time'):>12.2f}x "
          f"{tokens_per_s(mode + ', replay') / tokens_per_s('one-at-a-time, replay'):>14.2f}x")
  # what the cores allow: the batched live run keeps the machine busy for host cpu s (decode + env processes +
  # kernel), so on n cores it cannot finish in less than host cpu s / n, however well env steps overlap decoding
  cores, busy = os.cpu_count() or 1, results["batched"]["machine_s"]  # /proc/stat sums every core of the machine
  floor = busy / cores
  most = results["batched"]["sampled_tokens"] / floor / tokens_per_s("one-at-a-time")
  print(f"cpu floor: the batched live run kept this machine busy {busy:.2f} CPU-s ({cores} cores: >= {floor:.2f} s of "
        f"wall time); live speed-up at most {most:.2f}x on this machine "
        f"(measured {tokens_per_s('batched') / tokens_per_s('one-at-a-time'):.2f}x)")
  pool.shutdown()


if __name__ == "__main__":
  app.run(main, flags_parser=experiment.parse_flags)
