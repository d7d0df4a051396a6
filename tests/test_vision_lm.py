"""The LM with vision inputs: placeholders take the tower's tokens, no loss on image targets, joint
gradients, the count check, and the tower's params sharded by the rules table under a mesh."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moonshot_jax.config import ModelConfig
from moonshot_jax.model.transformer import Transformer
from moonshot_jax.parallel.rules import logical_axis_rules
from moonshot_jax.vision import VisionTower, init_vision, k3_vision, patch_layout
from moonshot_jax.vision.encoder import layout_arrays
from moonshot_jax.vision.multimodal import check_placeholders, text_loss_mask

IMG = 7
VCFG = k3_vision(out_dim=64, width=32, num_heads=2, head_dim=16, mlp_dim=48, n_layers=1, pos_emb_height=4,
                 pos_emb_width=4, attn_block_size=16)
GRID = np.array([[1, 2, 4], [1, 2, 2]])  # 2 + 1 vision tokens


def _setup():
  cfg = ModelConfig(n_layers=2, mla_layers=(2,), dense_layers=(1,), scan_layers=False)
  tokens = np.array([[1, 2, 3, IMG, IMG, 4, IMG, 5, 6, 8]], np.int32)
  lm = Transformer(cfg)
  lm_vars = lm.init(jax.random.PRNGKey(0), jnp.asarray(tokens))
  v_vars = init_vision(VCFG, jax.random.PRNGKey(1))
  pixels = jnp.asarray(np.random.RandomState(0).uniform(-1, 1, (12, 3, 14, 14)).astype(np.float32))
  return cfg, lm, lm_vars, v_vars, tokens, pixels


@pytest.mark.slow  # compiles the LM three times (~60 s on a quiet 2-core box)
def test_placeholders_take_vision_tokens_causally_and_train_jointly():
  cfg, lm, lm_vars, v_vars, tokens, pixels = _setup()
  layout = layout_arrays(patch_layout(VCFG, GRID))
  check_placeholders(tokens, IMG, 3)
  mask = jnp.asarray(tokens == IMG)

  @jax.jit
  def logits_of(v_vars, scale=1.0):
    vis = VisionTower(VCFG).apply(v_vars, pixels * scale, layout)
    return lm.apply(lm_vars, jnp.asarray(tokens), image_mask_BT=mask, vision_MD=vis)[0]

  a, b = logits_of(v_vars), logits_of(v_vars, scale=-1.0)
  np.testing.assert_allclose(a[0, :3], b[0, :3], atol=2e-6)  # before the first image: untouched (fp32 noise)
  assert float(jnp.max(jnp.abs(a[0, 3:] - b[0, 3:]))) > 1e-3
  text_only = jax.jit(lambda: lm.apply(lm_vars, jnp.asarray(tokens))[0])()
  no_image = jax.jit(lambda: lm.apply(lm_vars, jnp.asarray(tokens), image_mask_BT=jnp.zeros_like(mask),
                                      vision_MD=jnp.zeros((3, 64)))[0])()
  np.testing.assert_allclose(no_image, text_only, rtol=1e-6)

  targets = jnp.asarray(np.roll(tokens, -1, 1))
  loss_mask = text_loss_mask(jnp.ones(tokens.shape), targets, IMG)
  assert loss_mask.tolist() == [[1, 1, 0, 0, 1, 0, 1, 1, 1, 1]]

  def loss(v_vars):
    logp = jax.nn.log_softmax(logits_of(v_vars))
    ce = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return jnp.sum(ce * loss_mask) / jnp.sum(loss_mask)

  g = jax.jit(jax.grad(loss))(v_vars)
  assert float(jnp.abs(nn.meta.unbox(g)["params"]["encoder"]["patch_embed"]["kernel"]).max()) > 0
  with pytest.raises(ValueError, match="pass both or neither"):
    lm.apply(lm_vars, jnp.asarray(tokens), image_mask_BT=mask)


def test_placeholder_count_mismatch_names_both_counts():
  with pytest.raises(ValueError, match=r"hold 2 placeholder\(s\) \(id 7\) but the images give 3"):
    check_placeholders(np.array([[1, IMG, IMG]]), IMG, 3)
  check_placeholders(np.array([[1, IMG, IMG, IMG]]), IMG, 3)


@pytest.mark.slow  # ~40 s under load: compiles init and apply on 8 fake devices
def test_vision_params_sharded_by_the_rules_table():
  devices = np.array(jax.devices()[:8]).reshape(4, 2)
  mesh = jax.sharding.Mesh(devices, ("data", "tensor"))
  rules = tuple((k, v) for k, v in logical_axis_rules("zero3") if v is None or v in ("data", "tensor")
                or (isinstance(v, tuple) and all(a in ("data", "tensor") for a in v)))
  layout = layout_arrays(patch_layout(VCFG, GRID))
  pixels = jnp.zeros((12, 3, 14, 14))
  init = lambda: VisionTower(VCFG).init(jax.random.PRNGKey(1), pixels, layout)  # noqa: E731
  with mesh, nn.logical_axis_rules(rules):
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(jax.eval_shape(init)), mesh, rules)
    variables = jax.jit(init, out_shardings=shardings)()
    out = jax.jit(lambda v: VisionTower(VCFG).apply(v, pixels, layout))(variables)
  wqkv = variables["params"]["encoder"]["block_0"]["wqkv"]["kernel"]
  assert wqkv.value.sharding.spec == jax.sharding.PartitionSpec("data", None, "tensor", None)
  ref = VisionTower(VCFG).apply(jax.device_get(nn.meta.unbox(variables)), pixels, layout)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
