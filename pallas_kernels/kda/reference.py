"""Token-by-token KDA recurrence in fp32: the golden oracle, and the one-token decode step.

Per value head, state S [K,V]:  S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ,
o_t = S_tᵀ (scale·q_t). Computed as S' = e^{g_t}⊙S, S_t = S' + β_t k_t (v_t − S'ᵀk_t)ᵀ.

Inputs here are already validated, head-expanded (q/k have HV heads) and fp32; the public wrapper with
checks, grouped heads and segment resets is `api.recurrent_kda`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_HIGHEST = lax.Precision.HIGHEST
BLOCK = 64  # tokens per checkpointed block: backward memory is one state per block, not per token


def _step(scale: float):
  def step(S_BHKV, x):
    q_BHK, k_BHK, v_BHV, g_BHK, b_BH = x
    S_BHKV = jnp.exp(g_BHK)[..., None] * S_BHKV
    pred_BHV = jnp.einsum("bhk,bhkv->bhv", k_BHK, S_BHKV, precision=_HIGHEST)
    S_BHKV = S_BHKV + (b_BH[..., None, None] * k_BHK[..., :, None]) * (v_BHV - pred_BHV)[..., None, :]
    o_BHV = jnp.einsum("bhk,bhkv->bhv", q_BHK * scale, S_BHKV, precision=_HIGHEST)
    return S_BHKV, o_BHV
  return step


def recurrent_core(q, k, v, g, beta, scale: float, h0):
  """q,k,g [B,T,HV,K], v [B,T,HV,V], beta [B,T,HV], h0 [B,HV,K,V], all fp32.
  Returns (o [B,T,HV,V] fp32, final state [B,HV,K,V])."""
  B, T, HV, K = k.shape
  V = v.shape[-1]
  pad = -T % BLOCK if T > BLOCK else 0
  n = (T + pad) // BLOCK if T > BLOCK else 1
  blk = (T + pad) // n

  def to_blocks(x):  # [B,T,...] -> [n, blk, B, ...]; padded tokens have k=v=β=g=0: a no-op step
    x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
    x = jnp.moveaxis(x, 1, 0)
    return x.reshape(n, blk, *x.shape[1:])

  xs = tuple(to_blocks(x) for x in (q, k, v, g, beta))
  step = _step(scale)

  @jax.checkpoint
  def block(S, xb):
    return lax.scan(step, S, xb)

  hT, o = lax.scan(block, h0, xs)
  o = jnp.moveaxis(o.reshape(n * blk, B, HV, V), 0, 1)[:, :T]
  return o, hT
