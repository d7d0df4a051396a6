"""Auxiliary-loss-free load balancing of the MoE router: statistics, bias update, metrics, aux loss.

The router picks top-k of (s + b), s = sigmoid(x W_r) in (0, 1), b = the "moe_state"/"bias" [E]
(never trained by the optimizer). Once per step, OUTSIDE the model, the training loop sums the
per-layer statistics over the global batch (every statistic here is a SUM over tokens, so a psum
over data-parallel replicas is exact) and calls `update_balancing_bias`.

Statistics (per MoE layer, masked tokens excluded):
  counts [E]          token-copies routed to each expert (float32).
  hist   [E, n_bins]  histogram over tokens i of d_ij = alpha_i - (s_ij + b_j), where alpha_i is the
                      (k+1)-th largest biased score of token i. Zeros unless cfg.balancing == "quantile".

Quantile balancing (K3). Sign convention: expert j is in token i's top-k  <=>  d_ij < 0
(the (k+1)-th expert has d = 0 exactly; every selected one is above it). So load_j / T = CDF_j(0),
and the bias that would give expert j exactly the balanced share k/E, all else fixed, is
    b_j' = b_j + q_j,   q_j = quantile_{k/E} over tokens of d_ij   (= quantile of alpha_i - s_ij).
An overloaded expert has more than k/E of its d below 0, so q_j < 0 and its bias drops. The update
    b <- centre(b + eta * q),   eta = cfg.balance_rate in (0, 1]
(eta = 1 jumps straight to the quantile; smaller damps the joint move of all experts, whose
thresholds alpha interact). Centring is free: top-k of s + b is invariant to a common shift.
The quantile is read from the histogram: fixed bins over [-HIST_RANGE, HIST_RANGE], quadratically
spaced (fine near 0 where the fixed point lies, coarse in the tails; values beyond the range are
clipped into the edge bins, which caps one update's step at HIST_RANGE), linear inside a bin.

With cfg.balance_in_batch the train step also balances each batch on its own (`in_batch_shift`,
rate-1 steps from b); the stored bias still takes the step above (cfg.balance_stored_update ==
"histogram", the default) or, with "shift", follows
    b <- centre(b + eta * mean shift)   (stats "shift_sum" / "num_tokens"),
an EMA of the bias the batches were routed with (opt-in: on small, seed 0, eta = 1 balanced the
training batches more tightly but ended 0.033 worse in eval loss; WORKSPACE_NOTES, session 14).

Sign balancing (DeepSeek-V3): b_j <- b_j + gamma * sign(mean_load - load_j), gamma = cfg.balance_rate.

Collapse diagnostics (issue #23), also sums over valid tokens, so exact over microbatches and data
shards: `router_diag_sums` per layer in the forward pass, `routing_diagnostics` from the global
sums in the train step (load max/mean and min/mean, entropy, dead experts, router logit spread
across tokens, mean pairwise cosine of the MoE input and of the router input), and
`update_router_stats` for the running router-input statistics of cfg.router_norm == "batch".
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moonshot_jax.config import ModelConfig

DEFAULT_NUM_BINS = 64
HIST_RANGE = 2.0  # |d| <= 1 + (max b - min b): scores live in (0, 1)


def bin_edges(n_bins: int) -> jax.Array:
  """[n_bins + 1] increasing edges, symmetric, 0 is an edge, denser near 0."""
  if n_bins < 2 or n_bins % 2:
    raise ValueError(f"n_bins: expected an even int >= 2, got {n_bins!r}")
  u = np.linspace(-1.0, 1.0, n_bins + 1)
  return jnp.asarray(HIST_RANGE * np.sign(u) * u * u, jnp.float32)


def topk_threshold(biased_TE: jax.Array, k: int) -> jax.Array:
  """alpha_T: the (k+1)-th largest biased score of each token (k < E)."""
  return jax.lax.top_k(biased_TE, k + 1)[0][:, k]


def routing_stats(scores_TE: jax.Array, bias_E: jax.Array, expert_idx_Tk: jax.Array,
                  token_mask_T: jax.Array, cfg: ModelConfig,
                  n_bins: int = DEFAULT_NUM_BINS) -> dict[str, jax.Array]:
  """Per-layer sums over the valid tokens: {"counts": [E], "hist": [E, n_bins]} (float32)."""
  T, E = scores_TE.shape
  K = expert_idx_Tk.shape[-1]
  w_T = token_mask_T.astype(jnp.float32)
  counts_E = jnp.zeros((E,), jnp.float32).at[expert_idx_Tk].add(jnp.broadcast_to(w_T[:, None], (T, K)))
  hist_EB = jnp.zeros((E, n_bins), jnp.float32)
  if cfg.balancing == "quantile" and K < E:
    biased_TE = scores_TE.astype(jnp.float32) + bias_E.astype(jnp.float32)
    d_TE = topk_threshold(biased_TE, K)[:, None] - biased_TE
    # bin b holds [edge_b, edge_{b+1}); d = 0 (the (K+1)-th expert) lands right of 0: not selected
    bin_TE = jnp.clip(jnp.searchsorted(bin_edges(n_bins), d_TE, side="right") - 1, 0, n_bins - 1)
    expert_TE = jnp.broadcast_to(jnp.arange(E), (T, E))
    hist_EB = hist_EB.at[expert_TE, bin_TE].add(jnp.broadcast_to(w_T[:, None], (T, E)))
  return {"counts": counts_E, "hist": hist_EB}


# rate-1 quantile steps on one skewed batch: max/mean 3.2 -> 1.59 (1), 1.15 (2), 1.09 (3); one default,
# the config's (LatentMoE passes cfg.balance_in_batch_iters)
IN_BATCH_ITERS = ModelConfig.balance_in_batch_iters


def in_batch_shift(scores_TE: jax.Array, bias_E: jax.Array, w_T: jax.Array, k: int,
                   n_bins: int = DEFAULT_NUM_BINS, iters: int = IN_BATCH_ITERS,
                   band: tuple[float | jax.Array, float | jax.Array] | None = None) -> jax.Array:
  """Centred shift_E of the selection bias that balances THIS batch's top-k of scores + bias + shift:
  `iters` rate-1 quantile steps on the batch's own histogram (cfg.balance_in_batch; train step only;
  the stored bias learns from it or from its own histogram: `update_balancing_bias`). w_T: token
  weights (0 = masked).
  band = (lo, hi), lo <= 1 <= hi (multiples of the mean load; floats or traced scalars): in each step only
  the experts whose load is outside [lo, hi] x mean take their quantile step (to the mean load); those
  inside keep the tokens bias + jitter give them. (1, 1) moves every expert: the exact step, bit for bit.
  Moving an offender only to the band's edge converges far slower: its displaced tokens land mostly on
  the other overloaded experts (a skewed 8-expert batch: 1.42x after 4 steps, 1.30x after 16)."""
  T, E = scores_TE.shape
  shift_E = jnp.zeros((E,), jnp.float32)
  if k >= E:
    return shift_E
  experts_TE = jnp.broadcast_to(jnp.arange(E), (T, E))
  w_TE = jnp.broadcast_to(w_T.astype(jnp.float32)[:, None], (T, E))
  for _ in range(iters):
    biased_TE = scores_TE.astype(jnp.float32) + (bias_E.astype(jnp.float32) + shift_E)
    d_TE = topk_threshold(biased_TE, k)[:, None] - biased_TE
    bin_TE = jnp.clip(jnp.searchsorted(bin_edges(n_bins), d_TE, side="right") - 1, 0, n_bins - 1)
    hist_EB = jnp.zeros((E, n_bins), jnp.float32).at[experts_TE, bin_TE].add(w_TE)
    q_E = quantile_from_hist(hist_EB, k / E)
    if band is not None:  # load / mean from the histogram: d < 0 (its first half) = selected
      lo, hi = band
      half = n_bins // 2
      rel_E = jnp.sum(hist_EB[:, :half], -1) / jnp.maximum(jnp.sum(hist_EB, -1), 1e-9) * (E / k)
      move_E = (rel_E > hi) | (rel_E < lo) | ((lo == 1.0) & (hi == 1.0))
      q_E = jnp.where(move_E, q_E, 0.0)
    shift_E = shift_E + q_E
  return shift_E - jnp.mean(shift_E)


def in_batch_band(cfg: ModelConfig, step: jax.Array | int | None) -> tuple[jax.Array, jax.Array] | None:
  """in_batch_shift's band for the train step `step` (updates so far): None (exact balance) unless
  cfg.balance_in_batch_max_load / min_load differ from 1; then (min_load, max_load) from step
  cfg.balance_in_batch_band_from on and (1, 1) before it."""
  lo, hi = float(cfg.balance_in_batch_min_load), float(cfg.balance_in_batch_max_load)
  if lo == 1.0 and hi == 1.0:
    return None
  start = int(cfg.balance_in_batch_band_from)
  if start == 0:
    return jnp.float32(lo), jnp.float32(hi)
  if step is None:
    raise ValueError(f"model.balance_in_batch_band_from={start}: the band's start needs the train step; "
                     "trace under moe.batch_routing(step=...)")
  on = jnp.asarray(step) >= start
  return jnp.where(on, lo, 1.0).astype(jnp.float32), jnp.where(on, hi, 1.0).astype(jnp.float32)


def slot_jitter(t: int, e: int, std: float) -> jax.Array:
  """[t, e] fixed pseudo-random offsets of standard deviation `std` (a sine hash of the token slot and
  expert: uniform, no RNG state; tokens land in slots independently of their content)."""
  h = jnp.sin(jnp.arange(t, dtype=jnp.float32)[:, None] * 12.9898 + jnp.arange(e, dtype=jnp.float32) * 78.233)
  u = h * 43758.5453
  return (u - jnp.floor(u) - 0.5) * (std * np.sqrt(12.0))


def jitter_scale(step: jax.Array | int | None, decay_steps: int, floor: float = 0.0,
                 decay: str = "linear") -> jax.Array:
  """Factor on slot_jitter's std: 1 for decay_steps == 0 (constant); else it ends at `floor` (a fraction
  of the full std) at step decay_steps, "linear": 1 - (1 - floor) step / decay_steps down to floor,
  "step": 1 before decay_steps, floor from it on (the jitter is needed while the router is young and
  collapse-prone; later most of it is selection noise). `step`: the train step's updates so far."""
  if decay_steps == 0:
    return jnp.float32(1.0)
  if step is None:
    raise ValueError(f"model.balance_jitter_steps={decay_steps}: the decaying jitter needs the train step; "
                     "trace under moe.batch_routing(step=...)")
  frac = jnp.asarray(step, jnp.float32) / decay_steps
  if decay == "step":
    return jnp.where(frac < 1.0, 1.0, floor).astype(jnp.float32)
  if decay != "linear":
    raise ValueError(f"decay: expected 'linear' or 'step', got {decay!r}")
  return floor + (1.0 - floor) * jnp.clip(1.0 - frac, 0.0, 1.0)


def quantile_from_hist(hist_EB: jax.Array, level: float) -> jax.Array:
  """Per-expert `level`-quantile of the binned values, linear inside the bin; 0 if empty."""
  e, n_bins = hist_EB.shape
  edges = bin_edges(n_bins)
  cdf_EB1 = jnp.concatenate([jnp.zeros((e, 1), jnp.float32), jnp.cumsum(hist_EB, -1)], -1)
  total_E = cdf_EB1[:, -1]
  target_E = level * total_E

  def one(cdf, target):
    # first edge where the CDF reaches the target: cdf[i-1] < target <= cdf[i]
    i = jnp.clip(jnp.searchsorted(cdf, target, side="left"), 1, n_bins)
    lo, hi = cdf[i - 1], cdf[i]
    frac = jnp.clip((target - lo) / jnp.maximum(hi - lo, 1e-30), 0.0, 1.0)
    return edges[i - 1] + frac * (edges[i] - edges[i - 1])

  q_E = jax.vmap(one)(cdf_EB1, target_E)
  return jnp.where(total_E > 0, q_E, 0.0)


def update_balancing_bias(bias_E: jax.Array, stats: dict[str, jax.Array],
                          cfg: ModelConfig) -> jax.Array:
  """One balancing step from the global-batch `stats` (summed "counts" [E] / "hist" [E, n_bins])."""
  E, K = cfg.num_experts, cfg.num_experts_per_tok
  if bias_E.shape != (E,):
    raise ValueError(f"bias_E: expected shape ({E},), got {bias_E.shape}")
  bias_E = bias_E.astype(jnp.float32)
  if cfg.balancing == "none" or K >= E:  # K == E: every expert takes every token already
    return bias_E
  if cfg.balancing == "sign":
    counts_E = stats["counts"].astype(jnp.float32)
    if counts_E.shape != (E,):
      raise ValueError(f"stats['counts']: expected shape ({E},), got {counts_E.shape}")
    return bias_E + cfg.balance_rate * jnp.sign(jnp.mean(counts_E) - counts_E)
  if cfg.balance_in_batch and cfg.balance_stored_update == "shift":
    return _follow_shift(bias_E, stats, cfg)
  hist_EB = stats["hist"].astype(jnp.float32)
  if hist_EB.ndim != 2 or hist_EB.shape[0] != E:
    raise ValueError(f"stats['hist']: expected shape ({E}, n_bins), got {hist_EB.shape}")
  new_E = bias_E + cfg.balance_rate * quantile_from_hist(hist_EB, K / E)
  return new_E - jnp.mean(new_E)


def _follow_shift(bias_E: jax.Array, stats: dict[str, jax.Array], cfg: ModelConfig) -> jax.Array:
  # b <- b + eta * mean shift: an EMA of the bias the training batches were routed with (the in-batch
  # shift is that batch's converged balancing offset from b), so eval routing tracks training's
  for key in ("shift_sum", "num_tokens"):
    if key not in stats:
      raise ValueError(f"stats[{key!r}]: needed by balance_stored_update='shift' (LatentMoE's aux in the "
                       f"train step), got keys {sorted(stats)}")
  shift_E = stats["shift_sum"].astype(jnp.float32)
  if shift_E.shape != bias_E.shape:
    raise ValueError(f"stats['shift_sum']: expected shape {bias_E.shape}, got {shift_E.shape}")
  new_E = bias_E + cfg.balance_rate * shift_E / jnp.maximum(stats["num_tokens"].astype(jnp.float32), 1.0)
  return new_E - jnp.mean(new_E)


def load_metrics(counts_E: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(max load / mean load, entropy in nats of the load distribution; log E when balanced)."""
  counts_E = counts_E.astype(jnp.float32)
  total = jnp.sum(counts_E)
  max_over_mean = jnp.max(counts_E) / jnp.maximum(jnp.mean(counts_E), 1e-9)
  p_E = counts_E / jnp.maximum(total, 1e-9)
  entropy = -jnp.sum(jnp.where(p_E > 0, p_E * jnp.log(jnp.where(p_E > 0, p_E, 1.0)), 0.0))
  return max_over_mean, entropy


def sequence_aux_loss(scores_BTE: jax.Array, expert_idx_BTk: jax.Array, token_mask_BT: jax.Array,
                      cfg: ModelConfig) -> jax.Array:
  """DeepSeek-V3 sequence-wise balance loss: coef * mean_b sum_j f_bj P_bj, with
  f_bj = E / (k T_b) * #{t: j in top-k(t)} and P_bj = mean_t s_btj / sum_j' s_btj' (T_b valid tokens).
  Gradients reach the router through P only."""
  B, T, E = scores_BTE.shape
  K = expert_idx_BTk.shape[-1]
  m_BT = token_mask_BT.astype(jnp.float32)
  n_B = jnp.maximum(jnp.sum(m_BT, -1), 1.0)
  sel_BTE = jnp.sum(jax.nn.one_hot(expert_idx_BTk, E, dtype=jnp.float32), -2)  # [B, T, E]
  f_BE = (E / K) * jnp.einsum("bte,bt->be", sel_BTE, m_BT) / n_B[:, None]
  s_BTE = scores_BTE.astype(jnp.float32)
  p_BTE = s_BTE / jnp.sum(s_BTE, -1, keepdims=True)
  pbar_BE = jnp.einsum("bte,bt->be", p_BTE, m_BT) / n_B[:, None]
  return cfg.aux_loss_coef * jnp.mean(jnp.sum(jax.lax.stop_gradient(f_BE) * pbar_BE, -1))


DEAD_FRACTION = 0.1  # an expert below this fraction of the mean load counts as dead
DIAG_KEYS = ("num_tokens", "input_sum", "input_sq_sum", "input_unit_sum", "router_unit_sum",
             "logit_sum", "logit_sq_sum", "saturated_sum")
SAT_LOGIT = 4.59512  # |logit| above this = sigmoid score within 0.01 of 0 or 1 (logit(0.99))


def router_diag_sums(x_TD: jax.Array, r_TD: jax.Array, logits_TE: jax.Array,
                     w_T: jax.Array) -> dict[str, jax.Array]:
  """Sums over tokens weighted by w_T (0 = masked) of the MoE input x, the router input r (x itself
  unless normalised), the router logits and the fraction of saturated sigmoid scores (|logit| >
  SAT_LOGIT): the DIAG_KEYS, fp32, shapes [], [D] x4, [E] x2, []."""
  x = x_TD.astype(jnp.float32)
  r = r_TD.astype(jnp.float32)
  lg = logits_TE.astype(jnp.float32)
  unit = lambda v: v * jax.lax.rsqrt(jnp.maximum(jnp.sum(v * v, -1, keepdims=True), 1e-30))
  ws = lambda v: jnp.einsum("t,t...->...", w_T, v)
  return {"num_tokens": jnp.sum(w_T), "input_sum": ws(x), "input_sq_sum": ws(x * x),
          "input_unit_sum": ws(unit(x)), "router_unit_sum": ws(unit(r)),
          "logit_sum": ws(lg), "logit_sq_sum": ws(lg * lg),
          "saturated_sum": ws(jnp.mean((jnp.abs(lg) > SAT_LOGIT).astype(jnp.float32), -1))}


def _mean_pairwise_cos(unit_sum_D: jax.Array, n: jax.Array) -> jax.Array:
  # sum_{i != j} u_i.u_j = |sum u|^2 - n for unit vectors u
  return (jnp.sum(unit_sum_D * unit_sum_D) - n) / jnp.maximum(n * (n - 1.0), 1.0)


def routing_diagnostics(stats: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Scalars of ONE layer from its global-batch sums ("counts" [E] and the DIAG_KEYS; with "hist"
  [E, n_bins] of quantile balancing also stored_load_max_over_mean: the load the stored bias alone
  would give this batch, i.e. eval / decode routing, read off the histogram as the copies with d < 0)."""
  counts_E = stats["counts"].astype(jnp.float32)
  max_over_mean, entropy = load_metrics(counts_E)
  mean = jnp.maximum(jnp.mean(counts_E), 1e-9)
  out = {"load_max_over_mean": max_over_mean, "load_entropy": entropy,
         "load_min_over_mean": jnp.min(counts_E) / mean,
         "dead_experts": jnp.sum(counts_E < DEAD_FRACTION * mean).astype(jnp.float32)}
  if "num_tokens" in stats:
    n = stats["num_tokens"]
    nn_ = jnp.maximum(n, 1.0)
    mean_E = stats["logit_sum"] / nn_
    var_E = jnp.maximum(stats["logit_sq_sum"] / nn_ - mean_E * mean_E, 0.0)
    out.update(router_logit_std=jnp.mean(jnp.sqrt(var_E)),  # spread across tokens, mean over experts
               router_logit_offset=jnp.std(mean_E),  # token-independent per-expert offset
               input_cos=_mean_pairwise_cos(stats["input_unit_sum"], n),
               router_input_cos=_mean_pairwise_cos(stats["router_unit_sum"], n),
               sigmoid_saturation=stats["saturated_sum"] / nn_)
  if "hist" in stats:
    hist_EB = stats["hist"].astype(jnp.float32)
    stored_E = jnp.sum(hist_EB[:, :hist_EB.shape[1] // 2], -1)  # 0 is the middle edge: d < 0 = selected
    out["stored_load_max_over_mean"] = jnp.max(stored_E) / jnp.maximum(jnp.mean(stored_E), 1e-9)
  return out


def update_router_stats(mean_D: jax.Array, var_D: jax.Array, stats: dict[str, jax.Array], rate: jax.Array
                        ) -> tuple[jax.Array, jax.Array]:
  """Running mean / variance of the router input: m <- m + rate (batch - m) from the global sums;
  unchanged when the batch had no valid token."""
  n = stats["num_tokens"]
  nn_ = jnp.maximum(n, 1.0)
  bm = stats["input_sum"] / nn_
  bv = jnp.maximum(stats["input_sq_sum"] / nn_ - bm * bm, 0.0)
  rate = jnp.where(n > 0, rate, 0.0)
  return mean_D + rate * (bm - mean_D), var_D + rate * (bv - var_D)
