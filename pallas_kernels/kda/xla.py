"""Exact chunked KDA in plain XLA (any backend; the fast path on CPU), with a hand-written VJP.

Per chunk of C tokens (G = chunk-local inclusive cumsum of g, ≤ 0, non-increasing):
  L   = StrictTril(Diag(β)(e^G⊙K)(e^{−G}⊙K)ᵀ),  A = (I + L)^−1           (UT transform)
  W   = A·Diag(β)(e^G⊙K),  U = A·Diag(β)V,  Aqk = scale·Tril((e^G⊙Q)(e^{−G}⊙K)ᵀ)
then, carrying the state S [K,V] from chunk to chunk:
  V' = U − W·S,  O = scale·(e^G⊙Q)·S + Aqk·V',  S ← Diag(e^{G_C})·S + (e^{G_C−G}⊙K)ᵀ·V'.

Gate safety: no unpaired e^{−G} is ever formed. The intra-chunk matrices are built by recursive
halving (`relations`): the pairs (a in the second half of a 2s-block, b in its first half) are factored
around G_m, the last row of the first half: e^{G_a−G_b} = e^{G_a−G_m}·e^{G_m−G_b}, both ≤ 1. So any
gate (−5 per token, hard resets of −1000) stays finite and a reset makes cross terms exactly 0, for
log2(C)·C·K exps per chunk (exps, not flops, are the scarce resource on CPU).

Execution: one `lax.scan` over chunks does the per-chunk preparation and the state step together.
Measured on CPU, that beats preparing many chunks in one batched einsum: the batched intermediates are
large and memory-bound, while one chunk's working set stays in cache. The VJP is hand-written: the
forward keeps only the chunk-start states (T/C·K·V floats per head, memory-sane at T = 32k); the
backward is a reverse scan that recomputes each chunk's preparation and back-propagates through it.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
_HIGHEST = lax.Precision.HIGHEST


def _mm(spec: str, *xs: jax.Array) -> jax.Array:
  return jnp.einsum(spec, *xs, precision=_HIGHEST, preferred_element_type=F32)


# ---- block helpers (C a power of two) --------------------------------------------------------------
def _quadrants(M: jax.Array) -> dict:
  """{s: lower-left s×s quadrant of every 2s diagonal block of M [..., C, C]} -> [..., C/2s, s, s]."""
  *batch, C, _ = M.shape
  out, D, s = {}, M[..., None, :, :], C
  while s > 1:
    h = s // 2
    D5 = D.reshape(*batch, -1, 2, h, 2, h)
    out[h] = D5[..., 1, :, 0, :]
    D = jnp.stack([D5[..., 0, :, 0, :], D5[..., 1, :, 1, :]], axis=-3).reshape(*batch, -1, h, h)
    s = h
  return out


def _merge(X: jax.Array, quad: jax.Array) -> jax.Array:
  """Diagonal blocks X [..., n, s, s] + lower-left quadrants [..., n/2, s, s] -> [..., n/2, 2s, 2s]."""
  *batch, n, s, _ = X.shape
  Xp = X.reshape(*batch, n // 2, 2, s, s)
  top = jnp.concatenate([Xp[..., 0, :, :], jnp.zeros_like(quad)], axis=-1)
  return jnp.concatenate([top, jnp.concatenate([quad, Xp[..., 1, :, :]], axis=-1)], axis=-2)


# ---- intra-chunk relations and their VJP ------------------------------------------------------------
SUB = 8  # diagonal sub-block size
CLAMP = -20.0  # gate floor inside a diagonal sub-block (see `relations`)


def _block_cumsum(x: jax.Array, sub: int, reverse: bool = False) -> jax.Array:
  """Cumsum over rows of x [..., C, K] restarting every `sub` rows (sub = C: plain cumsum), as one exact
  fp32 matmul with a 0/1 (block-)triangular matrix (an XLA cumsum is a log-depth scan of many ops)."""
  C = x.shape[-2]
  r, c = jnp.arange(C)[:, None], jnp.arange(C)[None, :]
  m = ((r <= c) if reverse else (r >= c)) & (r // sub == c // sub)
  return _mm("ij,...jk->...ik", m.astype(F32), x)


class _Factors(NamedTuple):
  """Gate factors of `relations` for one chunk (all ≤ 1 except the clamped diagonal ones)."""
  rd: jax.Array  # [..., n, sub, K] e^{Gc_a − Gc_mid}, diagonal blocks, rows
  cd: jax.Array  # [..., n, sub, K] e^{Gc_mid − Gc_b}, diagonal blocks, columns
  ro: jax.Array  # [..., n−1, sub, K] e^{G_a − E_{i−1}}, rows of blocks i ≥ 1
  co: jax.Array  # [..., n−1, n, sub, K] e^{E_{i−1} − G_b} for b in block j < i, else 0
  keep: jax.Array  # bool [.., C, C] or [C, C]: strictly lower (and same segment)


def _factors(G: jax.Array, g: jax.Array, seg: jax.Array | None) -> _Factors:
  *batch, C, K = G.shape
  sub = min(SUB, C)
  n = C // sub
  Gc = _block_cumsum(jnp.maximum(g, CLAMP), sub).reshape(*batch, n, sub, K)
  mid = Gc[..., sub // 2 - 1:sub // 2, :]
  G4 = G.reshape(*batch, n, sub, K)
  E = G4[..., -1, :]  # [..., n, K]: G at the end of each block
  ro = jnp.exp(G4[..., 1:, :, :] - E[..., :-1, None, :])
  before = jnp.arange(n)[None, :] < jnp.arange(1, n)[:, None]  # [n−1, n]: block j left of block i
  pair = jnp.exp(jnp.where(before[:, :, None], E[..., :-1, None, :] - E[..., None, :, :], -jnp.inf))
  co = pair[..., :, :, None, :] * jnp.exp(E[..., :, None, :] - G4)[..., None, :, :, :]
  keep = jnp.tril(jnp.ones((C, C), bool), -1)
  if seg is not None:
    keep = keep & (seg[..., :, None] == seg[..., None, :])
  return _Factors(jnp.exp(Gc - mid), jnp.exp(mid - Gc), ro, co, keep)


def relations(xs: tuple, y: jax.Array, f: _Factors) -> tuple:
  """For each x in xs: M[a,b] = Σ_d x[a,d]·y[b,d]·e^{G[a,d]−G[b,d]} for a > b (same segment), else 0;
  x, y: [..., C, K]. Blocks of SUB rows:
  * block pairs i > j: e^{G_a−E_{i−1}}·e^{E_{i−1}−E_j}·e^{E_j−G_b} with E_j = G at the end of block j;
    all three factors ≤ 1, so any gate is safe and a reset between the blocks gives exactly 0;
  * diagonal blocks: factored around the block's middle row on gates clamped at CLAMP, so no factor
    exceeds e^{4·20}; exact unless a gate below −20 lies between a and b, where the true factor is
    < e^{−20} ≈ 2e−9 and the computed one is too (segment boundaries are masked exactly)."""
  *batch, C, K = y.shape
  n, sub = f.rd.shape[-3:-1]
  y4 = y.reshape(*batch, n, sub, K)
  yd = y4 * f.cd
  yo = (y4[..., None, :, :, :] * f.co).reshape(*batch, n - 1, C, K)
  out = []
  for x in xs:
    x4 = x.reshape(*batch, n, sub, K)
    d = _mm("...iak,...ibk->...iab", x4 * f.rd, yd)
    M = _mm("...iab,ij->...iajb", d, jnp.eye(n, dtype=F32)).reshape(*batch, C, C)
    if n > 1:
      off = _mm("...iak,...ick->...iac", x4[..., 1:, :, :] * f.ro, yo)
      M = M + jnp.pad(off.reshape(*batch, C - sub, C), [(0, 0)] * len(batch) + [(sub, 0), (0, 0)])
    out.append(jnp.where(f.keep, M, 0.0))
  return tuple(out)


def relations_vjp(xs: tuple, y: jax.Array, g: jax.Array, f: _Factors, dMs: tuple):
  """VJP of `relations`. Returns (dxs, dy, dG, dg): dG is the gradient through the exact factors
  (w.r.t. the chunk cumsum G), dg through the clamped diagonal factors (w.r.t. g directly). With
  P_x = ∂/∂x and Q = ∂/∂y of one factorised part, its gate gradient is Σ_x x⊙P_x − y⊙Q."""
  *batch, C, K = y.shape
  n, sub = f.rd.shape[-3:-1]
  y4 = y.reshape(*batch, n, sub, K)
  yd = y4 * f.cd
  yo = (y4[..., None, :, :, :] * f.co).reshape(*batch, n - 1, C, K)
  dyd, dyo, Px_d, Px_o = 0.0, 0.0, [], []
  for x, dM in zip(xs, dMs):
    dM = jnp.where(f.keep, dM, 0.0)
    x4 = x.reshape(*batch, n, sub, K)
    dd = jnp.diagonal(dM.reshape(*batch, n, sub, n, sub), axis1=-4, axis2=-2)  # [..., a, b, n]
    dd = jnp.moveaxis(dd, -1, -3)
    Px_d.append(f.rd * _mm("...iab,...ibk->...iak", dd, yd))
    dyd = dyd + _mm("...iab,...iak->...ibk", dd, x4 * f.rd)
    if n > 1:
      do = dM.reshape(*batch, n, sub, C)[..., 1:, :, :]
      Px_o.append(f.ro * _mm("...iac,...ick->...iak", do, yo))
      dyo = dyo + _mm("...iac,...iak->...ick", do, x4[..., 1:, :, :] * f.ro)
  Qd = f.cd * dyd
  dGc = sum(x.reshape(p.shape) * p for x, p in zip(xs, Px_d)) - y4 * Qd
  dg = _block_cumsum(dGc.reshape(*batch, C, K), sub, reverse=True) * (g > CLAMP)
  P = [p.reshape(*batch, C, K) for p in Px_d]
  Q = Qd.reshape(*batch, C, K)
  dG = jnp.zeros_like(y)
  if n > 1:
    # Σ over row blocks as a dot: a fused reduce over this non-minor axis is pathologically slow on CPU
    Qo = _mm("...ijbk,...ijbk->...jbk", dyo.reshape(f.co.shape), f.co).reshape(*batch, C, K)
    pad = [(0, 0)] * len(batch) + [(sub, 0), (0, 0)]
    Po = [jnp.pad(p.reshape(*batch, C - sub, K), pad) for p in Px_o]
    dG = sum(x * p for x, p in zip(xs, Po)) - y * Qo
    P = [p + po for p, po in zip(P, Po)]
    Q = Q + Qo
  return P, Q, dG, dg


# ---- UT transform ---------------------------------------------------------------------------------
def inv_unit_lower(L: jax.Array) -> jax.Array:
  """(I + L)^−1 for strictly lower L [..., C, C]: blocked forward substitution by doubling. The
  inverse of each 2s diagonal block is [[X_A, 0], [−X_B·M·X_A, X_B]] (X_A, X_B the inverses of its
  halves, M its lower-left quadrant), so every intermediate is an exact inverse (no series)."""
  *batch, C, _ = L.shape
  quads = _quadrants(L)
  X = jnp.ones((*batch, C, 1, 1), L.dtype)
  s = 1
  while s < C:
    Xp = X.reshape(*batch, -1, 2, s, s)
    X = _merge(X, -_mm("...ij,...jk,...kl->...il", Xp[..., 1, :, :], quads[s], Xp[..., 0, :, :]))
    s *= 2
  return X[..., 0, :, :]


# ---- one chunk ---------------------------------------------------------------------------------------
def _prepare(q, k, v, g, beta, seg, scale: float):
  """Chunk-local terms for q,k,g [..., C, K], v [..., C, V], beta [..., C], seg [..., C] int or None.
  Returns (terms for `_step`, what `_prepare_vjp` needs)."""
  C = g.shape[-2]
  G = _block_cumsum(g, C)
  Gl = G[..., -1:, :]
  eG, dec = jnp.exp(G), jnp.exp(Gl - G)
  bk = beta[..., None] * k
  f = _factors(G, g, seg)
  Mq, L = relations((q, bk), k, f)
  qk = jnp.sum(q * k, axis=-1)
  aqk = scale * (Mq + qk[..., None] * jnp.eye(C, dtype=F32))
  A = inv_unit_lower(L)
  bkg, bv = bk * eG, beta[..., None] * v
  W = _mm("...ij,...jk->...ik", A, bkg)
  U = _mm("...ij,...jv->...iv", A, bv)
  terms = (scale * q * eG, k * dec, W, U, aqk, jnp.exp(Gl[..., 0, :]))
  return terms, (f, eG, dec, bk, A, bkg, bv)


def _prepare_vjp(q, k, v, g, beta, seg, scale: float, saved, dterms):
  f, eG, dec, bk, A, bkg, bv = saved
  dqs, dkd, dW, dU, daqk, dgam = dterms
  C = g.shape[-2]
  # W = A·bkg, U = A·bv, A = (I+L)^-1 -> dL = −Aᵀ·dA·Aᵀ
  dA = _mm("...ik,...jk->...ij", dW, bkg) + _mm("...iv,...jv->...ij", dU, bv)
  dbkg = _mm("...ij,...ik->...jk", A, dW)
  dbv = _mm("...ij,...iv->...jv", A, dU)
  dL = -_mm("...ji,...jk,...lk->...il", A, dA, A)
  (dq_rel, dbk_rel), dk_rel, dG, dg = relations_vjp((q, bk), k, g, f, (scale * daqk, dL))
  dqk = scale * jnp.diagonal(daqk, axis1=-2, axis2=-1)[..., None]
  dbk = dbk_rel + eG * dbkg
  dq = dq_rel + dqk * k + scale * eG * dqs
  dk = dk_rel + dqk * q + beta[..., None] * dbk + dec * dkd
  dv = beta[..., None] * dbv
  dbeta = jnp.sum(k * dbk, axis=-1) + jnp.sum(v * dbv, axis=-1)
  kd = k * dec
  dG = dG + bkg * dbkg + scale * q * eG * dqs - kd * dkd
  dGl = jnp.sum(kd * dkd, axis=-2) + jnp.exp(jnp.sum(g, axis=-2)) * dgam
  dG = dG + jnp.where(jnp.arange(C)[:, None] == C - 1, dGl[..., None, :], 0.0)
  dg = dg + _block_cumsum(dG, C, reverse=True)  # g_t feeds every G_a with a ≥ t
  return dq, dk, dv, dg, dbeta, None


def _step(S, terms):
  """State recurrence over one chunk: returns (new S, O, V')."""
  qs, kd, W, U, aqk, gam = terms
  vn = U - _mm("...ck,...kv->...cv", W, S)
  o = _mm("...ck,...kv->...cv", qs, S) + _mm("...cj,...jv->...cv", aqk, vn)
  return gam[..., :, None] * S + _mm("...ck,...cv->...kv", kd, vn), o, vn


def _step_vjp(S, terms, vn, do, dS_next):
  qs, kd, W, U, aqk, gam = terms
  dvn = _mm("...cj,...cv->...jv", aqk, do) + _mm("...ck,...kv->...cv", kd, dS_next)
  dS = (gam[..., :, None] * dS_next + _mm("...ck,...cv->...kv", qs, do)
        - _mm("...ck,...cv->...kv", W, dvn))
  dterms = (_mm("...cv,...kv->...ck", do, S),
            _mm("...cv,...kv->...ck", vn, dS_next),
            -_mm("...cv,...kv->...ck", dvn, S),
            dvn,
            _mm("...cv,...jv->...cj", do, vn),  # only its lower triangle is ever read
            jnp.sum(S * dS_next, axis=-1))
  return dS, dterms


# ---- the scan and its custom VJP ---------------------------------------------------------------------
def _fwd_body(scale, S, x):
  terms, _ = _prepare(*x, scale=scale)
  S_next, o, _ = _step(S, terms)
  return S_next, (o, S)


def _bwd_body(scale, dS, inp):
  x, S, do = inp
  terms, saved = _prepare(*x, scale=scale)
  _, _, vn = _step(S, terms)
  dS, dterms = _step_vjp(S, terms, vn, do, dS)
  return dS, _prepare_vjp(*x, scale=scale, saved=saved, dterms=dterms)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunk_scan(scale: float, xs, h0):
  """xs = (q, k, v, g, beta, seg) chunk-major [N, B, HV, C, ·] (seg [N, B, 1, C] or None);
  returns (o [N, B, HV, C, V], final state)."""
  return _chunk_scan_fwd(scale, xs, h0)[0]


def _chunk_scan_fwd(scale, xs, h0):
  hT, (o, h) = lax.scan(functools.partial(_fwd_body, scale), h0, xs)
  return (o, hT), (xs, h)  # residuals: the inputs and the chunk-start states


def _chunk_scan_bwd(scale, res, cts):
  xs, h = res
  do, dhT = cts
  dh0, dxs = lax.scan(functools.partial(_bwd_body, scale), dhT, (xs, h, do), reverse=True)
  return dxs, dh0


_chunk_scan.defvjp(_chunk_scan_fwd, _chunk_scan_bwd)


def chunk_core(q, k, v, g, beta, scale: float, h0, chunk_size: int, segment_ids=None):
  """q,k,g [B,T,HV,K], v [B,T,HV,V], beta [B,T,HV], h0 [B,HV,K,V], all fp32, g already reset at
  segment starts; segment_ids [B,T] int or None (masks the intra-chunk matrices exactly).
  Returns (o [B,T,HV,V] fp32, final state [B,HV,K,V])."""
  B, T, HV, K = k.shape
  V = v.shape[-1]
  C = chunk_size
  N = -(-T // C)
  pad = N * C - T  # padded tokens: q = k = v = β = g = 0 leave the state untouched

  def split(x):  # [B,T,H,...] -> [N, B, H, C, ...]
    x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(B, N, C, *x.shape[2:]), (1, 2), (0, 3))

  seg = None if segment_ids is None else split(segment_ids.astype(jnp.int32)[:, :, None])
  o, hT = _chunk_scan(float(scale), tuple(split(x) for x in (q, k, v, g, beta)) + (seg,), h0)
  o = jnp.moveaxis(o, (0, 3), (1, 2)).reshape(B, N * C, HV, V)[:, :T]
  return o, hT
