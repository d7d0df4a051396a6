"""Expert parallelism (moonshot_jax/parallel/expert.py) on 8 fake CPU devices.

References are written here independently: every token through every expert densely, then the
top-k outputs picked and weighted — no sorting, no dispatch.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from moonshot_jax.config import ModelConfig
from moonshot_jax.parallel import expert as X
from moonshot_jax.parallel.mesh import make_mesh

E, L, F, T, K = 8, 16, 32, 64, 2
CFG = ModelConfig(num_experts=E, num_experts_per_tok=K, expert_ff_dim=F)


def _inputs(seed=0, skew=0.0):
  ks = jax.random.split(jax.random.key(seed), 6)
  x = jax.random.normal(ks[0], (T, L))
  logits = jax.random.normal(ks[1], (T, E)) + skew * jnp.arange(E)[::-1]  # skew: expert 0 hot
  idx = jax.lax.top_k(logits, K)[1].astype(jnp.int32)
  w = jax.random.uniform(ks[2], (T, K), minval=0.1)
  wg = jax.random.normal(ks[3], (E, L, F)) * 0.3
  wu = jax.random.normal(ks[4], (E, L, F)) * 0.3
  wd = jax.random.normal(ks[5], (E, F, L)) * 0.3
  return x, idx, w, wg, wu, wd


def _reference(x, idx, w, wg, wu, wd, keep=None):
  g = jnp.einsum("tl,elf->tef", x, wg)
  u = jnp.einsum("tl,elf->tef", x, wu)
  y_TEL = jnp.einsum("tef,efl->tel", g * jax.nn.sigmoid(g) * u, wd)
  y_TKL = jnp.take_along_axis(y_TEL, idx[..., None], axis=1)
  if keep is not None:
    y_TKL = y_TKL * keep[..., None]
  return jnp.sum(y_TKL * w[..., None], axis=1)


def _rel(a, b):
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _run(mesh, ep, args, a2a=None, placement=None):
  """Value, stats and gradients (wrt x, w, wg, wu, wd) of sum(sin(y)) through the sharded fn."""
  fn = X.make_expert_fn(mesh, ep, with_stats=True, ragged_all_to_all=a2a)
  x, idx, w, wg, wu, wd = args

  def loss(x, w, wg, wu, wd):
    y, st = fn(x, idx, w, wg, wu, wd, CFG, placement)
    return jnp.sum(jnp.sin(y)), (y, st)

  with jax.set_mesh(mesh):
    (_, (y, st)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(
        x, w, wg, wu, wd)
  return y, st, grads


def _ref_grads(args, keep=None):
  x, idx, w, wg, wu, wd = args
  f = lambda x, w, wg, wu, wd: jnp.sum(jnp.sin(_reference(x, idx, w, wg, wu, wd, keep)))
  return jax.grad(f, argnums=(0, 1, 2, 3, 4))(x, w, wg, wu, wd)


@pytest.mark.parametrize("shape,dispatch", [
    (dict(data=2, expert=4), "dense"),
    (dict(data=2, expert=2, tensor=2), "dense"),
    (dict(expert=4, tensor=2), "ragged"),
])
def test_sharded_matches_reference(shape, dispatch):
  args = _inputs(1)
  mesh = make_mesh(shape)
  a2a = X.emulated_ragged_all_to_all if dispatch == "ragged" else None
  # capacity_factor = E: a buffer that holds every copy even if all pick one expert -> dropless
  y, st, grads = _run(mesh, X.EPConfig(dispatch, capacity_factor=float(E)), args, a2a)
  assert float(st["ep_dropped"]) == 0
  assert _rel(y, _reference(*args)) < 1e-5
  for name, g, r in zip(("x", "w", "w_gate", "w_up", "w_down"), grads, _ref_grads(args)):
    assert _rel(g, r) < 1e-5, name


def test_dispatch_round_trip_is_exact():
  """dispatch then return with identity experts: every copy comes back bit-exactly."""
  mesh = make_mesh(dict(data=2, expert=4))
  x, idx, *_ = _inputs(2)
  n_loc = T // 8 * K
  cap = X.dense_capacity(n_loc, E, float(E))

  def body(x_TL, idx_Tk):
    xin, route = X.dispatch_dense(x_TL, idx_Tk.reshape(-1), k=K, n_slots=E, ep_size=4, cap=cap)
    back = X.return_dense(xin, route, ep_size=4)
    return back.reshape(x_TL.shape[0], K, -1), jax.lax.psum(jnp.sum(~route["keep_N"]), ("data", "expert"))

  with jax.set_mesh(mesh):
    back, dropped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(("data", "expert")),) * 2,
                                          out_specs=(P(("data", "expert")), P()),
                                          axis_names=frozenset({"data", "expert"})))(x, idx)
  assert int(dropped) == 0
  np.testing.assert_array_equal(np.asarray(back), np.repeat(np.asarray(x)[:, None], K, axis=1))


def _numpy_keep(idx, n_dev, cap):
  """Which copies survive: per device (contiguous token chunk), per expert, the first `cap` copies in
  (token, k) order."""
  idx = np.asarray(idx)
  keep = np.zeros(idx.shape, bool)
  per = idx.shape[0] // n_dev
  for d in range(n_dev):
    seen = np.zeros(E, int)
    for t in range(d * per, (d + 1) * per):
      for j in range(K):
        e = idx[t, j]
        keep[t, j] = seen[e] < cap
        seen[e] += 1
  return keep


def test_overflow_is_counted_and_dropped_copies_are_zero():
  args = _inputs(3, skew=1.5)
  mesh = make_mesh(dict(data=2, expert=4))
  cf = 0.5
  y, st, grads = _run(mesh, X.EPConfig("dense", capacity_factor=cf), args)
  cap = X.dense_capacity(T // 8 * K, E, cf)
  keep = _numpy_keep(args[1], 8, cap)
  assert int(st["ep_capacity"]) == cap
  assert float(st["ep_dropped"]) == (~keep).sum() > 0
  np.testing.assert_allclose(float(st["ep_drop_fraction"]), (~keep).mean(), rtol=1e-6)
  assert _rel(y, _reference(*args, keep=jnp.asarray(keep, jnp.float32))) < 1e-5
  for g, r in zip(grads, _ref_grads(args, keep=jnp.asarray(keep, jnp.float32))):
    assert _rel(g, r) < 1e-5


def test_ragged_refused_on_cpu_before_compiling():
  mesh = make_mesh(dict(data=2, expert=4))
  with pytest.raises(ValueError, match="ragged_all_to_all"):
    X.make_expert_fn(mesh, X.EPConfig("ragged"))


def test_bad_config_values_raise():
  mesh = make_mesh(dict(data=2, expert=4))
  args = _inputs(0)
  with pytest.raises(ValueError, match="redundant_experts"):
    X.make_expert_fn(mesh, X.EPConfig("dense", redundant_experts=2))(*args, CFG)
  with pytest.raises(ValueError, match="ep_dispatch"):
    X.make_expert_fn(mesh, X.EPConfig("sparse"))(*args, CFG)


def test_redundant_placement_replicates_the_hottest():
  load = jnp.array([100., 10, 10, 10, 10, 10, 10, 40])
  placed = np.asarray(X.redundant_placement(load, 4, 4))
  assert placed.shape == (4, 1)
  # per-copy loads after 4 greedy replicas: expert 0 gets 3 copies (33 each), expert 7 one (20) -> 0,0,0,7
  assert sorted(placed.ravel().tolist()) == [0, 0, 0, 7]
  # replicas of the hot expert avoid its home rank (rank 0 holds experts 0,1 and is the most loaded)
  assert 0 not in [r for r in range(4) if placed[r, 0] == 0]


def test_redundant_experts_same_math_less_imbalance():
  """Replicas are copies: outputs and gradients (summed back to the home expert) equal the
  reference; with the placement from the loads, rank imbalance and overflow go down."""
  args = _inputs(4, skew=2.0)
  mesh = make_mesh(dict(data=2, expert=4))
  load = jnp.bincount(args[1].reshape(-1), length=E)
  placement = X.redundant_placement(load, 4, 4)
  y, st, grads = _run(mesh, X.EPConfig("dense", capacity_factor=float(E + 4), redundant_experts=4), args,
                      placement=placement)
  assert float(st["ep_dropped"]) == 0
  assert _rel(y, _reference(*args)) < 1e-5
  for g, r in zip(grads, _ref_grads(args)):
    assert _rel(g, r) < 1e-5
  _, st0, _ = _run(mesh, X.EPConfig("dense", capacity_factor=float(E)), args)
  assert float(st["ep_rank_load_max_over_mean"]) < float(st0["ep_rank_load_max_over_mean"]) - 0.2
  # same total buffer (capacity_factor) -> fewer dropped copies with replicas of the hot experts
  _, lo0, _ = _run(mesh, X.EPConfig("dense", capacity_factor=1.0), args)
  _, lo1, _ = _run(mesh, X.EPConfig("dense", capacity_factor=1.0, redundant_experts=4), args,
                   placement=placement)
  assert float(lo1["ep_dropped"]) < float(lo0["ep_dropped"])


def _sort_sizes(compiled_text: str) -> set[int]:
  """Leading dimension of every sort's first operand in compiled HLO text."""
  return {int(m.group(1)) for m in re.finditer(r"= \(?[su]\d+\[(\d+)[\],].*? sort\(", compiled_text)}


@pytest.mark.parametrize("shape", [dict(data=4, tensor=2), dict(data=8)])
def test_local_expert_fn_matches_reference_and_keeps_tokens_local(shape):
  """expert == 1 with data (and tensor) > 1: the dropless path runs on each device's own T/data
  tokens. Same values and gradients as the dense reference; the compiled fwd+bwd sorts T*k/data
  copies and gathers no tokens, where GSPMD's partitioning of the plain function all-gathers them."""
  from jax.sharding import NamedSharding
  from moonshot_jax.layers.moe import routed_experts
  args = _inputs(3)
  x, idx, w, wg, wu, wd = args
  mesh = make_mesh(shape)
  tok = NamedSharding(mesh, P("data"))

  def loss(fn):
    f = lambda x, w, wg, wu, wd: jnp.sum(jnp.sin(fn(x, idx, w, wg, wu, wd, CFG)))
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4)), in_shardings=(tok, tok, None, None, None))

  local_fn = X.make_local_expert_fn(mesh)
  with jax.set_mesh(mesh):
    f_local, f_plain = loss(local_fn), loss(routed_experts)
    y = jax.jit(local_fn, static_argnums=6)(x, idx, w, wg, wu, wd, CFG)
    _, grads = f_local(x, w, wg, wu, wd)
    local_hlo = f_local.lower(x, w, wg, wu, wd).compile().as_text()
    plain_hlo = f_plain.lower(x, w, wg, wu, wd).compile().as_text()
  assert _rel(y, _reference(*args)) < 1e-5
  for name, g, r in zip(("x", "w", "w_gate", "w_up", "w_down"), grads, _ref_grads(args)):
    assert _rel(g, r) < 1e-5, name
  sorts = _sort_sizes(local_hlo)
  assert sorts and max(sorts) <= T * K // shape["data"], sorts
  assert "all-gather" not in local_hlo
  assert "all-gather" in plain_hlo  # the control: without the shard_map the tokens travel
