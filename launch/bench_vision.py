"""python -m launch.bench_vision [--config=experiments/vl_small.py] [--max_patches=16384] [--reps=3]

Prints two tables (2-core CPU numbers: see WORKSPACE_NOTES.md):
1. The vision tower's fwd+bwd (gradients of all tower params) on one packed batch at the config's
   shapes: vl.patch_budget patches of the corpus' image sizes (vision/scenes.py SIZES, cycled),
   analytic FLOPs (vision/plan.py: 3 x forward, attention within each image only) per second, as a
   percentage of the measured fp32 [2048 x 2048] matmul rate of this machine (train/peak_flops.py).
2. Packed attention (one image of N patches, the config's heads and block size) fwd+bwd: the
   compiled program's temporary memory (XLA memory_analysis, nothing is run) for N up to
   --max_patches, beside the dense [H, N, N] reference's; bytes per patch stay flat for the blocked
   path (linear growth) while the dense one grows with N.
"""
from __future__ import annotations

import time

from absl import app, flags
from ml_collections import config_flags

from moonshot_jax import experiment

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/vl_small.py", "a vision-language experiment",
                                          lock_config=True)
_MAX_PATCHES = flags.DEFINE_integer("max_patches", 16384, "largest single image (patches) of table 2")
_REPS = flags.DEFINE_integer("reps", 3, "timed repetitions (best is reported)")


def _packed_grid(vcfg, budget: int):
  """grid_thw of corpus-sized images cycled until the next one would overflow `budget` patches."""
  import numpy as np
  from moonshot_jax.vision import scenes
  from moonshot_jax.vision.data import image_grid
  grids, used, i = [], 0, 0
  while True:
    h, w = scenes.SIZES[i % len(scenes.SIZES)]
    gh, gw = image_grid(vcfg, scenes.Scene("single", h, w, 0))
    if used + gh * gw > budget:
      return np.asarray(grids, np.int64)
    grids.append((1, gh, gw))
    used += gh * gw
    i += 1


def encoder_table(cfg, reps: int) -> None:
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import numpy as np
  from moonshot_jax.train.peak_flops import measure_matmul_flops
  from moonshot_jax.vision.encoder import VisionTower, init_vision, layout_arrays
  from moonshot_jax.vision.layout import patch_layout
  from moonshot_jax.vision.plan import forward_flops

  vcfg = experiment.vision_config(cfg)
  P = int(cfg.vl.patch_budget)
  grid = _packed_grid(vcfg, P)
  layout = layout_arrays(patch_layout(vcfg, grid, P, P // vcfg.merge_size))
  pixels = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, (P, vcfg.patch_dim)).astype(np.float32))
  params = nn.meta.unbox(init_vision(vcfg, jax.random.key(0)))
  tower = VisionTower(vcfg)

  def loss(p):
    return jnp.sum(jnp.square(tower.apply(p, pixels, layout)))

  step = jax.jit(jax.grad(loss))
  t0 = time.perf_counter()
  jax.block_until_ready(step(params))
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(step(params))
    times.append(time.perf_counter() - t0)
  flops = 3 * sum(sum(forward_flops(vcfg, int(t), int(h), int(w)).values()) for t, h, w in grid)
  peak = measure_matmul_flops(2048, "float32")
  best = min(times)
  real = int(grid[:, 0] @ (grid[:, 1] * grid[:, 2]))
  print(f"\nvision tower fwd+bwd, {experiment.vision_config(cfg).n_layers} layers x width {vcfg.width} "
        f"({vcfg.num_heads} heads x {vcfg.head_dim}, MLP {vcfg.mlp_dim}); {len(grid)} images, "
        f"{real} of {P} patches; compile {compile_s:.1f} s")
  print("| GFLOP / step | best step s | GFLOP/s | fp32 matmul GFLOP/s | % of matmul rate |")
  print("| --- | --- | --- | --- | --- |")
  print(f"| {flops / 1e9:.2f} | {best:.3f} | {flops / best / 1e9:.1f} | {peak / 1e9:.1f} | "
        f"{100 * flops / best / peak:.1f}% |")


def memory_table(cfg, max_patches: int) -> None:
  import jax
  import jax.numpy as jnp
  from moonshot_jax.vision.attention import packed_attention, reference_packed_attention

  vcfg = experiment.vision_config(cfg)
  H, D, block = vcfg.num_heads, vcfg.head_dim, vcfg.attn_block_size

  def temp_bytes(fn, n):
    sds = jax.ShapeDtypeStruct((n, H, D), jnp.float32)
    seg = jax.ShapeDtypeStruct((n,), jnp.int32)
    f = jax.jit(jax.grad(lambda q, k, v, s: jnp.sum(fn(q, k, v, s)), argnums=(0, 1, 2)))
    return f.lower(sds, sds, sds, seg).compile().memory_analysis().temp_size_in_bytes

  print(f"\npacked attention fwd+bwd, one image of N patches, {H} heads x {D}, block {block}: "
        "compiled temporary memory")
  print("| N patches | blocked MiB | blocked bytes / patch | dense [H,N,N] MiB | dense bytes / patch |")
  print("| --- | --- | --- | --- | --- |")
  n = 1024
  while n <= max_patches:
    blocked = temp_bytes(lambda q, k, v, s: packed_attention(q, k, v, s, block), n)
    dense = temp_bytes(reference_packed_attention, n)
    print(f"| {n} | {blocked / 2**20:.1f} | {blocked / n:.0f} | {dense / 2**20:.1f} | {dense / n:.0f} |", flush=True)
    n *= 2


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  cfg = _CONFIG.value
  if experiment.vision_config(cfg) is None or "vl" not in cfg:
    raise app.UsageError("--config: needs a vision-language experiment (vision and vl sections)")
  encoder_table(cfg, _REPS.value)
  memory_table(cfg, _MAX_PATCHES.value)


if __name__ == "__main__":
  app.run(main, flags_parser=experiment.parse_flags)
