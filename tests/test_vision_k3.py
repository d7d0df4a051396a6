"""K3's MoonViT-V2: the packed tower against the plain-JAX per-image reference, and its exact size."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from moonshot_jax.vision import VisionTower, encode_images, init_vision, k3_vision, patch_layout
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
