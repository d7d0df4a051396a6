"""Packed bidirectional attention: many images in one sequence, each attending only within itself.

  out[n] = softmax_m( q[n] . k[m] * scale  over m with seg[m] == seg[n] ) v[m]

`packed_attention` is the blocked (flash-style) path: the sequence is cut into blocks of `block`
rows, every query block walks only the key blocks its segments touch with an online softmax, and
the backward recomputes the probabilities block by block from the saved log-sum-exp. Memory is
O(N * block), never [N, N], so a 16,384-patch image fits; packing many small images also skips
every block pair that no segment shares. `reference_packed_attention` is the dense definition.

Two schedules of the same block pairs (`mode`): "loop" walks each query block's key blocks in a loop
of its own (only the pairs a segment shares); "offsets" loops over the block offset o = j - i and does
every query block's pair (i, i + o) at once as one batched product (pairs no segment shares are masked
out and change nothing: the online-softmax update with every key masked is exact). Offsets does more
pairs (every block for every offset in [min_i lo_i - i, max_i hi_i - 1 - i]) in far fewer, larger
steps: many small images (every image within a block or two) are a handful of offsets instead of
dozens of loop trips, where the per-step overhead dominates on CPU. "auto" picks offsets when it does
at most twice the loop's pairs (a lax.cond on the batch's segments, so one compiled step serves
both). Both visit a query block's key blocks in increasing order, as does the backward's key-block
pass over query blocks, so they sum in the same order.

Segments must be contiguous runs (the layout in vision/layout.py packs images one after another).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

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


def _forward_loop(q, k, v, seg, block):
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


def _backward_loop(q, k, v, seg, out, lse, dout, block):
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

  def dq_block(i):
    def body(j, dq):
      _, ds = probs(i, j)
      return dq + jnp.einsum("hqk,khd->qhd", ds, sl(k, j).astype(f32)) * scale
    return jax.lax.fori_loop(lo[i], hi[i], body, jnp.zeros((block,) + q.shape[1:], f32))

  def dkv_block(j):
    def body(i, carry):
      dk, dv = carry
      p, ds = probs(i, j)
      dv = dv + jnp.einsum("hqk,qhd->khd", p, sl(dout, i).astype(f32))
      dk = dk + jnp.einsum("hqk,qhd->khd", ds, sl(q, i).astype(f32)) * scale
      return dk, dv
    init = (jnp.zeros((block,) + k.shape[1:], f32), jnp.zeros((block,) + v.shape[1:], f32))
    return jax.lax.fori_loop(lo[j], hi[j], body, init)  # bidirectional: the same block ranges

  dq = jax.lax.map(dq_block, jnp.arange(nb)).reshape(q.shape)
  dk, dv = jax.lax.map(dkv_block, jnp.arange(nb))
  return (dq.astype(q.dtype), dk.reshape(k.shape).astype(k.dtype), dv.reshape(v.shape).astype(v.dtype))


def _offset_range(seg, block):
  """(o_min, o_max): the block offsets j - i of every block pair (i, j) the loop schedule visits."""
  lo, hi = _block_ranges(seg, block)
  ar = jnp.arange(lo.shape[0])
  return jnp.min(lo - ar), jnp.max(hi - 1 - ar)


def _use_offsets(seg, block):
  """The "auto" rule: offsets when its pairs are at most twice the loop's."""
  lo, hi = _block_ranges(seg, block)
  o_min, o_max = _offset_range(seg, block)
  return (o_max - o_min + 1) * lo.shape[0] <= 2 * jnp.sum(hi - lo)


def _shifted(x_nb, o, nb):
  """Block i of the result is block i + o of x (wrapped around: the caller masks those blocks out)."""
  return jnp.roll(x_nb, -o, axis=0), (jnp.arange(nb) + o >= 0) & (jnp.arange(nb) + o < nb)


def _batched_scores(q_nbHD, k_nbHD, sq_nb, sk_nb, valid_n, scale):
  """[n, H, bq, bk] scores of query block i against key block i's partner, and where they count."""
  s = jnp.einsum("nqhd,nkhd->nhqk", q_nbHD, k_nbHD, preferred_element_type=jnp.float32) * scale
  mask = ((sq_nb[:, :, None] == sk_nb[:, None, :]) & valid_n[:, None, None])[:, None]
  return s, mask


def _forward_offsets(q, k, v, seg, block):
  scale = q.shape[-1] ** -0.5
  nb = q.shape[0] // block
  o_min, o_max = _offset_range(seg, block)
  qb, kb, vb, sb = (_blocks(x, block) for x in (q, k, v, seg))
  H, D = q.shape[1], v.shape[2]

  def body(o, carry):
    m, l, acc = carry
    (k_o, valid), v_o, s_o = _shifted(kb, o, nb), _shifted(vb, o, nb)[0], _shifted(sb, o, nb)[0]
    s, mask = _batched_scores(qb, k_o, sb, s_o, valid, scale)
    s = jnp.where(mask, s, _NEG)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    acc = acc * alpha[..., None] + jnp.einsum("nhqk,nkhd->nhqd", p, v_o.astype(jnp.float32))
    return m_new, l * alpha + p.sum(-1), acc

  init = (jnp.full((nb, H, block), _NEG, jnp.float32), jnp.zeros((nb, H, block), jnp.float32),
          jnp.zeros((nb, H, block, D), jnp.float32))
  m, l, acc = jax.lax.fori_loop(o_min, o_max + 1, body, init)
  out = jnp.swapaxes(acc / l[..., None], 1, 2)  # [nb, b, H, D]
  lse = jnp.swapaxes(m + jnp.log(l), 1, 2)  # [nb, b, H]
  return out.reshape(q.shape[0], H, D), lse.reshape(q.shape[0], H)


def _backward_offsets(q, k, v, seg, out, lse, dout, block):
  scale = q.shape[-1] ** -0.5
  nb = q.shape[0] // block
  o_min, o_max = _offset_range(seg, block)
  f32 = jnp.float32
  delta = jnp.sum(dout.astype(f32) * out.astype(f32), -1)  # [N, H]
  qb, kb, vb, sb, lb, db, dob = (_blocks(x, block) for x in (q, k, v, seg, lse, delta, dout))

  def probs(q_, k_, v_, sq, sk, lse_q, delta_q, do_q, valid):
    """p, ds of each query block against its partner key block ([n, H, bq, bk])."""
    s, mask = _batched_scores(q_, k_, sq, sk, valid, scale)
    p = jnp.where(mask, jnp.exp(s - jnp.swapaxes(lse_q, 1, 2)[..., None]), 0.0)
    dp = jnp.einsum("nqhd,nkhd->nhqk", do_q, v_, preferred_element_type=f32)
    return p, p * (dp - jnp.swapaxes(delta_q, 1, 2)[..., None])

  def dq_body(o, dq):  # query block i against key block i + o, o increasing: the loop's key order
    (k_o, valid), v_o, s_o = _shifted(kb, o, nb), _shifted(vb, o, nb)[0], _shifted(sb, o, nb)[0]
    _, ds = probs(qb, k_o, v_o, sb, s_o, lb, db, dob, valid)
    return dq + jnp.einsum("nhqk,nkhd->nqhd", ds, k_o.astype(f32)) * scale

  def dkv_body(o, carry):  # key block j against query block j + o, o increasing: the loop's query order
    dk, dv = carry
    (q_o, valid), s_o, l_o, d_o, do_o = (_shifted(qb, o, nb), _shifted(sb, o, nb)[0], _shifted(lb, o, nb)[0],
                                         _shifted(db, o, nb)[0], _shifted(dob, o, nb)[0])
    p, ds = probs(q_o, kb, vb, s_o, sb, l_o, d_o, do_o, valid)
    dv = dv + jnp.einsum("nhqk,nqhd->nkhd", p, do_o.astype(f32))
    dk = dk + jnp.einsum("nhqk,nqhd->nkhd", ds, q_o.astype(f32)) * scale
    return dk, dv

  dq = jax.lax.fori_loop(o_min, o_max + 1, dq_body, jnp.zeros(qb.shape, f32))
  dk, dv = jax.lax.fori_loop(o_min, o_max + 1, dkv_body, (jnp.zeros(kb.shape, f32), jnp.zeros(vb.shape, f32)))
  return (dq.reshape(q.shape).astype(q.dtype), dk.reshape(k.shape).astype(k.dtype),
          dv.reshape(v.shape).astype(v.dtype))


def _forward(q, k, v, seg, block, mode):
  if mode == "auto":
    return jax.lax.cond(_use_offsets(seg, block), functools.partial(_forward_offsets, block=block),
                        functools.partial(_forward_loop, block=block), q, k, v, seg)
  return (_forward_offsets if mode == "offsets" else _forward_loop)(q, k, v, seg, block)


def _backward(q, k, v, seg, out, lse, dout, block, mode):
  if mode == "auto":
    return jax.lax.cond(_use_offsets(seg, block), functools.partial(_backward_offsets, block=block),
                        functools.partial(_backward_loop, block=block), q, k, v, seg, out, lse, dout)
  return (_backward_offsets if mode == "offsets" else _backward_loop)(q, k, v, seg, out, lse, dout, block)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q, k, v, seg, block, mode):
  return _forward(q, k, v, seg, block, mode)[0].astype(q.dtype)


def _flash_fwd(q, k, v, seg, block, mode):
  out, lse = _forward(q, k, v, seg, block, mode)
  out = out.astype(q.dtype)
  return out, (q, k, v, seg, out, lse)


def _flash_bwd(block, mode, res, dout):
  q, k, v, seg, out, lse = res
  dq, dk, dv = _backward(q, k, v, seg, out, lse, dout, block, mode)
  return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)

MODES = ("auto", "loop", "offsets")


def packed_attention(q_NHD, k_NHD, v_NHD, seg_N, block: int = 256, mode: str = "auto"):
  """Blocked packed attention; N need not be a multiple of `block` (padded inside, sliced off);
  `mode`: the schedule of the block pairs (module docstring)."""
  if mode not in MODES:
    raise ValueError(f"packed_attention: mode={mode!r}, expected one of {MODES}")
  if not (q_NHD.shape == k_NHD.shape and q_NHD.shape[:2] == v_NHD.shape[:2]):
    raise ValueError(f"packed_attention: q {q_NHD.shape}, k {k_NHD.shape}, v {v_NHD.shape} must agree")
  if seg_N.shape != q_NHD.shape[:1]:
    raise ValueError(f"packed_attention: seg_N {seg_N.shape} must be [N={q_NHD.shape[0]}]")
  n = q_NHD.shape[0]
  block = max(1, min(block, n))
  n_pad = (-n) % block
  seg = _pad(seg_N.astype(jnp.int32), n_pad, jnp.iinfo(jnp.int32).min)  # its own segment
  q, k, v = (_pad(x, n_pad, 0) for x in (q_NHD, k_NHD, v_NHD))
  return _flash(q, k, v, seg, block, mode)[:n]
