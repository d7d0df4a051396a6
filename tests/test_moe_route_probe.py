"""launch/moe_route_probe.py: the per-layer capture and the token-identity bound, against numpy."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from launch.moe_route_probe import capture_moe_inputs, exact_shift, probe_layer
from moonshot_jax import experiment
from moonshot_jax.model.transformer import Transformer, layer_variables


def test_identical_tokens_bound_the_balance_and_fill_the_top_expert():
  """40% of the tokens share one id and one router input: no bias can split them, so each of their
  k experts carries >= 0.4 * E / k times the mean load, whatever the balancing."""
  t, d, e, k = 400, 8, 16, 2
  rng = np.random.default_rng(0)
  x = rng.standard_normal((t, d)).astype(np.float32)
  tokens = rng.integers(10, 200, t)
  hot = rng.random(t) < 0.4
  x[hot], tokens[hot] = x[0], 7
  layer = {"x": x, "w": np.ones((t,), np.float32), "router": rng.standard_normal((d, e)).astype(np.float32),
           "bias": np.zeros((e,), np.float32)}
  res = probe_layer(layer, tokens, k)
  bound = hot.mean() * e / k
  np.testing.assert_allclose(res["id_bound"], bound, rtol=1e-6)
  assert res["top_expert_one_id_share"] > 0.75  # the 160 identical copies, plus the few the rest adds
  for key in ("stored", "hist64_4", "exact_8"):
    assert res[key] >= bound - 1e-6, (key, res[key], bound)
  assert res["copies_per_expert"] == t * k / e


def test_exact_shift_balances_distinct_tokens():
  t, e, k = 3000, 8, 2
  rng = np.random.default_rng(1)
  s = 1 / (1 + np.exp(-(rng.standard_normal((t, e)) + np.linspace(-2, 2, e))))
  w = np.ones((t,), np.float32)
  b = np.zeros((e,))
  load = lambda bias: np.bincount(np.argsort(-(s + bias), -1)[:, :k].reshape(-1), minlength=e) / (t * k / e)
  assert load(b).max() > 2.5
  assert load(exact_shift(s, b, w, k, 8)).max() < 1.1


@pytest.mark.slow  # ~10 s CPU: an eager forward of tiny
def test_capture_takes_every_moe_layer_input_in_order():
  cfg = experiment.model_config(experiment.load_experiment("experiments/tiny.py"))
  tok = jnp.asarray(np.random.default_rng(2).integers(0, 256, (2, 16)), jnp.int32)
  shapes = nn.meta.unbox(jax.eval_shape(Transformer(cfg).init, jax.random.key(0), tok))
  r = np.random.default_rng(3)
  variables = jax.tree.map(lambda s: (r.standard_normal(s.shape) * 0.1 + (len(s.shape) == 1)).astype(np.float32),
                           shapes)
  batch = {"tokens": np.asarray(tok), "segment_ids": np.ones((2, 16), np.int32),
           "positions": np.tile(np.arange(16, dtype=np.int32), (2, 1))}
  layers = capture_moe_inputs(cfg, variables, batch)
  moe_layers = [i for i, (_, ffn) in enumerate(cfg.layer_kinds) if ffn == "moe"]
  assert len(layers) == len(moe_layers) == 2
  for layer, i in zip(layers, moe_layers):
    assert layer["x"].shape == (32, cfg.d_model) and layer["w"].shape == (32,)
    want = layer_variables(variables, cfg, i)["params"]["ffn"]["moe"]["router"]
    np.testing.assert_array_equal(layer["router"], want)
  assert np.abs(layers[0]["x"] - layers[1]["x"]).max() > 1e-3  # two different layers' inputs
