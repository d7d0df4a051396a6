"""Block Attention Residuals (Kimi Team, "Attention Residuals"): learned depth-wise mixing of sources.

Instead of x_{l+1} = x_l + f(x_l), every sublayer input is a softmax mix of *sources*
    x = sum_i softmax_i(w . rmsnorm(v_i)) * v_i
with one learned pseudo-query w in R^d per mixing site (zero-initialised: uniform mixing at init).
RMSNorm is folded into the score only (values v_i stay un-normalised) and has no scale (it would be
redundant with w); scores, softmax and the weighted sum run in fp32.

Sources (Block AttnRes). Layers are grouped in blocks of cfg.attn_res_block_size decoder layers.
  * slot 0: the token embedding;
  * slots 1..: the *completed* block sums, b_n = sum of every attention and FFN output of block n;
  * the current *partial* sum of the running block.
Conventions (pinned by tests/test_attn_res.py):
  * The partial sum starts EMPTY at the start of every block and is excluded from the softmax while
    empty. So the first attention site of a block sees [emb, b_1..b_n] only; the FFN site right after
    it also sees that attention's output as the partial sum.
  * A block is COMPLETED right after its last layer's FFN output is added, i.e. after layer l with
    (l + 1) % block_size == 0, and also after the model's last layer (a short final block), see
    `is_block_end`. The partial then moves into the next buffer slot and is reset to empty.
  * Sites: one before each attention and each FFN (2 per layer) plus a final one before the output
    norm, which sees [emb, all block sums] = cfg.num_attn_res_sites = 2 * n_layers + 1 sites.
  * With a single block covering all layers this is full (per-sublayer-sum) attention over
    [emb, running sum]; block size 1 gives [emb, one sum per layer, partial].

Static shapes (so it runs under nn.scan over layers and inside pipeline stages, with the state
travelling with the activations): `buffer` is [N_slots, B, T, D] with N_slots = 1 + n_blocks
(n_blocks = ceil(n_layers / block_size)) plus `partial` [B, T, D], so N_max = 1 + n_blocks + 1
sources; `mask` [N_slots] marks filled slots, `count` the completed blocks, `partial_valid` whether
the partial sum is non-empty. Every update uses where/dynamic_update_slice, so the layer index and
the block-end flag may be traced.

Use in a layer stack (the model code owns the cfg.attn_res=False branch):
    state = AttnResState.init(emb_BTD, cfg)
    for l in layers:
      x = AttnResMix(cfg)(state)  # attention site
      state = add_output(state, attn(x), cfg, block_end=False)
      x = AttnResMix(cfg)(state)  # FFN site
      state = add_output(state, ffn(x), cfg, block_end=is_block_end(l, cfg))
    x = AttnResMix(cfg, name="final_site")(state)   # then the output norm
For memory: under a per-layer scan the carried buffer is saved per layer for the backward pass
(n_layers * N_slots activations); scanning over blocks (outer scan carries the state, the inner scan
over a block's layers only changes `partial` via `accumulate`, then one `complete_block`) keeps the
buffer constant inside the block and saves it once per block.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from moonshot_jax.config import ModelConfig
from moonshot_jax.layers.varying import same_varying


def num_blocks(cfg: ModelConfig) -> int:
  return -(-cfg.n_layers // cfg.attn_res_block_size)


def num_slots(cfg: ModelConfig) -> int:
  """Buffer slots: the embedding plus one per block (the partial sum is kept separately)."""
  return 1 + num_blocks(cfg)


def is_block_end(layer_idx: jax.Array | int, cfg: ModelConfig) -> jax.Array:
  """True after the FFN of the last layer of a block (0-indexed `layer_idx`, may be traced)."""
  layer_idx = jnp.asarray(layer_idx)
  return ((layer_idx + 1) % cfg.attn_res_block_size == 0) | (layer_idx == cfg.n_layers - 1)


@flax.struct.dataclass
class AttnResState:
  buffer: jax.Array  # [N_slots, B, T, D] embedding + completed block sums (unfilled slots are 0)
  mask: jax.Array  # [N_slots] bool, filled slots
  partial: jax.Array  # [B, T, D] running sum of the current block (0 while empty)
  partial_valid: jax.Array  # [] bool, the partial sum holds at least one output
  count: jax.Array  # [] int32, completed blocks (next block goes to slot 1 + count)

  @classmethod
  def init(cls, emb_BTD: jax.Array, cfg: ModelConfig, dtype=jnp.float32) -> "AttnResState":
    """Fresh state holding only the embedding. `dtype` is the storage dtype of the sources
    (fp32 by default: the partial sum accumulates up to 2 * block_size outputs)."""
    if emb_BTD.ndim != 3 or emb_BTD.shape[-1] != cfg.d_model:
      raise ValueError(f"emb_BTD: expected [B, T, d_model={cfg.d_model}], got shape {emb_BTD.shape}")
    n = num_slots(cfg)
    emb = emb_BTD.astype(dtype)
    buffer = jnp.zeros((n,) + emb.shape, dtype).at[0].set(emb)
    return cls(buffer=buffer, mask=jnp.arange(n) == 0, partial=jnp.zeros_like(emb),
               partial_valid=jnp.array(False), count=jnp.array(0, jnp.int32))


def accumulate(state: AttnResState, y_BTD: jax.Array) -> AttnResState:
  """Add one sublayer output to the partial sum of the current block."""
  if y_BTD.shape != state.partial.shape:
    raise ValueError(f"y_BTD: expected shape {state.partial.shape}, got {y_BTD.shape}")
  partial = jnp.where(state.partial_valid, state.partial, 0) + y_BTD.astype(state.partial.dtype)
  return state.replace(partial=partial, partial_valid=jnp.array(True))


def complete_block(state: AttnResState, block_end: jax.Array | bool = True) -> AttnResState:
  """Where `block_end` (may be traced): move the partial sum into slot 1 + count, empty it.
  An empty partial sum never completes a block."""
  block_end = jnp.asarray(block_end, bool) & state.partial_valid
  n = state.buffer.shape[0]
  slot = jnp.minimum(1 + state.count, n - 1)  # the clamp only matters if called too often
  old = jax.lax.dynamic_index_in_dim(state.buffer, slot, 0, keepdims=False)
  new = jnp.where(block_end, state.partial, old)
  buffer = jax.lax.dynamic_update_index_in_dim(state.buffer, new, slot, 0)
  mask = state.mask | (block_end & (jnp.arange(n) == slot))
  return state.replace(buffer=buffer, mask=mask,
                       partial=jnp.where(block_end, jnp.zeros_like(state.partial), state.partial),
                       partial_valid=state.partial_valid & ~block_end,
                       count=state.count + block_end.astype(jnp.int32))


def add_output(state: AttnResState, y_BTD: jax.Array, cfg: ModelConfig,
               block_end: jax.Array | bool) -> AttnResState:
  """Add a sublayer output, then complete the block if `block_end` (pass False after attention,
  `is_block_end(layer_idx, cfg)` after the FFN)."""
  del cfg  # kept in the signature so callers need not know which fields matter
  return complete_block(accumulate(state, y_BTD), block_end)


# The mix with a hand-written VJP: autodiff of the einsum form ran the score gradient as [B·T]
# batched 1xDxN dots behind transposed copies of the buffer; here every step is elementwise or a
# reduce over D, one buffer slot per loop iteration (a loop, not unrolled, so the program stays
# the same size whatever the number of blocks; step times in WORKSPACE_NOTES). For source n (the
# buffer slots and the partial sum):
#   a_n = v_n . w,  r_n = rsqrt(mean(v_n^2) + eps),  s_n = a_n r_n (-inf if invalid),  p = softmax_n(s)
#   out = sum_n p_n v_n
#   ds_n = p_n (dout . v_n - dout . out)
#   dv_n = p_n dout + ds_n r_n w - ds_n a_n r_n^3 / D v_n,   dw = sum_{n,b,t} ds_n r_n v_n
def _score_parts(v, query_D, eps):
  v = v.astype(jnp.float32)
  return jnp.sum(v * query_D, -1), jax.lax.rsqrt(jnp.mean(v * v, -1) + eps)


def _mix_parts(buffer_NBTD, partial_BTD, mask_N, partial_valid, query_D, eps):
  # one token per row (decode): the loops' per-slot dispatch costs more than their work, so they are
  # unrolled / vectorised (same ops in the same order); training keeps the loops
  small = buffer_NBTD.shape[2] == 1
  score = lambda v: _score_parts(v, query_D, eps)
  a_N, r_N = (jax.vmap(score) if small else functools.partial(jax.lax.map, score))(buffer_NBTD)  # [N, B, T] each
  a_p, r_p = _score_parts(partial_BTD, query_D, eps)
  s_N = jnp.where(mask_N[:, None, None], a_N * r_N, -jnp.inf)
  s_p = jnp.where(partial_valid, a_p * r_p, -jnp.inf)
  # slot 0 (embedding) is always valid, so the max is finite and the softmax well defined
  m_BT = jnp.maximum(jnp.max(s_N, 0), s_p)
  e_N, e_p = jnp.exp(s_N - m_BT), jnp.exp(s_p - m_BT)
  z_BT = jnp.sum(e_N, 0) + e_p
  p_N, p_p = e_N / z_BT, e_p / z_BT
  out = jax.lax.fori_loop(0, buffer_NBTD.shape[0],
                          lambda n, o: o + p_N[n][..., None] * buffer_NBTD[n].astype(jnp.float32),
                          p_p[..., None] * partial_BTD.astype(jnp.float32), unroll=small)
  return out, (a_N, r_N, p_N, a_p, r_p, p_p)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _mix(buffer_NBTD, partial_BTD, mask_N, partial_valid, query_D, eps):
  return _mix_parts(buffer_NBTD, partial_BTD, mask_N, partial_valid, query_D, eps)[0]


def _mix_fwd(buffer_NBTD, partial_BTD, mask_N, partial_valid, query_D, eps):
  out, parts = _mix_parts(buffer_NBTD, partial_BTD, mask_N, partial_valid, query_D, eps)
  return out, (buffer_NBTD, partial_BTD, query_D, out) + parts


def _mix_bwd(eps, res, dout_BTD):
  buffer_NBTD, partial_BTD, query_D, out, a_N, r_N, p_N, a_p, r_p, p_p = res
  c_BT = jnp.sum(dout_BTD * out, -1)

  def source(v, p, a, r):  # -> (dv, this source's part of dw)
    v = v.astype(jnp.float32)
    ds = p * (jnp.sum(dout_BTD * v, -1) - c_BT)
    dv = (p[..., None] * dout_BTD + (ds * r)[..., None] * query_D
          - (ds * a * r ** 3 / v.shape[-1])[..., None] * v)
    return dv, jnp.sum((ds * r)[..., None] * v, axis=(0, 1))

  def slot(dq, xs):
    dv, dq_n = source(*xs)
    return dq + dq_n, dv.astype(buffer_NBTD.dtype)

  dpartial, dq = source(partial_BTD, p_p, a_p, r_p)
  dq, dbuffer = jax.lax.scan(slot, dq, (buffer_NBTD, p_N, a_N, r_N))
  return dbuffer, dpartial.astype(partial_BTD.dtype), None, None, dq


_mix.defvjp(_mix_fwd, _mix_bwd)


def attn_res_mix(state: AttnResState, query_D: jax.Array, eps: float) -> jax.Array:
  """softmax over valid sources of w . rmsnorm(v_i), applied to the raw v_i. Returns fp32 [B,T,D]."""
  buffer, partial, query = same_varying(state.buffer, state.partial, query_D.astype(jnp.float32))
  return _mix(buffer, partial, state.mask, state.partial_valid, query, float(eps))


class AttnResMix(nn.Module):
  """One mixing site: param "query" [d] (fp32, zero-init, logical ("norm",)). Returns [B, T, D]
  in cfg.dtype, ready for the sublayer's pre-norm."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, state: AttnResState) -> jax.Array:
    cfg = self.cfg
    if state.buffer.shape[-1] != cfg.d_model:
      raise ValueError(f"state: expected sources of width d_model={cfg.d_model}, "
                       f"got buffer shape {state.buffer.shape}")
    query = self.param("query", nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)),
                       (cfg.d_model,), jnp.float32)
    x = attn_res_mix(state, query, cfg.norm_eps).astype(jnp.dtype(cfg.dtype))
    return nn.with_logical_constraint(x, ("act_batch", "act_length", "act_embed"))
