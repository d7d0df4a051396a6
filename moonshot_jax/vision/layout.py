"""Host-side metadata of a packed batch of images and clips, computed once from `grid_thw`.

Many images of different sizes share one patch sequence (raster order per image, frames of a clip one
after another), so everything that depends on the grid sizes is precomputed here in numpy and the jitted
encoder sees only static shapes: pad `n_patches` / `n_tokens` to a budget and one compile serves every
batch. Padding patches get segment id -1 (the encoder gives each its own one-row attention segment) and
padding merged tokens gather nothing (weight 0).

Position-grid resampling is a weighted gather (separable taps, half-pixel centres, border-clamped
taps, no antialias): bilinear = 2x2 taps, bicubic = 4x4 taps of the Keys kernel with a = -0.75, which
is what `F.interpolate(align_corners=False)` computes when upsampling and what HF's Kimi K2.5 uses at
every size.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from moonshot_jax.vision.config import VisionConfig


@dataclasses.dataclass(frozen=True)
class PatchLayout:
  segment_ids: np.ndarray  # [N] int32: image index, -1 for padding
  pos_hw: np.ndarray  # [N, 2] int32: (row, col) of the patch in its image (2-D RoPE)
  frame_index: np.ndarray  # [N] int32: 0 = no time embedding (single images), f + 1 for frame f of a clip
  interp_index: np.ndarray  # [N, taps] int32 into the flattened position grid
  interp_weight: np.ndarray  # [N, taps] float32
  merge_index: np.ndarray  # [M, T, K] int32: the T frames x K kernel patches that pool into token m
  merge_weight: np.ndarray  # [M, T] float32: 1/t on real frames, 0 elsewhere (and on padding tokens)
  n_real_patches: int
  n_real_tokens: int


def _check_grid(cfg: VisionConfig, grid_thw) -> np.ndarray:
  grid = np.asarray(grid_thw)
  if grid.ndim != 2 or grid.shape[1] != 3 or grid.shape[0] == 0:
    raise ValueError(f"grid_thw: expected shape [n_images, 3] with n_images >= 1, got {grid.shape}")
  if not np.issubdtype(grid.dtype, np.integer):
    raise ValueError(f"grid_thw: expected integers, got dtype {grid.dtype}")
  kh, kw = cfg.merge_kernel
  for i, (t, h, w) in enumerate(grid.tolist()):
    if min(t, h, w) <= 0:
      raise ValueError(f"grid_thw[{i}] = {(t, h, w)}: every entry must be positive (an empty image)")
    if t > cfg.pos_emb_time:
      raise ValueError(f"grid_thw[{i}]: a clip of {t} frames is longer than the time table "
                       f"(vision.pos_emb_time={cfg.pos_emb_time})")
    if h % kh or w % kw:
      raise ValueError(f"grid_thw[{i}] = {(t, h, w)}: h and w must be multiples of the merge kernel "
                       f"{cfg.merge_kernel}")
  return grid.astype(np.int64)


def axis_taps(size: int, side: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
  """Taps [size, n] into a `side`-long source axis and their weights, for a target axis of `size`."""
  src = (np.arange(size, dtype=np.float64) + 0.5) * side / size - 0.5
  floor = np.floor(src)
  offsets = np.arange(0, 2) if mode == "bilinear" else np.arange(-1, 3)
  taps = floor[:, None].astype(np.int64) + offsets
  dist = np.abs(src[:, None] - taps)
  if mode == "bilinear":
    weights = np.clip(1.0 - dist, 0.0, None)
  else:
    a = -0.75
    near = ((a + 2) * dist - (a + 3)) * dist * dist + 1
    far = ((a * dist - 5 * a) * dist + 8 * a) * dist - 4 * a
    weights = np.where(dist <= 1, near, far)
  return np.clip(taps, 0, side - 1), weights


def token_counts(cfg: VisionConfig, grid_thw) -> np.ndarray:
  """Merged tokens per image (what the LM's placeholder runs must hold)."""
  grid = _check_grid(cfg, grid_thw)
  return (grid[:, 1] * grid[:, 2]) // cfg.merge_size


def patch_layout(cfg: VisionConfig, grid_thw, n_patches: int | None = None,
                 n_tokens: int | None = None) -> PatchLayout:
  """The layout of `grid_thw` images packed in order, padded to `n_patches` / `n_tokens` if given."""
  grid = _check_grid(cfg, grid_thw)
  kh, kw = cfg.merge_kernel
  side = cfg.pos_emb_height
  seg, hw, frame, idx, wts, m_idx, m_wts = [], [], [], [], [], [], []
  start = 0
  for i, (t, h, w) in enumerate(grid.tolist()):
    seg.append(np.full(t * h * w, i, np.int32))
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    hw.append(np.tile(np.stack([rows.ravel(), cols.ravel()], -1), (t, 1)))
    frame.append(np.repeat(np.arange(t) + (1 if t > 1 else 0), h * w))
    th, wh = axis_taps(h, side, cfg.interpolation)
    tw, ww = axis_taps(w, side, cfg.interpolation)
    n = th.shape[1]
    ind = (th[:, None, :, None] * side + tw[None, :, None, :]).reshape(h * w, n * n)
    wt = (wh[:, None, :, None] * ww[None, :, None, :]).reshape(h * w, n * n)
    idx.append(np.tile(ind, (t, 1)))
    wts.append(np.tile(wt, (t, 1)))
    # Token (r, c) pools frames x the kh x kw patches below and right of (r*kh, c*kw), row-major.
    base = start + np.arange(t * h * w).reshape(t, h // kh, kh, w // kw, kw)
    base = base.transpose(1, 3, 0, 2, 4).reshape(-1, t, kh * kw)
    pad_t = cfg.pos_emb_time - t
    m_idx.append(np.pad(base, ((0, 0), (0, pad_t), (0, 0))))
    m_wts.append(np.pad(np.full((base.shape[0], t), 1.0 / t), ((0, 0), (0, pad_t))))
    start += t * h * w

  n_real, m_real = start, sum(x.shape[0] for x in m_idx)
  n_patches = n_real if n_patches is None else n_patches
  n_tokens = m_real if n_tokens is None else n_tokens
  if n_real > n_patches:
    raise ValueError(f"n_patches: the images hold {n_real} patches, over the budget of {n_patches}")
  if m_real > n_tokens:
    raise ValueError(f"n_tokens: the images hold {m_real} merged tokens, over the budget of {n_tokens}")
  pn, pm = n_patches - n_real, n_tokens - m_real

  def cat(parts, pad_rows, dtype, fill=0):
    x = np.concatenate(parts).astype(dtype)
    return np.concatenate([x, np.full((pad_rows,) + x.shape[1:], fill, dtype)])

  return PatchLayout(
      segment_ids=cat(seg, pn, np.int32, -1), pos_hw=cat(hw, pn, np.int32),
      frame_index=cat(frame, pn, np.int32), interp_index=cat(idx, pn, np.int32),
      interp_weight=cat(wts, pn, np.float32), merge_index=cat(m_idx, pm, np.int32),
      merge_weight=cat(m_wts, pm, np.float32), n_real_patches=n_real, n_real_tokens=m_real)
