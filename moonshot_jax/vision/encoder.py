"""MoonViT / MoonViT-V2 encoder, patch merger and projector (Flax Linen), and `encode_images`.

  patches [N, 3*14*14] -> x = patches W_patch (+b)             (the stride-14 conv as one matmul)
  x += pos_grid resampled to each image's (h, w) + time_table[frame]   (layout.py: weighted gather)
  n_layers x pre-norm blocks: x += Wo attn(RoPE2d(q), RoPE2d(k), v; within each image/clip)
                              (opt-in, not K2.5 / K3: q, k = RMSNorm(q), RMSNorm(k) over head_dim first)
                              x += fc2 gelu_tanh(fc1 norm(x))
  x = norm(x); tokens = mean over frames of each kh x kw neighbourhood, concatenated [M, K*width]
  projector: [LayerNorm per patch (K2.5)] -> Linear -> GELU(erf) -> Linear -> [RMSNorm(d_model) (K3)]

2-D RoPE (head dim D, F = D/4 frequencies theta^(-2f/(D/2))): in the rotate-half layout the first
D/2 angles alternate (col * inv_freq[f], row * inv_freq[f]) for f = 0..F-1 and repeat for the second
half; HF's converted weights use this layout (hf_import.py undoes the hub's interleaved pairs).

Weights carry logical names only (parallel/rules.py): embed, heads, head_dim, mlp, norm, vit_patch,
vit_pos, vit_merged.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from moonshot_jax.layers.linear import project
from moonshot_jax.layers.norms import rms_normalize
from moonshot_jax.vision.attention import packed_attention
from moonshot_jax.vision.config import VisionConfig
from moonshot_jax.vision.layout import PatchLayout, patch_layout


def time_table(width: int, n_frames: int) -> np.ndarray:
  """[n_frames + 1, width]: row 0 is zero (single images), row f + 1 = [sin(f w_i), cos(f w_i)]."""
  inv = 1.0 / (10000.0 ** (np.arange(0, width, 2, dtype=np.float32) / width))
  ang = np.arange(n_frames, dtype=np.float32)[:, None] * inv[None]
  return np.concatenate([np.zeros((1, width), np.float32),
                         np.concatenate([np.sin(ang), np.cos(ang)], 1)]).astype(np.float32)


def rope_angles(pos_hw_N2: jax.Array, head_dim: int, theta: float) -> jax.Array:
  """[N, head_dim] angles in the rotate-half layout described above."""
  half = head_dim // 2
  inv = 1.0 / (theta ** (jnp.arange(0, half, 2, dtype=jnp.float32) / half))  # [D/4]
  pos = pos_hw_N2.astype(jnp.float32)
  ang = jnp.stack([pos[:, 1:2] * inv, pos[:, 0:1] * inv], -1).reshape(pos.shape[0], half)
  return jnp.concatenate([ang, ang], -1)


def apply_rope(x_NHD: jax.Array, ang_ND: jax.Array) -> jax.Array:
  x = x_NHD.astype(jnp.float32)
  cos, sin = jnp.cos(ang_ND)[:, None], jnp.sin(ang_ND)[:, None]
  h = x.shape[-1] // 2
  rot = jnp.concatenate([-x[..., h:], x[..., :h]], -1)
  return (x * cos + rot * sin).astype(x_NHD.dtype)


def attention_segments(seg_N: jax.Array) -> jax.Array:
  """Each padding patch (segment id < 0) as a segment of its own: no merged token reads a padding patch,
  so what it attends to is irrelevant, and a one-row segment keeps the blocked attention from walking
  every block of the padding run (the budget's tail: up to hundreds of patches) for nothing. Real
  patches are untouched (bit for bit: they never attend to padding)."""
  return jnp.where(seg_N < 0, -1 - jnp.arange(seg_N.shape[0], dtype=seg_N.dtype), seg_N)


class Norm(nn.Module):
  """LayerNorm (scale + bias) or RMSNorm (scale only), in fp32."""
  kind: str
  eps: float
  dtype: jnp.dtype = jnp.float32
  scale_init: float = 1.0

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.constant(self.scale_init),
                                                             ("norm",)), (d,), jnp.float32)
    if self.kind == "rmsnorm":
      return (rms_normalize(x, self.eps) * scale).astype(self.dtype)
    bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)), (d,),
                      jnp.float32)
    x32 = x.astype(jnp.float32)
    mu = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mu).mean(-1, keepdims=True)
    return ((x32 - mu) * jax.lax.rsqrt(var + self.eps) * scale + bias).astype(self.dtype)


class Dense(nn.Module):
  """y = einsum(spec, x, W) (+ b); W's first n_in axes are contracted, b has W's other axes."""
  features: tuple[int, ...]
  names: tuple[str | None, ...]
  spec: str
  use_bias: bool
  cfg: VisionConfig
  n_in: int = 1

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    init = nn.initializers.normal(cfg.init_std)
    w = self.param("kernel", nn.with_logical_partitioning(init, self.names), self.features,
                   jnp.dtype(cfg.param_dtype))
    y = project(self.spec, x.astype(cfg.dtype), w)
    if self.use_bias:
      b = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, self.names[self.n_in:]),
                     self.features[self.n_in:], jnp.float32)
      y = y + b
    return y.astype(cfg.dtype)


class Block(nn.Module):
  cfg: VisionConfig

  @nn.compact
  def __call__(self, x_ND, ang_ND, seg_N):
    cfg = self.cfg
    H, Dh, W = cfg.num_heads, cfg.head_dim, cfg.width
    h = Norm(cfg.norm, cfg.norm_eps, cfg.dtype, name="norm1")(x_ND)
    qkv = Dense((W, 3, H, Dh), ("embed", None, "heads", "head_dim"), "nw,wthd->nthd", cfg.use_bias,
                cfg, name="wqkv")(h)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    if cfg.qk_norm:  # opt-in (config.py): bounded logits; not part of K2.5 / K3
      q = Norm("rmsnorm", cfg.norm_eps, cfg.dtype, name="q_norm")(q)
      k = Norm("rmsnorm", cfg.norm_eps, cfg.dtype, name="k_norm")(k)
    q, k = apply_rope(q, ang_ND), apply_rope(k, ang_ND)
    a = packed_attention(q, k, v, seg_N, cfg.attn_block_size, cfg.attn_backward)
    x_ND = x_ND + Dense((H, Dh, W), ("heads", "head_dim", "embed"), "nhd,hdw->nw", cfg.use_bias, cfg,
                        n_in=2, name="wo")(a)
    h = Norm(cfg.norm, cfg.norm_eps, cfg.dtype, name="norm2")(x_ND)
    h = Dense((W, cfg.mlp_dim), ("embed", "mlp"), "nw,wf->nf", cfg.use_bias, cfg, name="fc1")(h)
    h = jax.nn.gelu(h.astype(jnp.float32), approximate=True).astype(cfg.dtype)
    return x_ND + Dense((cfg.mlp_dim, W), ("mlp", "embed"), "nf,fw->nw", cfg.use_bias, cfg,
                        name="fc2")(h)


class Encoder(nn.Module):
  """Patches [N, C, p, p] (or [N, C*p*p]) -> final-normed features [N, width]."""
  cfg: VisionConfig

  @nn.compact
  def __call__(self, patches, layout):
    cfg = self.cfg
    x = patches.reshape(patches.shape[0], -1)
    if x.shape[1] != cfg.patch_dim:
      raise ValueError(f"pixel_values: expected {cfg.patch_dim} values per patch "
                       f"({cfg.in_channels}x{cfg.patch_size}x{cfg.patch_size}), got shape {patches.shape}")
    x = Dense((cfg.patch_dim, cfg.width), ("vit_patch", "embed"), "np,pw->nw", cfg.use_bias, cfg,
              name="patch_embed")(x)
    if cfg.patch_norm:
      x = Norm(cfg.norm, cfg.norm_eps, cfg.dtype, name="patch_norm")(x)
    grid = self.param("pos_emb", nn.with_logical_partitioning(nn.initializers.normal(cfg.pos_init_std),
                                                              ("vit_pos", None, "embed")),
                      (cfg.pos_emb_height, cfg.pos_emb_width, cfg.width), jnp.dtype(cfg.param_dtype))
    table = grid.reshape(-1, cfg.width).astype(jnp.float32)
    pos = jnp.zeros(x.shape, jnp.float32)
    for t in range(layout.interp_index.shape[1]):  # one [N, width] gather per tap, never [N, taps, width]
      pos = pos + table[layout.interp_index[:, t]] * layout.interp_weight[:, t, None]
    pos = pos + jnp.asarray(time_table(cfg.width, cfg.pos_emb_time))[layout.frame_index]
    x = (x.astype(jnp.float32) + pos).astype(cfg.dtype)
    ang = rope_angles(layout.pos_hw, cfg.head_dim, cfg.rope_theta)
    seg = attention_segments(layout.segment_ids)
    for i in range(cfg.n_layers):
      x = Block(cfg, name=f"block_{i}")(x, ang, seg)
    return Norm(cfg.norm, cfg.norm_eps, cfg.dtype, name="final_norm")(x)


def merge_patches(x_ND, layout) -> jax.Array:
  """[N, width] -> [M, K, width]: mean over a token's frames of its K kernel patches."""
  g = x_ND[layout.merge_index].astype(jnp.float32)  # [M, T, K, width]
  return jnp.einsum("mtkw,mt->mkw", g, layout.merge_weight)


class Projector(nn.Module):
  """[M, K, width] -> [M, out_dim]."""
  cfg: VisionConfig

  @nn.compact
  def __call__(self, x_MKW):
    cfg = self.cfg
    if cfg.projector_norm == "pre":
      x_MKW = Norm("layernorm", cfg.norm_eps, cfg.dtype, name="pre_norm")(x_MKW)
    x = x_MKW.reshape(x_MKW.shape[0], cfg.merged_dim).astype(cfg.dtype)
    h = Dense((cfg.merged_dim, cfg.merged_dim), ("vit_merged", "mlp"), "nk,kf->nf", cfg.use_bias, cfg,
              name="in_proj")(x)
    h = jax.nn.gelu(h.astype(jnp.float32), approximate=False).astype(cfg.dtype)
    y = Dense((cfg.merged_dim, cfg.out_dim), ("mlp", "embed"), "nf,fd->nd", cfg.use_bias, cfg,
              name="out_proj")(h)
    if cfg.projector_norm == "post":
      y = Norm("rmsnorm", cfg.norm_eps, cfg.dtype, cfg.proj_norm_init, name="post_norm")(y)
    return y


class VisionTower(nn.Module):
  """Encoder + merger + projector: (patches, layout) -> [n_tokens, out_dim] (padding tokens at the end)."""
  cfg: VisionConfig

  def setup(self):
    self.encoder = Encoder(self.cfg)
    self.projector = Projector(self.cfg)

  def __call__(self, patches, layout):
    return self.projector(merge_patches(self.encoder(patches, layout), layout))

  def features(self, patches, layout):
    """Encoder output before merging [N, width] (HF's last_hidden_state)."""
    return self.encoder(patches, layout)


def layout_arrays(layout: PatchLayout):
  """The device half of a layout (a pytree of arrays; the counts stay on the host)."""
  return PatchLayout(*(jnp.asarray(getattr(layout, f)) for f in
                       ("segment_ids", "pos_hw", "frame_index", "interp_index", "interp_weight",
                        "merge_index", "merge_weight")), layout.n_real_patches, layout.n_real_tokens)


jax.tree_util.register_pytree_node(
    PatchLayout,
    lambda l: ((l.segment_ids, l.pos_hw, l.frame_index, l.interp_index, l.interp_weight, l.merge_index,
                l.merge_weight), (l.n_real_patches, l.n_real_tokens)),
    lambda aux, ch: PatchLayout(*ch, *aux))


def check_pixel_values(cfg: VisionConfig, pixel_values, n_patches: int) -> None:
  """Shape and finiteness of host pixel values, naming what is wrong."""
  shape = tuple(np.shape(pixel_values))
  want = (n_patches, cfg.in_channels, cfg.patch_size, cfg.patch_size)
  if len(shape) != 4 or shape[2:] != want[2:]:
    raise ValueError(f"pixel_values: expected shape [n_patches, {cfg.in_channels}, {cfg.patch_size}, "
                     f"{cfg.patch_size}], got {shape}")
  if shape[1] != cfg.in_channels:
    raise ValueError(f"pixel_values: expected {cfg.in_channels} channels per patch, got {shape[1]}")
  if shape[0] != n_patches:
    raise ValueError(f"pixel_values: grid_thw holds {n_patches} patches but pixel_values has {shape[0]}")
  if not isinstance(pixel_values, jax.core.Tracer):
    bad = ~np.isfinite(np.asarray(pixel_values, np.float32))
    if bad.any():
      first = np.argwhere(bad)[0]
      raise ValueError(f"pixel_values: {int(bad.sum())} non-finite value(s), the first at patch {first[0]}")


@functools.lru_cache(maxsize=8)
def _jitted_apply(cfg: VisionConfig):
  return jax.jit(lambda variables, patches, layout: VisionTower(cfg).apply(variables, patches, layout))


def encode_images(variables, vision_cfg: VisionConfig, pixel_values, grid_thw) -> jax.Array:
  """[n_merged_tokens, out_dim]: every image's projected tokens, images in order."""
  layout = patch_layout(vision_cfg, grid_thw)
  check_pixel_values(vision_cfg, pixel_values, layout.n_real_patches)
  return _jitted_apply(vision_cfg)(variables, jnp.asarray(pixel_values), layout_arrays(layout))


def init_vision(vision_cfg: VisionConfig, rng: jax.Array):
  """Variables of a VisionTower (a 1-image 2x2-token dummy layout fixes nothing but shapes)."""
  kh, kw = vision_cfg.merge_kernel
  layout = layout_arrays(patch_layout(vision_cfg, np.array([[1, kh, kw]])))
  patches = jnp.zeros((kh * kw, vision_cfg.in_channels, vision_cfg.patch_size, vision_cfg.patch_size))
  return VisionTower(vision_cfg).init(rng, patches, layout)
