"""Stable LatentMoE: sigmoid router with a balancing bias, routed experts in a latent space, shared experts.

    s = sigmoid(x W_r)                  fp32 router on the full hidden, W_r [d, E]
    idx = top-k(s + b)                  b = "moe_state"/"bias" [E], used for selection only
    w = s[idx] / sum s[idx] * cfg.routed_scaling_factor
    routed = up(RMSNorm_l(sum_k w_k E_k(down(x))))   cfg.moe_latent_dim = l > 0 (no norm: moe_latent_norm=False)
           = sum_k w_k E_k(x)                       cfg.moe_latent_dim == 0 (no down / up / norm)
    y = routed + shared(x)              shared: one fused gated MLP of width cfg.shared_ff_dim (if > 0)
Experts are gated MLPs (ffn.gated_activation: SwiGLU or the soft-capped SiTU-GLU). Note: with the
latent RMSNorm (scale-invariant) the routed_scaling_factor cancels; the norm's learned scale sets
the routed branch's magnitude instead.

Parameters ("params"):
  router      [d, E]   fp32       ("embed", None)
  latent_down [d, l]              ("embed", "latent")      } only when moe_latent_dim > 0
  latent_up   [l, d]              ("latent", "embed")      }
  latent_norm/scale [l]           ("norm",)                }  and cfg.moe_latent_norm
  w_gate, w_up [E, L, F], w_down [E, F, L]  ("expert", "latent" | "embed", "mlp"), L = l or d
  (cfg.moe_expert_tie_steps = N > 0: the E experts start as copies of one; the train step computes with
  their mean while its step < N, so each gets the mean gradient and they stay equal, then they part.)
  shared/{wi_gate, wi_up, wo}     (ffn.DenseFFN)           only when shared_ff_dim > 0
Non-trainable ("moe_state"): bias [E] fp32 ("norm",); with cfg.router_norm == "batch" also
input_mean, input_var [d] fp32 ("norm",), the running statistics of the router input. Pass the
collection at apply (read only); under nn.scan give "moe_state" the same variable_axes as "params".

Router input normalisation (cfg.router_norm == "batch", issue #23): the router reads
    r = (x - mu) / sqrt(var + eps)   per feature, mu / var stop-gradient,
with mu / var of the valid tokens of the current batch when traced under `batch_routing()` (the
train step does) and the running "moe_state" statistics otherwise (eval, prefill, decode: a batch
of one never routes on its own statistics). Measured on small (WORKSPACE_NOTES, session 12): in
warm-up every token's MoE input takes one shared direction (pairwise cosine -> 0.999); raw, the
router then ranks experts the same for every token and all tokens go to k experts; a lagged running
mean does not follow that direction fast enough, the batch's own mean does.

Expert-parallel hook: `routed_experts(x_TL, expert_idx_Tk, expert_w_Tk, w_gate_ELF, w_up_ELF,
w_down_EFL, cfg) -> y_TL` (inputs cast to cfg.dtype, fp32 accumulation, y_TL fp32) is the whole routed
compute; `LatentMoE(cfg, expert_fn=f)` calls `f` with that signature instead. The default is
dropless on one device, no dense all-experts compute: token-copies sorted by expert and either
`jax.lax.ragged_dot` (GPU/TPU) or padded per-expert blocks, one at a time in a loop ("blocked", CPU).

`LatentMoE.__call__(x_BTD, token_mask_BT=None) -> (y_BTD, aux)`, aux (fixed shapes, stackable by
nn.scan): "aux_loss" [] (sequence-wise, 0 unless cfg.aux_loss_coef > 0), "counts" [E], "hist"
[E, n_bins] (sums over unmasked tokens, see balancing.py), "shift_sum" [E] (the in-batch shift
times the number of valid tokens; zeros outside the balance_in_batch train step), "load_max_over_mean" [],
"load_entropy" [] (this layer, local batch), and the diagnostic sums of `router_diag_sums`
(balancing.py: router logits, unit input vectors, input moments). Masked tokens are still computed
(fixed shapes) but leave every statistic, the batch mean / variance and the aux loss.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp

from moonshot_jax.config import ModelConfig
from moonshot_jax.layers.balancing import (DEFAULT_NUM_BINS, in_batch_band, in_batch_shift, load_metrics,
                                           router_diag_sums, routing_stats, sequence_aux_loss, jitter_scale,
                                           slot_jitter)
from moonshot_jax.layers.ffn import DenseFFN, gated_activation
from moonshot_jax.layers.linear import project
from moonshot_jax.layers.norms import RMSNorm
from moonshot_jax.layers.varying import same_varying

ExpertFn = Callable[..., jax.Array]


ROUTER_NORM_EPS = 1e-5
# (router input on the batch's own statistics, in-batch balancing shift, train step count or None):
# the first two in the train step
_BATCH_ROUTING = contextvars.ContextVar("moe_batch_routing", default=(False, False, None))


@contextlib.contextmanager
def batch_routing(enabled: bool = True, *, stats: bool = True, shift: bool = True,
                  step: jax.Array | int | None = None) -> Iterator[None]:
  """While a model is TRACED inside this context, cfg.router_norm == "batch" layers normalise the
  router input with the batch's own statistics (the train step; outside, the running ones) and
  cfg.balance_in_batch layers add the in-batch balancing shift to the stored bias. `stats` / `shift`
  False leave that part as at eval (launch/moe_eval_gap.py measures each part's eval-loss effect).
  `step` (the train step's updates so far, a traced scalar of that same trace) scales a decaying
  cfg.balance_jitter (cfg.balance_jitter_steps > 0), which needs it.
  Read at trace time and invisible to jit's cache: a jitted function must enter it itself (the
  train step does, inside its traced body), never be traced once inside and reused outside."""
  token = _BATCH_ROUTING.set((enabled and stats, enabled and shift, step))
  try:
    yield
  finally:
    _BATCH_ROUTING.reset(token)


def router_input(x_TD: jax.Array, w_T: jax.Array, running_mean_D: jax.Array, running_var_D: jax.Array,
                 use_batch: bool) -> jax.Array:
  """(x - mu) / sqrt(var + eps) fp32; mu, var of the tokens weighted by w_T (0 = masked) if
  use_batch, else the running ones; no gradient through mu / var."""
  x = x_TD.astype(jnp.float32)
  if use_batch:
    n = jnp.maximum(jnp.sum(w_T), 1.0)
    mu_D = jnp.einsum("t,td->d", w_T, x) / n
    var_D = jnp.einsum("t,td->d", w_T, jnp.square(x - mu_D)) / n
  else:
    mu_D, var_D = running_mean_D.astype(jnp.float32), running_var_D.astype(jnp.float32)
  mu_D, var_D = jax.lax.stop_gradient(mu_D), jax.lax.stop_gradient(jnp.maximum(var_D, 0.0))
  return (x - mu_D) * jax.lax.rsqrt(var_D + ROUTER_NORM_EPS)


def route_logits(x_TD: jax.Array, w_router_DE: jax.Array, bias_E: jax.Array,
                 cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """As `route`, plus the router logits_TE (fp32) first."""
  logits_TE = project("td,de->te", x_TD, w_router_DE, jnp.float32)
  return (logits_TE,) + _select(jax.nn.sigmoid(logits_TE), bias_E, cfg)


def route(x_TD: jax.Array, w_router_DE: jax.Array, bias_E: jax.Array,
          cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(scores_TE = sigmoid(x W_r) fp32, expert_idx_Tk int32, expert_w_Tk fp32)."""
  return route_logits(x_TD, w_router_DE, bias_E, cfg)[1:]


def _select(scores_TE: jax.Array, bias_E: jax.Array, cfg: ModelConfig):
  # the bias only picks experts: it must not enter the weights (nor receive gradients)
  biased_TE = scores_TE + jax.lax.stop_gradient(bias_E.astype(jnp.float32))
  _, idx_Tk = jax.lax.top_k(biased_TE, cfg.num_experts_per_tok)
  s_Tk = jnp.take_along_axis(scores_TE, idx_Tk, axis=-1)
  w_Tk = s_Tk / jnp.sum(s_Tk, -1, keepdims=True) * cfg.routed_scaling_factor
  return scores_TE, idx_Tk.astype(jnp.int32), w_Tk


def _check_expert_shapes(x_TL, expert_idx_Tk, expert_w_Tk, w_gate_ELF, w_up_ELF, w_down_EFL):
  T, L = x_TL.shape
  E, _, F = w_gate_ELF.shape
  K = expert_idx_Tk.shape[-1]
  if expert_idx_Tk.shape != (T, K) or expert_w_Tk.shape != (T, K):
    raise ValueError(f"expert_idx_Tk / expert_w_Tk: expected [{T}, K], got "
                     f"{expert_idx_Tk.shape} / {expert_w_Tk.shape}")
  if w_gate_ELF.shape != (E, L, F) or w_up_ELF.shape != (E, L, F) or w_down_EFL.shape != (E, F, L):
    raise ValueError(f"w_gate_ELF / w_up_ELF / w_down_EFL: expected [{E},{L},{F}] x2 and [{E},{F},{L}], "
                     f"got {w_gate_ELF.shape} / {w_up_ELF.shape} / {w_down_EFL.shape}")
  return T, L, E, F, K


def moe_implementation(cfg: ModelConfig) -> str:
  """"ragged_dot" or "blocked". "auto": blocked on CPU, where XLA lowers ragged_dot to a dense
  masked product over all experts (E/k times the FLOPs plus [T*k, E*L] masks), ragged_dot elsewhere."""
  if cfg.moe_implementation != "auto":
    return cfg.moe_implementation
  return "blocked" if jax.default_backend() == "cpu" else "ragged_dot"


def routed_experts(x_TL: jax.Array, expert_idx_Tk: jax.Array, expert_w_Tk: jax.Array,
                   w_gate_ELF: jax.Array, w_up_ELF: jax.Array, w_down_EFL: jax.Array,
                   cfg: ModelConfig) -> jax.Array:
  """sum_k w_tk * E_{idx_tk}(x_t) in fp32, dropless, on one device (cfg.moe_implementation)."""
  T, L, E, F, K = _check_expert_shapes(x_TL, expert_idx_Tk, expert_w_Tk, w_gate_ELF, w_up_ELF, w_down_EFL)
  if moe_implementation(cfg) == "blocked":
    y_TkL = _blocked_experts(x_TL, expert_idx_Tk, w_gate_ELF, w_up_ELF, w_down_EFL, cfg)
    return jnp.einsum("tkl,tk->tl", y_TkL, expert_w_Tk.astype(jnp.float32))
  dtype = jnp.dtype(cfg.dtype)
  flat_e = expert_idx_Tk.reshape(-1)
  order = jnp.argsort(flat_e, stable=True)  # token-copies grouped by expert
  xs = x_TL.astype(dtype)[order // K]
  group_sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)

  def gmm(lhs, rhs):
    return jax.lax.ragged_dot(lhs, rhs.astype(dtype), group_sizes, preferred_element_type=jnp.float32)

  h = gated_activation(gmm(xs, w_gate_ELF), gmm(xs, w_up_ELF), cfg).astype(dtype)
  ys = gmm(h, w_down_EFL)  # [T*K, L] fp32, in sorted order
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
  y_TkL = ys[inverse].reshape(T, K, L)
  return jnp.einsum("tkl,tk->tl", y_TkL, expert_w_Tk.astype(jnp.float32))


def block_size_for(n_copies: int, num_experts: int) -> int:
  """Rows per block: half the mean group size (power of two in [8, 128]). The static buffer holds
  n_copies + num_experts·bs rows whatever the routing, so bs = mean makes it 2x the copies and
  bs = mean/2 1.5x, while blocks stay large enough for efficient matmuls (measured block sizes:
  WORKSPACE_NOTES, sessions 9 and 12)."""
  half_mean = max(1, n_copies // (2 * num_experts))
  return int(min(128, max(8, 1 << (half_mean.bit_length() - 1))))


def _blocked_experts(x_TL, expert_idx_Tk, w_gate_ELF, w_up_ELF, w_down_EFL, cfg) -> jax.Array:
  """Dropless grouped MLP over dense blocks: each expert's token-copies are padded to a multiple of
  the block size and every block belongs to one expert. Static shapes: a buffer of
  ceil(T*K/bs) + E blocks; only the blocks in use are computed (`_block_mlp`).
  Returns y_TkL fp32 (unweighted, per copy)."""
  T, L = x_TL.shape
  E, _, F = w_gate_ELF.shape
  K = expert_idx_Tk.shape[-1]
  N = T * K
  bs = block_size_for(N, E)
  nb = -(-N // bs) + E
  dtype = jnp.dtype(cfg.dtype)
  flat_e = expert_idx_Tk.reshape(-1)
  sizes_E = jnp.bincount(flat_e, length=E).astype(jnp.int32)
  padded_E = -(-sizes_E // bs) * bs
  start_E = jnp.cumsum(sizes_E) - sizes_E
  pstart_E = jnp.cumsum(padded_E) - padded_E
  order = jnp.argsort(flat_e, stable=True)
  e_sorted = flat_e[order]
  dest_sorted = pstart_E[e_sorted] + jnp.arange(N, dtype=jnp.int32) - start_E[e_sorted]
  dest_N = jnp.zeros((N,), jnp.int32).at[order].set(dest_sorted)  # padded row of each copy
  buf = jnp.zeros((nb * bs, L), dtype).at[dest_N].set(jnp.repeat(x_TL.astype(dtype), K, axis=0))
  # searchsorted(side="right") as a comparison count: [nb, E] is tiny, and jnp.searchsorted's scan
  # trips an internal assertion under shard_map (make_local_expert_fn) on jax 0.10
  ends_E = jnp.cumsum(padded_E)
  block_e = jnp.sum(ends_E[None, :] <= jnp.arange(nb, dtype=jnp.int32)[:, None] * bs, axis=1)
  # blocks past the last in use are never computed; the clamp keeps their ids valid all the same
  block_e = jnp.minimum(block_e, E - 1).astype(jnp.int32)
  n_used = (ends_E[-1] // bs).astype(jnp.int32)
  args = same_varying(buf.reshape(nb, bs, L), block_e, n_used, w_gate_ELF, w_up_ELF, w_down_EFL)
  ys = _block_mlp(*args, cfg)
  return ys.reshape(nb * bs, L)[dest_N].reshape(T, K, L)


# One block at a time in a loop that stops at the last block in use, with its own backward: a
# batched matmul over all nb blocks would multiply the ~E/2 all-padding blocks too and need every
# block's weights copied out ([nb, L, F], 3x the expert weights) and per-block weight gradients
# scatter-added back; here each block reads its expert's weights in place and adds its weight
# gradient into that expert's slot (faster than the batched form on CPU: WORKSPACE_NOTES, session 9).
@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _block_mlp(x_nbL, block_e, n_used, w_gate_ELF, w_up_ELF, w_down_EFL, cfg):
  return _block_mlp_fwd(x_nbL, block_e, n_used, w_gate_ELF, w_up_ELF, w_down_EFL, cfg)[0]


def _block_dot(a, w, dtype):
  return jnp.dot(a, w.astype(dtype), preferred_element_type=jnp.float32)


def _block_act(g, u, cfg):
  return gated_activation(g, u, cfg).astype(jnp.dtype(cfg.dtype))


def _block_mlp_fwd(x_nbL, block_e, n_used, w_gate_ELF, w_up_ELF, w_down_EFL, cfg):
  nb, bs, L = x_nbL.shape
  F = w_gate_ELF.shape[-1]
  dtype = jnp.dtype(cfg.dtype)

  def body(i, carry):
    y, g, u = carry
    e, xb = block_e[i], x_nbL[i]
    gi, ui = _block_dot(xb, w_gate_ELF[e], dtype), _block_dot(xb, w_up_ELF[e], dtype)
    yi = _block_dot(_block_act(gi, ui, cfg), w_down_EFL[e], dtype)
    return y.at[i].set(yi), g.at[i].set(gi), u.at[i].set(ui)

  zeros = lambda d: jnp.zeros_like(x_nbL, shape=(nb, bs, d), dtype=jnp.float32)  # x's manual axes
  y, g, u = jax.lax.fori_loop(0, n_used, body, (zeros(L), zeros(F), zeros(F)))
  return y, (x_nbL, block_e, n_used, w_gate_ELF, w_up_ELF, w_down_EFL, g, u)


def _block_mlp_bwd(cfg, res, dy_nbL):
  x_nbL, block_e, n_used, w_gate_ELF, w_up_ELF, w_down_EFL, g, u = res
  dtype = jnp.dtype(cfg.dtype)

  def body(i, carry):
    dx, dwg, dwu, dwd = carry
    e, xb, dyi = block_e[i], x_nbL[i], dy_nbL[i].astype(dtype)
    h, act_vjp = jax.vjp(lambda a, b: _block_act(a, b, cfg), g[i], u[i])
    dwd = dwd.at[e].add(jnp.dot(h.T, dyi, preferred_element_type=jnp.float32))
    dg, du = act_vjp(_block_dot(dyi, w_down_EFL[e].T, dtype).astype(h.dtype))
    dg, du = dg.astype(dtype), du.astype(dtype)
    dwg = dwg.at[e].add(jnp.dot(xb.T, dg, preferred_element_type=jnp.float32))
    dwu = dwu.at[e].add(jnp.dot(xb.T, du, preferred_element_type=jnp.float32))
    dxi = _block_dot(dg, w_gate_ELF[e].T, dtype) + _block_dot(du, w_up_ELF[e].T, dtype)
    return dx.at[i].set(dxi.astype(dx.dtype)), dwg, dwu, dwd

  zeros = lambda a, dtype=jnp.float32: jnp.zeros_like(x_nbL, shape=a.shape, dtype=dtype)
  dx, dwg, dwu, dwd = jax.lax.fori_loop(0, n_used, body, (zeros(x_nbL, x_nbL.dtype), zeros(w_gate_ELF),
                                                          zeros(w_up_ELF), zeros(w_down_EFL)))
  return (dx, None, None, dwg.astype(w_gate_ELF.dtype), dwu.astype(w_up_ELF.dtype),
          dwd.astype(w_down_EFL.dtype))


_block_mlp.defvjp(_block_mlp_fwd, _block_mlp_bwd)


def _tied_init(init):
  """`init` drawn once for expert 0 and copied to every expert (leading axis): cfg.moe_expert_tie_steps."""
  def f(key, shape, dtype=jnp.float32):
    return jnp.broadcast_to(init(key, (1,) + tuple(shape[1:]), dtype), shape)
  return f


class LatentMoE(nn.Module):
  cfg: ModelConfig
  expert_fn: ExpertFn | None = None  # same signature as routed_experts (expert parallelism)
  n_bins: int = DEFAULT_NUM_BINS  # quantile-balancing histogram bins

  @nn.compact
  def __call__(self, x_BTD: jax.Array,
               token_mask_BT: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    cfg = self.cfg
    e, d, lat, f = cfg.num_experts, cfg.d_model, cfg.moe_latent_dim, cfg.expert_ff_dim
    if x_BTD.ndim != 3 or x_BTD.shape[-1] != d:
      raise ValueError(f"x_BTD: expected [B, T, d_model={d}], got shape {x_BTD.shape}")
    b, t, _ = x_BTD.shape
    if token_mask_BT is None:
      token_mask_BT = jnp.ones((b, t), bool)
    elif token_mask_BT.shape != (b, t):
      raise ValueError(f"token_mask_BT: expected shape {(b, t)}, got {token_mask_BT.shape}")
    dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    init = nn.initializers.normal(cfg.init_std)

    w_router = self.param("router", nn.with_logical_partitioning(init, ("embed", None)), (d, e),
                          jnp.float32)
    bias = self.variable("moe_state", "bias", lambda: nn.Partitioned(
        jnp.zeros((e,), jnp.float32), names=("norm",))).value
    x_TD = x_BTD.reshape(b * t, d)
    w_T = token_mask_BT.reshape(-1).astype(jnp.float32)
    use_batch_stats, use_shift, step = _BATCH_ROUTING.get()
    if cfg.router_norm == "batch":
      state = lambda name, fill: self.variable("moe_state", name, lambda: nn.Partitioned(
          jnp.full((d,), fill, jnp.float32), names=("norm",))).value
      r_TD = router_input(x_TD, w_T, state("input_mean", 0.0), state("input_var", 1.0),
                          use_batch_stats)
    else:
      r_TD = x_TD
    sel_bias = bias
    shift_E = jnp.zeros((e,), jnp.float32)
    if cfg.balance_in_batch and use_shift:  # train step: also balance this very batch
      logits0 = project("td,de->te", r_TD, w_router, jnp.float32)
      s0_TE = jax.lax.stop_gradient(jax.nn.sigmoid(logits0))
      if cfg.balance_jitter > 0:  # selection only ([T, E] offset): the weights keep the plain scores
        scale = jitter_scale(step, cfg.balance_jitter_steps, cfg.balance_jitter_floor / cfg.balance_jitter,
                             cfg.balance_jitter_decay)
        jit_TE = slot_jitter(b * t, e, cfg.balance_jitter) * scale
        s0_TE, sel_bias = s0_TE + jit_TE, bias + jit_TE
      shift_E = in_batch_shift(s0_TE, bias, w_T, cfg.num_experts_per_tok, self.n_bins,
                               cfg.balance_in_batch_iters, band=in_batch_band(cfg, step))
      sel_bias = sel_bias + shift_E
    logits_TE, scores_TE, idx_Tk, w_Tk = route_logits(r_TD, w_router, sel_bias, cfg)

    in_name = "latent" if lat > 0 else "embed"
    width = lat if lat > 0 else d
    tie = cfg.moe_expert_tie_steps
    e_init = _tied_init(init) if tie > 0 else init
    w_gate = self.param("w_gate", nn.with_logical_partitioning(e_init, ("expert", in_name, "mlp")),
                        (e, width, f), pdtype)
    w_up = self.param("w_up", nn.with_logical_partitioning(e_init, ("expert", in_name, "mlp")),
                      (e, width, f), pdtype)
    w_down = self.param("w_down", nn.with_logical_partitioning(e_init, ("expert", "mlp", in_name)),
                        (e, f, width), pdtype)
    if tie > 0 and step is not None:  # train step: every expert computes with (and so is trained as) their mean
      # outside the train step the stored experts are used: equal while tied. A cond, not a where: only the
      # branch taken runs (after step N: none of the mean's work, forward or backward)
      w_gate, w_up, w_down = jax.lax.cond(
          jnp.asarray(step) < tie,
          lambda ws: tuple(jnp.broadcast_to(jnp.mean(w, 0, keepdims=True), w.shape) for w in ws),
          lambda ws: ws, (w_gate, w_up, w_down))
    expert_fn = routed_experts if self.expert_fn is None else self.expert_fn
    x_c = x_TD.astype(dtype)
    if lat > 0:
      w_ld = self.param("latent_down", nn.with_logical_partitioning(init, ("embed", "latent")), (d, lat),
                        pdtype)
      w_lu = self.param("latent_up", nn.with_logical_partitioning(init, ("latent", "embed")), (lat, d),
                        pdtype)
      x_TL = project("td,dl->tl", x_c, w_ld, dtype).astype(dtype)
      z_TL, ep_stats = _split_stats(expert_fn(x_TL, idx_Tk, w_Tk, w_gate, w_up, w_down, cfg))
      if cfg.moe_latent_norm:
        z_TL = RMSNorm(eps=cfg.norm_eps, dtype=dtype, name="latent_norm")(z_TL)
      y_TD = project("tl,ld->td", z_TL, w_lu, dtype)
    else:
      y_TD, ep_stats = _split_stats(expert_fn(x_c, idx_Tk, w_Tk, w_gate, w_up, w_down, cfg))
    y_BTD = y_TD.astype(dtype).reshape(b, t, d)
    if cfg.shared_ff_dim > 0:
      y_BTD = y_BTD + DenseFFN(cfg, cfg.shared_ff_dim, activation=cfg.expert_activation,
                               name="shared")(x_BTD)
    y_BTD = nn.with_logical_constraint(y_BTD, ("act_batch", "act_length", "act_embed"))

    stats = routing_stats(jax.lax.stop_gradient(scores_TE), bias, idx_Tk, token_mask_BT.reshape(-1),
                          cfg, self.n_bins)
    max_over_mean, entropy = load_metrics(stats["counts"])
    if cfg.aux_loss_coef > 0:
      aux_loss = sequence_aux_loss(scores_TE.reshape(b, t, e), idx_Tk.reshape(b, t, -1),
                                   token_mask_BT, cfg)
    else:
      aux_loss = jnp.zeros((), jnp.float32)
    diag = router_diag_sums(jax.lax.stop_gradient(x_TD), jax.lax.stop_gradient(r_TD),
                            jax.lax.stop_gradient(logits_TE), w_T)
    # token-weighted, so a sum over microbatches / shards / num_tokens is the batch's mean shift
    shift_sum = jax.lax.stop_gradient(shift_E) * jnp.sum(w_T)
    return y_BTD, {"aux_loss": aux_loss, "counts": stats["counts"], "hist": stats["hist"], "shift_sum": shift_sum,
                   "load_max_over_mean": max_over_mean, "load_entropy": entropy, **diag, **ep_stats}


def _split_stats(out) -> tuple[jax.Array, dict]:
  """An expert_fn may return (y, stats) — expert parallelism's dispatch counters (ep_drop_fraction,
  ...; parallel/expert.py) — which join this layer's aux."""
  if isinstance(out, tuple):
    y, stats = out
    return y, {k: jax.lax.stop_gradient(v) for k, v in stats.items()}
  return out, {}
