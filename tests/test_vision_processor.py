"""The processor against transformers' Kimi K2.5 image processor, and its bad-input errors.

Pillow's bicubic and torch's uint8 antialiased bicubic (what HF's processor calls) round their
fixed-point weights differently: where an image is downscaled, a few pixels differ by 1-2 levels of
255. Images that need no resizing must match exactly.
"""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from moonshot_jax.vision import k25_vision, k3_vision
from moonshot_jax.vision.processor import preprocess, resized_size

RNG = np.random.RandomState(0)


def _img(h, w, mode="RGB"):
  c = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
  a = (RNG.rand(h, w, c) * 255).astype(np.uint8)
  return Image.fromarray(a[..., 0] if c == 1 else a, mode)


def _hf(images):
  from tests.vision_oracle import hf_image_processor
  out = hf_image_processor()(images, return_tensors="np")
  return out["pixel_values"], out["image_grid_thw"]


def test_exact_for_images_that_keep_their_size():
  images = [_img(37, 61), _img(50, 33, "L"), _img(45, 70, "RGBA"), _img(5, 3), _img(30, 900)]
  pv, grid = preprocess(images, k25_vision())
  pv_hf, grid_hf = _hf(images)
  np.testing.assert_array_equal(grid, grid_hf)
  np.testing.assert_array_equal(pv, pv_hf)


@pytest.mark.parametrize("shape", [(1900, 2000), (40, 7300)], ids=["over_patch_limit", "panorama"])
def test_resized_images_match_up_to_rounding(shape):
  image = _img(*shape)
  pv, grid = preprocess([image], k25_vision())
  pv_hf, grid_hf = _hf([image])
  np.testing.assert_array_equal(grid, grid_hf)
  assert grid[0, 1] * grid[0, 2] <= 16384 + 2 * (grid[0, 1] + grid[0, 2]) and grid[0, 2] <= 512 + 1
  diff = np.abs(pv - pv_hf) * 127.5  # in levels of 255
  assert diff.max() <= 2.0 + 1e-3 and (diff > 1e-3).mean() < 0.01


def test_k3_limits_and_a_clip():
  cfg = k3_vision()
  (h, w), (ph, pw) = resized_size(cfg, 3584, 3584)
  assert (h, w, ph, pw) == (3584, 3584, 3584, 3584)  # 65,536 patches fit K3, not K2.5
  assert resized_size(k25_vision(), 3584, 3584)[0] == (1792, 1792)
  frames = [np.full((30, 40, 3), v, np.uint8) for v in (0, 128, 255)]
  pv, grid = preprocess([frames, _img(28, 28)], cfg)
  assert grid.tolist() == [[3, 4, 4], [1, 2, 2]] and pv.shape == (3 * 16 + 4, 3, 14, 14)
  np.testing.assert_array_equal(pv[16, :, 0, 0], np.float32(0.5) / np.float32(127.5))


@pytest.mark.parametrize("bad, match", [
    (np.zeros((10, 10, 2), np.uint8), "expected 1, 3 or 4 channels"),
    (np.zeros((0, 10, 3), np.uint8), "empty image"),
    (np.full((10, 10, 3), np.nan, np.float32), "non-finite"),
    ([np.zeros((28, 28, 3), np.uint8)] * 5, "longer than the time table"),
])
def test_bad_inputs_name_the_culprit(bad, match):
  with pytest.raises(ValueError, match=match):
    preprocess([bad], k25_vision())
