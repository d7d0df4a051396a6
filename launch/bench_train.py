"""Training throughput and MFU of an experiment on this machine (default: experiments/small.py), or an
A/B of config variants of one experiment's train step, timed in one process.

    python -m launch.bench_train [--config=experiments/small.py] [--steps=10] [--warmup=2]
    python -m launch.bench_train --config=experiments/vl_tiny.py \
        --variants='split:vision.attn_backward=split;fused:vision.attn_backward=fused' [--rounds=5] [--steps=8]

Without --variants: runs the real jitted train step (random tokens, the config's batch and sequence
length) and prints a markdown table: config, tokens/s, model TFLOP/s (analytic FLOPs/token x 3 x
tokens/s), peak (CPU: a measured fp32 matmul rate; accelerators: the chip table), MFU. On CPU the
goal is >= 35% of the measured matmul rate.

With --variants (`name[:key=value,key=value...]` separated by `;`, keys as --config.* overrides):
each variant is the config plus its overrides, built and compiled once; then --rounds rounds, each
timing --steps steps of every variant in turn (round-robin, so a change in the machine's load hits
all variants alike), every variant from the same initial state on the same batches: real corpus
batches for a vision-language config (the vision fields need them), random tokens otherwise. Prints
per variant the median and min wall ms/step over rounds, the process CPU ms/step (both cores'
work: less sensitive to other processes than wall time), the ratio of medians to the first variant,
the loss after each variant's first step, and whether its params after all its steps (the same
number, on the same batches, from the same initial state) are bit for bit the first variant's.
"""
from __future__ import annotations

import ast
import os
import statistics
import time

from absl import app, flags
from ml_collections import config_flags

from moonshot_jax import host_memory

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/small.py", "Experiment config file.",
                                          lock_config=True)
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps (per round with --variants).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps first (the first one compiles).")
_VARIANTS = flags.DEFINE_string("variants", "", "name[:key=value,...] variants separated by ';' (A/B mode)")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "A/B mode: rounds of --steps steps per variant")


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


def parse_variants(spec: str) -> list[tuple[str, dict[str, str]]]:
  """'a;b:x.y=1,x.z=s' -> [("a", {}), ("b", {"x.y": "1", "x.z": "s"})]; ValueError naming the bad part."""
  out = []
  for part in (p.strip() for p in spec.split(";")):
    if not part:
      continue
    name, _, rest = part.partition(":")
    overrides = {}
    for kv in (x.strip() for x in rest.split(",") if x.strip()):
      key, eq, value = kv.partition("=")
      if not eq or not key.strip():
        raise ValueError(f"--variants: {kv!r} in variant {name!r} is not key=value")
      overrides[key.strip()] = value.strip()
    if not name.strip() or name.strip() in [n for n, _ in out]:
      raise ValueError(f"--variants: variant names must be non-empty and distinct (got {name!r})")
    out.append((name.strip(), overrides))
  if not out:
    raise ValueError("--variants: no variant given")
  return out


def with_overrides(cfg, overrides: dict[str, str]):
  """A copy of cfg with each dotted key set (the value parsed as a Python literal, else kept as a string):
  ml_collections' locked update names an unknown key or a value of the wrong type (a ValueError here)."""
  cfg = cfg.copy_and_resolve_references()
  for key, raw in overrides.items():
    try:
      value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
      value = raw
    try:
      cfg.update_from_flattened_dict({key: value})
    except (KeyError, TypeError, AttributeError) as e:
      raise ValueError(f"--variants: {key}={raw!r}: {e}") from e
  return cfg


def compare(cfg, variants: list[tuple[str, dict[str, str]]], rounds: int, steps: int) -> list[dict]:
  import jax
  import numpy as np

  from moonshot_jax.train import loop, state as state_lib

  built = []
  for name, overrides in variants:
    vcfg = with_overrides(cfg, overrides)
    trainer = loop.build(vcfg)
    built.append((name, vcfg, trainer))
  first = built[0][2]
  if first.vision is not None:  # real packed batches: the vision fields come from the corpus
    import tempfile

    from moonshot_jax.vision.data import make_vl_data
    data = make_vl_data(cfg, first.vision, tempfile.mkdtemp(prefix="bench_train_"))
    it = data.train_iter()
    host = [next(it) for _ in range(steps)]
    batches = [loop.to_global(b, first.mesh, first.model_inputs) for b in host]
  else:
    batches = [loop.random_batch(first, seed=i) for i in range(steps)]
  rows = []
  for name, vcfg, trainer in built:
    state = state_lib.create_train_state(trainer.setup, trainer.init_fn, int(vcfg.train.seed))
    t0 = time.perf_counter()
    state, m = trainer.train_step(state, batches[0])
    loss = float(jax.device_get(m["loss"]))
    rows.append(dict(name=name, overrides=variants[len(rows)][1], trainer=trainer, state=state, wall=[], cpu=[],
                     compile_s=time.perf_counter() - t0, loss=loss))
    print(f"[bench_train] {name}: compiled + first step {rows[-1]['compile_s']:.1f} s, loss {loss!r}", flush=True)
  for r in range(rounds):
    for row in rows:
      state = row["state"]
      c0, t0 = time.process_time(), time.perf_counter()
      for b in batches:
        state, m = row["trainer"].train_step(state, b)
      jax.block_until_ready((state, m))
      row["wall"].append((time.perf_counter() - t0) / len(batches))
      row["cpu"].append((time.process_time() - c0) / len(batches))
      row["state"] = state
    print(f"[bench_train] round {r + 1}/{rounds}: " + ", ".join(f"{row['name']} {1e3 * row['wall'][-1]:.1f} ms"
                                                            for row in rows) + f"; load {os.getloadavg()[0]:.2f}",
          flush=True)
  ref = jax.device_get(rows[0]["state"].params)
  for row in rows:  # every variant ran the same steps on the same batches from the same initial state
    got = jax.device_get(row["state"].params)
    diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a, np.float64) - b)))
                                         if np.size(a) else 0.0, got, ref))
    row["param_diff"] = max(diffs) if diffs else 0.0
    row["bit_equal"] = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
    row["steps_run"] = 1 + rounds * len(batches)
  return rows


def main(argv):
  del argv
  cfg = _CONFIG.value
  if _VARIANTS.value:
    rows = compare(cfg, parse_variants(_VARIANTS.value), _ROUNDS.value, _STEPS.value)
    base = statistics.median(rows[0]["wall"])
    print(f"\n{_ROUNDS.value} rounds x {_STEPS.value} steps per variant; host malloc: {host_memory.describe()}")
    print("| variant | overrides | median ms/step | min ms/step | CPU ms/step (median) | vs first (median) | "
          "first-step loss | params vs first after all steps | compile s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for row in rows:
      med = statistics.median(row["wall"])
      ov = ", ".join(f"{k}={v}" for k, v in row["overrides"].items()) or "-"
      same = "bit-equal" if row["bit_equal"] else f"max abs diff {row['param_diff']:.3g}"
      print(f"| {row['name']} | {ov} | {1e3 * med:.1f} | {1e3 * min(row['wall']):.1f} | "
            f"{1e3 * statistics.median(row['cpu']):.1f} | {med / base:.3f} | {row['loss']!r} | "
            f"{same} ({row['steps_run']} steps) | {row['compile_s']:.1f} |")
    return
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
