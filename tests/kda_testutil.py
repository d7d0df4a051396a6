"""Shared KDA test helpers: random input generators, the error metric, and a float64 NumPy oracle.

Reused by the op tests (test_kda_ops.py), the Pallas backend tests and the KDA layer tests.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

GATES = ("tiny", "typical", "lower", "reset")


class KDAInputs(NamedTuple):
  q: jax.Array  # [B,T,H,K], L2-normalised
  k: jax.Array  # [B,T,H,K], L2-normalised
  v: jax.Array  # [B,T,HV,V]
  g: jax.Array  # [B,T,HV,K] log decay ≤ 0
  beta: jax.Array  # [B,T,HV] in (0,1)
  initial_state: jax.Array | None  # [B,HV,K,V] fp32

  def args(self):
    return self.q, self.k, self.v, self.g, self.beta

  def initial_state_shape(self):
    B, _, HV, V = self.v.shape
    return (B, HV, self.q.shape[-1], V)


def make_gates(key: jax.Array, shape: tuple, kind: str = "typical") -> jax.Array:
  """Log decays of a given kind: "tiny" (≈ −1e−3), "typical" (logsigmoid(randn)), "lower" (the −5 lower
  bound of the safe gate, −5·sigmoid(randn) with about a tenth of the entries exactly −5), "reset"
  (typical plus ~3% of tokens hard-reset to −1000 on every channel and ~3% of entries on single
  channels)."""
  k1, k2, k3, k4 = jax.random.split(key, 4)
  if kind == "tiny":
    return -1e-3 * jax.random.uniform(k1, shape, minval=0.5, maxval=1.5)
  if kind == "typical":
    return jax.nn.log_sigmoid(jax.random.normal(k1, shape))
  if kind == "lower":
    g = -5.0 * jax.nn.sigmoid(jax.random.normal(k1, shape))
    return jnp.where(jax.random.uniform(k2, shape) < 0.1, -5.0, g)
  if kind == "reset":
    g = jax.nn.log_sigmoid(jax.random.normal(k1, shape))
    token = jax.random.uniform(k3, shape[:2])[:, :, None, None] < 0.03
    entry = jax.random.uniform(k4, shape) < 0.03
    return jnp.where(token | entry, -1000.0, g)
  raise ValueError(f"kind: expected one of {GATES}, got {kind!r}")


def l2norm(x: jax.Array) -> jax.Array:
  return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def make_inputs(key: jax.Array, B: int, T: int, H: int, K: int, V: int | None = None, *, group: int = 1,
                dtype=jnp.float32, gate: str = "typical", initial_state: bool = False) -> KDAInputs:
  """Random KDA inputs (fresh per key); HV = H·group value heads. Inputs are cast to `dtype` (the
  initial state stays fp32)."""
  V = K if V is None else V
  HV = H * group
  ks = jax.random.split(key, 6)
  q = l2norm(jax.random.normal(ks[0], (B, T, H, K)))
  k = l2norm(jax.random.normal(ks[1], (B, T, H, K)))
  v = jax.random.normal(ks[2], (B, T, HV, V))
  g = make_gates(ks[3], (B, T, HV, K), gate)
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, HV)))
  h0 = jax.random.normal(ks[5], (B, HV, K, V), jnp.float32) if initial_state else None
  cast = lambda x: x.astype(dtype)
  return KDAInputs(cast(q), cast(k), cast(v), cast(g), cast(beta), h0)


def make_segment_ids(seed: int, B: int, T: int, max_docs: int = 4) -> np.ndarray:
  """[B,T] int32 non-decreasing document ids; each row is cut at random points into 1..max_docs docs."""
  rng = np.random.default_rng(seed)
  ids = np.zeros((B, T), np.int32)
  for b in range(B):
    n = min(int(rng.integers(1, max_docs + 1)), T)
    for c in rng.choice(np.arange(1, T), size=n - 1, replace=False) if n > 1 else ():
      ids[b, c:] += 1
  return ids


def rel_err(ref, x) -> float:
  """‖ref − x‖ / ‖ref‖ in float64 (0 when both are exactly 0)."""
  ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  den = np.linalg.norm(ref)
  num = np.linalg.norm(ref - x)
  return float(num / den) if den > 0 else float(num)


def numpy_kda(q, k, v, g, beta, *, scale=None, initial_state=None):
  """The literal recurrence, token by token in float64: S_t = (I − β k kᵀ) Diag(e^g) S + β k vᵀ,
  o_t = S_tᵀ(scale·q_t), value head h reading q/k head h // (HV // H). Returns (o, final state)."""
  q, k, v, g, beta = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v, g, beta))
  B, T, H, K = q.shape
  HV, V = v.shape[2], v.shape[3]
  scale = K ** -0.5 if scale is None else scale
  S = (np.zeros((B, HV, K, V)) if initial_state is None
       else np.asarray(initial_state, np.float64).copy())
  o = np.zeros((B, T, HV, V))
  eye = np.eye(K)
  for b in range(B):
    for h in range(HV):
      hq = h // (HV // H)
      for t in range(T):
        kt = k[b, t, hq][:, None]
        S[b, h] = (eye - beta[b, t, h] * kt @ kt.T) @ np.diag(np.exp(g[b, t, h])) @ S[b, h] \
            + beta[b, t, h] * kt @ v[b, t, h][None, :]
        o[b, t, h] = S[b, h].T @ (scale * q[b, t, hq])
  return o, S
