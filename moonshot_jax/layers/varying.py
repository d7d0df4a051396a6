"""Varying manual axes inside `jax.shard_map`, across jax versions.

Below the layers (linear, moe, attn_res use `same_varying`) so that imports only point down;
`parallel.mesh` re-exports both helpers.
"""
from __future__ import annotations

from typing import Any

import jax


def varying_axes(x: Any) -> frozenset | None:
  """Manual mesh axes `x` varies over inside `jax.shard_map` (empty outside one), or None when this
  jax's avals do not say (the attribute is `manual_axis_type.varying` on jax 0.10 / 0.11, `vma` on
  others)."""
  t = jax.typeof(x)
  mat = getattr(t, "manual_axis_type", None)
  vma = mat.varying if mat is not None else getattr(t, "vma", None)
  return None if vma is None else frozenset(vma)


def same_varying(*xs):
  """`xs` cast to vary over the union of their manual axes (unchanged outside `jax.shard_map`): a
  custom_vjp's cotangents must have its inputs' types, and a backward's products of tokens (varying
  over "data") with weights (varying over "tensor") vary over both. The cast's transpose psums each
  cotangent back."""
  have = [varying_axes(x) or frozenset() for x in xs]
  axes = frozenset().union(*have)
  out = []
  for x, h in zip(xs, have):
    missing = tuple(sorted(axes - h))
    out.append(jax.lax.pcast(x, missing, to="varying") if missing else x)
  return out
