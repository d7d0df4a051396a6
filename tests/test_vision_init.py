"""Init scales of the from-scratch tower (vl_tiny): patches that differ only in position must give
different tokens at step 0, and the projector's output RMS is what the config says."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import numpy as np
from PIL import Image

from moonshot_jax.experiment import vision_config
from moonshot_jax.vision.encoder import encode_images, init_vision
from moonshot_jax.vision.processor import preprocess

ROOT = Path(__file__).resolve().parents[1]


def _vl_tiny_vision():
  spec = importlib.util.spec_from_file_location("vl_tiny", ROOT / "experiments" / "vl_tiny.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return vision_config(mod.get_config())


def _max_token_cosine(vcfg, seed=0):
  variables = init_vision(vcfg, jax.random.PRNGKey(seed))
  blank = Image.new("RGB", (56, 56), (255, 255, 255))  # one colour: only position tells patches apart
  pixel_values, grid = preprocess([blank], vcfg)
  tok = np.asarray(encode_images(variables, vcfg, pixel_values, grid), np.float64)  # 4 tokens
  u = tok / np.linalg.norm(tok, axis=1, keepdims=True)
  cos = u @ u.T
  return float(cos[~np.eye(len(u), dtype=bool)].max()), tok


def test_vl_tiny_tokens_carry_position_at_init():
  # a position grid at 0.02 next to unit-scale patch features gives four identical tokens (cos 0.99994);
  # the vl_tiny init scales give 0.92 (measured without the test conftest)
  vcfg = _vl_tiny_vision()
  worst, tok = _max_token_cosine(vcfg)
  assert worst < 0.99, f"tokens of a one-colour image are nearly collinear at init (max cosine {worst:.4f})"
  if vcfg.projector_norm == "post":  # the tokens enter the LM at the configured RMS
    rms = np.sqrt(np.mean(tok ** 2, axis=1))
    np.testing.assert_allclose(rms, vcfg.proj_norm_init, rtol=1e-3)
