"""The vision plan: analytic parameter counts equal eval_shape of the real init; k3.py carries the tower."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moonshot_jax import experiment
from moonshot_jax.config import ConfigError
from moonshot_jax.vision import VisionTower, k25_vision, k3_vision, patch_layout
from moonshot_jax.vision.encoder import layout_arrays
from moonshot_jax.vision.plan import forward_flops, param_counts


def _shape_count(cfg):
  layout = layout_arrays(patch_layout(cfg, np.array([[1, 2, 2]])))
  tree = jax.eval_shape(lambda: VisionTower(cfg).init(jax.random.PRNGKey(0), jnp.zeros((4, 3, 14, 14)), layout))
  p = nn.meta.unbox(tree)["params"]
  n = lambda t: sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(t))  # noqa: E731
  return n(p["encoder"]), n(p["projector"])


@pytest.mark.parametrize("cfg", [k3_vision(), k25_vision(), k3_vision(out_dim=64, width=32, num_heads=2,
                                                                       head_dim=24, n_layers=1)],
                         ids=["k3", "k25", "tiny"])
def test_param_counts_match_init(cfg):
  c = param_counts(cfg)
  assert _shape_count(cfg) == (sum(v for k, v in c.items() if k != "projector"), c["projector"])


def test_k3_experiment_has_the_tower_and_flops_scale():
  from experiments import k3
  cfg = k3.get_config()
  vcfg = experiment.vision_config(cfg)
  c = param_counts(vcfg)
  assert sum(c.values()) - c["projector"] == 401_214_464 and c["projector"] == 46_144_512
  f1, f2 = forward_flops(vcfg, 1, 32, 32), forward_flops(vcfg, 1, 64, 64)
  assert f2["mlp"] == 4 * f1["mlp"] and f2["attn_scores"] == 16 * f1["attn_scores"]
  bad = k3.get_config()
  with bad.unlocked():
    bad.vision.out_dim = 100
  with pytest.raises(ConfigError, match="vision.out_dim"):
    experiment.validate(bad)
