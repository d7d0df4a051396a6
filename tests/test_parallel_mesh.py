"""Mesh construction, logical->mesh specs, ZeRO-1 / ZeRO-3 shardings (toy model: fast)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from moonshot_jax import experiment
from moonshot_jax.parallel import rules, zero
from moonshot_jax.parallel.mesh import make_mesh, mesh_sizes


def _exp(**mesh):
  cfg = experiment.base_config()
  for k, v in mesh.items():
    cfg.mesh[k] = v
  return cfg


def test_make_mesh_from_experiment_and_mapping():
  m = make_mesh(_exp())
  assert m.axis_names == rules.MESH_AXES and mesh_sizes(m) == dict(pipeline=1, data=8, expert=1, tensor=1)
  m = make_mesh(_exp(pipeline=2, expert=2))
  assert mesh_sizes(m) == dict(pipeline=2, data=2, expert=2, tensor=1)
  m = make_mesh(dict(expert=-1, tensor=2))
  assert mesh_sizes(m) == dict(pipeline=1, data=1, expert=4, tensor=2)
  sub = make_mesh(dict(data=2), jax.devices()[2:4])
  assert list(sub.devices.flat) == jax.devices()[2:4]


@pytest.mark.parametrize("bad,match", [
    (dict(data=-1, expert=-1), "only one axis"),
    (dict(data=3), "multiply to|devices"),
    (dict(data=-1, expert=3), "not divisible"),
    (dict(batch=2), "unknown axis"),
])
def test_make_mesh_rejects_bad_sizes(bad, match):
  with pytest.raises(ValueError, match=match):
    make_mesh(bad)


def test_spec_for_drops_axes_that_do_not_divide():
  mesh = make_mesh(dict(data=2, expert=2, tensor=2))
  r3 = rules.logical_axis_rules("zero3")
  assert zero.spec_for(("embed", "mlp"), (64, 32), r3, mesh) == P("data", "tensor")
  assert zero.spec_for(("embed", "mlp"), (63, 32), r3, mesh) == P(None, "tensor")
  assert zero.spec_for(("expert", "latent", "mlp"), (8, 16, 3), r3, mesh) == P("expert", "data", None)
  # flax gives a mesh axis to the first dim that asks for it: [embed, latent] splits embed only
  assert zero.spec_for(("embed", "latent"), (64, 16), r3, mesh) == P("data", None)
  assert zero.spec_for(("norm",), (64,), r3, mesh) == P(None)
  with pytest.raises(ValueError, match="logical_axes"):
    zero.spec_for(("embed",), (4, 4), r3, mesh)
  with pytest.raises(ValueError, match="mesh.strategy"):
    rules.logical_axis_rules("zero2")


class _Toy(nn.Module):
  @nn.compact
  def __call__(self, x_BD):
    w1 = self.param("w1", nn.with_logical_partitioning(nn.initializers.normal(0.3), ("embed", "mlp")), (16, 32))
    w2 = self.param("w2", nn.with_logical_partitioning(nn.initializers.normal(0.3), ("mlp", "embed")), (32, 16))
    s = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (16,))
    return jnp.tanh(x_BD @ w1) @ w2 * s


def _train_one_step(strategy, shape, devices=None):
  mesh = make_mesh(shape, devices)
  model, tx = _Toy(), optax.adamw(1e-2)
  x = jax.random.normal(jax.random.key(1), (8, 16))
  boxed = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
  p_sh = zero.param_shardings(boxed, mesh, strategy)
  o_sh = zero.opt_state_shardings(tx, jax.eval_shape(tx.init, zero.unbox(boxed)), boxed, mesh, strategy)
  x_sh = NamedSharding(mesh, P(("data", "expert")))

  def init():
    params = zero.unbox(model.init(jax.random.key(0), x)["params"])
    return params, tx.init(params)

  def step(params, opt, x):
    grads = jax.grad(lambda p: jnp.mean(model.apply({"params": p}, x) ** 2))(params)
    upd, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, upd), opt

  with jax.set_mesh(mesh):
    params, opt = jax.jit(init, out_shardings=(p_sh, o_sh))()
    new_params, new_opt = jax.jit(step, in_shardings=(p_sh, o_sh, x_sh), out_shardings=(p_sh, o_sh))(
        params, opt, jax.device_put(x, x_sh))
  return new_params, new_opt


def test_zero1_and_zero3_shard_state_over_data_and_train_identically():
  ref_params, _ = _train_one_step("zero1", dict(data=1), jax.devices()[:1])
  p1, o1 = _train_one_step("zero1", dict(data=8))
  p3, o3 = _train_one_step("zero3", dict(data=8))
  local = lambda a: a.addressable_shards[0].data.shape
  # ZeRO-1: params replicated, Adam moments split over data on the embed dim
  assert local(p1["w1"]) == (16, 32) and local(o1[0].mu["w1"]) == (2, 32) and local(o1[0].nu["w2"]) == (32, 2)
  # ZeRO-3: params split too; small vectors stay replicated
  assert local(p3["w1"]) == (2, 32) and local(p3["w2"]) == (32, 2) and local(p3["scale"]) == (16,)
  for p in (p1, p3):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7),
                 p, ref_params)
