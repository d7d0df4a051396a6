"""GRPO / DAPO / Dr.GRPO math in plain JAX: group advantages and the clipped policy-gradient loss.

  advantages:   A_i = (r_i - mean_g r) / (std_g r + eps)    adv_norm="std"  (GRPO)
                A_i =  r_i - mean_g r                       adv_norm="none" (Dr.GRPO: no std, which
                                                            up-weights near-uniform groups)
  ratio_t     = exp(logp_t - old_logp_t)     old_logp = the log-prob under the policy that sampled
                                             the token (the rollout engine's own number)
  pg_t        = -min(ratio_t A, clip(ratio_t, 1 - clip_low, 1 + clip_high) A)
                (clip_high > clip_low is DAPO's clip-higher: rare tokens may grow further)
  kl_t        = exp(ref_t - logp_t) - (ref_t - logp_t) - 1       (k3 estimator of KL(pi || ref), >= 0)
  loss        = sum_t m_t (pg_t + kl_coef kl_t) / sum_t m_t      token-level over ALL policy tokens of
                the batch (DAPO): long responses are not down-weighted per sequence. The train step
                weights each microbatch's token-mean by n_m / N, so this holds across microbatches.

`rl_objective(...)` returns a `step.LossFn`: the pretraining train step runs it unchanged, reading
the extra [B, T] batch fields RL_FIELDS. Masked positions (prompt, environment observations,
padding) are zeroed *before* exp, so an arbitrary old_logp there can neither overflow nor carry a
gradient.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

RL_FIELDS = ("advantages", "old_logp", "ref_logp")  # float32 [B, T], aligned with targets
ADV_NORMS = ("std", "none")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  clip_low: float = 0.2
  clip_high: float = 0.28
  kl_coef: float = 0.0  # 0: no reference model term
  z_loss_coef: float = 0.0

  def __post_init__(self):
    for k in ("clip_low", "clip_high", "kl_coef", "z_loss_coef"):
      v = getattr(self, k)
      if not (isinstance(v, (int, float)) and v >= 0):
        raise ValueError(f"rl.{k}: expected a float >= 0, got {v!r}")
    if self.clip_low >= 1:
      raise ValueError(f"rl.clip_low: must be < 1 (the ratio's lower bound 1 - clip_low > 0), got {self.clip_low}")


def group_advantages(rewards_N, group_size: int, adv_norm: str = "std", eps: float = 1e-6) -> np.ndarray:
  """rewards [N] in consecutive groups of `group_size` -> advantages [N] (float32)."""
  r = np.asarray(rewards_N, np.float64)
  if r.ndim != 1 or group_size < 1 or r.shape[0] % group_size:
    raise ValueError(f"rewards: expected [N] with N a multiple of group_size={group_size}, got shape {r.shape}")
  if adv_norm not in ADV_NORMS:
    raise ValueError(f"rl.adv_norm: expected one of {ADV_NORMS}, got {adv_norm!r}")
  g = r.reshape(-1, group_size)
  a = g - g.mean(1, keepdims=True)
  if adv_norm == "std":
    a = a / (g.std(1, keepdims=True) + eps)
  return a.reshape(-1).astype(np.float32)


def policy_terms(logp_BT, old_logp_BT, ref_logp_BT, adv_BT, mask_BT, cfg: GRPOConfig):
  """Per-token pg, kl and the clip indicator; every output is exactly 0 where mask is 0."""
  m = mask_BT.astype(bool)
  logp = jnp.where(m, logp_BT, 0.0)
  log_ratio = jnp.where(m, logp_BT - old_logp_BT, 0.0)
  ratio = jnp.exp(log_ratio)
  clipped = jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
  pg = -jnp.minimum(ratio * adv_BT, clipped * adv_BT)
  d = jnp.where(m, ref_logp_BT - logp, 0.0)
  kl = jnp.exp(d) - d - 1.0
  is_clipped = (ratio * adv_BT) > (clipped * adv_BT)  # the min chose the clipped branch
  zero = jnp.zeros_like(pg)
  return jnp.where(m, pg, zero), jnp.where(m, kl, zero), jnp.where(m, is_clipped, False), log_ratio


def rl_objective(cfg: GRPOConfig):
  """A `step.LossFn` for the batch fields tokens/targets/loss_mask + RL_FIELDS."""

  def loss_fn(stats, mb, model_cfg, aux):
    del model_cfg
    mask = mb["loss_mask"].astype(jnp.float32)
    n = jnp.maximum(jnp.sum(mask), 1.0)
    logp = stats["target_logit"] - stats["lse"]
    pg, kl, clipped, log_ratio = policy_terms(logp, mb["old_logp"], mb["ref_logp"], mb["advantages"],
                                              mb["loss_mask"], cfg)
    z = cfg.z_loss_coef * jnp.sum(jnp.square(stats["lse"]) * mask) / n
    pg_m, kl_m = jnp.sum(pg) / n, jnp.sum(kl) / n
    obj = pg_m + cfg.kl_coef * kl_m + z
    metrics = {"pg_loss": pg_m, "kl": kl_m, "z_loss": z,
               "clip_fraction": jnp.sum(clipped.astype(jnp.float32)) / n,
               # on a batch's first update old_logp is the rollout engine's number for the same
               # weights: this is the train/rollout numerical mismatch (0 in exact arithmetic)
               "logp_mismatch": jnp.sum(jnp.abs(log_ratio)) / n,
               "train_logp": jnp.sum(jnp.where(mask > 0, logp, 0.0)) / n}
    aux_loss = jnp.sum(aux["aux_loss"]) if "aux_loss" in aux else jnp.zeros((), jnp.float32)
    return obj, metrics, aux_loss, jnp.sum(mask)

  return loss_fn
