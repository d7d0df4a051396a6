"""Decode-cache memory planner: bytes per token and per sequence, hybrid vs all-MLA vs all-KDA.

What a sequence keeps while decoding (see cache.py for the arrays themselves):
  KDA layer   conv window [W-1, 2·H·K + HV·V] in cfg.dtype + recurrent state [HV, K, V] in fp32:
              constant in the context length T.
  MLA layer   latent rows [T, kv_lora_rank + qk_rope_head_dim] in cfg.dtype: linear in T.
  AttnRes     nothing: it mixes the current token's own sublayer outputs over depth, so decode
              recomputes its sources from the per-layer caches above (no cross-token state).
  MoE / FFN   nothing (per token).
Variants are the same model with every mixer MLA (`all_mla`) or KDA (`all_kda`).
"""
from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp

from moonshot_jax.config import ModelConfig


def _itemsize(dtype: str) -> int:
  return jnp.dtype(dtype).itemsize


def kda_layer_bytes(cfg: ModelConfig) -> dict[str, int]:
  """Per sequence, per KDA layer: {"conv": ..., "state": ...} bytes (independent of T)."""
  channels = 2 * cfg.kda_num_heads * cfg.kda_head_dim + cfg.kda_num_v_heads * cfg.kda_v_head_dim
  conv = (cfg.kda_conv_size - 1) * channels * _itemsize(cfg.dtype)
  state = cfg.kda_num_v_heads * cfg.kda_head_dim * cfg.kda_v_head_dim * 4
  return {"conv": conv, "state": state}


def mla_bytes_per_token(cfg: ModelConfig) -> int:
  """Per token, per MLA layer: one latent row."""
  return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * _itemsize(cfg.dtype)


def variant(cfg: ModelConfig, kind: str) -> ModelConfig:
  """The same model as `cfg` with the mixers of `kind`: "hybrid" (as is), "all_mla", "all_kda"."""
  if kind == "hybrid":
    return cfg
  if kind == "all_mla":
    return cfg.replace(mla_layers=tuple(range(1, cfg.n_layers + 1)))
  if kind == "all_kda":
    return cfg.replace(mla_layers=())
  raise ValueError(f"kind: expected 'hybrid', 'all_mla' or 'all_kda', got {kind!r}")


@dataclasses.dataclass(frozen=True)
class CachePlan:
  kind: str
  context_len: int
  n_kda: int
  n_mla: int
  kda_bytes_per_seq: int  # constant part: all KDA layers' conv windows + states
  mla_bytes_per_token: int  # marginal cost of one more token (all MLA layers)
  bytes_per_seq: int  # at context_len
  bytes_per_token: float  # bytes_per_seq / context_len (amortised)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def plan(cfg: ModelConfig, context_len: int, kind: str = "hybrid") -> CachePlan:
  if not (isinstance(context_len, int) and context_len > 0):
    raise ValueError(f"context_len: expected a positive int, got {context_len!r}")
  c = variant(cfg, kind)
  n_mla = sum(c.is_mla(i) for i in range(c.n_layers))
  n_kda = c.n_layers - n_mla
  kda = kda_layer_bytes(c)
  kda_seq = n_kda * (kda["conv"] + kda["state"])
  mla_tok = n_mla * mla_bytes_per_token(c)
  total = kda_seq + mla_tok * context_len
  return CachePlan(kind=kind, context_len=context_len, n_kda=n_kda, n_mla=n_mla, kda_bytes_per_seq=kda_seq,
                   mla_bytes_per_token=mla_tok, bytes_per_seq=total, bytes_per_token=total / context_len)


def compare(cfg: ModelConfig, context_len: int) -> dict[str, CachePlan]:
  return {k: plan(cfg, context_len, k) for k in ("hybrid", "all_mla", "all_kda")}


def human_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  raise AssertionError


def format_table(plans: dict[str, CachePlan]) -> str:
  """Markdown table; ratios are relative to the all-MLA variant when present."""
  ref = plans.get("all_mla")
  lines = [f"KV-cache per sequence at context {next(iter(plans.values())).context_len:,} tokens",
           "| variant | KDA layers | MLA layers | per sequence | per token (amortised) | MLA bytes/token "
           "| vs all-MLA |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
  for p in plans.values():
    ratio = f"{p.bytes_per_seq / ref.bytes_per_seq:.3f}" if ref and ref.bytes_per_seq else "-"
    lines.append(f"| {p.kind} | {p.n_kda} | {p.n_mla} | {human_bytes(p.bytes_per_seq)} | "
                 f"{human_bytes(p.bytes_per_token)} | {human_bytes(p.mla_bytes_per_token)} | {ratio} |")
  return "\n".join(lines)


def summary_json(cfg: ModelConfig, context_len: int) -> str:
  return json.dumps({k: p.to_dict() for k, p in compare(cfg, context_len).items()})


def plan_section(cfg, m: ModelConfig) -> tuple[dict, list[str]]:
  """launch/plan.py section: decode-cache bytes at the model's context (model.max_seq_len)."""
  del cfg
  plans = compare(m, m.max_seq_len)
  return {"kv_cache": {k: p.to_dict() for k, p in plans.items()}}, format_table(plans).splitlines()
