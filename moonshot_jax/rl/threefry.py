"""Per-row Gumbel noise for the decode loop: jax.random's default (threefry) draws, bit for bit, with
the Threefry-2x32 hash written out.

  fold_in(keys_B2, pos_B)  == key_data(vmap(jax.random.fold_in)(keys, pos))      [B, 2] uint32
  gumbel(keys_B2, V)       == vmap(lambda k: jax.random.gumbel(k, (V,)))(keys)    [B, V] float32

keys are raw key data ([B, 2] uint32, jax.random.key_data of default-implementation keys). Why not
jax.random itself: on CPU jax lowers the hash as a 5-iteration while loop (to keep compile times
down), which XLA runs as separate passes over the [B, V] counters; written out, the 20 rounds fuse
into one pass (session 16: ~270 -> ~140 us per [64, 512] draw). tests/test_rl_rollout.py checks the
equality with jax.random.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_U = jnp.uint32
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def threefry2x32(k0, k1, x0, x1):
  """The Threefry-2x32 block cipher (20 rounds, key schedule every 4) on broadcastable uint32 arrays."""
  ks = (k0, k1, k0 ^ k1 ^ _U(0x1BD11BDA))
  x0, x1 = x0 + ks[0], x1 + ks[1]
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x0 = x0 + x1
      x1 = x0 ^ ((x1 << _U(r)) | (x1 >> _U(32 - r)))
    x0, x1 = x0 + ks[(i + 1) % 3], x1 + ks[(i + 2) % 3] + _U(i + 1)
  return x0, x1


def fold_in(keys_B2: jax.Array, pos_B: jax.Array) -> jax.Array:
  """jax.random.fold_in per row with a non-negative int32 datum (its 64-bit seed: high word 0)."""
  h0, h1 = threefry2x32(keys_B2[:, 0], keys_B2[:, 1], jnp.zeros(pos_B.shape, _U), pos_B.astype(_U))
  return jnp.stack([h0, h1], -1)


def random_bits(keys_B2: jax.Array, V: int) -> jax.Array:
  """jax.random.bits(key, (V,)) per row, [B, V] uint32, in either jax_threefry_partitionable mode:
  partitionable: both output words of threefry(key, (0, i)) xor-ed; otherwise the counters 0..V-1
  (padded to even with a 0) split in halves, hashed as pairs (i, i + half), the outputs concatenated."""
  k0, k1 = keys_B2[:, :1], keys_B2[:, 1:]
  if jax.config.jax_threefry_partitionable:
    lo_1V = jnp.arange(V, dtype=_U)[None, :]
    b0, b1 = threefry2x32(k0, k1, jnp.zeros_like(lo_1V), lo_1V)
    return b0 ^ b1
  half = (V + 1) // 2
  i_1H = jnp.arange(half, dtype=_U)[None, :]
  b0, b1 = threefry2x32(k0, k1, i_1H, jnp.where(i_1H + half < V, i_1H + half, _U(0)))
  return jnp.concatenate([b0, b1], -1)[:, :V]


def gumbel(keys_B2: jax.Array, V: int) -> jax.Array:
  """jax.random.gumbel(key, (V,)) per row, float32: -log(-log(u)), u uniform in [tiny, 1) from the
  top 23 bits of `random_bits`."""
  one = jax.lax.bitcast_convert_type((random_bits(keys_B2, V) >> _U(9)) | _U(0x3F800000), jnp.float32)  # [1, 2)
  tiny = jnp.float32(np.finfo(np.float32).tiny)
  u = jnp.maximum(tiny, (one - jnp.float32(1.0)) * (jnp.float32(1.0) - tiny) + tiny)
  return -jnp.log(-jnp.log(u))
