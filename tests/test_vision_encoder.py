"""MoonViT encoder / merger / projector against transformers' Kimi K2.5 (torch CPU), and the blocked
packed attention against its dense definition."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moonshot_jax.vision import encode_images
from moonshot_jax.vision.attention import packed_attention, reference_packed_attention
from moonshot_jax.vision.encoder import VisionTower, attention_segments, layout_arrays
from moonshot_jax.vision.layout import patch_layout

# Several images of different sizes (up- and down-sampling the 8x8 grid) and a 3-frame clip.
GRID = np.array([[1, 4, 6], [1, 10, 8], [3, 4, 4], [1, 2, 2]])


def _rel(a, b):
  return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


def test_k25_tower_matches_transformers():
  from tests.vision_oracle import hf_forward, hf_tower, tiny_k25, variables_from_transformers
  cfg = tiny_k25()
  model, proj = hf_tower(cfg)
  variables = variables_from_transformers(cfg, model, proj)
  n = int(np.prod(GRID, 1).sum())
  pixels = np.random.RandomState(1).uniform(-1, 1, (n, 3, 14, 14)).astype(np.float32)
  # transformers cannot pool a clip and single images in one call (ragged frame axis): images, then
  # the clip; ours packs all four together.
  n_img = int(np.prod(GRID[GRID[:, 0] == 1], 1).sum())
  clip = GRID[:, 0] > 1
  assert list(clip) == [False, False, True, False]
  order = np.r_[np.arange(0, 24 + 80), np.arange(24 + 80 + 48, n), np.arange(24 + 80, 24 + 80 + 48)]
  f_img, t_img = hf_forward(model, proj, pixels[order[:n_img]], GRID[~clip])
  f_clip, t_clip = hf_forward(model, proj, pixels[order[n_img:]], GRID[clip])
  back = np.argsort(order)
  feats_hf = np.concatenate([f_img, f_clip])[back]
  tok_order = np.r_[np.arange(0, 6 + 20), np.arange(6 + 20 + 4, 31), np.arange(6 + 20, 6 + 20 + 4)]
  tokens_hf = np.concatenate([t_img, t_clip])[np.argsort(tok_order)]

  layout = layout_arrays(patch_layout(cfg, GRID))
  feats = VisionTower(cfg).apply(variables, jnp.asarray(pixels), layout, method=VisionTower.features)
  assert _rel(feats, feats_hf) <= 1e-4
  tokens = encode_images(variables, cfg, pixels, GRID)
  assert tokens.shape == tokens_hf.shape == ((24 + 80 + 16 + 4) // 4, cfg.out_dim)
  assert _rel(tokens, tokens_hf) <= 1e-4


def test_padding_to_a_budget_leaves_real_tokens_unchanged():
  from tests.vision_oracle import hf_tower, tiny_k25, variables_from_transformers
  cfg = tiny_k25()
  variables = variables_from_transformers(cfg, *hf_tower(cfg))
  n = int(np.prod(GRID, 1).sum())
  pixels = np.random.RandomState(2).uniform(-1, 1, (n, 3, 14, 14)).astype(np.float32)
  exact = encode_images(variables, cfg, pixels, GRID)
  layout = layout_arrays(patch_layout(cfg, GRID, n_patches=n + 37, n_tokens=exact.shape[0] + 5))
  padded = np.concatenate([pixels, np.full((37, 3, 14, 14), 3.0, np.float32)])
  out = VisionTower(cfg).apply(variables, jnp.asarray(padded), layout)
  assert out.shape == (exact.shape[0] + 5, cfg.out_dim)
  np.testing.assert_allclose(out[: exact.shape[0]], exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [5, 64])
def test_packed_attention_value_and_grad(block):
  rng = np.random.RandomState(0)
  seg = np.repeat(np.arange(5), [7, 1, 20, 3, 9]).astype(np.int32)
  q, k, v = (jnp.asarray(rng.randn(seg.size, 2, 8).astype(np.float32)) for _ in range(3))
  w = jnp.asarray(rng.randn(seg.size, 2, 8).astype(np.float32))

  def loss(fn, q, k, v):
    return jnp.sum(fn(q, k, v) * w)

  flash = lambda q, k, v: packed_attention(q, k, v, jnp.asarray(seg), block)  # noqa: E731
  dense = lambda q, k, v: reference_packed_attention(q, k, v, jnp.asarray(seg))  # noqa: E731
  np.testing.assert_allclose(flash(q, k, v), dense(q, k, v), rtol=1e-5, atol=1e-5)
  g_flash = jax.grad(lambda *a: loss(flash, *a), argnums=(0, 1, 2))(q, k, v)
  g_dense = jax.grad(lambda *a: loss(dense, *a), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g_flash, g_dense):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("block", [4, 8])
def test_fused_backward_equals_split_bit_for_bit(block):
  # segments crossing block edges (and one spanning three blocks at block 4): the fused backward adds
  # each gradient's block-pair terms in the split backward's order, so the gradients are equal exactly
  rng = np.random.RandomState(1)
  seg = np.repeat(np.arange(6), [7, 1, 11, 3, 9, 9]).astype(np.int32)  # 40 rows
  q, k, v, w = (jnp.asarray(rng.randn(seg.size, 2, 8).astype(np.float32)) for _ in range(4))

  def grads(backward):
    loss = lambda q, k, v: jnp.sum(packed_attention(q, k, v, jnp.asarray(seg), block, backward) * w)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

  split, fused = grads("split"), grads("fused")
  for name, a, b in zip("qkv", fused, split):
    np.testing.assert_array_equal(a, b, err_msg=f"d{name}")
  with pytest.raises(ValueError, match="backward must be one of"):
    packed_attention(q, k, v, jnp.asarray(seg), block, "fast")


def test_padding_patches_attend_alone():
  # the encoder's segments: padding (id < 0) rows become one-row segments; real rows are bit for bit
  # what they were with the padding as one segment, padding rows return their own value
  seg = np.r_[np.repeat([0, 1], [5, 6]), np.full(9, -1)].astype(np.int32)
  rng = np.random.RandomState(3)
  q, k, v = (jnp.asarray(rng.randn(seg.size, 2, 4).astype(np.float32)) for _ in range(3))
  remapped = attention_segments(jnp.asarray(seg))
  assert len(set(np.asarray(remapped).tolist())) == 2 + 9
  one = packed_attention(q, k, v, jnp.asarray(seg), 4)
  alone = packed_attention(q, k, v, remapped, 4)
  np.testing.assert_array_equal(alone[:11], one[:11])
  np.testing.assert_allclose(alone[11:], v[11:], rtol=1e-6)


def test_bad_inputs_name_the_culprit():
  from moonshot_jax.vision import init_vision
  from tests.vision_oracle import tiny_k25
  cfg = tiny_k25()
  variables = init_vision(cfg, jax.random.PRNGKey(0))
  grid = np.array([[1, 2, 2]])
  ok = np.zeros((4, 3, 14, 14), np.float32)
  with pytest.raises(ValueError, match="expected 3 channels per patch, got 4"):
    encode_images(variables, cfg, np.zeros((4, 4, 14, 14), np.float32), grid)
  with pytest.raises(ValueError, match="non-finite value"):
    encode_images(variables, cfg, np.where(np.arange(4)[:, None, None, None] == 2, np.inf, ok), grid)
  with pytest.raises(ValueError, match="holds 4 patches but pixel_values has 3"):
    encode_images(variables, cfg, ok[:3], grid)
  with pytest.raises(ValueError, match="longer than the time table"):
    encode_images(variables, cfg, np.zeros((20, 3, 14, 14), np.float32), np.array([[5, 2, 2]]))
  with pytest.raises(ValueError, match="empty image"):
    encode_images(variables, cfg, ok, np.array([[1, 0, 2]]))
