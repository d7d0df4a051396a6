"""`launch/plan.py --aot_decode --target=tpu:<gen> --context=N`: one decode step at context N compiled by XLA:TPU.

    python -m launch.plan --config=experiments/k3.py --aot_decode --target=tpu:v5p --context=1048576

Proxy (same per-chip shapes as a serving mesh whose "expert" axis is `serve_expert`, default 64,
experts per chip E / serve_expert): the model's first unit of layer kinds -- layers 1..L where L
is the first MLA layer (K3: 1 dense KDA, 2 KDA + MoE, 1 MLA + MoE) -- with E / serve_expert experts
per chip x 16 chips, every chip on "expert"; one sequence (batch 1) whose cache holds `context`
tokens; weights as served: bf16, routed experts in MXFP4 (inference/mxfp4_experts.py, 4.25 bits
per weight) or bf16 with --noaot_decode_mxfp4. Compiled with engine's own decode jit
(`_decode_impl`, donating the cache) in a subprocess, next to the estimate of the same proxy:
weights per chip (each leaf's shard) + the cache (replicated: batch 1 cannot split) from
inference/plan_cache.py's formulas. Then the whole model at that context on paper: its weights
evenly over `serve_expert` chips and the cache per sequence for all its layers, with a fits line.
"""
from __future__ import annotations

import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moonshot_jax import experiment
from moonshot_jax.config import ModelConfig
from moonshot_jax.parallel import tpu_aot

N_CHIPS = 16


def proxy_model(mcfg: ModelConfig, serve_expert: int, mxfp4: bool) -> ModelConfig:
  if mcfg.num_experts % serve_expert:
    raise ValueError(f"--serve_expert={serve_expert} does not divide model.num_experts={mcfg.num_experts}")
  n = min(mcfg.mla_layers) if mcfg.mla_layers else min(mcfg.n_layers, 4)
  e = mcfg.num_experts // serve_expert * N_CHIPS
  return mcfg.replace(n_layers=n, mla_layers=tuple(l for l in mcfg.mla_layers if l <= n),
                      dense_layers=tuple(l for l in mcfg.dense_layers if l <= n), num_experts=e,
                      num_experts_per_tok=min(mcfg.num_experts_per_tok, e), param_dtype=mcfg.dtype,
                      attn_res_block_size=min(mcfg.attn_res_block_size, n), scan_layers=False)


def _abstract_inputs(cfg: ModelConfig, mesh, context: int, mxfp4: bool):
  """Sharded ShapeDtypeStructs: variables (experts boxed as MXFP4 when asked), cache, token."""
  import flax.linen as nn
  from jax.sharding import NamedSharding, PartitionSpec as P

  from moonshot_jax.inference import cache as cache_lib
  from moonshot_jax.inference.mxfp4_experts import EXPERT_LEAVES, MXFP4Experts
  from moonshot_jax.model.transformer import Transformer
  from moonshot_jax.parallel import zero

  boxed = jax.eval_shape(Transformer(cfg).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  specs = iter(jax.tree.leaves(nn.meta.unbox(zero.param_specs(boxed, "zero1", mesh)), is_leaf=lambda s: isinstance(s, P)))
  values = nn.meta.unbox(boxed)

  def leaf(path, a):
    spec = next(specs)  # same leaf order: both trees are the unboxed init tree
    names = [str(getattr(p, "key", p)) for p in path]
    sds = lambda shape, dt, sp: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, sp))
    if mxfp4 and names[-1] in EXPERT_LEAVES and "moe" in names:
      lead, (i, o) = a.shape[:-2], a.shape[-2:]
      sp = P(*(list(spec)[:len(lead)] + [None, None]))  # experts split, each matrix whole
      return MXFP4Experts(sds(lead + (o, i // 2), jnp.uint8, sp), sds(lead + (o, i // 32), jnp.uint8, sp))
    return sds(a.shape, a.dtype, spec)
  variables = jax.tree_util.tree_map_with_path(leaf, values)
  rep = NamedSharding(mesh, P())
  cache = jax.eval_shape(lambda: cache_lib.init_cache(cfg, 1, context))
  cache = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), cache)
  token = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=rep)
  return variables, cache, token


def _tree_bytes_per_chip(tree, mesh) -> float:
  from moonshot_jax.parallel import zero
  sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
  return float(sum(zero.shard_elements(x.shape, x.sharding.spec, sizes) * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))


def worker(exp_cfg: Any, target: str, context: int, serve_expert: int, mxfp4: bool) -> dict[str, Any]:
  """In the --aot_worker subprocess: compile the decode proxy for the target; memory per chip."""
  from moonshot_jax.inference import engine
  from moonshot_jax.parallel import plan_tpu

  topo = plan_tpu.parse_target(target)
  devices = tpu_aot.devices(topo)
  if len(devices) != N_CHIPS:
    raise ValueError(f"--target={target}: the decode proxy needs {N_CHIPS} chips, topology {topo} has {len(devices)}")
  mcfg = experiment.model_config(exp_cfg)
  cfg = proxy_model(mcfg, serve_expert, mxfp4)
  mesh = jax.sharding.Mesh(np.array(devices).reshape(1, 1, N_CHIPS, 1), ("pipeline", "data", "expert", "tensor"))
  variables, cache, token = _abstract_inputs(cfg, mesh, context, mxfp4)
  t0 = time.time()
  with engine._context(mesh, "zero1"):
    lowered = engine._decode_impl.lower(variables, cache, token, cfg=cfg, mesh=mesh, strategy="zero1")
    t1 = time.time()
    compiled = lowered.compile(tpu_aot.PLANNING_COMPILE_OPTIONS)
  est = dict(weights=_tree_bytes_per_chip(variables, mesh), cache=_tree_bytes_per_chip(cache, mesh))
  return dict(topology=topo, device_kind=devices[0].device_kind, lower_s=t1 - t0, compile_s=time.time() - t1,
              memory=tpu_aot.memory_stats(compiled), cost=tpu_aot.cost_stats(compiled), estimate=est,
              proxy=dict(n_layers=cfg.n_layers, layer_kinds=[list(k) for k in cfg.layer_kinds],
                         num_experts=cfg.num_experts, experts_per_chip=cfg.num_experts // N_CHIPS,
                         context=context, mxfp4=mxfp4))


def full_model_estimate(mcfg: ModelConfig, context: int, serve_expert: int, mxfp4: bool) -> dict[str, float]:
  """The whole model on `serve_expert` chips, on paper: all weights (bf16, routed experts MXFP4 or
  bf16) evenly split over the chips -- a lower bound: the proxy shows what replication adds -- plus
  one sequence's cache at `context` (replicated: batch 1 does not split)."""
  from moonshot_jax import params
  from moonshot_jax.inference import plan_cache
  from moonshot_jax.layers import mxfp4 as mx
  counts = params.tree_param_counts(params.abstract_params(mcfg)["params"])
  total, routed = sum(counts.values()), counts["routed_experts"]
  weights = (total - routed) * 2 + routed * (mx.nbytes((1, 32)) / 32 if mxfp4 else 2)
  cache = plan_cache.compare(mcfg, context)["hybrid"].bytes_per_seq
  return dict(weights_per_chip=weights / serve_expert, cache_per_seq=float(cache))


def format_decode(xla: dict[str, Any], full: dict[str, float], chip: tpu_aot.Chip, serve_expert: int) -> list[str]:
  from moonshot_jax.parallel.plan_memory import _human as g
  m, est, px = xla["memory"], xla["estimate"], xla["proxy"]
  est_args = est["weights"] + est["cache"]
  peak = m["peak_bytes"]
  full_total = full["weights_per_chip"] + full["cache_per_seq"]
  return [
      f"decode step at {px['context']} tokens, XLA:TPU ({xla['topology']}, {xla['device_kind']}; lower "
      f"{xla['lower_s']:.0f}s, compile {xla['compile_s']:.0f}s): proxy = layers 1-{px['n_layers']} "
      f"({', '.join('+'.join(k) for k in px['layer_kinds'])}), {px['experts_per_chip']} experts per chip "
      f"(as on {serve_expert}-way EP), batch 1, weights bf16, experts {'MXFP4' if px['mxfp4'] else 'bf16'}; per chip:",
      f"  arguments (weights+cache)  XLA {g(m['argument_size_in_bytes']):>11}   estimate {g(est_args):>11}"
      f"   ({m['argument_size_in_bytes'] / est_args - 1:+.1%}; weights {g(est['weights'])}, cache {g(est['cache'])})",
      f"  temporaries                XLA {g(m['temp_size_in_bytes']):>11}   outputs {g(m['output_size_in_bytes'])}, "
      f"aliased {g(m['alias_size_in_bytes'])} (the donated cache), peak {g(peak)}",
      f"  proxy fits {chip.name} ({g(chip.hbm_bytes)}): {'yes' if peak <= chip.hbm_bytes else 'NO'} ({peak / chip.hbm_bytes:.0%})",
      f"  whole model on paper, weights evenly over {serve_expert} chips: {g(full['weights_per_chip'])} per chip + one "
      f"sequence's cache {g(full['cache_per_seq'])} = {g(full_total)}: fits {chip.name} "
      f"{'yes' if full_total <= chip.hbm_bytes else 'NO'} ({full_total / chip.hbm_bytes:.0%})"]
