"""Effect of MoonEP-style redundant experts on expert-parallel imbalance and capacity overflow.

    python -m moonshot_jax.parallel.ep_placement_demo [--experts=64] [--ep=8] [--topk=4]

Synthetic skewed routing (expert popularity ~ Zipf(s) with a per-step jitter), 8 fake CPU devices
(data=1, expert=8 by default). For each number of replica slots R, the placement is chosen by
`expert.redundant_placement` from the PREVIOUS step's loads and evaluated on the next step's
routing through the real dense dispatch (`make_expert_fn`, stats from inside the shard_map):
max/mean tokens per EP rank and the fraction of token copies dropped at a given capacity factor
(same total buffer size for every R: capacity is per slot, capacity_factor x copies / slots).
"""
from __future__ import annotations

import argparse
import os
import sys

if "jax" not in sys.modules:
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from moonshot_jax.config import ModelConfig  # noqa: E402
from moonshot_jax.parallel import expert as X  # noqa: E402
from moonshot_jax.parallel.mesh import make_mesh  # noqa: E402


def routing(rng: np.random.Generator, tokens: int, experts: int, k: int, zipf: float) -> np.ndarray:
  pop = 1.0 / np.arange(1, experts + 1) ** zipf  # hot experts share rank 0: the worst case for EP
  logits = np.log(pop)[None] + rng.gumbel(size=(tokens, experts))
  return np.argsort(-logits, axis=1)[:, :k].astype(np.int32)


def run(experts=64, ep=8, k=4, tokens_per_rank=512, zipf=1.0, cfs=(1.0, 1.25, 2.0), replicas=(0, 8, 16, 32),
        seed=0) -> list[dict]:
  mesh = make_mesh(dict(expert=ep), jax.devices()[:ep])
  l = f = 8
  cfg = ModelConfig(num_experts=experts, num_experts_per_tok=k, expert_ff_dim=f)
  rng = np.random.default_rng(seed)
  t = tokens_per_rank * ep
  prev, cur = routing(rng, t, experts, k, zipf), routing(rng, t, experts, k, zipf)
  x = jnp.asarray(rng.normal(size=(t, l)), jnp.float32)
  w = jnp.full((t, k), 1.0 / k)
  wg, wu = (jnp.asarray(rng.normal(size=(experts, l, f)) * 0.1, jnp.float32) for _ in range(2))
  wd = jnp.asarray(rng.normal(size=(experts, f, l)) * 0.1, jnp.float32)
  load_prev = jnp.bincount(jnp.asarray(prev).reshape(-1), length=experts)
  rows = []
  for r in replicas:
    placement = X.redundant_placement(load_prev, r, ep) if r else None
    for cf in cfs:
      fn = X.make_expert_fn(mesh, X.EPConfig("dense", capacity_factor=cf, redundant_experts=r), with_stats=True)
      with jax.set_mesh(mesh):
        _, st = jax.jit(lambda *a: fn(*a, cfg, placement))(x, jnp.asarray(cur), w, wg, wu, wd)
      rows.append(dict(replicas=r, capacity_factor=cf, rank_load_max_over_mean=float(st["ep_rank_load_max_over_mean"]),
                       drop_fraction=float(st["ep_drop_fraction"])))
  return rows


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--experts", type=int, default=64)
  ap.add_argument("--ep", type=int, default=8)
  ap.add_argument("--topk", type=int, default=4)
  ap.add_argument("--tokens_per_rank", type=int, default=512)
  ap.add_argument("--zipf", type=float, default=1.0)
  args = ap.parse_args(argv)
  rows = run(args.experts, args.ep, args.topk, args.tokens_per_rank, args.zipf)
  print(f"E={args.experts} experts on EP={args.ep} ranks, top-{args.topk}, {args.tokens_per_rank} tokens/rank, "
        f"Zipf({args.zipf}) popularity; placement from the previous step's loads")
  print(f"| replicas R | capacity factor | rank load max/mean | dropped copies |")
  print(f"|---:|---:|---:|---:|")
  for row in rows:
    print(f"| {row['replicas']} | {row['capacity_factor']:.2f} | {row['rank_load_max_over_mean']:.3f} | "
          f"{row['drop_fraction']:.2%} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
