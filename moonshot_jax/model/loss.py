"""LM loss over packed rows: masked token cross-entropy (fp32), optional z-loss, MoE aux loss.

  lse_t = logsumexp(logits_t)  (fp32, max-shifted),   ce_t = lse_t - logits_t[target_t]
  ce     = sum_t m_t ce_t / max(sum_t m_t, 1)          m = loss_mask (0 on padding / cross-document)
  z_loss = cfg.z_loss_coef * sum_t m_t lse_t^2 / max(sum_t m_t, 1)   (PaLM's logit-drift regulariser)
  aux    = sum over MoE layers of aux["aux_loss"] (each already scaled by cfg.aux_loss_coef)
  loss   = ce + z_loss + aux

Two entry points with the same reduction: `lm_loss` from full logits [B, T, V] (the reference, and
what inference uses), and `lm_loss_from_stats` from the per-token (lse, target logit, correct) that
`head_token_stats` computes from the final hidden states in chunks of `cfg.loss_chunk_size`
positions, each under `jax.checkpoint` when there are several: at most B x chunk x V fp32 logits
exist at once, forward or backward. At K3's vocab (163840) and 8k tokens a row, full fp32 logits are
5.4 GB per row. A sequence that fits in one chunk keeps its logits for the backward instead of
recomputing them (the same bound). The head's VJP is written out (`_head_stats`): d lse = softmax,
d target logit = one-hot, one fused pass, then the two matmuls: autodiff of the same function runs
extra passes over the [B, chunk, V] logits (timings in WORKSPACE_NOTES).
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from moonshot_jax.config import ModelConfig
from moonshot_jax.layers.linear import contraction_grads


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

  return _reduce(_token_stats(logits_BTV.astype(jnp.float32), targets_BT), loss_mask_BT, cfg, aux)


def _token_stats(logits: jax.Array, targets: jax.Array) -> dict[str, jax.Array]:
  """What the loss needs of fp32 logits [..., V]: lse, the target's logit, and whether the target has
  the top logit (ties count as correct). That reuses logsumexp's max instead of a separate argmax,
  an index-carrying reduce over the whole vocabulary (1.4% of small's CPU step)."""
  target_logit = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return dict(lse=jax.nn.logsumexp(logits, axis=-1), target_logit=target_logit,
              correct=target_logit >= jnp.max(logits, axis=-1))


_HEAD_SPEC = {True: "btd,vd->btv", False: "btd,dv->btv"}  # by vocab_major


def head_logits(h_BTD: jax.Array, w: jax.Array, *, vocab_major: bool, dtype) -> jax.Array:
  """fp32 logits h @ w (w [V, D] if vocab_major, i.e. tied to the embedding, else [D, V])."""
  logits = jnp.einsum(_HEAD_SPEC[vocab_major], h_BTD, w.astype(dtype), preferred_element_type=jnp.float32)
  return nn.with_logical_constraint(logits, ("act_batch", "act_length", "vocab"))


def _stats_and_logits(h, w, targets, vocab_major: bool, dtype):
  logits = head_logits(h, w, vocab_major=vocab_major, dtype=dtype)
  return _token_stats(logits, targets), logits


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _head_stats(h, w, targets, vocab_major: bool, dtype):
  """`_token_stats` of head_logits(h, w) with a hand-written VJP."""
  return _stats_and_logits(h, w, targets, vocab_major, dtype)[0]


def _head_stats_fwd(h, w, targets, vocab_major, dtype):
  stats, logits = _stats_and_logits(h, w, targets, vocab_major, dtype)
  return stats, (h, w, targets, logits, stats["lse"])


def _head_stats_bwd(vocab_major, dtype, res, cts):
  h, w, targets, logits, lse = res
  onehot = jnp.arange(logits.shape[-1]) == targets[..., None]
  dlogits = (jnp.exp(logits - lse[..., None]) * cts["lse"][..., None]
             + jnp.where(onehot, cts["target_logit"][..., None], 0.0)).astype(dtype)
  dlogits = nn.with_logical_constraint(dlogits, ("act_batch", "act_length", "vocab"))
  dh, dw = contraction_grads(_HEAD_SPEC[vocab_major], h, w.astype(dtype), dlogits)
  return dh, dw.astype(w.dtype), None


_head_stats.defvjp(_head_stats_fwd, _head_stats_bwd)


def effective_chunk(chunk: int, T: int) -> int:
  """Positions per loss chunk: `chunk`, or the whole sequence when chunk is 0 or >= T."""
  return T if chunk <= 0 or chunk >= T else chunk


def head_token_stats(h_BTD: jax.Array, w: jax.Array, targets_BT: jax.Array, *, vocab_major: bool,
                     chunk: int, dtype) -> dict[str, jax.Array]:
  """Per-token lse_BT, target_logit_BT, correct_BT of logits = h @ w (w [V, D] if vocab_major else
  [D, V]; fp32 accumulation), computed `chunk` positions at a time and recomputed in the backward."""
  B, T, _ = h_BTD.shape
  c = effective_chunk(chunk, T)
  n = -(-T // c)
  pad = n * c - T
  if pad:  # padded positions are computed and then dropped
    h_BTD = jnp.pad(h_BTD, ((0, 0), (0, pad), (0, 0)))
    targets_BT = jnp.pad(targets_BT, ((0, 0), (0, pad)))

  def one(h_BcD, t_Bc):
    return _head_stats(h_BcD, w, t_Bc.astype(jnp.int32), vocab_major, dtype)

  chunks = lambda a: jnp.moveaxis(a.reshape((B, n, c) + a.shape[2:]), 1, 0)
  if n == 1:  # one chunk: keeping its logits for the backward is within the same bound, and saves
    out = one(h_BTD, targets_BT)  # recomputing h @ w (a third of the head's FLOPs)
  else:
    one = jax.checkpoint(one)
    out = jax.lax.map(lambda xs: one(*xs), (chunks(h_BTD), chunks(targets_BT)))
    out = {k: jnp.moveaxis(v, 0, 1).reshape(B, n * c) for k, v in out.items()}
  return {k: v[:, :T] for k, v in out.items()}


def lm_loss_from_stats(stats: dict[str, jax.Array], loss_mask_BT: jax.Array, cfg: ModelConfig,
                       aux: dict | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """`lm_loss` from `head_token_stats` output (what the model returns when given targets)."""
  if set(stats) != {"lse", "target_logit", "correct"}:
    raise ValueError(f"stats: expected keys lse, target_logit, correct, got {sorted(stats)}")
  if stats["lse"].shape != loss_mask_BT.shape:
    raise ValueError(f"loss_mask_BT: expected shape {stats['lse'].shape}, got {loss_mask_BT.shape}")
  return _reduce(stats, loss_mask_BT, cfg, aux)


def _reduce(stats, loss_mask_BT, cfg: ModelConfig, aux):
  mask = loss_mask_BT.astype(jnp.float32)
  n = jnp.maximum(jnp.sum(mask), 1.0)
  lse_BT = stats["lse"]
  ce = jnp.sum((lse_BT - stats["target_logit"]) * mask) / n
  z_loss = cfg.z_loss_coef * jnp.sum(jnp.square(lse_BT) * mask) / n
  aux = aux or {}
  aux_loss = jnp.sum(aux["aux_loss"]) if "aux_loss" in aux else jnp.zeros((), jnp.float32)
  loss = ce + z_loss + aux_loss
  metrics = dict(loss=loss, ce=ce, z_loss=z_loss, aux_loss=aux_loss, num_tokens=jnp.sum(mask),
                 accuracy=jnp.sum(stats["correct"].astype(jnp.float32) * mask) / n)
  for key in ("load_max_over_mean", "load_entropy"):
    if key in aux:
      metrics[key] = aux[key]  # [n_moe_layers]
      metrics[f"{key}_mean"] = jnp.mean(aux[key])
  return loss, metrics
