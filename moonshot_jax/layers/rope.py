"""Rotary position embedding (RoPE), half-split ("rotate_half") layout, computed in fp32.

Used only by MLA when cfg.mla_use_rope (K3 / Kimi Linear run NoPE and never call this).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_frequencies(rot_dim: int, theta: float) -> jax.Array:
  """[rot_dim // 2] inverse frequencies theta^(-2i / rot_dim)."""
  if rot_dim <= 0 or rot_dim % 2:
    raise ValueError(f"rot_dim: expected a positive even int, got {rot_dim}")
  return theta ** (-jnp.arange(0, rot_dim, 2, dtype=jnp.float32) / rot_dim)


def apply_rope(x_BTHR: jax.Array, positions_BT: jax.Array, theta: float) -> jax.Array:
  """Rotates pairs (x[..., i], x[..., i + R/2]) by angle position · theta^(-2i/R).

  x_BTHR: [B, T, H, R] (H may be 1 for MLA's shared rope key); positions_BT: [B, T] ints.
  Returns x's dtype; the rotation itself runs in fp32.
  """
  if x_BTHR.ndim != 4:
    raise ValueError(f"x_BTHR: expected [B, T, H, R], got shape {x_BTHR.shape}")
  if positions_BT.shape != x_BTHR.shape[:2]:
    raise ValueError(f"positions_BT: expected shape {x_BTHR.shape[:2]}, got {positions_BT.shape}")
  rot_dim = x_BTHR.shape[-1]
  inv_freq_R2 = rope_frequencies(rot_dim, theta)
  angle_BTR2 = positions_BT.astype(jnp.float32)[..., None] * inv_freq_R2
  cos_BT1R2 = jnp.cos(angle_BTR2)[:, :, None, :]
  sin_BT1R2 = jnp.sin(angle_BTR2)[:, :, None, :]
  x32 = x_BTHR.astype(jnp.float32)
  x1, x2 = x32[..., : rot_dim // 2], x32[..., rot_dim // 2:]
  out = jnp.concatenate([x1 * cos_BT1R2 - x2 * sin_BT1R2, x2 * cos_BT1R2 + x1 * sin_BT1R2], axis=-1)
  return out.astype(x_BTHR.dtype)
