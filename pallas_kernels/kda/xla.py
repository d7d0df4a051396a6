"""Exact chunked KDA in plain XLA (any backend; the fast path on CPU), with a hand-written VJP.

Per chunk of C tokens (G = chunk-local inclusive cumsum of g, ≤ 0, non-increasing):
  L   = StrictTril(Diag(β)(e^G⊙K)(e^{−G}⊙K)ᵀ),  A = (I + L)^−1           (UT transform)
  W   = A·Diag(β)(e^G⊙K),  U = A·Diag(β)V,  Aqk = scale·Tril((e^G⊙Q)(e^{−G}⊙K)ᵀ)
then, carrying the state S [K,V] from chunk to chunk:
  V' = U − W·S,  O = scale·(e^G⊙Q)·S + Aqk·V',  S ← Diag(e^{G_C})·S + (e^{G_C−G}⊙K)ᵀ·V'.

Gate safety: no unpaired e^{−G} is ever formed (see `relations`): pairs in different 8-row
sub-blocks are factored by recursive halving around a row between them (both factors ≤ 1), pairs inside
one sub-block around its middle row on gates clamped at −20 (factors ≤ e^80). Gates of −5 per token and
hard resets of −1000 stay finite; a reset between two sub-blocks gives exactly 0, one inside a
sub-block leaves < e^−20 (segment boundaries are masked exactly).

Execution: one `lax.scan` over chunks reads each chunk from the [B, T, HV, ·] inputs in place and does
its preparation and its state step together, because one chunk's working set stays in cache while
batched all-chunk intermediates are memory-bound on CPU (alternatives measured: WORKSPACE_NOTES).
Every dot keeps its operands' own layout (batched triangular matrices for the cumsums, one dot per
stacked operand, explicit adds instead of reduces over a stack axis): on XLA:CPU a transposed
operand drags its whole producing fusion into a strided copy.
The VJP is hand-written (less compile time and faster than autodiff of this scan with
`jax.checkpoint`; WORKSPACE_NOTES): the forward keeps the inputs, the chunk-start states
(T/C·K·V per head) and W, U, Aqk, A (T·(K+V+2C) per head), linear in T; the backward is a reverse
scan that recomputes the cheap elementwise gate terms and back-propagates through each chunk.
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
def _quadrants(M: jax.Array, lowest: int = 1):
  """Lower-left s×s quadrant of every 2s diagonal block of M [..., C, C] for s = lowest..C/2, as
  {s: [..., C/2s, s, s]}, and the diagonal blocks of size `lowest` [..., C/lowest, lowest, lowest]."""
  *batch, C, _ = M.shape
  out, D, s = {}, M[..., None, :, :], C
  while s > lowest:
    h = s // 2
    D5 = D.reshape(*batch, -1, 2, h, 2, h)
    out[h] = D5[..., 1, :, 0, :]
    D = jnp.stack([D5[..., 0, :, 0, :], D5[..., 1, :, 1, :]], axis=-3).reshape(*batch, -1, h, h)
    s = h
  return out, D


def _merge(X: jax.Array, quad: jax.Array) -> jax.Array:
  """Diagonal blocks X [..., n, s, s] + lower-left quadrants [..., n/2, s, s] -> [..., n/2, 2s, 2s]."""
  *batch, n, s, _ = X.shape
  Xp = X.reshape(*batch, n // 2, 2, s, s)
  top = jnp.concatenate([Xp[..., 0, :, :], jnp.zeros_like(quad)], axis=-1)
  return jnp.concatenate([top, jnp.concatenate([quad, Xp[..., 1, :, :]], axis=-1)], axis=-2)


def _halves(x: jax.Array, s: int) -> tuple[jax.Array, jax.Array]:
  """Rows of x [..., C, D] in the first / second half of each 2s-block -> two [..., C/2s, s, D]."""
  x5 = x.reshape(*x.shape[:-2], -1, 2, s, x.shape[-1])
  return x5[..., 0, :, :], x5[..., 1, :, :]


def _unhalve(first: jax.Array | None, second: jax.Array | None, like: jax.Array) -> jax.Array:
  """Inverse of `_halves` (a None half is zero)."""
  first = jnp.zeros_like(second) if first is None else first
  second = jnp.zeros_like(first) if second is None else second
  return jnp.stack([first, second], axis=-3).reshape(like.shape)


def _block_cumsum(x: jax.Array, sub: int, reverse: bool = False) -> jax.Array:
  """Cumsum over rows of x [..., C, K] restarting every `sub` rows (sub = C: plain cumsum), as one exact
  fp32 matmul with a 0/1 (block-)triangular matrix (an XLA cumsum is a log-depth scan of many ops).
  The matrix is broadcast over x's leading dims so the product is one batched dot in x's own layout
  (an unbatched matrix makes XLA:CPU transpose x and its whole producing fusion)."""
  C, K = x.shape[-2:]
  m = jnp.tril(jnp.ones((sub, sub), F32)) if not reverse else jnp.triu(jnp.ones((sub, sub), F32))
  xb = x.reshape(-1, sub, K)
  return _mm("nij,njk->nik", jnp.broadcast_to(m, (xb.shape[0], sub, sub)), xb).reshape(x.shape)


# ---- intra-chunk relations and their VJP ------------------------------------------------------------
SUB = 8  # diagonal sub-block size
CLAMP = -20.0  # gate floor inside a diagonal sub-block (see `relations`)


class _Factors(NamedTuple):
  """Gate factors of `relations` for one chunk."""
  rd: jax.Array  # [..., n, sub, K] e^{Gc_a − Gc_mid} on the diagonal sub-blocks (rows)
  cd: jax.Array  # [..., n, sub, K] e^{Gc_mid − Gc_b} on the diagonal sub-blocks (columns)
  levels: tuple  # per halving level s ≥ sub: (s, e^{G_a − G_m} second halves, e^{G_m − G_b} first halves)
  keep: jax.Array  # bool [..., C, C]: strictly lower (and same segment)


def _factors(G: jax.Array, g: jax.Array, seg: jax.Array | None) -> _Factors:
  *batch, C, K = G.shape
  sub = min(SUB, C)
  Gc = _block_cumsum(jnp.maximum(g, CLAMP), sub).reshape(*batch, C // sub, sub, K)
  mid = Gc[..., sub // 2 - 1:sub // 2, :]
  levels, s = [], sub
  while s < C:
    G1, G2 = _halves(G, s)
    Gm = G1[..., -1:, :]
    levels.append((s, jnp.exp(G2 - Gm), jnp.exp(Gm - G1)))
    s *= 2
  keep = jnp.tril(jnp.ones((C, C), bool), -1)
  if seg is not None:
    keep = keep & (seg[..., :, None] == seg[..., None, :])
  return _Factors(jnp.exp(Gc - mid), jnp.exp(mid - Gc), tuple(levels), keep)


def relations(x: jax.Array, y: jax.Array, f: _Factors) -> jax.Array:
  """M[..., a, b] = Σ_d x[..., a, d]·y[b, d]·e^{G[a,d]−G[b,d]} for a > b (same segment), else 0.
  y: [..., C, K]; x: [X, ..., C, K], a stack of X left operands sharing y and the factors.
  * Diagonal SUB-blocks: factored around the block's middle row on gates clamped at CLAMP, so no
    factor exceeds e^{4·20}; exact unless a gate below −20 lies between a and b, where the true
    factor is < e^{−20} ≈ 2e−9 and so is the computed one (segment boundaries are masked exactly).
  * Everything else by halving: the pairs with a in the second half of a 2s-block and b in its first
    half are factored around G_m, the first half's last row: e^{G_a−G_m}·e^{G_m−G_b}, both ≤ 1, so
    any gate is safe and a reset between a and b gives exactly 0. One C·K exp pass per level."""
  *batch, C, K = y.shape
  n, sub = f.rd.shape[-3:-1]
  y4 = y.reshape(*batch, n, sub, K)
  M = _each("...iak,...ibk->...iab", x.reshape(-1, *y4.shape) * f.rd, y4 * f.cd)
  for s, rowf, colf in f.levels:
    M = _merge(M, _each("...ad,...bd->...ab", _halves(x, s)[1] * rowf, _halves(y, s)[0] * colf))
  return jnp.where(f.keep, M[..., 0, :, :], 0.0)


def _each(spec: str, xs: jax.Array, y: jax.Array) -> jax.Array:
  """stack([_mm(spec, x, y) for x in xs]): one dot per stacked operand, each with plain batch dims
  (one dot over the stack makes XLA:CPU transpose the stacked operand and the result)."""
  return jnp.stack([_mm(spec, x, y) for x in xs])


def _stack_sum(xs) -> jax.Array:
  """Sum of a short stack (an array's leading axis, or an iterable of arrays) as explicit adds:
  XLA:CPU turns a reduce over a leading stack axis into a slow library fusion."""
  return functools.reduce(jnp.add, list(xs))


def relations_vjp(x: jax.Array, y: jax.Array, g: jax.Array, f: _Factors, dM: jax.Array):
  """VJP of `relations` for the cotangent dM [X, ..., C, C]. Returns (dx, dy, dG, dg): dG is the
  gradient through the halving factors (w.r.t. the chunk cumsum G), dg through the clamped diagonal
  factors (w.r.t. g directly). With P = ∂/∂x and Q = ∂/∂y of one factorised part, its gate gradient is
  Σ_X x⊙P − y⊙Q (the row and column roles of G in e^{G_a−G_b})."""
  *batch, C, K = y.shape
  n, sub = f.rd.shape[-3:-1]
  quads, dd = _quadrants(jnp.where(f.keep, dM, 0.0), sub)
  # diagonal sub-blocks
  x4 = x.reshape(-1, *batch, n, sub, K)
  y4 = y.reshape(*batch, n, sub, K)
  Pd = f.rd * _each("...iab,...ibk->...iak", dd, y4 * f.cd)
  Qd = f.cd * _stack_sum(_mm("...iab,...iak->...ibk", d, xd) for d, xd in zip(dd, x4 * f.rd))
  dGc = _stack_sum(x4 * Pd) - y4 * Qd
  dg = _block_cumsum(dGc.reshape(*batch, C, K), sub, reverse=True) * (g > CLAMP)
  P, Q = Pd.reshape(x.shape), Qd.reshape(y.shape)
  # halving levels
  Ph, Qh = jnp.zeros_like(x), jnp.zeros_like(y)
  for s, rowf, colf in f.levels:
    xr, yc = _halves(x, s)[1] * rowf, _halves(y, s)[0] * colf
    Ph = Ph + _unhalve(None, rowf * _each("...ab,...bd->...ad", quads[s], yc), x)
    Qh = Qh + _unhalve(colf * _stack_sum(_mm("...ab,...ad->...bd", d, xh) for d, xh in zip(quads[s], xr)),
                       None, y)
  dG = _stack_sum(x * Ph) - y * Qh
  return P + Ph, Q + Qh, dG, dg


# ---- UT transform ---------------------------------------------------------------------------------
def inv_unit_lower(L: jax.Array) -> jax.Array:
  """(I + L)^−1 for strictly lower L [..., C, C]: blocked forward substitution by doubling. The
  inverse of each 2s diagonal block is [[X_A, 0], [−X_B·M·X_A, X_B]] (X_A, X_B the inverses of its
  halves, M its lower-left quadrant), so every intermediate is an exact inverse (no series)."""
  *batch, C, _ = L.shape
  quads, _ = _quadrants(L)
  X = jnp.ones((*batch, C, 1, 1), L.dtype)
  s = 1
  while s < C:
    Xp = X.reshape(*batch, -1, 2, s, s)
    X = _merge(X, -_mm("...ij,...jk,...kl->...il", Xp[..., 1, :, :], quads[s], Xp[..., 0, :, :]))
    s *= 2
  return X[..., 0, :, :]


# ---- one chunk ---------------------------------------------------------------------------------------
class _Gates(NamedTuple):
  """The cheap chunk-local quantities (G = chunk-local cumsum of g)."""
  f: _Factors  # gate factors of `relations`
  eG: jax.Array  # e^G [..., C, K]
  dec: jax.Array  # e^{G_C − G} [..., C, K]: decay from each token to the chunk end
  bk: jax.Array  # β·k
  bkg: jax.Array  # β·k·e^G
  bv: jax.Array  # β·v


class _Terms(NamedTuple):
  """What one chunk's state step reads; the backward's cotangents of them use the same fields."""
  qs: jax.Array  # scale·q·e^G [..., C, K]
  kd: jax.Array  # k·e^{G_C − G} [..., C, K]
  W: jax.Array  # [..., C, K]
  U: jax.Array  # [..., C, V]
  aqk: jax.Array  # [..., C, C]
  gam: jax.Array  # e^{G_C}, the whole chunk's decay [..., K]


def _gates(k, v, g, beta, seg) -> _Gates:
  """The cheap (elementwise) chunk-local quantities, recomputed in the backward."""
  C = g.shape[-2]
  G = _block_cumsum(g, C)
  eG, dec = jnp.exp(G), jnp.exp(G[..., -1:, :] - G)
  bk = beta[..., None] * k
  return _Gates(_factors(G, g, seg), eG, dec, bk, bk * eG, beta[..., None] * v)


def _prepare(q, k, v, g, beta, seg, scale: float):
  """Chunk-local terms for q,k,g [..., C, K], v [..., C, V], beta [..., C], seg [..., C] int or None.
  Returns (terms for `_step`, the expensive part (W, U, Aqk, A) the backward keeps)."""
  C = g.shape[-2]
  f, eG, dec, bk, bkg, bv = _gates(k, v, g, beta, seg)
  Mq, L = relations(jnp.stack([q, bk]), k, f)
  aqk = scale * (Mq + jnp.sum(q * k, axis=-1)[..., None] * jnp.eye(C, dtype=F32))
  A = inv_unit_lower(L)
  W = _mm("...ij,...jk->...ik", A, bkg)
  U = _mm("...ij,...jv->...iv", A, bv)
  return _terms(q, k, g, eG, dec, W, U, aqk, scale), (W, U, aqk, A)


def _terms(q, k, g, eG, dec, W, U, aqk, scale) -> _Terms:
  return _Terms(scale * q * eG, k * dec, W, U, aqk, jnp.exp(jnp.sum(g, axis=-2)))


def _prepare_vjp(q, k, v, g, beta, seg, scale: float, gates: _Gates, A, dterms: _Terms):
  f, eG, dec, bk, bkg, bv = gates
  dqs, dkd, dW, dU, daqk, dgam = dterms
  C = g.shape[-2]
  # W = A·bkg, U = A·bv, A = (I+L)^-1 -> dL = −Aᵀ·dA·Aᵀ
  dA = _mm("...ik,...jk->...ij", dW, bkg) + _mm("...iv,...jv->...ij", dU, bv)
  dbkg = _mm("...ij,...ik->...jk", A, dW)
  dbv = _mm("...ij,...iv->...jv", A, dU)
  dL = -_mm("...ji,...jk,...lk->...il", A, dA, A)
  (dq_rel, dbk_rel), dk_rel, dG, dg = relations_vjp(jnp.stack([q, bk]), k, g, f,
                                                    jnp.stack([scale * daqk, dL]))
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


def _step(S, terms: _Terms):
  """State recurrence over one chunk: returns (new S, O, V')."""
  qs, kd, W, U, aqk, gam = terms
  vn = U - _mm("...ck,...kv->...cv", W, S)
  o = _mm("...ck,...kv->...cv", qs, S) + _mm("...cj,...jv->...cv", aqk, vn)
  return gam[..., :, None] * S + _mm("...ck,...cv->...kv", kd, vn), o, vn


def _step_vjp(S, terms: _Terms, vn, do, dS_next):
  qs, kd, W, U, aqk, gam = terms
  dvn = _mm("...cj,...cv->...jv", aqk, do) + _mm("...ck,...kv->...cv", kd, dS_next)
  dS = (gam[..., :, None] * dS_next + _mm("...ck,...cv->...kv", qs, do)
        - _mm("...ck,...cv->...kv", W, dvn))
  dterms = _Terms(qs=_mm("...cv,...kv->...ck", do, S),
                  kd=_mm("...cv,...kv->...ck", vn, dS_next),
                  W=-_mm("...cv,...kv->...ck", dvn, S),
                  U=dvn,
                  aqk=_mm("...cv,...jv->...cj", do, vn),  # only its lower triangle is ever read
                  gam=jnp.sum(S * dS_next, axis=-1))
  return dS, dterms


# ---- the scan and its custom VJP ---------------------------------------------------------------------
# The loop reads each chunk straight out of the [B, T', HV, ·] inputs and writes o (and, in the
# backward, dq..dβ) back in place, so the only layout change is a [B, C, HV, ·] <-> [B·HV, C, ·] transpose
# of one chunk, done in cache. (Transposing whole inputs to chunk-major order before the loop cost
# ~20% of fwd+bwd at T = 4096 on CPU: XLA:CPU's out-of-cache transposes run at ~2 GB/s.)
# Per-chunk tensors are [R, C, ·] with R = B·HV rows: one batch dim for every einsum (dots with several
# batch dims hit a segfaulting XLA:CPU executable in jax 0.10.2 for some shapes).
def _take(x: jax.Array | None, n, C: int):
  """Chunk n of x [B, T', HV, ...] as [B·HV, C, ...] (None stays None)."""
  if x is None:
    return None
  c = lax.dynamic_slice_in_dim(x, n * C, C, axis=1)
  c = jnp.moveaxis(c, 1, 2)
  return c.reshape(-1, *c.shape[2:])


def _put(buf: jax.Array, c: jax.Array, n, C: int) -> jax.Array:
  """Writes chunk n, c [B·HV, C, ...], into buf [B, T', HV, ...]."""
  B, _, HV = buf.shape[:3]
  c = jnp.moveaxis(c.reshape(B, HV, *c.shape[1:]), 1, 2)
  return lax.dynamic_update_slice_in_dim(buf, c.astype(buf.dtype), n * C, axis=1)


def _chunks(xs, n, C):
  return tuple(_take(x, n, C) for x in xs)


def zeros_varying_like(shape, refs) -> jax.Array:
  """fp32 zeros that vary over every manual mesh axis any array in `refs` varies over. Inside
  `jax.shard_map` (heads or batch over devices) a scan carry must keep the type its body gives it,
  and the KDA state varies like all of its inputs after one step. `lax.full_like` carries that type
  on every jax version; XLA folds the zeros away."""
  refs = [r for r in jax.tree.leaves(refs) if r is not None]
  return functools.reduce(jnp.add, (lax.full_like(r, 0, F32, shape) for r in refs))


def _chunk_ids(xs, C: int) -> jax.Array:
  return jnp.arange(xs[0].shape[1] // C)


def _forward(scale: float, C: int, xs, h0, keep: bool):
  """The chunk loop: (o [B, T', HV, V], final state, per-chunk residuals (S, W, U, Aqk, A) or None)."""
  def body(carry, n):
    S, o = carry
    terms, heavy = _prepare(*_chunks(xs, n, C), scale=scale)
    S_next, oc, _ = _step(S, terms)
    return (S_next, _put(o, oc, n, C)), ((S,) + heavy if keep else None)

  (hT, o), saved = lax.scan(body, (h0, zeros_varying_like(xs[2].shape, (xs, h0))), _chunk_ids(xs, C))
  return o, hT, saved


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunk_scan(scale: float, C: int, xs, h0):
  """xs = (q, k, v, g, beta, seg) [B, T', HV, ·] with T' a multiple of C (seg [B, T', HV] or None),
  h0 [B·HV, K, V]; returns (o [B, T', HV, V], final state)."""
  o, hT, _ = _forward(scale, C, xs, h0, keep=False)  # no residuals when not differentiated
  return o, hT


def _chunk_scan_fwd(scale, C, xs, h0):
  o, hT, saved = _forward(scale, C, xs, h0, keep=True)
  # residuals: the inputs, the chunk-start states and W, U, Aqk, A (≈ the size of q, k, v, g again)
  return (o, hT), (xs, saved)


def _chunk_scan_bwd(scale, C, res, cts):
  xs, saved = res
  do, dhT = cts

  def body(carry, inp):
    dS, dbufs = carry
    n, (S, W, U, aqk, A) = inp
    x = _chunks(xs, n, C)
    q, k, v, g, beta, seg = x
    gates = _gates(k, v, g, beta, seg)
    terms = _terms(q, k, g, gates.eG, gates.dec, W, U, aqk, scale)
    _, _, vn = _step(S, terms)
    dS, dterms = _step_vjp(S, terms, vn, _take(do, n, C), dS)
    dx = _prepare_vjp(*x, scale=scale, gates=gates, A=A, dterms=dterms)
    return (dS, tuple(_put(b, d, n, C) for b, d in zip(dbufs, dx[:5]))), None

  refs = (xs, saved, do, dhT)
  dbufs = tuple(zeros_varying_like(x.shape, refs) for x in xs[:5])
  dS0 = dhT + zeros_varying_like(dhT.shape, refs)  # an unused final state's cotangent is plain zeros
  (dh0, dxs), _ = lax.scan(body, (dS0, dbufs), (_chunk_ids(xs, C), saved), reverse=True)
  return dxs + (None,), dh0


_chunk_scan.defvjp(_chunk_scan_fwd, _chunk_scan_bwd)


def chunk_core(q, k, v, g, beta, scale: float, h0, chunk_size: int, segment_ids=None):
  """q,k,g [B,T,HV,K], v [B,T,HV,V], beta [B,T,HV], h0 [B,HV,K,V], all fp32, g already reset at
  segment starts; segment_ids [B,T] int or None (masks the intra-chunk matrices exactly).
  Returns (o [B,T,HV,V] fp32, final state [B,HV,K,V])."""
  B, T, HV, K = k.shape
  V = v.shape[-1]
  C = chunk_size
  pad = -T % C  # padded tokens: q = k = v = β = g = 0 leave the state untouched

  def padded(x):
    return jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)) if pad else x

  seg = None
  if segment_ids is not None:
    seg = padded(jnp.broadcast_to(segment_ids.astype(jnp.int32)[:, :, None], (B, T, HV)))
  xs = tuple(padded(x) for x in (q, k, v, g, beta)) + (seg,)
  o, hT = _chunk_scan(float(scale), C, xs, h0.reshape(B * HV, K, V))
  return o[:, :T], hT.reshape(B, HV, K, V)
