"""K3's MoonViT-V2: the packed tower against the plain-JAX per-image reference, and its exact size."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moonshot_jax.config import ConfigError
from moonshot_jax.vision import VisionTower, encode_images, init_vision, k3_vision, patch_layout
from moonshot_jax.vision.config import VisionConfig
from moonshot_jax.vision.encoder import layout_arrays
from moonshot_jax.vision.reference import reference_tower


def _randomize(variables, seed):
  leaves, tree = jax.tree_util.tree_flatten(nn.meta.unbox(variables))
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  out = [(1.0 if x.ndim == 1 else 0.0) + (0.2 if x.ndim == 1 else 0.1) * jax.random.normal(k, x.shape)
         for k, x in zip(keys, leaves)]
  return jax.tree_util.tree_unflatten(tree, out)


def test_k3_tower_matches_reference():
  cfg = k3_vision(out_dim=40, width=48, num_heads=3, head_dim=24, mlp_dim=64, n_layers=2,
                  pos_emb_height=6, pos_emb_width=6, attn_block_size=32)
  variables = _randomize(init_vision(cfg, jax.random.PRNGKey(0)), 1)
  assert "bias" not in str(jax.tree_util.tree_structure(variables))
  grid = np.array([[1, 4, 6], [2, 8, 4], [1, 6, 6], [1, 2, 2]])  # up/down-sampled grids, a 2-frame clip
  n = int(np.prod(grid, 1).sum())
  pixels = np.random.RandomState(0).uniform(-1, 1, (n, 3, 14, 14)).astype(np.float32)
  ours = encode_images(variables, cfg, pixels, grid)
  ref = reference_tower(cfg, variables["params"], pixels, grid)
  assert ours.shape == ref.shape == (6 + 8 + 9 + 1, 40)
  assert float(jnp.max(jnp.abs(ours - ref)) / jnp.max(jnp.abs(ref))) <= 1e-4


def test_k3_parameter_count_exact():
  cfg = k3_vision()
  layout = layout_arrays(patch_layout(cfg, np.array([[1, 2, 2]])))
  shapes = jax.eval_shape(lambda: VisionTower(cfg).init(jax.random.PRNGKey(0), jnp.zeros((4, 3, 14, 14)), layout))
  shapes = nn.meta.unbox(shapes)["params"]
  count = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree))  # noqa: E731
  assert count(shapes["encoder"]) == 401_214_464
  assert count(shapes["projector"]) == 46_144_512


def test_qk_norm_is_opt_in_matches_reference_and_bounds_the_logits():
  cfg = k3_vision(out_dim=40, width=48, num_heads=3, head_dim=24, mlp_dim=64, n_layers=2,
                  pos_emb_height=6, pos_emb_width=6, attn_block_size=32)
  assert not cfg.qk_norm and "q_norm" not in str(jax.tree_util.tree_structure(init_vision(cfg, jax.random.PRNGKey(0))))
  grid = np.array([[1, 4, 6], [2, 4, 4], [1, 6, 6]])
  n = int(np.prod(grid, 1).sum())
  pixels = np.random.RandomState(0).uniform(-1, 1, (n, 3, 14, 14)).astype(np.float32)

  def q_k_scaled(variables, cq, ck):  # q's and k's columns of every block's fused qkv times cq, ck
    p = jax.tree_util.tree_map(lambda x: x, variables)
    for name, blk in p["params"]["encoder"].items():
      if name.startswith("block_"):
        blk["wqkv"]["kernel"] = blk["wqkv"]["kernel"] * jnp.array([cq, ck, 1.0])[None, :, None, None]
    return p

  on = cfg.replace(qk_norm=True)
  var_on = _randomize(init_vision(on, jax.random.PRNGKey(0)), 2)
  assert var_on["params"]["encoder"]["block_1"]["q_norm"]["scale"].shape == (24,)
  ours = encode_images(var_on, on, pixels, grid)
  ref = reference_tower(on, var_on["params"], pixels, grid)
  assert float(jnp.max(jnp.abs(ours - ref)) / jnp.max(jnp.abs(ref))) <= 1e-4
  # normalised q and k: their scale no longer reaches the logits (it does without the norm)
  big = encode_images(q_k_scaled(var_on, 8.0, 0.25), on, pixels, grid)
  assert float(jnp.max(jnp.abs(big - ours)) / jnp.max(jnp.abs(ours))) <= 1e-4
  var_off = jax.tree_util.tree_map(lambda x: x, var_on)
  for blk in ("block_0", "block_1"):
    for nm in ("q_norm", "k_norm"):
      del var_off["params"]["encoder"][blk][nm]
  plain = encode_images(var_off, cfg, pixels, grid)
  plain_big = encode_images(q_k_scaled(var_off, 8.0, 0.25), cfg, pixels, grid)
  assert float(jnp.max(jnp.abs(plain_big - plain)) / jnp.max(jnp.abs(plain))) > 1e-2


def test_qk_norm_bad_value_names_the_key():
  with pytest.raises(ConfigError, match="vision.qk_norm"):
    k3_vision(out_dim=40, qk_norm=1)
  with pytest.raises(ConfigError, match="vision.qk_norm"):
    VisionConfig.from_dict({"qk_norm": "yes"})


def test_attn_backward_bad_value_names_the_key():
  with pytest.raises(ConfigError, match="vision.attn_backward"):
    VisionConfig.from_dict({"attn_backward": "fast"})
