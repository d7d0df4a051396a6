"""python launch/bench_envs.py [--episodes=100] [--threads=8] [--ray] [--quick]

The agent task families (moonshot_jax/agentenv/envs.py, tasks.py) played by their scripted oracle, one
row per family x difficulty: oracle success (goal 1.000), turns and characters per episode (prompt +
actions + observations: what a byte-level policy reads and writes), and p50 / p99 latency of reset() and
step(). Half the seeds are held-out ones (>= HELD_OUT_SEED). With --ray, the same episodes also run with
backend="ray" (a local 2-CPU cluster, one sandbox-host actor) and the step p50 ratio ray / local is printed
beside. Then fork(8, lazy=False) of a freshly reset env per family (8 sandbox copies: what a GRPO group's lazy fork
pays at most, as its rows first write) and closing the 8 children;
last line: --threads threads stepping their own envs at once (the RL side's env pool): episodes/s.
Quick check: --quick (20 episodes, 4 threads).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import sys
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moonshot_jax.agentenv import envs  # noqa: E402


def pct(xs, q):
  xs = sorted(xs)
  return 1000 * xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def play(family, difficulty, episodes, backend):
  """Oracle episodes; returns success rate, turns/episode, chars/episode, reset and step times (s)."""
  solved = turns = chars = 0
  t_reset, t_step = [], []
  with envs.make_env(family, difficulty=difficulty, backend=backend) as env:
    for i in range(episodes):
      seed = envs.HELD_OUT_SEED + i if i % 2 else i
      t = time.perf_counter()
      prompt = env.reset(seed)
      t_reset.append(time.perf_counter() - t)
      chars += len(prompt)
      while True:
        action = env.oracle_action()
        t = time.perf_counter()
        r = env.step(action)
        t_step.append(time.perf_counter() - t)
        turns, chars = turns + 1, chars + len(action) + len(r.observation)
        if r.done:
          break
      solved += r.reward
      if r.reward != 1.0:  # the oracle should never fail: say where and why
        print(f"  oracle failed: {family} d={difficulty} seed={seed} {backend}: {r}", flush=True)
  return solved / episodes, turns / episodes, chars / episodes, t_reset, t_step


def fork_group(family, g, reps):
  """p50 / p99 of env.fork(g, lazy=False) right after reset (g sandbox copies), and of closing the g children."""
  t_fork, t_close = [], []
  with envs.make_env(family, difficulty=2) as env:
    for i in range(reps):
      env.reset(i)
      t = time.perf_counter()
      kids = env.fork(g, lazy=False)
      t_fork.append(time.perf_counter() - t)
      t = time.perf_counter()
      for k in kids:
        k.close()
      t_close.append(time.perf_counter() - t)
  return t_fork, t_close


def threaded(n_threads, episodes):
  def worker(i):
    fam = envs.TASK_FAMILIES[i % len(envs.TASK_FAMILIES)]
    with envs.make_env(fam, difficulty=2) as env:
      return sum(envs.rollout_oracle(env, 1000 * i + s)[1][-1][1].reward for s in range(episodes))

  t = time.perf_counter()
  with cf.ThreadPoolExecutor(n_threads) as ex:
    solved = sum(ex.map(worker, range(n_threads)))
  return solved, n_threads * episodes, time.perf_counter() - t


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--episodes", type=int, default=100)
  ap.add_argument("--threads", type=int, default=8)
  ap.add_argument("--ray", action="store_true", help="also run every row with backend='ray'")
  ap.add_argument("--quick", action="store_true")
  a = ap.parse_args()
  if a.quick:
    a.episodes, a.threads = 20, 4
  if a.episodes < 1 or a.threads < 1:
    ap.error("--episodes and --threads must be >= 1")
  if a.ray:
    from moonshot_jax.agentenv import ray_backend
    ray_backend.init_local(num_cpus=2)
  head = f"{'family':12s} {'d':>2s} {'oracle':>6s} {'turns':>5s} {'chars':>5s} {'reset p50/p99 ms':>17s} " \
         f"{'step p50/p99 ms':>16s}" + (f" {'ray step p50/p99 ms':>20s} {'ray/local':>9s}" if a.ray else "")
  print(f"oracle episodes per row: {a.episodes} (half held-out seeds); load {os.getloadavg()[0]:.1f}")
  print(head)
  for fam in envs.TASK_FAMILIES:
    for d in range(1, envs.max_difficulty(fam) + 1):
      ok, turns, chars, tr, ts = play(fam, d, a.episodes, "local")
      line = f"{fam:12s} {d:2d} {ok:6.3f} {turns:5.2f} {chars:5.0f} {pct(tr, 50):8.1f}/{pct(tr, 99):7.1f} " \
             f"{pct(ts, 50):7.1f}/{pct(ts, 99):7.1f}"
      if a.ray:
        rok, _, _, _, rts = play(fam, d, a.episodes, "ray")
        line += f" {pct(rts, 50):10.1f}/{pct(rts, 99):8.1f} {pct(rts, 50) / max(pct(ts, 50), 1e-3):9.1f}"
        line += "" if rok == ok else f"  (ray oracle {rok:.3f})"
      print(line, flush=True)
  for fam in envs.TASK_FAMILIES:
    tf, tc = fork_group(fam, 8, max(5, a.episodes // 4))
    print(f"{fam:12s} fork(8) after reset p50/p99 {pct(tf, 50):6.1f}/{pct(tf, 99):6.1f} ms, "
          f"closing the 8 p50 {pct(tc, 50):6.1f} ms")
  solved, total, dt = threaded(a.threads, max(1, a.episodes // 4))
  print(f"{a.threads} threads, difficulty 2, families round robin: {solved:.0f}/{total} solved, "
        f"{total / dt:.1f} episodes/s")


if __name__ == "__main__":
  main()
