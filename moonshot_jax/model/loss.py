"""LM loss over packed rows: masked token cross-entropy (fp32), optional z-loss, MoE aux loss.

  lse_t = logsumexp(logits_t)  (fp32, max-shifted),   ce_t = lse_t - logits_t[target_t]
  ce     = sum_t m_t ce_t / max(sum_t m_t, 1)          m = loss_mask (0 on padding / cross-document)
  z_loss = cfg.z_loss_coef * sum_t m_t lse_t^2 / max(sum_t m_t, 1)   (PaLM's logit-drift regulariser)
  aux    = sum over MoE layers of aux["aux_loss"] (each already scaled by cfg.aux_loss_coef)
  loss   = ce + z_loss + aux
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from moonshot_jax.config import ModelConfig


def lm_loss(logits_BTV: jax.Array, targets_BT: jax.Array, loss_mask_BT: jax.Array, cfg: ModelConfig,
            aux: dict | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(scalar loss, metrics). metrics: loss, ce, z_loss, aux_loss, accuracy, num_tokens, and per MoE
  layer [L] load_max_over_mean / load_entropy with their means (when aux has MoE statistics)."""
  if logits_BTV.ndim != 3:
    raise ValueError(f"logits_BTV: expected [B, T, V], got shape {logits_BTV.shape}")
  B, T, V = logits_BTV.shape
  if targets_BT.shape != (B, T) or not jnp.issubdtype(targets_BT.dtype, jnp.integer):
    raise ValueError(f"targets_BT: expected an integer array of shape {(B, T)}, got "
                     f"{targets_BT.dtype}{targets_BT.shape}")
  if loss_mask_BT.shape != (B, T):
    raise ValueError(f"loss_mask_BT: expected shape {(B, T)}, got {loss_mask_BT.shape}")
  if V != cfg.vocab_size:
    raise ValueError(f"logits_BTV: expected vocab size cfg.vocab_size={cfg.vocab_size}, got {V}")

  logits = logits_BTV.astype(jnp.float32)
  mask = loss_mask_BT.astype(jnp.float32)
  n = jnp.maximum(jnp.sum(mask), 1.0)
  lse_BT = jax.nn.logsumexp(logits, axis=-1)
  target_logit_BT = jnp.take_along_axis(logits, targets_BT[..., None].astype(jnp.int32), axis=-1)[..., 0]
  ce = jnp.sum((lse_BT - target_logit_BT) * mask) / n
  z_loss = cfg.z_loss_coef * jnp.sum(jnp.square(lse_BT) * mask) / n
  aux = aux or {}
  aux_loss = jnp.sum(aux["aux_loss"]) if "aux_loss" in aux else jnp.zeros((), jnp.float32)
  loss = ce + z_loss + aux_loss

  correct = (jnp.argmax(logits, -1) == targets_BT).astype(jnp.float32)
  metrics = dict(loss=loss, ce=ce, z_loss=z_loss, aux_loss=aux_loss, num_tokens=jnp.sum(mask),
                 accuracy=jnp.sum(correct * mask) / n)
  for key in ("load_max_over_mean", "load_entropy"):
    if key in aux:
      metrics[key] = aux[key]  # [n_moe_layers]
      metrics[f"{key}_mean"] = jnp.mean(aux[key])
  return loss, metrics
