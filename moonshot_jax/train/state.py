"""TrainState and its sharded creation: eval_shape(init) -> logical specs -> mesh shardings -> jit(init).

Nothing is ever materialised unsharded: `create_train_state` traces the model's init abstractly,
derives every leaf's NamedSharding from its logical names (parallel/zero.py, rules.py), and runs
the real init under `jax.jit(..., out_shardings=...)`, so each device only allocates its shard.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moonshot_jax.parallel import zero


@struct.dataclass
class TrainState:
  step: jax.Array  # int32 []: batches consumed so far (skipped non-finite steps included)
  params: Any  # fp32 master weights
  opt_state: Any
  moe_state: Any  # {"...": {"bias": [E]}}: MoE balancing biases, never touched by the optimizer
  rng: jax.Array  # uint32 [2]: raw threefry key data (checkpointable as a plain array)
  bad_steps: jax.Array  # int32 []: consecutive non-finite steps up to now


@dataclasses.dataclass(frozen=True)
class StateSetup:
  """Everything derived once from (model, optimizer, mesh) that the step and the loop need."""
  tx: optax.GradientTransformation
  schedule: Callable[[jax.Array], jax.Array]
  boxed: Any  # abstract variables with LogicallyPartitioned boxes ({"params", "moe_state"})
  abstract: TrainState  # ShapeDtypeStructs carrying their target shardings
  shardings: TrainState  # NamedSharding per leaf
  mesh: Mesh
  strategy: str


def _unboxed_abstract(boxed: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nn.meta.unbox(boxed))


def _with_shardings(abstract: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def _logical_boxes(boxed: Any) -> Any:
  """Normalises the boxes: plain `nn.Partitioned` ones (the MoE bias in "moe_state") carry logical
  names too and become LogicallyPartitioned; a name repeated within one array (e.g. ("head_dim",
  "v_heads", "head_dim")), which flax rejects, keeps its first occurrence only (a later one
  could never take the same mesh axis anyway)."""
  def one(x):
    if not isinstance(x, nn.Partitioned):
      return x
    seen, names = set(), []
    for n in x.names:
      names.append(None if n is not None and n in seen else n)
      seen.add(n)
    return nn.LogicallyPartitioned(x.value, tuple(names))
  return jax.tree.map(one, boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def setup_state(init_fn: Callable[[jax.Array], dict], make_tx: Callable[[Any], tuple], mesh: Mesh,
                strategy: str = "zero1") -> StateSetup:
  """init_fn(rng) -> variables {"params": boxed, "moe_state": boxed (optional)};
  make_tx(boxed_params) -> (optax tx, schedule)."""
  boxed = jax.eval_shape(init_fn, jax.random.key(0))
  if "params" not in boxed:
    raise ValueError(f"init_fn: expected variables with a 'params' collection, got {sorted(boxed)}")
  extra = sorted(set(boxed) - {"params", "moe_state"})
  if extra:
    raise ValueError(f"init_fn: unexpected variable collections {extra} (only params, moe_state)")
  boxed = _logical_boxes({"params": boxed["params"], "moe_state": boxed.get("moe_state", {})})
  tx, schedule = make_tx(boxed["params"])
  params_abs = _unboxed_abstract(boxed["params"])
  moe_abs = _unboxed_abstract(boxed["moe_state"])
  opt_abs = jax.eval_shape(tx.init, params_abs)
  replicated = NamedSharding(mesh, P())
  shardings = TrainState(
      step=replicated,
      params=zero.param_shardings(boxed["params"], mesh, strategy),
      opt_state=zero.opt_state_shardings(tx, opt_abs, boxed["params"], mesh, strategy),
      moe_state=zero.param_shardings(boxed["moe_state"], mesh, strategy),
      rng=replicated,
      bad_steps=replicated)
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  abstract = TrainState(step=scalar, params=params_abs, opt_state=opt_abs, moe_state=moe_abs,
                        rng=jax.ShapeDtypeStruct((2,), jnp.uint32), bad_steps=scalar)
  abstract = _with_shardings(abstract, shardings)
  return StateSetup(tx=tx, schedule=schedule, boxed=boxed, abstract=abstract, shardings=shardings,
                    mesh=mesh, strategy=strategy)


def create_train_state(setup: StateSetup, init_fn: Callable[[jax.Array], dict], seed: int) -> TrainState:
  """The initial state, created directly in its shardings."""

  def init(seed_arr):
    root = jax.random.key(seed_arr)
    k_init, k_run = jax.random.split(root)
    variables = init_fn(k_init)
    params = nn.meta.unbox(variables["params"])
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=setup.tx.init(params),
                      moe_state=nn.meta.unbox(variables.get("moe_state", {})),
                      rng=jax.random.key_data(k_run).astype(jnp.uint32),
                      bad_steps=jnp.zeros((), jnp.int32))

  # No mesh / rules context: out_shardings place every leaf, and in-model constraints stay no-ops
  # (a plain nn.Partitioned box with logical names would otherwise be read as mesh axes).
  return jax.jit(init, out_shardings=setup.shardings)(jnp.uint32(seed))
