"""Packed bidirectional attention: many images in one sequence, each attending only within itself.

  out[n] = softmax_m( q[n] . k[m] * scale  over m with seg[m] == seg[n] ) v[m]

`packed_attention` is the blocked (flash-style) path: the sequence is cut into blocks of `block`
rows, every query block walks only the key blocks its segments touch with an online softmax, and
the backward recomputes the probabilities block by block from the saved log-sum-exp. Memory is
O(N * block), never [N, N], so a 16,384-patch image fits; packing many small images also skips
every block pair that no segment shares. `reference_packed_attention` is the dense definition.

Segments must be contiguous runs (the layout in vision/layout.py packs images one after another).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moonshot_jax.vision.config import ATTN_BACKWARDS as BACKWARDS

_NEG = -1e30  # finite, so a row with no key in a block keeps exp(0) * 0 contributions, never NaN


def reference_packed_attention(q_NHD, k_NHD, v_NHD, seg_N):
  """Dense [H, N, N] version (test oracle, small N only)."""
  scale = q_NHD.shape[-1] ** -0.5
  s = jnp.einsum("nhd,mhd->hnm", q_NHD.astype(jnp.float32), k_NHD.astype(jnp.float32)) * scale
  mask = seg_N[:, None] == seg_N[None, :]
  p = jax.nn.softmax(jnp.where(mask[None], s, -jnp.inf), axis=-1)
  return jnp.einsum("hnm,mhd->nhd", p, v_NHD.astype(jnp.float32)).astype(q_NHD.dtype)


def _segment_bounds(seg_N):
  """First and last row of each row's (contiguous) segment."""
  n = seg_N.shape[0]
  ar = jnp.arange(n)
  starts = jnp.concatenate([jnp.ones((1,), bool), seg_N[1:] != seg_N[:-1]])
  ends = jnp.concatenate([seg_N[1:] != seg_N[:-1], jnp.ones((1,), bool)])
  first = jax.lax.cummax(jnp.where(starts, ar, 0))
  last = jax.lax.cummin(jnp.where(ends, ar, n - 1), reverse=True)
  return first, last


def _block_ranges(seg_N, block):
  """Per block b: [lo, hi) of the blocks holding any row that shares a segment with block b."""
  first, last = _segment_bounds(seg_N)
  nb = seg_N.shape[0] // block
  lo = first.reshape(nb, block)[:, 0] // block
  hi = last.reshape(nb, block)[:, -1] // block + 1
  return lo, hi


def _pad(x, n_pad, fill):
  return jnp.pad(x, [(0, n_pad)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)


def _blocks(x, block):
  return x.reshape((x.shape[0] // block, block) + x.shape[1:])


def _scores(q_bHD, k_bHD, sq_b, sk_b, scale):
  s = jnp.einsum("qhd,khd->hqk", q_bHD, k_bHD, preferred_element_type=jnp.float32) * scale
  mask = (sq_b[:, None] == sk_b[None, :])[None]
  return s, mask


def _forward(q, k, v, seg, block):
  scale = q.shape[-1] ** -0.5
  nb = q.shape[0] // block
  lo, hi = _block_ranges(seg, block)
  qb, sb = _blocks(q, block), _blocks(seg, block)
  H, D = q.shape[1], v.shape[2]

  def one_q_block(i):
    q_i, s_i = qb[i], sb[i]

    def body(j, carry):
      m, l, acc = carry
      k_j = jax.lax.dynamic_slice_in_dim(k, j * block, block)
      v_j = jax.lax.dynamic_slice_in_dim(v, j * block, block)
      s_j = jax.lax.dynamic_slice_in_dim(seg, j * block, block)
      s, mask = _scores(q_i, k_j, s_i, s_j, scale)
      s = jnp.where(mask, s, _NEG)
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
      alpha = jnp.exp(m - m_new)
      acc = acc * alpha[..., None] + jnp.einsum("hqk,khd->hqd", p, v_j.astype(jnp.float32))
      return m_new, l * alpha + p.sum(-1), acc

    init = (jnp.full((H, block), _NEG, jnp.float32), jnp.zeros((H, block), jnp.float32),
            jnp.zeros((H, block, D), jnp.float32))
    m, l, acc = jax.lax.fori_loop(lo[i], hi[i], body, init)
    out = acc / l[..., None]
    return jnp.swapaxes(out, 0, 1), jnp.swapaxes(m + jnp.log(l), 0, 1)  # [b, H, D], [b, H]

  out, lse = jax.lax.map(one_q_block, jnp.arange(nb))
  return out.reshape(q.shape[0], H, D), lse.reshape(q.shape[0], H)


def _backward(q, k, v, seg, out, lse, dout, block, fused=False):
  scale = q.shape[-1] ** -0.5
  nb = q.shape[0] // block
  lo, hi = _block_ranges(seg, block)
  f32 = jnp.float32
  delta = jnp.sum(dout.astype(f32) * out.astype(f32), -1)  # [N, H]

  def sl(x, j):
    return jax.lax.dynamic_slice_in_dim(x, j * block, block)

  def probs(i, j):
    """p, ds of query block i against key block j ([H, bq, bk])."""
    q_i, k_j, v_j, do_i = sl(q, i), sl(k, j), sl(v, j), sl(dout, i)
    s, mask = _scores(q_i, k_j, sl(seg, i), sl(seg, j), scale)
    p = jnp.where(mask, jnp.exp(s - jnp.swapaxes(sl(lse, i), 0, 1)[..., None]), 0.0)
    dp = jnp.einsum("qhd,khd->hqk", do_i, v_j, preferred_element_type=f32)
    ds = p * (dp - jnp.swapaxes(sl(delta, i), 0, 1)[..., None])
    return p, ds

  def dq_term(j, ds):
    return jnp.einsum("hqk,khd->qhd", ds, sl(k, j).astype(f32)) * scale

  def dkv_terms(i, p, ds):
    return (jnp.einsum("hqk,qhd->khd", ds, sl(q, i).astype(f32)) * scale,
            jnp.einsum("hqk,qhd->khd", p, sl(dout, i).astype(f32)))

  def dq_block(i):
    def body(j, dq):
      _, ds = probs(i, j)
      return dq + dq_term(j, ds)
    return jax.lax.fori_loop(lo[i], hi[i], body, jnp.zeros((block,) + q.shape[1:], f32))

  def dkv_block(j):
    def body(i, carry):
      dk, dv = carry
      p, ds = probs(i, j)
      ddk, ddv = dkv_terms(i, p, ds)
      return dk + ddk, dv + ddv
    init = (jnp.zeros((block,) + k.shape[1:], f32), jnp.zeros((block,) + v.shape[1:], f32))
    return jax.lax.fori_loop(lo[j], hi[j], body, init)  # bidirectional: the same block ranges

  def key_block_fused(dq, j):
    """backward="fused": key block j's dk, dv and its pairs' dq terms from one probs(i, j) per pair."""
    def body(i, carry):
      dk, dv, dq = carry
      p, ds = probs(i, j)
      ddk, ddv = dkv_terms(i, p, ds)
      return dk + ddk, dv + ddv, jax.lax.dynamic_update_slice_in_dim(dq, sl(dq, i) + dq_term(j, ds), i * block, 0)
    init = (jnp.zeros((block,) + k.shape[1:], f32), jnp.zeros((block,) + v.shape[1:], f32), dq)
    dk, dv, dq = jax.lax.fori_loop(lo[j], hi[j], body, init)
    return dq, (dk, dv)

  if fused:
    # One pass over the block pairs (key blocks in order outside) instead of two, each pair's
    # probabilities computed once instead of twice. dq_i still takes its pairs' terms in ascending j,
    # starting from zeros (i is in j's range iff j is in i's: the same block ranges both ways), so
    # every gradient is the split backward's sum in the same order.
    dq, (dk, dv) = jax.lax.scan(key_block_fused, jnp.zeros(q.shape, f32), jnp.arange(nb))
  else:
    dq = jax.lax.map(dq_block, jnp.arange(nb)).reshape(q.shape)
    dk, dv = jax.lax.map(dkv_block, jnp.arange(nb))
  return (dq.astype(q.dtype), dk.reshape(k.shape).astype(k.dtype), dv.reshape(v.shape).astype(v.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q, k, v, seg, block, backward):
  return _forward(q, k, v, seg, block)[0].astype(q.dtype)


def _flash_fwd(q, k, v, seg, block, backward):
  out, lse = _forward(q, k, v, seg, block)
  out = out.astype(q.dtype)
  return out, (q, k, v, seg, out, lse)


def _flash_bwd(block, backward, res, dout):
  q, k, v, seg, out, lse = res
  dq, dk, dv = _backward(q, k, v, seg, out, lse, dout, block, fused=backward == "fused")
  return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def packed_attention(q_NHD, k_NHD, v_NHD, seg_N, block: int = 256, backward: str = "split"):
  """Blocked packed attention; N need not be a multiple of `block` (padded inside, sliced off).
  `backward`: "split" (a dq pass over query blocks and a dk / dv pass over key blocks, each pair's
  probabilities recomputed in both) or "fused" (one pass, the probabilities once per pair; the same
  gradients: each is the same sum in the same order)."""
  if backward not in BACKWARDS:
    raise ValueError(f"packed_attention: backward must be one of {BACKWARDS}, got {backward!r}")
  if not (q_NHD.shape == k_NHD.shape and q_NHD.shape[:2] == v_NHD.shape[:2]):
    raise ValueError(f"packed_attention: q {q_NHD.shape}, k {k_NHD.shape}, v {v_NHD.shape} must agree")
  if seg_N.shape != q_NHD.shape[:1]:
    raise ValueError(f"packed_attention: seg_N {seg_N.shape} must be [N={q_NHD.shape[0]}]")
  n = q_NHD.shape[0]
  block = max(1, min(block, n))
  n_pad = (-n) % block
  seg = _pad(seg_N.astype(jnp.int32), n_pad, jnp.iinfo(jnp.int32).min)  # its own segment
  q, k, v = (_pad(x, n_pad, 0) for x in (q_NHD, k_NHD, v_NHD))
  return _flash(q, k, v, seg, block, backward)[:n]
