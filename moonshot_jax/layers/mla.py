"""Gated Multi-head Latent Attention (DeepSeek-style MLA with an output gate), Flax Linen.

Shapes: B batch, T query length, S cached length, D d_model, H heads, N qk_nope_head_dim,
R qk_rope_head_dim, V v_head_dim, L kv_lora_rank, C = L + R (one latent row per token).

  q      = x W_q (or RMSNorm(x W_qa) W_qb when cfg.q_lora_rank > 0)    -> [B,T,H,N+R]
  c      = RMSNorm(x W_kva)                                              -> [B,T,L]  (the latent)
  k_rope = x W_krope (one key per token, shared by all heads)            -> [B,T,R]
  k      = [c W_UK | k_rope],  v = c W_UV                                -> [B,T,H,N+R], [B,T,H,V]
  y      = W_o (softmax(q kᵀ / sqrt(N+R) + causal/segment mask) v ⊙ sigmoid(x W_g))

NoPE by default (cfg.mla_use_rope=False, as K3 / Kimi Linear): the rope parts of q and k are ordinary
channels, never rotated, so MLA layers carry no position signal. With cfg.mla_use_rope the rope parts
are rotated (half-split RoPE, theta cfg.rope_theta) at `positions_BT` (default arange).

Methods (all share the parameters made in `setup`):
  __call__(x_BTD, segment_ids_BT=None, positions_BT=None) -> y_BTD
  prefill(x_BTD, segment_ids_BT=None, positions_BT=None) -> (y_BTD, latent_BTC)
      latent_BTC = [c | k_rope] in cfg.dtype, k_rope already rotated when RoPE is on: exactly what
      decode reads back, so the caller writes it into a [B, S_max, C] cache unchanged.
  decode(x_B1D, latent_cache_BSC, cache_len_B, positions_B1=None, cache_start_B=None)
      -> (y_B1D, new_latent_B1C)
      the new token attends to latent_cache_BSC[b, cache_start_B[b]:cache_len_B[b]] (start default 0)
      plus itself, with W_UK absorbed
      into the query and W_UV into the output (`absorbed_attention`), so the per-head keys and values
      are never expanded. The caller writes new_latent_B1C at row position cache_len_B. cache_start_B
      lets a row continue the last document of a packed prefill (start = that document's first row).
      positions_B1 defaults to cache_len_B[:, None] (RoPE only).

Training attention (`causal_attention`): a dense masked softmax for T <= attn_block_size, else a
flash-style blocked path with online softmax and a custom VJP that recomputes probabilities per block
(memory O(T · block) instead of O(T²); fully-masked causal blocks are skipped with lax.cond). Logits,
softmax and norms are fp32; matmuls take cfg.dtype inputs with fp32 accumulation.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from moonshot_jax.config import ModelConfig
from moonshot_jax.layers.linear import project
from moonshot_jax.layers.norms import RMSNorm
from moonshot_jax.layers.rope import apply_rope

_NEG = -1e30  # finite "-inf": exp(_NEG - m) underflows to exactly 0 without NaNs on all-masked blocks
_F32 = jnp.float32


# ---------------------------------------------------------------------------------------------
# Attention cores (pure functions, usable without the module)
# ---------------------------------------------------------------------------------------------
def _block_mask(seg_q_BQ, seg_k_BK, pos_q_Q, pos_k_K) -> jax.Array:
  """[B, 1, Q, K] bool: causal and same segment."""
  causal_QK = pos_k_K[None, :] <= pos_q_Q[:, None]
  same_BQK = seg_q_BQ[:, :, None] == seg_k_BK[:, None, :]
  return (causal_QK[None] & same_BQK)[:, None]


def dense_causal_attention(q_BTHK, k_BTHK, v_BTHV, segment_ids_BT, scale: float) -> jax.Array:
  """Reference masked softmax attention; materialises [B, H, T, T] fp32 logits."""
  T = q_BTHK.shape[1]
  pos_T = jnp.arange(T)
  logits_BHTT = jnp.einsum("bqhd,bkhd->bhqk", q_BTHK, k_BTHK, preferred_element_type=_F32) * scale
  mask_B1TT = _block_mask(segment_ids_BT, segment_ids_BT, pos_T, pos_T)
  probs_BHTT = jax.nn.softmax(jnp.where(mask_B1TT, logits_BHTT, _NEG), axis=-1)
  o_BTHV = jnp.einsum("bhqk,bkhv->bqhv", probs_BHTT.astype(v_BTHV.dtype), v_BTHV,
                      preferred_element_type=_F32)
  return o_BTHV.astype(v_BTHV.dtype)


def _to_blocks(x_BTHD, block: int) -> jax.Array:
  """[B, T, H, D] -> [nb, B, H, block, D] (T zero-padded to a multiple of block)."""
  B, T, H, D = x_BTHD.shape
  nb = -(-T // block)
  x = jnp.pad(x_BTHD, ((0, 0), (0, nb * block - T), (0, 0), (0, 0)))
  return x.reshape(B, nb, block, H, D).transpose(1, 0, 3, 2, 4)


def _from_blocks(x_nBHQD, T: int) -> jax.Array:
  nb, B, H, Q, D = x_nBHQD.shape
  return x_nBHQD.transpose(1, 0, 3, 2, 4).reshape(B, nb * Q, H, D)[:, :T]


def _seg_blocks(seg_BT, block: int) -> jax.Array:
  """[B, T] -> [nb, B, block]; pad tokens sit after every real token, so causality hides them."""
  B, T = seg_BT.shape
  nb = -(-T // block)
  seg = jnp.pad(seg_BT, ((0, 0), (0, nb * block - T)), constant_values=-1)
  return seg.reshape(B, nb, block).transpose(1, 0, 2)


def _flash_forward(q_BTHK, k_BTHK, v_BTHV, seg_BT, scale, block):
  qb, kb, vb, sb = (_to_blocks(q_BTHK, block), _to_blocks(k_BTHK, block), _to_blocks(v_BTHV, block),
                    _seg_blocks(seg_BT, block))
  nb, B, H, Q, _ = qb.shape
  Vd = vb.shape[-1]
  idx = jnp.arange(nb)
  off = jnp.arange(block)

  def one_query_block(xs):
    q_i, seg_i, i = xs

    def kv_step(carry, ys):
      k_j, v_j, seg_j, j = ys

      def attend(carry):
        m_BHQ, l_BHQ, acc_BHQV = carry
        s = jnp.einsum("bhqd,bhkd->bhqk", q_i, k_j, preferred_element_type=_F32) * scale
        mask = _block_mask(seg_i, seg_j, i * block + off, j * block + off)
        s = jnp.where(mask, s, _NEG)
        m_new = jnp.maximum(m_BHQ, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m_BHQ - m_new)
        acc = acc_BHQV * corr[..., None] + jnp.einsum(
            "bhqk,bhkv->bhqv", p.astype(v_j.dtype), v_j, preferred_element_type=_F32)
        return m_new, l_BHQ * corr + p.sum(-1), acc

      return jax.lax.cond(j <= i, attend, lambda c: c, carry), None

    init = (jnp.full((B, H, Q), _NEG, _F32), jnp.zeros((B, H, Q), _F32), jnp.zeros((B, H, Q, Vd), _F32))
    (m, l, acc), _ = jax.lax.scan(kv_step, init, (kb, vb, sb, idx))
    return acc / l[..., None], m + jnp.log(l)  # every row sees at least itself, so l > 0

  o_nBHQV, lse_nBHQ = jax.lax.map(one_query_block, (qb, sb, idx))
  return o_nBHQV, lse_nBHQ


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def flash_causal_attention(q_BTHK, k_BTHK, v_BTHV, segment_ids_BT, scale: float, block: int):
  """Blocked causal+segment attention, O(T·block) memory in forward and backward."""
  o_nBHQV, _ = _flash_forward(q_BTHK, k_BTHK, v_BTHV, segment_ids_BT, scale, block)
  return _from_blocks(o_nBHQV, q_BTHK.shape[1]).astype(v_BTHV.dtype)


def _flash_fwd_rule(q, k, v, seg, scale, block):
  o_nBHQV, lse_nBHQ = _flash_forward(q, k, v, seg, scale, block)
  o = _from_blocks(o_nBHQV, q.shape[1]).astype(v.dtype)
  return o, (q, k, v, seg, o, lse_nBHQ)


def _flash_bwd_rule(scale, block, res, do_BTHV):
  q, k, v, seg, o, lse = res
  T = q.shape[1]
  qb, kb, vb, sb = _to_blocks(q, block), _to_blocks(k, block), _to_blocks(v, block), _seg_blocks(seg, block)
  dob = _to_blocks(do_BTHV.astype(_F32), block)
  delta_nBHQ = jnp.sum(dob * _to_blocks(o.astype(_F32), block), axis=-1)  # rowsum(dO ⊙ O)
  nb = qb.shape[0]
  idx = jnp.arange(nb)
  off = jnp.arange(block)

  def probs_and_dlogits(q_i, k_j, v_j, seg_i, seg_j, i, j, lse_i, do_i, delta_i):
    s = jnp.einsum("bhqd,bhkd->bhqk", q_i, k_j, preferred_element_type=_F32) * scale
    mask = _block_mask(seg_i, seg_j, i * block + off, j * block + off)
    p = jnp.where(mask, jnp.exp(s - lse_i[..., None]), 0.0)
    dp = jnp.einsum("bhqv,bhkv->bhqk", do_i, v_j.astype(_F32))
    return p, p * (dp - delta_i[..., None])

  # dK, dV: each key block j accumulates over the query blocks i >= j.
  def one_key_block(xs):
    k_j, v_j, seg_j, j = xs

    def q_step(carry, ys):
      q_i, seg_i, lse_i, do_i, delta_i, i = ys

      def grads(carry):
        dk, dv = carry
        p, ds = probs_and_dlogits(q_i, k_j, v_j, seg_i, seg_j, i, j, lse_i, do_i, delta_i)
        dv = dv + jnp.einsum("bhqk,bhqv->bhkv", p, do_i)
        dk = dk + jnp.einsum("bhqk,bhqd->bhkd", ds, q_i.astype(_F32)) * scale
        return dk, dv

      return jax.lax.cond(i >= j, grads, lambda c: c, carry), None

    init = (jnp.zeros(k_j.shape, _F32), jnp.zeros(v_j.shape, _F32))
    (dk, dv), _ = jax.lax.scan(q_step, init, (qb, sb, lse, dob, delta_nBHQ, idx))
    return dk, dv

  # dQ: each query block i accumulates over the key blocks j <= i.
  def one_query_block(xs):
    q_i, seg_i, lse_i, do_i, delta_i, i = xs

    def k_step(dq, ys):
      k_j, v_j, seg_j, j = ys

      def grads(dq):
        _, ds = probs_and_dlogits(q_i, k_j, v_j, seg_i, seg_j, i, j, lse_i, do_i, delta_i)
        return dq + jnp.einsum("bhqk,bhkd->bhqd", ds, k_j.astype(_F32)) * scale

      return jax.lax.cond(j <= i, grads, lambda c: c, dq), None

    dq, _ = jax.lax.scan(k_step, jnp.zeros(q_i.shape, _F32), (kb, vb, sb, idx))
    return dq

  dkb, dvb = jax.lax.map(one_key_block, (kb, vb, sb, idx))
  dqb = jax.lax.map(one_query_block, (qb, sb, lse, dob, delta_nBHQ, idx))
  return (_from_blocks(dqb, T).astype(q.dtype), _from_blocks(dkb, T).astype(k.dtype),
          _from_blocks(dvb, T).astype(v.dtype), None)


flash_causal_attention.defvjp(_flash_fwd_rule, _flash_bwd_rule)


def causal_attention(q_BTHK, k_BTHK, v_BTHV, segment_ids_BT, scale: float, block: int) -> jax.Array:
  """Dense path for T <= block, flash path beyond (same math)."""
  if q_BTHK.shape[1] <= block:
    return dense_causal_attention(q_BTHK, k_BTHK, v_BTHV, segment_ids_BT, scale)
  return flash_causal_attention(q_BTHK, k_BTHK, v_BTHV, segment_ids_BT, scale, block)


def absorbed_attention(q_nope_BHN, q_rope_BHR, w_uk_LHN, w_uv_LHV, latent_cache_BSC, cache_len_B,
                       new_latent_BC, scale: float, cache_start_B=None) -> jax.Array:
  """One query token per row over a latent cache, with W_UK / W_UV absorbed; returns o_BHV.

  score(s) = (q_nope W_UKᵀ) · c_s + q_rope · k_rope_s, o = (Σ_s p_s c_s) W_UV: identical to expanding
  k_nope = c W_UK and v = c W_UV per head, at O(S·C) per head instead of O(S·(N+V)) plus expansion.
  Keys are cache rows cache_start_B[b] <= s < cache_len_B[b] (start default 0) and the new token's
  own latent (new_latent_BC None: it is already a cache row below cache_len_B).
  """
  L = w_uk_LHN.shape[0]
  dtype = latent_cache_BSC.dtype
  q_lat_BHL = jnp.einsum("bhn,lhn->bhl", q_nope_BHN, w_uk_LHN, preferred_element_type=_F32).astype(dtype)
  q_rope_BHR = q_rope_BHR.astype(dtype)
  # both products read the whole [c | k_rope] rows: slicing the cache into c and k_rope would copy it
  # every step (session 16 profile); the extra rope columns of the value product are dropped after
  q_BHC = jnp.concatenate([q_lat_BHL, q_rope_BHR], axis=-1)
  logits_BHS = jnp.einsum("bhc,bsc->bhs", q_BHC, latent_cache_BSC, preferred_element_type=_F32) * scale
  s_S = jnp.arange(latent_cache_BSC.shape[1])
  valid_BS = s_S[None, :] < cache_len_B[:, None]
  if cache_start_B is not None:
    valid_BS &= s_S[None, :] >= cache_start_B[:, None]
  logits_BHS = jnp.where(valid_BS[:, None, :], logits_BHS, _NEG)
  if new_latent_BC is None:
    p_BHS = jax.nn.softmax(logits_BHS, axis=-1)
  else:
    c_new_BL, kr_new_BR = new_latent_BC[..., :L], new_latent_BC[..., L:]
    logit_new_BH = (jnp.einsum("bhl,bl->bh", q_lat_BHL, c_new_BL, preferred_element_type=_F32)
                    + jnp.einsum("bhr,br->bh", q_rope_BHR, kr_new_BR, preferred_element_type=_F32)) * scale
    probs = jax.nn.softmax(jnp.concatenate([logits_BHS, logit_new_BH[..., None]], axis=-1), axis=-1)
    p_BHS, p_new_BH = probs[..., :-1], probs[..., -1]
  o_lat_BHL = jnp.einsum("bhs,bsc->bhc", p_BHS.astype(dtype), latent_cache_BSC, preferred_element_type=_F32)[..., :L]
  if new_latent_BC is not None:
    o_lat_BHL = o_lat_BHL + p_new_BH[..., None] * c_new_BL[:, None, :].astype(_F32)
  o_BHV = jnp.einsum("bhl,lhv->bhv", o_lat_BHL.astype(dtype), w_uv_LHV.astype(dtype),
                     preferred_element_type=_F32)
  return o_BHV.astype(dtype)


# ---------------------------------------------------------------------------------------------
# The module
# ---------------------------------------------------------------------------------------------
def _check_x(x, d_model: int, name: str, length: int | None = None) -> None:
  if x.ndim != 3 or x.shape[-1] != d_model or (length is not None and x.shape[1] != length):
    t = "T" if length is None else str(length)
    raise ValueError(f"{name}: expected [B, {t}, d_model={d_model}], got shape {x.shape}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name}: expected a floating dtype, got {x.dtype}")


def _check_ids(ids, shape, name: str) -> None:
  if ids is None:
    return
  if ids.shape != tuple(shape) or not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"{name}: expected integer array of shape {tuple(shape)}, got {ids.dtype}{ids.shape}")


class MLA(nn.Module):
  """Gated MLA mixer; see the module docstring for the math and the cache layout."""
  cfg: ModelConfig
  attn_block_size: int = 512  # dense attention up to this T, flash-style blocks beyond

  def setup(self) -> None:
    cfg = self.cfg
    D, H, N, R, V, L = (cfg.d_model, cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                        cfg.v_head_dim, cfg.kv_lora_rank)
    pdt = jnp.dtype(cfg.param_dtype)
    init = nn.initializers.normal(stddev=cfg.init_std)

    def param(name, shape, names):
      return self.param(name, nn.with_logical_partitioning(init, names), shape, pdt)

    if cfg.q_lora_rank > 0:
      self.wq_a = param("wq_a", (D, cfg.q_lora_rank), ("embed", "q_lora"))
      self.q_norm = RMSNorm(eps=cfg.norm_eps, dtype=jnp.dtype(cfg.dtype))
      self.wq_b = param("wq_b", (cfg.q_lora_rank, H, N + R), ("q_lora", "heads", "head_dim"))
    else:
      self.wq = param("wq", (D, H, N + R), ("embed", "heads", "head_dim"))
    self.wkv_a = param("wkv_a", (D, L), ("embed", "kv_lora"))
    if R > 0:
      self.wk_rope = param("wk_rope", (D, R), ("embed", "head_dim"))
    self.kv_norm = RMSNorm(eps=cfg.norm_eps, dtype=jnp.dtype(cfg.dtype))
    self.w_uk = param("w_uk", (L, H, N), ("kv_lora", "heads", "head_dim"))
    self.w_uv = param("w_uv", (L, H, V), ("kv_lora", "heads", "head_dim"))
    if cfg.mla_output_gate:
      self.w_gate = param("w_gate", (D, H, V), ("embed", "heads", "head_dim"))
    self.wo = param("wo", (H, V, D), ("heads", "head_dim", "embed"))

  # -- pieces ----------------------------------------------------------------------------------
  @property
  def _dtype(self):
    return jnp.dtype(self.cfg.dtype)

  @property
  def _scale(self) -> float:
    return (self.cfg.qk_nope_head_dim + self.cfg.qk_rope_head_dim) ** -0.5

  def _w(self, w):
    return w.astype(self._dtype)

  def _rope(self, x_BTHR, positions_BT):
    if not self.cfg.mla_use_rope or x_BTHR.shape[-1] == 0:
      return x_BTHR
    return apply_rope(x_BTHR, positions_BT, self.cfg.rope_theta)

  def _query(self, x_BTD, positions_BT):
    """-> q_nope [B,T,H,N], q_rope [B,T,H,R] (rotated if RoPE)."""
    if self.cfg.q_lora_rank > 0:
      cq = self.q_norm(project("btd,dr->btr", x_BTD, self.wq_a, self._dtype))
      q = project("btr,rhk->bthk", cq, self.wq_b, self._dtype)
    else:
      q = project("btd,dhk->bthk", x_BTD, self.wq, self._dtype)
    q = nn.with_logical_constraint(q.astype(self._dtype), ("act_batch", "act_length", "act_heads", None))
    N = self.cfg.qk_nope_head_dim
    return q[..., :N], self._rope(q[..., N:], positions_BT)

  def _latent(self, x_BTD, positions_BT):
    """-> latent [B,T,C] = [RMSNorm(x W_kva) | rotated k_rope] in cfg.dtype."""
    c = self.kv_norm(project("btd,dl->btl", x_BTD, self.wkv_a, self._dtype))
    if self.cfg.qk_rope_head_dim == 0:
      return c
    kr = project("btd,dr->btr", x_BTD, self.wk_rope, self._dtype)
    kr = self._rope(kr.astype(self._dtype)[:, :, None, :], positions_BT)[:, :, 0, :]
    return jnp.concatenate([c.astype(self._dtype), kr], axis=-1)

  def _output(self, o_BTHV, x_BTD):
    if self.cfg.mla_output_gate:  # per head and channel, full rank: the "gated" in Gated MLA
      g = project("btd,dhv->bthv", x_BTD, self.w_gate, self._dtype)
      o_BTHV = (o_BTHV.astype(_F32) * jax.nn.sigmoid(g)).astype(self._dtype)
    y = project("bthv,hvd->btd", o_BTHV, self.wo, self._dtype)
    return nn.with_logical_constraint(y.astype(self._dtype), ("act_batch", "act_length", "act_embed"))

  def _prepare(self, x_BTD, segment_ids_BT, positions_BT):
    _check_x(x_BTD, self.cfg.d_model, "x_BTD")
    B, T, _ = x_BTD.shape
    _check_ids(segment_ids_BT, (B, T), "segment_ids_BT")
    _check_ids(positions_BT, (B, T), "positions_BT")
    if segment_ids_BT is None:
      segment_ids_BT = jnp.zeros((B, T), jnp.int32)
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    x = nn.with_logical_constraint(x_BTD.astype(self._dtype), ("act_batch", "act_length", "act_embed"))
    return x, segment_ids_BT, positions_BT

  # -- public API ------------------------------------------------------------------------------
  def prefill(self, x_BTD, segment_ids_BT=None, positions_BT=None):
    x, seg, pos = self._prepare(x_BTD, segment_ids_BT, positions_BT)
    L, H = self.cfg.kv_lora_rank, self.cfg.mla_num_heads
    q_nope, q_rope = self._query(x, pos)
    latent_BTC = self._latent(x, pos)
    c_BTL, kr_BTR = latent_BTC[..., :L], latent_BTC[..., L:]
    k_nope = project("btl,lhn->bthn", c_BTL, self.w_uk, self._dtype)
    v_BTHV = project("btl,lhv->bthv", c_BTL, self.w_uv, self._dtype)
    kr_BTHR = jnp.broadcast_to(kr_BTR[:, :, None, :], kr_BTR.shape[:2] + (H, kr_BTR.shape[-1]))
    q_BTHK = jnp.concatenate([q_nope, q_rope], axis=-1)
    k_BTHK = jnp.concatenate([k_nope.astype(self._dtype), kr_BTHR], axis=-1)
    o_BTHV = causal_attention(q_BTHK, k_BTHK, v_BTHV.astype(self._dtype), seg, self._scale,
                              self.attn_block_size)
    return self._output(o_BTHV, x), latent_BTC

  def __call__(self, x_BTD, segment_ids_BT=None, positions_BT=None):
    return self.prefill(x_BTD, segment_ids_BT, positions_BT)[0]

  def decode(self, x_B1D, latent_cache_BSC, cache_len_B, positions_B1=None, cache_start_B=None, write_at_B=None):
    """-> (out, the new token's latent [B, 1, C]). With write_at_B: the new latent is first written into
    the cache at row write_at_B[b] (out of range: not written) and attended from there (rows below
    cache_len_B + 1); returns (out, the updated cache). A decode loop that carries the cache then
    updates it in place: reading the old buffer after the write made XLA copy it every step."""
    cfg = self.cfg
    _check_x(x_B1D, cfg.d_model, "x_B1D", length=1)
    B = x_B1D.shape[0]
    C = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    if latent_cache_BSC.ndim != 3 or latent_cache_BSC.shape[0] != B or latent_cache_BSC.shape[2] != C:
      raise ValueError(f"latent_cache_BSC: expected [B={B}, S, C={C}], got shape {latent_cache_BSC.shape}")
    _check_ids(cache_len_B, (B,), "cache_len_B")
    _check_ids(positions_B1, (B, 1), "positions_B1")
    _check_ids(cache_start_B, (B,), "cache_start_B")
    if positions_B1 is None:
      positions_B1 = cache_len_B.astype(jnp.int32)[:, None]
    x = x_B1D.astype(self._dtype)
    q_nope, q_rope = self._query(x, positions_B1)
    new_latent_B1C = self._latent(x, positions_B1)
    if write_at_B is not None:
      _check_ids(write_at_B, (B,), "write_at_B")
      cache = latent_cache_BSC.at[jnp.arange(B), write_at_B].set(
          new_latent_B1C[:, 0].astype(latent_cache_BSC.dtype), mode="drop")
      o_BHV = absorbed_attention(q_nope[:, 0], q_rope[:, 0], self._w(self.w_uk), self._w(self.w_uv),
                                 cache.astype(self._dtype), cache_len_B + 1, None, self._scale, cache_start_B)
      return self._output(o_BHV[:, None], x), cache
    o_BHV = absorbed_attention(q_nope[:, 0], q_rope[:, 0], self._w(self.w_uk), self._w(self.w_uv),
                               latent_cache_BSC.astype(self._dtype), cache_len_B, new_latent_B1C[:, 0],
                               self._scale, cache_start_B)
    return self._output(o_BHV[:, None], x), new_latent_B1C
