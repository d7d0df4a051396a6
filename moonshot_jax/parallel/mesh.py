"""Device mesh ("pipeline", "data", "expert", "tensor") from the experiment's `mesh` section.

Multi-host: call `initialize_distributed` (a thin wrapper over `jax.distributed.initialize`) before
anything touches devices; `make_mesh` then spans every process's devices. The axis order puts
"tensor" and "expert" innermost so their collectives stay inside a host when hosts hold whole
expert×tensor groups, and "data"/"pipeline" (cheap, bandwidth-tolerant traffic) across hosts.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from moonshot_jax.parallel.rules import MESH_AXES


def _sizes_from(cfg: Any, num_devices: int) -> dict[str, int]:
  """`cfg` is an experiment ConfigDict (uses its `mesh` section) or a mapping axis -> size."""
  from moonshot_jax import experiment  # local: experiment imports nothing from parallel

  if hasattr(cfg, "mesh"):
    return experiment.mesh_shape(cfg, num_devices)
  if isinstance(cfg, Mapping):
    unknown = sorted(set(cfg) - set(MESH_AXES))
    if unknown:
      raise ValueError(f"mesh: unknown axis name(s) {unknown}; valid axes are {MESH_AXES}")
    full = {a: int(cfg.get(a, 1)) for a in MESH_AXES}
    free = [a for a in MESH_AXES if full[a] == -1]
    if len(free) > 1:
      raise ValueError(f"mesh: only one axis may be -1, got {free}")
    fixed = math.prod(s for s in full.values() if s != -1)
    if any(s == 0 or s < -1 for s in full.values()):
      raise ValueError(f"mesh: axis sizes must be positive or -1, got {full}")
    if free:
      if num_devices % fixed:
        raise ValueError(f"mesh: {num_devices} devices not divisible by the fixed axes' product {fixed}")
      full[free[0]] = num_devices // fixed
    if math.prod(full.values()) != num_devices:
      raise ValueError(f"mesh: axis sizes {full} multiply to {math.prod(full.values())}, "
                       f"but there are {num_devices} devices")
    return full
  raise ValueError(f"make_mesh: cfg must be an experiment ConfigDict or a mapping of axis sizes, "
                   f"got {type(cfg).__name__}")


def make_mesh(cfg: Any, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Mesh over `devices` (default: all devices of all processes) with the four named axes.

  All axes are `AxisType.Auto`: weights and activations are placed by logical-name rules and XLA's
  sharding propagation; the explicitly parallel parts (expert dispatch, pipeline) enter manual mode
  locally with `jax.shard_map`.
  """
  devs = list(jax.devices() if devices is None else devices)
  if not devs:
    raise ValueError("make_mesh: devices is empty")
  sizes = _sizes_from(cfg, len(devs))
  shape = tuple(sizes[a] for a in MESH_AXES)
  auto = (AxisType.Auto,) * len(MESH_AXES)
  if devices is None:
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto)
  # An explicit device list is used in the order given (tests, sub-meshes, AOT on fake devices).
  return Mesh(np.asarray(devs, dtype=object).reshape(shape), MESH_AXES, axis_types=auto)


def mesh_sizes(mesh: Mesh) -> dict[str, int]:
  """Axis name -> size, 1 for the named axes a mesh lacks."""
  return {a: int(mesh.shape.get(a, 1)) for a in MESH_AXES}


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, local_device_ids: Sequence[int] | None = None,
                           cpu_collectives: str | None = "gloo") -> None:
  """Multi-process start-up through `jax.distributed.initialize` (arguments as there; all None lets
  JAX auto-detect SLURM / TPU pods / Kubernetes). On CPU, cross-process collectives need a
  collectives implementation: `cpu_collectives` ("gloo" or "mpi") is set before initialising."""
  if cpu_collectives is not None:
    if cpu_collectives not in ("gloo", "mpi"):
      raise ValueError(f"cpu_collectives: expected 'gloo', 'mpi' or None, got {cpu_collectives!r}")
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                             process_id=process_id, local_device_ids=local_device_ids)
