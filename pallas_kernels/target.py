"""Which platform a computation will be compiled for, decided while it is being traced.

A Pallas kernel can only be lowered for its own platform, so backend selection must follow the
*compilation target*, which is not always `jax.default_backend()`: on a CPU host with libtpu,
`jax.jit(f).lower(x_sds).compile()` with `x_sds` sharded over `jax.experimental.topologies` TPU
devices compiles for TPU (deviceless AOT). Where the target shows while tracing, in order:
  1. a concrete array argument: the platform of the devices it lives on (eager calls);
  2. a traced argument: the mesh of its aval's sharding, which jit derives from the input shardings
     and which carries an `abstract_device` (jax >= 0.10, Auto and Explicit axes alike);
  3. the context mesh (`jax.set_mesh`, `jax.sharding.use_abstract_mesh`, inside `shard_map`);
  4. otherwise `jax.default_backend()` (an unannotated jit runs there).
"""
from __future__ import annotations

from typing import Any

import jax

# PJRT platform names of one vendor -> the name our backends use
_CANONICAL = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu", "cpu": "cpu"}


def _canonical(platform: str | None) -> str | None:
  return None if platform is None else _CANONICAL.get(platform.lower(), platform.lower())


def _mesh_platform(mesh: Any) -> str | None:
  if isinstance(mesh, jax.sharding.AbstractMesh):  # no devices, maybe an abstract_device
    return getattr(getattr(mesh, "abstract_device", None), "platform", None)
  if isinstance(mesh, jax.sharding.Mesh) and mesh.devices.size:
    return mesh.devices.flat[0].platform
  return None


def _array_platform(x: Any) -> str | None:
  if isinstance(x, jax.core.Tracer):
    sharding = getattr(jax.typeof(x), "sharding", None)
    return _mesh_platform(getattr(sharding, "mesh", None))
  sharding = getattr(x, "sharding", None)  # a concrete jax.Array (or a ShapeDtypeStruct with one)
  devices = getattr(sharding, "device_set", None)
  if devices:
    return next(iter(devices)).platform
  return None


def target_platform(*arrays: Any) -> tuple[str, str]:
  """(platform, how it was decided): platform is "cpu", "gpu" or "tpu" (others as named by PJRT);
  `how` names the evidence ("argument", "context mesh", "default backend") for error messages."""
  for x in arrays:
    if x is not None and (p := _array_platform(x)) is not None:
      return _canonical(p), "argument devices"
  try:
    ctx = jax.sharding.get_abstract_mesh()
  except AttributeError:  # pragma: no cover - a jax without the context-mesh API
    ctx = None
  if ctx is not None and not getattr(ctx, "empty", True) and (p := _mesh_platform(ctx)) is not None:
    return _canonical(p), "context mesh"
  return _canonical(jax.default_backend()), "default backend"
