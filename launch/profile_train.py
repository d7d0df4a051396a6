"""Where a train step's time goes, by model component, from a jax.profiler trace (CPU or GPU host).

    python -m launch.profile_train [--config=experiments/small.py] [--steps=2] [--outdir=/tmp/prof]

Compiles the real train step once, runs `--warmup` untimed steps, traces `--steps` steps with
jax.profiler (the trace lands in OUTDIR for TensorBoard / xprof), then attributes every XLA op's
self time to a component through the op_name metadata of the compiled HLO (the Flax module path:
`.../mixer/kda/...`, `.../ffn/moe/...`). Prints a markdown table: component, ms per step summed over
the XLA worker threads, share, and how much of it is matmul-like ops (dot / YNNPACK / cuBLAS
fusions). This is what issue #4's MFU work is steered by: the table says which component to fix.
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import time

from absl import app, flags
from ml_collections import config_flags

from moonshot_jax import host_memory

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/small.py", "Experiment config file.",
                                          lock_config=True)
_STEPS = flags.DEFINE_integer("steps", 2, "Traced steps.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps before the trace.")
_OUTDIR = flags.DEFINE_string("outdir", "/tmp/moonshot_profile", "Where the trace is written.")
_TOP = flags.DEFINE_integer("top", 12, "Also list this many single ops with the most self time.")

# first match wins: the module path names the component
COMPONENTS = (("head_stats", "LM head + loss"), ("Transformer.head", "LM head + loss"),
              ("kda", "KDA mixer"), ("mla", "MLA mixer"), ("moe/shared", "MoE shared expert"),
              ("moe", "MoE routed (router, dispatch, experts)"), ("ffn/dense", "dense FFN"),
              ("attn_res", "AttnRes"), ("init_carry", "AttnRes"), ("final_site", "AttnRes"),
              ("embed", "embedding"))
_MATMUL = re.compile(r"^(dot|ynn_fusion|cublas|gemm|.*convolution|.*triton_gemm)")


def component(op_name: str) -> str:
  for key, name in COMPONENTS:
    if key in op_name:
      return name
  if op_name and "jvp(" not in op_name and "transpose(" not in op_name:
    return "optimizer + step bookkeeping"
  return "unattributed (layout copies, scan stacking, glue)"


def hlo_op_names(hlo_text: str) -> dict[str, str]:
  """HLO instruction name -> its metadata op_name (empty when XLA created it without one)."""
  out = {}
  for line in hlo_text.splitlines():
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
    if m:
      op = re.search(r'op_name="([^"]*)"', line)
      out[m.group(1)] = op.group(1) if op else ""
  return out


def self_times(trace_file: str) -> dict[str, float]:
  """Event name -> summed self time (us) over XLA's compute threads (nested events subtracted)."""
  ev = json.load(gzip.open(trace_file))["traceEvents"]
  threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  by_tid = collections.defaultdict(list)
  for e in ev:
    name = threads.get((e.get("pid"), e.get("tid")), "")
    if e.get("ph") == "X" and ("Eigen" in name or "stream" in name.lower()):
      by_tid[(e["pid"], e["tid"])].append(e)
  out: dict[str, float] = collections.Counter()
  for es in by_tid.values():
    es.sort(key=lambda e: (e["ts"], -e["dur"]))
    stack: list[dict] = []
    for e in es:
      while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
        stack.pop()
      if stack:
        out[stack[-1]["name"]] -= e["dur"]
      out[e["name"]] += e["dur"]
      stack.append(e)
  return out


def profile(cfg, steps: int, warmup: int, outdir: str) -> tuple[list[tuple], list[tuple], float]:
  import jax

  from moonshot_jax.train import loop, state as state_lib, step as step_lib

  trainer = loop.build(cfg)
  state = state_lib.create_train_state(trainer.setup, trainer.init_fn, int(cfg.train.seed))
  batch = loop.random_batch(trainer)
  with step_lib.step_context(trainer.setup):
    compiled = trainer.train_step.jitted.lower(state, batch).compile()
    names = hlo_op_names(compiled.as_text())
    for _ in range(warmup):
      state, m = compiled(state, batch)
    jax.block_until_ready(m)
    os.makedirs(outdir, exist_ok=True)
    t0 = time.perf_counter()
    with jax.profiler.trace(outdir):
      for _ in range(steps):
        state, m = compiled(state, batch)
      jax.block_until_ready((state, m))
    wall = (time.perf_counter() - t0) / steps
  trace = max(glob.glob(os.path.join(outdir, "**", "*.trace.json.gz"), recursive=True), key=os.path.getmtime)
  st = self_times(trace)
  comp = collections.defaultdict(lambda: [0.0, 0.0])
  for op, us in st.items():
    c = component(names.get(op, ""))
    comp[c][0] += us / steps
    if _MATMUL.match(op):
      comp[c][1] += us / steps
  rows = sorted(((c, v[0], v[1]) for c, v in comp.items()), key=lambda r: -r[1])
  ops = sorted(((op, us / steps, names.get(op, "")) for op, us in st.items()), key=lambda r: -r[1])
  return rows, ops, wall


def main(argv):
  del argv
  rows, ops, wall = profile(_CONFIG.value, _STEPS.value, _WARMUP.value, _OUTDIR.value)
  total = sum(r[1] for r in rows)
  print(f"\nstep wall {wall:.3f} s (traced, so a little slower than bench_train); "
        f"XLA thread time {total / 1e6:.3f} s per step; trace in {_OUTDIR.value}")
  print("| component | ms/step | share | of which matmul ms |")
  print("| --- | ---: | ---: | ---: |")
  for c, us, mm in rows:
    print(f"| {c} | {us / 1e3:.1f} | {100 * us / total:.1f}% | {mm / 1e3:.1f} |")
  print(f"\ntop {_TOP.value} ops by self time")
  print("| op | ms/step | module path (tail) |")
  print("| --- | ---: | --- |")
  for op, us, path in ops[:_TOP.value]:
    print(f"| {op} | {us / 1e3:.1f} | {path[-80:]} |")


if __name__ == "__main__":
  host_memory.reexec_with_huge_pages()  # before any jax work: glibc reads it at start-up
  app.run(main)
