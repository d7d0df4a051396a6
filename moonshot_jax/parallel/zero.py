"""ZeRO-1 / ZeRO-3 shardings: logical names (+ shapes) -> PartitionSpec -> NamedSharding.

Usage (training state):
    abstract = jax.eval_shape(model.init, rng, tokens)               # boxed LogicallyPartitioned leaves
    p_shard = param_shardings(abstract["params"], mesh, strategy)     # ZeRO-3 shards over "data"
    o_shard = opt_state_shardings(tx, jax.eval_shape(tx.init, unboxed), abstract["params"], mesh, strategy)
The optimizer-state table (rules.opt_state_axis_rules) shards moments over "data" for both
strategies; for zero1 the parameters stay replicated over "data", so XLA all-gathers the updated
parameter shards after the (sharded) optimizer update — ZeRO-1's all-gather, derived, not hand-written.

A mesh axis is only kept on a dimension it divides (otherwise that dimension is replicated): specs
depend on the shape, so everything here takes shapes, never just names.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moonshot_jax.parallel import rules as rules_lib

Rules = Sequence[tuple[str, Any]]


def _is_box(x: Any) -> bool:
  return isinstance(x, nn.LogicallyPartitioned)


def spec_for(logical_axes: Sequence[str | None] | None, shape: Sequence[int], rules: Rules,
             mesh: Mesh | None = None) -> P:
  """PartitionSpec for one array. With `mesh`, mesh axes it lacks or that do not divide the
  dimension are dropped (trailing axes of a multi-axis entry first)."""
  if logical_axes is None:
    return P()
  if len(logical_axes) != len(shape):
    raise ValueError(f"logical_axes: {tuple(logical_axes)} has {len(logical_axes)} names for an array "
                     f"of shape {tuple(shape)}")
  spec = nn.logical_to_mesh_axes(tuple(logical_axes), rules)
  if mesh is None:
    return spec
  out = []
  for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
    kept = tuple(a for a in axes if a in mesh.shape)
    while kept and dim % math.prod(mesh.shape[a] for a in kept):
      kept = kept[:-1]
    out.append(None if not kept else (kept[0] if len(kept) == 1 else kept))
  return P(*out)


def logical_names(boxed_tree: Any) -> Any:
  """Tree of logical-name tuples (None for unannotated leaves)."""
  return jax.tree.map(lambda x: tuple(x.names) if _is_box(x) else None, boxed_tree, is_leaf=_is_box)


def _shape(x: Any) -> tuple[int, ...]:
  v = x.value if _is_box(x) else x
  return tuple(v.shape)


def tree_specs(boxed_tree: Any, rules: Rules, mesh: Mesh | None = None) -> Any:
  """PartitionSpec per leaf of a (possibly abstract) tree with LogicallyPartitioned boxes."""
  return jax.tree.map(lambda x: spec_for(x.names if _is_box(x) else None, _shape(x), rules, mesh),
                      boxed_tree, is_leaf=_is_box)


def param_specs(boxed_params: Any, strategy: str = "zero1", mesh: Mesh | None = None) -> Any:
  return tree_specs(boxed_params, rules_lib.logical_axis_rules(strategy), mesh)


def param_shardings(boxed_params: Any, mesh: Mesh, strategy: str = "zero1") -> Any:
  specs = param_specs(boxed_params, strategy, mesh)
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


def opt_state_specs(tx: Any, abstract_opt_state: Any, boxed_params: Any, strategy: str = "zero1",
                    mesh: Any = None) -> Any:
  """PartitionSpecs for an optax state: param-shaped parts (moments) follow the optimizer-state
  table through the params' logical names; everything else (counts, schedules) is replicated."""
  import optax  # local: keeps the rest of the module optax-free

  specs = tree_specs(boxed_params, rules_lib.opt_state_axis_rules(strategy), mesh)
  masked = optax.transforms.MaskedNode  # leaves a masked sub-optimizer (e.g. Muon) does not track
  return optax.tree_map_params(tx, lambda x, s: x if isinstance(x, masked) else s, abstract_opt_state, specs,
                               transform_non_params=lambda _: P(),
                               is_leaf=lambda s: isinstance(s, (P, masked)))


def opt_state_shardings(tx: Any, abstract_opt_state: Any, boxed_params: Any, mesh: Mesh,
                        strategy: str = "zero1") -> Any:
  specs = opt_state_specs(tx, abstract_opt_state, boxed_params, strategy, mesh)
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


def shard_elements(shape: Sequence[int], spec: P, mesh_shape: Any) -> int:
  """Elements of one device's shard of an array of `shape` laid out by `spec`."""
  n = 1
  for i, dim in enumerate(shape):
    entry = spec[i] if i < len(spec) else None
    axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
    n *= -(-dim // math.prod(int(mesh_shape[a]) for a in axes))
  return n


def unbox(tree: Any) -> Any:
  return nn.meta.unbox(tree)
