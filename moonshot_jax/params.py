"""Parameter counts per component: from the real parameter tree (eval_shape) and from closed forms.

Components (COMPONENTS): embedding, kda, mla, attn_res (mixing-site queries), norms (sublayer and
final RMSNorm scales), dense_ffn, router, routed_experts, shared_experts, latent (LatentMoE down/up
projections and latent norm), head (untied LM head).

`tree_param_counts(params)` classifies every leaf of a `Transformer` "params" tree (arrays or
ShapeDtypeStructs, boxed or not) by its path; `formula_param_counts(cfg)` computes the same numbers
from the config alone, written independently from the layer code (the tests pin one to the other).
Active parameters per token (`active_params`): the weights a token is multiplied by — every
component, the routed experts scaled by top-k / E, and NOT the input embedding table, of which a
token reads one row (unless tied: then the table is the LM head). This convention gives K3's
published 104B; `active_params_with_embedding` adds the table (DeepSeek-V3's "activated" count).
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

from moonshot_jax.config import ModelConfig

COMPONENTS = ("embedding", "kda", "mla", "attn_res", "norms", "dense_ffn", "router", "routed_experts",
              "shared_experts", "latent", "head")
_ROUTED = ("w_gate", "w_up", "w_down")
_LATENT = ("latent_down", "latent_up", "latent_norm")


def _component(path: tuple[str, ...]) -> str:
  if path[0] == "embedding":
    return "embedding"
  if path[0] == "lm_head":
    return "head"
  if "site" in path or path[0] == "final_site":
    return "attn_res"
  if path[0] == "final_norm":
    return "norms"
  # layer_{i}/{mixer|ffn}/... or layers_{a}_{b}/layer_{j}/{mixer|ffn}/...
  i = next(i for i, p in enumerate(path) if p in ("mixer", "ffn"))
  op = path[i + 1]
  if op == "norm":
    return "norms"
  if op in ("kda", "mla", "dense"):
    return {"kda": "kda", "mla": "mla", "dense": "dense_ffn"}[op]
  if op == "moe":
    leaf = path[i + 2]
    if leaf == "router":
      return "router"
    if leaf in _ROUTED:
      return "routed_experts"
    if leaf in _LATENT:
      return "latent"
    if leaf == "shared":
      return "shared_experts"
  raise ValueError(f"params: cannot classify parameter {'/'.join(path)}")


def _path_names(path) -> tuple[str, ...]:
  return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def tree_param_counts(params: Any) -> dict[str, int]:
  """Per-component parameter counts of a "params" tree (leaves: arrays / ShapeDtypeStructs / boxes)."""
  counts = {c: 0 for c in COMPONENTS}
  leaves = jax.tree_util.tree_leaves_with_path(params)
  if not leaves:
    raise ValueError("params: empty tree")
  for path, leaf in leaves:
    names = tuple(n for n in _path_names(path) if n != "value")  # boxed leaves end in .value
    counts[_component(names)] += int(np.prod(leaf.shape))
  return counts


def _per_layer(cfg: ModelConfig) -> dict[str, int]:
  """Closed-form parameter counts of each layer kind (written from the layer specs)."""
  D = cfg.d_model
  H, HV, K, V, W = (cfg.kda_num_heads, cfg.kda_num_v_heads, cfg.kda_head_dim, cfg.kda_v_head_dim,
                    cfg.kda_conv_size)
  out_gate = D * HV * V if cfg.kda_output_gate_full_rank else D * V + V * HV * V + HV * V
  kda = (2 * D * H * K + D * HV * V  # q, k, v projections
         + W * (2 * H * K + HV * V)  # depthwise short convs
         + D * K + K * HV * K + HV + HV * K  # decay: low-rank f, A_log [HV], dt_bias [HV*K]
         + D * HV  # beta
         + out_gate  # full-rank output gate (K3), or low-rank + its bias (Kimi Linear)
         + V + HV * V * D)  # headwise output norm, o_proj
  Hm, N, R, Vm, L, Q = (cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                        cfg.kv_lora_rank, cfg.q_lora_rank)
  q = D * Q + Q + Q * Hm * (N + R) if Q > 0 else D * Hm * (N + R)
  mla = (q + D * L + L + D * R  # query; kv latent + its norm; shared rope key
         + L * Hm * (N + Vm)  # W_UK, W_UV
         + (D * Hm * Vm if cfg.mla_output_gate else 0) + Hm * Vm * D)
  E, F, lat = cfg.num_experts, cfg.expert_ff_dim, cfg.moe_latent_dim
  width = lat if lat > 0 else D
  return dict(kda=kda, mla=mla, dense_ffn=3 * D * cfg.dense_ff_dim, router=D * E,
              routed_experts=E * 3 * width * F, shared_experts=3 * D * cfg.shared_ff_dim,
              latent=2 * D * lat + lat if lat > 0 else 0)


def formula_param_counts(cfg: ModelConfig) -> dict[str, int]:
  """Per-component totals from the config alone."""
  per = _per_layer(cfg)
  D = cfg.d_model
  counts = {c: 0 for c in COMPONENTS}
  counts["embedding"] = cfg.vocab_size * D
  counts["head"] = 0 if cfg.tie_embeddings else cfg.vocab_size * D
  counts["norms"] = D * (2 * cfg.n_layers + 1)
  counts["attn_res"] = D * cfg.num_attn_res_sites if cfg.attn_res else 0
  for mixer, ffn in cfg.layer_kinds:
    counts[mixer] += per[mixer]
    if ffn == "dense":
      counts["dense_ffn"] += per["dense_ffn"]
    else:
      for c in ("router", "routed_experts", "shared_experts", "latent"):
        counts[c] += per[c]
  return counts


def active_param_counts(counts: Mapping[str, int], cfg: ModelConfig) -> dict[str, float]:
  """Per-token active parameters from per-component totals: routed experts scaled by k/E, the
  embedding table 0 unless tied (see the module docstring)."""
  out = {c: float(v) for c, v in counts.items()}
  out["routed_experts"] *= cfg.num_experts_per_tok / cfg.num_experts
  if not cfg.tie_embeddings:
    out["embedding"] = 0.0
  return out


def abstract_params(cfg: ModelConfig, seq_len: int = 8) -> Any:
  """Boxed ShapeDtypeStruct tree of `Transformer(cfg).init` (nothing allocated)."""
  import jax.numpy as jnp

  from moonshot_jax.model.transformer import Transformer
  tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
  return jax.eval_shape(Transformer(cfg).init, jax.random.key(0), tokens)


def summary(cfg: ModelConfig, params: Any | None = None) -> dict[str, Any]:
  """{"total_params", "active_params", "active_params_with_embedding", "components": {c: {total,
  active}}} from the real tree (eval_shape of init unless `params` is given)."""
  if params is None:
    params = abstract_params(cfg)["params"]
  counts = tree_param_counts(params)
  active = active_param_counts(counts, cfg)
  return dict(total_params=int(sum(counts.values())), active_params=int(round(sum(active.values()))),
              active_params_with_embedding=int(round(sum(active.values()) + (
                  0 if cfg.tie_embeddings else counts["embedding"]))),
              components={c: dict(total=counts[c], active=int(round(active[c]))) for c in COMPONENTS})
