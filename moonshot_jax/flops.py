"""Analytic model FLOPs per token, per component, at a training sequence length T.

Forward FLOPs of one token in a packed row of T tokens (one document per row assumed: the causal
context averages (T + 1) / 2). Training = 3 x forward (backward = 2 x forward); remat's
recomputation is not counted (MFU counts model FLOPs). Elementwise work (norms, activations,
gates, softmax exponentials) is left out, as in the usual 6·N convention; the embedding lookup
costs nothing.

  matmuls           2 x (weights the token is multiplied by): KDA / MLA projections, dense FFN,
                    router, top-k routed experts only, shared experts, latent down/up, LM head.
  kda_conv          depthwise short conv: 2 W FLOPs per q/k/v channel.
  kda_core          the chunked delta rule per value head (K key dim, V value dim, chunk C), per
                    chunk of C tokens, with full C x C tiles as the kernels compute them:
                      L = (βe^G K)(e^-G K)ᵀ, Aqk = (e^G Q)(e^-G K)ᵀ       2 C²K each
                      A = (I + L)⁻¹ (forward substitution)                  (2/3) C³
                      W = A βe^G K, U = A βV                                2 C²K, 2 C²V
                      V' = U - W S, O = e^G Q S + Aqk V', S update          3 x 2 C K V + 2 C²V
                    per token: 6 K V + 2 C (3 K + 2 V) + (2/3) C², T padded up to a chunk multiple.
                    (Kimi Linear's Eq. 13, 6Td² + 3TCd + TC² per head, is `kda_paper_flops`; it
                    counts the triangular tiles as half and differs only in the C terms.)
  mla_attn          causal QKᵀ and PV: 2 H (N + R) ctx + 2 H V ctx, ctx = (T + 1) / 2.
  attn_res          per mixing site over n sources: score (dot + mean square, 4 D) and weighted
                    sum (2 D) per source: 6 D n.
"""
from __future__ import annotations

import math

from moonshot_jax.config import ModelConfig
from moonshot_jax.layers import attn_res as attn_res_lib

COMPONENTS = ("kda_proj", "kda_conv", "kda_core", "mla_proj", "mla_attn", "attn_res", "dense_ffn",
              "router", "routed_experts", "shared_experts", "latent", "head")


def kda_chunk_flops_per_token(seq_len: int, chunk: int, k_dim: int, v_dim: int) -> float:
  """Forward FLOPs per token of one KDA value head (see the module docstring)."""
  if seq_len <= 0 or chunk <= 0:
    raise ValueError(f"seq_len, chunk: expected positive ints, got {seq_len}, {chunk}")
  C, K, V = chunk, k_dim, v_dim
  per_chunk = 6 * C * K * V + 2 * C * C * (3 * K + 2 * V) + (2 / 3) * C ** 3
  return per_chunk * math.ceil(seq_len / C) / seq_len


def kda_paper_flops(seq_len: int, chunk: int, head_dim: int) -> float:
  """Kimi Linear Eq. 13 per head for a sequence of seq_len tokens: 6Td² + 3TCd + TC²."""
  T, C, d = seq_len, chunk, head_dim
  return 6 * T * d * d + 3 * T * C * d + T * C * C


def _attn_res_sources(cfg: ModelConfig) -> int:
  """Sum over all mixing sites of the number of sources each one mixes."""
  bs, total = cfg.attn_res_block_size, 0
  for layer in range(cfg.n_layers):
    done = layer // bs  # completed blocks before this layer
    first_in_block = layer % bs == 0
    total += 1 + done + (0 if first_in_block else 1)  # mixer site: emb, blocks, partial if non-empty
    total += 1 + done + 1  # FFN site: the partial holds at least the mixer output
  return total + 1 + attn_res_lib.num_blocks(cfg)  # final site: emb + all blocks


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
  """Forward FLOPs per token by component (COMPONENTS)."""
  if not (isinstance(seq_len, int) and seq_len > 0):
    raise ValueError(f"seq_len: expected a positive int, got {seq_len!r}")
  D, T = cfg.d_model, seq_len
  H, HV, K, V, W = (cfg.kda_num_heads, cfg.kda_num_v_heads, cfg.kda_head_dim, cfg.kda_v_head_dim,
                    cfg.kda_conv_size)
  out_gate = D * HV * V if cfg.kda_output_gate_full_rank else D * V + V * HV * V
  kda_mm = 2 * D * H * K + D * HV * V + D * K + K * HV * K + D * HV + out_gate + HV * V * D
  Hm, N, R, Vm, L, Q = (cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                        cfg.kv_lora_rank, cfg.q_lora_rank)
  q_mm = D * Q + Q * Hm * (N + R) if Q > 0 else D * Hm * (N + R)
  mla_mm = q_mm + D * L + D * R + L * Hm * (N + Vm) + (D * Hm * Vm if cfg.mla_output_gate else 0) + Hm * Vm * D
  ctx = (T + 1) / 2
  lat = cfg.moe_latent_dim
  width = lat if lat > 0 else D

  f = {c: 0.0 for c in COMPONENTS}
  for mixer, ffn in cfg.layer_kinds:
    if mixer == "kda":
      f["kda_proj"] += 2 * kda_mm
      f["kda_conv"] += 2 * W * (2 * H * K + HV * V)
      f["kda_core"] += HV * kda_chunk_flops_per_token(T, cfg.kda_chunk_size, K, V)
    else:
      f["mla_proj"] += 2 * mla_mm
      f["mla_attn"] += 2 * Hm * (N + R) * ctx + 2 * Hm * Vm * ctx
    if ffn == "dense":
      f["dense_ffn"] += 2 * 3 * D * cfg.dense_ff_dim
    else:
      f["router"] += 2 * D * cfg.num_experts
      f["routed_experts"] += 2 * cfg.num_experts_per_tok * 3 * width * cfg.expert_ff_dim
      f["shared_experts"] += 2 * 3 * D * cfg.shared_ff_dim
      f["latent"] += 2 * 2 * D * lat
  if cfg.attn_res:
    f["attn_res"] = 6 * D * _attn_res_sources(cfg)
  f["head"] = 2 * D * cfg.vocab_size
  return f


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Model FLOPs per trained token (forward + backward = 3 x forward), for MFU."""
  return 3.0 * sum(forward_flops_per_token(cfg, seq_len).values())
