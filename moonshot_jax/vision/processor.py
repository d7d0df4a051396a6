"""Images (PIL or numpy) and short clips -> `pixel_values [n_patches, 3, p, p]`, `grid_thw [n, 3]`.

The layout of HF transformers' Kimi K2.5 image processor:
  1. to RGB: transparency is composited onto white (PIL's alpha_composite), grayscale is repeated;
  2. resize (bicubic, Pillow) so the image holds <= max_patches patches and <= max_patches_per_side
     patches per side, never upscaling: scale = min(1, sqrt(max_patches / (h//p * w//p)),
     side*p/h, side*p/w), new size = max(1, int(size * scale));
  3. pad bottom/right with zeros to a multiple of merge * patch (28 px);
  4. (x - 127.5) / 127.5 (rescale 1/255 then mean = std = 0.5, fused as HF does);
  5. patches in raster order per image, each [3, p, p].
A clip is a list of frames (or a [T, H, W, C] array) of one size: every frame goes through the same
steps and the frames follow each other in `pixel_values`, grid (T, h, w).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from PIL import Image

from moonshot_jax.vision.config import VisionConfig


def resized_size(cfg: VisionConfig, height: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
  """((resized h, w), (padded h, w)) in pixels."""
  p, side = cfg.patch_size, cfg.max_patches_per_side
  count = max(1.0, height // p) * max(1.0, width // p)
  scale = min(1.0, math.sqrt(cfg.max_patches / count), side * p / height, side * p / width)
  new_h = min(max(1, int(height * scale)), side * p)
  new_w = min(max(1, int(width * scale)), side * p)
  factor = cfg.merge_kernel[0] * p, cfg.merge_kernel[1] * p
  return (new_h, new_w), (new_h + (-new_h) % factor[0], new_w + (-new_w) % factor[1])


def to_rgb(image, what: str = "image") -> Image.Image:
  """A PIL RGB image of a PIL image or a uint8 / [0, 1]-float numpy array (HW or HWC, C in 1, 3, 4)."""
  if isinstance(image, Image.Image):
    if image.width == 0 or image.height == 0:
      raise ValueError(f"{what}: empty image ({image.width}x{image.height})")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
      white = Image.new("RGBA", image.size, (255, 255, 255, 255))
      return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")
  arr = np.asarray(image)
  if arr.ndim == 3 and arr.shape[-1] not in (1, 3, 4):
    raise ValueError(f"{what}: expected 1, 3 or 4 channels (HWC), got shape {arr.shape}")
  if arr.ndim not in (2, 3):
    raise ValueError(f"{what}: expected an HW or HWC array, got shape {arr.shape}")
  if arr.shape[0] == 0 or arr.shape[1] == 0:
    raise ValueError(f"{what}: empty image (shape {arr.shape})")
  if np.issubdtype(arr.dtype, np.floating):
    if not np.isfinite(arr).all():
      raise ValueError(f"{what}: {int((~np.isfinite(arr)).sum())} non-finite pixel value(s)")
    if arr.min() < 0 or arr.max() > 1:
      raise ValueError(f"{what}: float pixels must lie in [0, 1], got [{arr.min()}, {arr.max()}]")
    arr = np.round(arr * 255.0).astype(np.uint8)
  elif arr.dtype != np.uint8:
    raise ValueError(f"{what}: expected uint8 or float pixels, got dtype {arr.dtype}")
  if arr.ndim == 3 and arr.shape[-1] == 1:
    arr = arr[..., 0]
  mode = {2: "L", 3: "RGB", 4: "RGBA"}[1 if arr.ndim == 2 else arr.shape[-1]] if arr.ndim == 3 else "L"
  return to_rgb(Image.fromarray(arr, mode=mode), what)


def _frame_pixels(cfg: VisionConfig, rgb: Image.Image, size) -> np.ndarray:
  (h, w), (ph, pw) = size
  if (rgb.height, rgb.width) != (h, w):
    rgb = rgb.resize((w, h), Image.Resampling.BICUBIC)
  x = np.zeros((ph, pw, 3), np.uint8)
  x[:h, :w] = np.asarray(rgb)
  x = (x.astype(np.float32) - np.float32(127.5)) / np.float32(127.5)
  p = cfg.patch_size
  x = x.reshape(ph // p, p, pw // p, p, 3).transpose(0, 2, 4, 1, 3)
  return x.reshape(-1, 3, p, p)


def preprocess(images: Sequence, cfg: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
  """(pixel_values [n_patches, 3, p, p] float32, grid_thw [n_images, 3] int64) of images and clips.

  Each item is an image, or a clip: a list / tuple of frames or a 4-D [T, H, W, C] array.
  """
  if isinstance(images, (Image.Image, np.ndarray)) and not (isinstance(images, np.ndarray) and images.ndim == 4):
    images = [images]
  if len(images) == 0:
    raise ValueError("images: expected at least one image")
  if cfg.in_channels != 3:
    raise ValueError(f"vision.in_channels={cfg.in_channels}: the processor makes RGB patches")
  pixels, grids = [], []
  for i, item in enumerate(images):
    frames = list(item) if isinstance(item, (list, tuple)) or (isinstance(item, np.ndarray) and item.ndim == 4) \
        else [item]
    if not frames:
      raise ValueError(f"images[{i}]: a clip with no frames")
    if len(frames) > cfg.pos_emb_time:
      raise ValueError(f"images[{i}]: a clip of {len(frames)} frames is longer than the time table "
                       f"(vision.pos_emb_time={cfg.pos_emb_time})")
    rgbs = [to_rgb(f, f"images[{i}]" + (f" frame {j}" if len(frames) > 1 else "")) for j, f in enumerate(frames)]
    if len({r.size for r in rgbs}) != 1:
      raise ValueError(f"images[{i}]: clip frames differ in size {sorted({r.size for r in rgbs})}")
    size = resized_size(cfg, rgbs[0].height, rgbs[0].width)
    pixels += [_frame_pixels(cfg, r, size) for r in rgbs]
    grids.append((len(rgbs), size[1][0] // cfg.patch_size, size[1][1] // cfg.patch_size))
  return np.concatenate(pixels), np.asarray(grids, np.int64)
