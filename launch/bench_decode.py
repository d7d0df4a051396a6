"""python -m launch.bench_decode --config=experiments/small.py --contexts=1024,4096,16384,65536

Decode speed and cache size of the hybrid model vs its all-MLA and all-KDA variants (same widths,
every mixer swapped), random weights, one process so the ratios compare like with like. For each
context length S the cache is filled as if S - 1 tokens had been prefilled (random contents: decode
cost does not depend on the values) and `decode_step` is timed over --steps tokens after one
compile/warm-up step, the variants taking turns step by step. Prints a markdown table (tokens/s, ms/token, cache bytes per sequence, and
the hybrid's speedup / cache fraction vs all-MLA); --json adds one JSON line at the end.
Goal (issue #7): at 64k context the hybrid decodes >= 3x faster than all-MLA with <= 30% of its cache.
Quick check: --contexts=256,1024 --steps=4.
"""
from __future__ import annotations

import json
import os
import sys
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from moonshot_jax import host_memory  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/small.py", "experiment config file",
                                          lock_config=True)
_CONTEXTS = flags.DEFINE_list("contexts", ["1024", "4096", "16384", "65536"], "context lengths")
_BATCH = flags.DEFINE_integer("batch", 1, "sequences decoded together")
_STEPS = flags.DEFINE_integer("steps", 16, "timed decode steps per point")
_VARIANTS = flags.DEFINE_list("variants", ["hybrid", "all_mla", "all_kda"], "model variants")
_JSON = flags.DEFINE_bool("json", False, "print a JSON line with all results at the end")


def random_variables(cfg, seed: int = 0):
  """Random weights in the model's tree, from eval_shape (no init compile)."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  from moonshot_jax.model.transformer import Transformer
  abstract = nn.meta.unbox(jax.eval_shape(
      lambda: Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32))))
  leaves, tree = jax.tree.flatten(abstract)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [0.02 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])


def filled_cache(cfg, batch: int, context: int, seed: int = 0):
  """A cache holding context - 1 tokens of random content."""
  import jax
  import jax.numpy as jnp
  from moonshot_jax.inference.cache import init_cache
  c = init_cache(cfg, batch, context)
  leaves, tree = jax.tree.flatten(c.layers)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  layers = jax.tree.unflatten(tree, [0.1 * jax.random.normal(k, x.shape, jnp.float32).astype(x.dtype)
                                     for x, k in zip(leaves, keys)])
  return c.replace(layers=layers, lengths=jnp.full((batch,), context - 1, jnp.int32))


def bench_context(cfgs: dict, variables: dict, batch: int, context: int, steps: int) -> dict[str, dict]:
  """All variants at one context, timed round-robin (one step of each in turn) so that load on a
  shared machine hits every variant alike and the ratios stay meaningful."""
  import jax.numpy as jnp
  from moonshot_jax.inference.cache import cache_bytes
  from moonshot_jax.inference.engine import decode_step
  tok = jnp.ones((batch,), jnp.int32)
  caches, out, times = {}, {}, {k: [] for k in cfgs}
  for kind, cfg in cfgs.items():
    cache = filled_cache(cfg, batch, context)
    out[kind] = dict(context=context, batch=batch, cache_bytes_per_seq=cache_bytes(cache.layers) // batch)
    t0 = time.perf_counter()
    logits, caches[kind] = decode_step(variables[kind], cfg, cache.replace(lengths=cache.lengths - 1), tok)
    logits.block_until_ready()
    out[kind]["compile_s"] = time.perf_counter() - t0
  for _ in range(steps):
    for kind, cfg in cfgs.items():
      cache = caches[kind].replace(lengths=caches[kind].lengths - 1)  # stay at the same context length
      t0 = time.perf_counter()
      logits, caches[kind] = decode_step(variables[kind], cfg, cache, tok)
      logits.block_until_ready()
      times[kind].append(time.perf_counter() - t0)
  for kind in cfgs:
    med = sorted(times[kind])[len(times[kind]) // 2]
    out[kind].update(ms_per_step=med * 1e3, tokens_per_s=batch / med)
  return out


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  import jax
  from moonshot_jax import experiment
  from moonshot_jax.inference import plan_cache

  base = experiment.model_config(_CONFIG.value)
  contexts = [int(c) for c in _CONTEXTS.value]
  print(f"# decode benchmark: {jax.devices()[0].device_kind} x{jax.device_count()}, batch {_BATCH.value}, "
        f"{_STEPS.value} timed steps (median)", flush=True)
  cfgs = {k: plan_cache.variant(base, k).replace(max_seq_len=max(contexts)) for k in _VARIANTS.value}
  variables = {}
  for kind, cfg in cfgs.items():
    v = random_variables(cfg)
    variables[kind] = {"params": v["params"], "moe_state": v.get("moe_state", {})}
  results: dict[str, list[dict]] = {k: [] for k in cfgs}
  for ctx in contexts:
    for kind, r in bench_context(cfgs, variables, _BATCH.value, ctx, _STEPS.value).items():
      results[kind].append(r)
      print(f"  {kind:8s} context {ctx:>7,}: {r['ms_per_step']:9.2f} ms/token, "
            f"{r['tokens_per_s']:9.1f} tok/s, cache {plan_cache.human_bytes(r['cache_bytes_per_seq'])}/seq "
            f"(compile {r['compile_s']:.1f}s)", flush=True)
  both = {"hybrid", "all_mla"} <= set(results)
  cols = ["context"] + [f"{k} {c}" for k in results for c in ("tok/s", "cache")]
  cols += ["hybrid speedup vs all-MLA", "hybrid cache / all-MLA"] if both else []
  print()
  print("| " + " | ".join(cols) + " |")
  print("|" + " ---: |" * len(cols))
  for i, ctx in enumerate(contexts):
    row = [f"{ctx:,}"]
    for k in results:
      r = results[k][i]
      row += [f"{r['tokens_per_s']:.1f}", plan_cache.human_bytes(r["cache_bytes_per_seq"])]
    if both:
      h, m = results["hybrid"][i], results["all_mla"][i]
      row += [f"{h['tokens_per_s'] / m['tokens_per_s']:.2f}x",
              f"{h['cache_bytes_per_seq'] / m['cache_bytes_per_seq']:.3f}"]
    print("| " + " | ".join(row) + " |")
  if _JSON.value:
    print(json.dumps({"model": _CONFIG.value.model.to_dict(), "batch": _BATCH.value, "results": results},
                     default=str))


if __name__ == "__main__":
  host_memory.reexec_with_huge_pages()  # before any jax work: glibc reads it at start-up
  app.run(main)
