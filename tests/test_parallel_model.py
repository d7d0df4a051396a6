"""The tiny model on 8 fake CPU devices: loss and gradients of every parallel layout equal the
single-device Transformer (rel. error <= 1e-5, fp32); training steps give the same losses.

Fast tier: loss, routing statistics and gradients on two meshes that together cover ZeRO-3,
expert, tensor and pipeline x data x expert parallelism (data=2 x expert=2 x tensor=2 with ZeRO-3;
pipeline=2 x data=2 x expert=2); 5 training steps on data=2 x expert=2 x tensor=2 (ZeRO-3) and
data=2 x expert=4. The rest of the grid is `slow`: each mesh compiles the whole model's backward again.
"""
import zlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grad_testutil import assert_grads_close
from moonshot_jax import experiment
from moonshot_jax.model import Transformer, lm_loss
from moonshot_jax.parallel import rules
from moonshot_jax.parallel.expert import EPConfig
from moonshot_jax.parallel.mesh import make_mesh
from moonshot_jax.parallel.parallel_model import ParallelModel

B, T = 8, 32


def _tiny():
  import importlib.util
  spec = importlib.util.spec_from_file_location("tiny", "experiments/tiny.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


@pytest.fixture(scope="module")
def setup():
  cfg = experiment.model_config(_tiny())
  ks = jax.random.split(jax.random.key(0), 5)
  tokens = jax.random.randint(ks[0], (B, T), 0, cfg.vocab_size)
  targets = jax.random.randint(ks[1], (B, T), 0, cfg.vocab_size)
  # two documents per row (segment ids 1, 2) so segment handling is on the path
  seg = jnp.where(jnp.arange(T) < T // 2 + 3, 1, 2)[None].repeat(B, 0).astype(jnp.int32)
  pos = jnp.where(seg == 1, jnp.arange(T), jnp.arange(T) - (T // 2 + 3)).astype(jnp.int32)
  mask = jnp.ones((B, T), jnp.float32)
  variables = nn.meta.unbox(jax.jit(Transformer(cfg).init)(ks[2], tokens, seg, pos))
  # non-zero AttnRes queries and balancing biases: the init's zeros would hide mistakes there
  variables["params"] = jax.tree_util.tree_map_with_path(
      lambda p, x: jax.random.normal(jax.random.fold_in(ks[3], zlib.crc32(str(p).encode()) % 1000), x.shape) * 0.5
      if "query" in str(p) else x, variables["params"])
  # (router-input running variances stay positive: 0.5 + |noise|)
  variables["moe_state"] = jax.tree_util.tree_map_with_path(
      lambda p, x: (0.5 + jnp.abs(jax.random.normal(ks[4], x.shape))) if "input_var" in str(p)
      else jax.random.normal(ks[4], x.shape) * 0.02, variables["moe_state"])
  batch = (tokens, targets, seg, pos, mask)

  def loss(apply, params, moe_state):
    logits, aux = apply({"params": params, "moe_state": moe_state}, tokens, seg, pos)
    return lm_loss(logits, targets, mask, cfg, aux)[0], aux

  return cfg, variables, batch, loss


@pytest.fixture(scope="module")
def ref_grads(setup):
  cfg, variables, _, loss = setup
  return jax.jit(jax.value_and_grad(lambda p, m: loss(Transformer(cfg).apply, p, m), has_aux=True))(
      variables["params"], variables["moe_state"])


# The first AttnRes site (layer 0's mixer) has a single source, the embedding: its softmax weight is
# 1 whatever the query, so that query's true gradient is exactly 0 (fp32 noise on a mesh).
ZERO_GRADS = ("layer_0/mixer/site/query",)


def _parallel(setup, shape):
  cfg, variables, _, loss = setup
  mesh = make_mesh(shape)
  # capacity_factor = E: no token copy can overflow, so the dense dispatch is exact
  pm = ParallelModel(cfg, mesh, EPConfig("dense", capacity_factor=float(cfg.num_experts)))
  return mesh, pm, pm.from_model_layout(variables), loss


def _check_aux(aux, ref_aux):
  # balancing statistics are global-batch sums, not per shard / per microbatch
  np.testing.assert_array_equal(np.asarray(aux["counts"]), np.asarray(ref_aux["counts"]))
  np.testing.assert_allclose(np.asarray(aux["hist"]), np.asarray(ref_aux["hist"]), atol=1e-3)


def _mesh_id(x):
  return "x".join(f"{k}{v}" for k, v in x.items()) if isinstance(x, dict) else str(x)


slow = pytest.mark.slow


# Fast tier: two meshes that between them cover ZeRO-3, expert parallel, tensor parallel and
# pipeline x data x expert (its loss and routing statistics too); the rest of the grid is slow.
@pytest.mark.parametrize("shape,strategy", [
    (dict(data=2, expert=2, tensor=2), "zero3"),
    (dict(pipeline=2, data=2, expert=2), "zero1"),
    pytest.param(dict(data=8), "zero1", marks=slow),
    pytest.param(dict(data=8), "zero3", marks=slow),
    pytest.param(dict(data=2, expert=4), "zero1", marks=slow),
    pytest.param(dict(pipeline=2, expert=2, tensor=2), "zero3", marks=slow),
], ids=_mesh_id)
def test_loss_and_grads_match_single_device(setup, ref_grads, shape, strategy):
  (ref_loss, ref_aux), ref_g = ref_grads
  mesh, pm, pv, loss = _parallel(setup, shape)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules.logical_axis_rules(strategy)):
    (val, aux), grads = jax.jit(jax.value_and_grad(lambda p, m: loss(pm.apply, p, m), has_aux=True))(
        pv["params"], pv["moe_state"])
  np.testing.assert_allclose(float(val), float(ref_loss), rtol=1e-5)
  _check_aux(aux, ref_aux)
  assert_grads_close(pm.to_model_layout({"params": grads})["params"], ref_g, zero=ZERO_GRADS)


def test_layout_round_trip_and_stage_names(setup):
  cfg, variables, *_ = setup
  pm = ParallelModel(cfg, make_mesh(dict(pipeline=2, data=4)))
  pv = pm.from_model_layout(variables)
  assert "stages" in pv["params"] and "layer_0" not in pv["params"]
  back = pm.to_model_layout(pv)
  jax.tree.map(np.testing.assert_array_equal, back["params"], variables["params"])
  boxed = jax.eval_shape(pm.init, jax.random.key(0), jnp.zeros((8, 16), jnp.int32))
  names = {tuple(x.names[:2]) for x in jax.tree.leaves(boxed["params"]["stages"],
                                                        is_leaf=lambda x: hasattr(x, "names"))}
  assert names == {("stage", "layers")}


def test_batch_not_divisible_by_microbatches_raises(setup):
  cfg, variables, *_ = setup
  pm = ParallelModel(cfg, make_mesh(dict(pipeline=2, data=4)), microbatches=3)
  pv = pm.from_model_layout(variables)
  with pytest.raises(ValueError, match="pipeline_microbatches"):
    jax.eval_shape(lambda v: pm.apply(v, jnp.zeros((8, 16), jnp.int32)), pv)


def _train_losses(shape, devices, steps=5, strategy="zero1", router_norm="batch", start=None):
  """Losses of `steps` real train steps (train.state / train.step, AdamW of tiny.py) on fixed batches,
  and the initial train state (host arrays). `start`: such a state (same layout: no pipeline) placed in
  this mesh's shardings instead of compiling the init again (jit's shardings do not change its values;
  the init's compile is ~1/4 of a mesh's cost)."""
  from moonshot_jax.train import optim, state as state_lib, step as step_lib

  exp = _tiny()
  exp.unlock()
  exp.mesh.capacity_factor, exp.mesh.strategy = 8.0, strategy  # 8 = E: nothing can overflow
  exp.model.router_norm = router_norm
  mesh = make_mesh(shape, devices)
  mcfg = experiment.model_config(exp)
  pm = ParallelModel.from_experiment(exp, mesh)
  init_fn = lambda rng: pm.init(rng, jnp.zeros((B, T), jnp.int32))
  setup_ = state_lib.setup_state(init_fn, lambda bp: optim.make_optimizer(exp.optimizer, bp, steps), mesh,
                                 strategy)
  if start is None:
    state = state_lib.create_train_state(setup_, init_fn, 0)
    start = jax.device_get(state)
  else:
    state = jax.device_put(start, setup_.shardings)
  train_step = step_lib.make_train_step(pm.apply, mcfg, setup_, 1)
  rng = np.random.default_rng(0)
  losses = []
  for _ in range(steps):
    toks = rng.integers(0, mcfg.vocab_size, (B, T + 1)).astype(np.int32)
    seg = np.where(np.arange(T) < 20, 1, 2).astype(np.int32)[None].repeat(B, 0)
    batch = dict(tokens=toks[:, :-1], targets=toks[:, 1:], segment_ids=seg,
                 positions=np.where(seg == 1, np.arange(T), np.arange(T) - 20).astype(np.int32),
                 loss_mask=np.ones((B, T), np.int32))
    state, m = train_step(state, {k: jax.device_put(v, step_lib.batch_sharding(mesh)) for k, v in batch.items()})
    losses.append(float(m["loss"]))
  return np.asarray(losses), start


@pytest.fixture(scope="module")
def single_device_losses():
  return _train_losses(dict(data=1), jax.devices()[:1])


@pytest.fixture(scope="module")
def single_device_losses_raw_router():
  return _train_losses(dict(data=1), jax.devices()[:1], router_norm="none")


# Fast tier: two meshes without a pipeline (its train step compiles ~4x longer; the pipeline's
# gradients are checked above in the fast tier).
@pytest.mark.parametrize("shape,strategy", [
    (dict(data=2, expert=2, tensor=2), "zero3"),
    (dict(data=2, expert=4), "zero1"),
    pytest.param(dict(data=8), "zero3", marks=slow),
    pytest.param(dict(pipeline=2, data=2, expert=2), "zero1", marks=slow),
    pytest.param(dict(pipeline=2, expert=2, tensor=2), "zero3", marks=slow),
], ids=_mesh_id)
def test_five_train_steps_match_single_device(request, shape, strategy):
  # router_norm "batch" routes each pipeline microbatch on its own statistics (train/step.py):
  # pipelines match the single device with the raw-input router; data / expert / tensor sharding
  # must match with the batch statistics too (a mean over sharded batch axes is global)
  norm = "none" if shape.get("pipeline", 1) > 1 else "batch"
  ref, start = request.getfixturevalue("single_device_losses" if norm == "batch"
                                        else "single_device_losses_raw_router")
  pipelined = shape.get("pipeline", 1) > 1  # its stage-stacked layout is not the single device's
  losses, _ = _train_losses(shape, jax.devices(), strategy=strategy, router_norm=norm,
                            start=None if pipelined else start)
  np.testing.assert_allclose(losses, ref, rtol=1e-5)
  assert losses[-1] != losses[0]  # it trained
