"""Training throughput and MFU of an experiment on this machine (default: experiments/small.py).

    python -m launch.bench_train [--config=experiments/small.py] [--steps=10] [--warmup=2]

Runs the real jitted train step (random tokens, the config's batch and sequence length) and prints
a markdown table: config, tokens/s, model TFLOP/s (analytic FLOPs/token x 3 x tokens/s), peak
(CPU: a measured fp32 matmul rate; accelerators: the chip table), MFU. On CPU the goal is >= 35%
of the measured matmul rate.
"""
from __future__ import annotations

import time

from absl import app, flags
from ml_collections import config_flags

from moonshot_jax import host_memory

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/small.py", "Experiment config file.",
                                          lock_config=True)
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps first (the first one compiles).")


def bench(cfg, steps: int, warmup: int) -> dict:
  import jax

  from moonshot_jax.train import loop, state as state_lib, step as step_lib
  from moonshot_jax.train.peak_flops import measure_matmul_flops, peak_flops

  trainer = loop.build(cfg)
  state = state_lib.create_train_state(trainer.setup, trainer.init_fn, int(cfg.train.seed))
  b, t = int(cfg.data.batch_size), int(cfg.data.seq_len)
  gbatch = loop.random_batch(trainer)
  t0 = time.perf_counter()
  for _ in range(max(warmup, 1)):
    state, m = trainer.train_step(state, gbatch)
    jax.block_until_ready(m)
  first = time.perf_counter() - t0
  t0 = time.perf_counter()
  for _ in range(steps):
    state, m = trainer.train_step(state, gbatch)
  jax.block_until_ready((state, m))
  dt = (time.perf_counter() - t0) / steps
  tps = b * t / dt
  fpt = loop.train_flops_per_token(trainer.model_cfg, t)
  peak, src = peak_flops(list(trainer.mesh.devices.flat), trainer.model_cfg.dtype)
  matmul = measure_matmul_flops() if jax.devices()[0].platform == "cpu" else peak
  return dict(step_s=dt, tokens_per_s=tps, model_tflops=tps * fpt / 1e12, matmul_tflops=matmul / 1e12,
              peak_tflops=peak / 1e12, peak_source=src, mfu=tps * fpt / peak, warmup_s=first,
              loss=float(m["loss"]), devices=len(trainer.mesh.devices.flat))


def main(argv):
  del argv
  cfg = _CONFIG.value
  r = bench(cfg, _STEPS.value, _WARMUP.value)
  name = f"d{cfg.model.d_model}-L{cfg.model.n_layers}-E{cfg.model.num_experts} B{cfg.data.batch_size}xT{cfg.data.seq_len}"
  print(f"\nwarmup (incl. compile) {r['warmup_s']:.1f} s, {r['devices']} device(s), peak: {r['peak_source']}, "
        f"host malloc: {host_memory.describe()}")
  print("| config | step s | tokens/s | model TFLOP/s | matmul TFLOP/s | MFU |")
  print("| --- | --- | --- | --- | --- | --- |")
  print(f"| {name} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {r['model_tflops']:.4f} | "
        f"{r['matmul_tflops']:.4f} | {100 * r['mfu']:.1f}% |")


if __name__ == "__main__":
  host_memory.reexec_with_huge_pages()  # before any jax work: glibc reads it at start-up
  app.run(main)
