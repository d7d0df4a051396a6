"""RMSNorm, computed in fp32 whatever the activation dtype (K3 keeps norms in fp32)."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
  """x / rms(x) over the last axis, in fp32."""
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class RMSNorm(nn.Module):
  """Scale-only RMSNorm over the last axis; the scale is fp32 and tagged `norm` (replicated)."""
  eps: float = 1e-6
  dtype: jnp.dtype = jnp.float32  # output dtype

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                       (x.shape[-1],), jnp.float32)
    return (rms_normalize(x, self.eps) * scale).astype(self.dtype)
