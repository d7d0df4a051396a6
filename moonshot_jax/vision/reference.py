"""Plain-JAX reference of the vision tower, one image at a time, straight from the definition.

No packing, no layout tables, no blocked attention: each image's position grid is resized with
`jax.image.resize` (bilinear, no antialias: exact for K3's bilinear grid; K2.5's bicubic clamps
border taps where jax renormalises, so use transformers for K2.5), attention is a dense softmax over
the image, the merger a reshape. The test oracle of the K3 variant.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moonshot_jax.vision.config import VisionConfig
from moonshot_jax.vision.encoder import time_table


def _norm(cfg, p, x, kind=None):
  kind = kind or cfg.norm
  if kind == "rmsnorm":
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * p["scale"]
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / jnp.sqrt(var + cfg.norm_eps) * p["scale"] + p["bias"]


def _lin(p, x, spec):
  y = jnp.einsum(spec, x, p["kernel"])
  return y + p["bias"] if "bias" in p else y


def _rope(x_hwHD, theta):
  """Rotate (pairs i, i + D/2); pair i turns by col (even i) or row (odd i) times freq i // 2."""
  h, w, _, d = x_hwHD.shape
  f = theta ** (-np.arange(d // 4) * 4.0 / d)
  rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
  ang = np.zeros((h, w, d // 2))
  ang[..., 0::2] = cols[..., None] * f
  ang[..., 1::2] = rows[..., None] * f
  c, s = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
  a, b = x_hwHD[..., : d // 2], x_hwHD[..., d // 2:]
  return jnp.concatenate([a * c - b * s, b * c + a * s], -1)


def reference_tower(cfg: VisionConfig, params: dict, pixel_values, grid_thw) -> jax.Array:
  """[n_tokens, out_dim] for the images in order."""
  enc, proj = params["encoder"], params["projector"]
  p, kh, kw = cfg.patch_size, *cfg.merge_kernel
  out, start = [], 0
  for t, h, w in np.asarray(grid_thw).tolist():
    px = jnp.asarray(pixel_values[start:start + t * h * w], jnp.float32).reshape(t, h, w, -1)
    start += t * h * w
    x = _lin(enc["patch_embed"], px, "thwp,pd->thwd")
    method = "linear" if cfg.interpolation == "bilinear" else "cubic"
    x = x + jax.image.resize(enc["pos_emb"], (h, w, cfg.width), method, antialias=False)
    if t > 1:
      x = x + time_table(cfg.width, cfg.pos_emb_time)[1:t + 1, None, None]
    for i in range(cfg.n_layers):
      b = enc[f"block_{i}"]
      y = _norm(cfg, b["norm1"], x)
      qkv = _lin(b["wqkv"], y, "thwd,dkHD->thwkHD")
      q, k, v = qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]
      if cfg.qk_norm:  # per head, over head_dim, before the rotation
        q, k = _norm(cfg, b["q_norm"], q, "rmsnorm"), _norm(cfg, b["k_norm"], k, "rmsnorm")
      q = jnp.stack([_rope(q[f], cfg.rope_theta) for f in range(t)])
      k = jnp.stack([_rope(k[f], cfg.rope_theta) for f in range(t)])
      q, k, v = (z.reshape(t * h * w, cfg.num_heads, cfg.head_dim) for z in (q, k, v))
      s = jnp.einsum("nHD,mHD->Hnm", q, k) / np.sqrt(cfg.head_dim)
      a = jnp.einsum("Hnm,mHD->nHD", jax.nn.softmax(s, -1), v).reshape(t, h, w, cfg.num_heads, cfg.head_dim)
      x = x + _lin(b["wo"], a, "thwHD,HDd->thwd")
      y = _norm(cfg, b["norm2"], x)
      x = x + _lin(b["fc2"], jax.nn.gelu(_lin(b["fc1"], y, "thwd,df->thwf"), approximate=True), "thwf,fd->thwd")
    x = _norm(cfg, enc["final_norm"], x).mean(0)  # [h, w, d]: frames pooled
    x = x.reshape(h // kh, kh, w // kw, kw, cfg.width).transpose(0, 2, 1, 3, 4)
    x = x.reshape(-1, kh * kw, cfg.width)
    if cfg.projector_norm == "pre":
      x = _norm(cfg, proj["pre_norm"], x, "layernorm")
    x = x.reshape(x.shape[0], -1)
    y = _lin(proj["out_proj"], jax.nn.gelu(_lin(proj["in_proj"], x, "nk,kf->nf"), approximate=False), "nf,fd->nd")
    if cfg.projector_norm == "post":
      y = _norm(cfg, proj["post_norm"], y, "rmsnorm")
    out.append(y)
  return jnp.concatenate(out)
