"""Run a custom kernel on per-device blocks when the surrounding mesh axes are automatic.

XLA cannot partition a Mosaic (Pallas TPU) custom call: "Mosaic kernels cannot be automatically
partitioned. Please wrap the call in a shard_map." The model leaves data/expert/tensor automatic
(the pipeline's shard_map is manual over "pipeline" only), so a kernel call is wrapped here in a
`jax.shard_map` over the context mesh's Auto axes, with per-argument PartitionSpecs
read from the logical-axis rules in force (the same table that shards the activations, so no
resharding is added around the kernel). Without such axes the function is returned unchanged.
"""
from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn
import jax
from jax.sharding import AxisType, PartitionSpec as P


def auto_axes() -> frozenset[str]:
  """Names of the context mesh's Auto axes (empty outside a mesh). Size-1 axes count: Mosaic's
  lowering wants every axis manual once any is."""
  am = jax.sharding.get_abstract_mesh()
  if am is None or am.empty:
    return frozenset()
  return frozenset(n for n, t in zip(am.axis_names, am.axis_types) if t == AxisType.Auto)


def _spec(logical: Sequence[str | None], shape: Sequence[int] | None, axes: frozenset[str]) -> P:
  """The rules' mesh axes for `logical`, keeping only `axes` and, given a shape, only the leading
  axes whose product divides the dimension (the rest replicate: e.g. the batch-1 init trace)."""
  sizes = jax.sharding.get_abstract_mesh().shape
  out = []
  for i, entry in enumerate(nn.logical_to_mesh_axes(tuple(logical))):
    names = entry if isinstance(entry, tuple) else (() if entry is None else (entry,))
    kept, n = [], 1
    for a in names:
      if a in axes and (shape is None or shape[i] % (n * sizes[a]) == 0):
        kept.append(a)
        n *= sizes[a]
    out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return P(*out)


def over_auto_axes(fn: Callable, in_logical: Sequence[Sequence[str | None]],
                   out_logical: Sequence[Sequence[str | None]]) -> Callable:
  """`fn` (positional arrays -> tuple of arrays) mapped over per-device blocks of the context mesh's
  Auto axes; `in_logical` / `out_logical` give each argument's / output's logical axis names. An
  output's spec follows the first input with the same logical name on each dimension."""
  axes = auto_axes()
  if not axes:
    return fn

  def wrapped(*args):
    in_specs = tuple(_spec(l, a.shape, axes) for l, a in zip(in_logical, args))
    # the mesh axes each logical name got on the inputs (outputs reuse them: same split)
    got = {}
    for l, sp in zip(in_logical, in_specs):
      for name, s in zip(l, sp):
        if name is not None:
          got.setdefault(name, s)
    out_specs = tuple(P(*(got.get(name) if name is not None else None for name in l)) for l in out_logical)
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names=axes, check_vma=False)(*args)

  return wrapped
