"""Deviceless compilation for Cloud TPUs: topologies from libtpu, chip specs, compiled-program stats.

With `jax[tpu]` installed (libtpu), `jax.experimental.topologies.get_topology_desc` describes a TPU
slice on any host; jit-lowering with inputs sharded over its devices and `.compile()` runs the real
XLA:TPU compiler (and Mosaic for Pallas kernels) without a TPU. Nothing can be run, but
`memory_analysis()` and `cost_analysis()` of the compiled program are XLA:TPU's own.

Env (ENV, set here before the first topology request): libtpu queries the GCE metadata server when
it starts unless TPU_SKIP_MDS_QUERY=1, and holds /tmp/libtpu_lockfile (a second process then fails
"Internal error when accessing libtpu multi-process lockfile") unless ALLOW_MULTIPLE_LIBTPU_LOAD=1.
Keep JAX_PLATFORMS=cpu: without it a process with libtpu installed tries to start a TPU backend.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any

import jax
import numpy as np

GiB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Chip:
  """Per-chip figures from Google's Cloud TPU system-architecture pages (dense bf16 MXU peak)."""
  name: str
  hbm_bytes: int
  bf16_flops: float  # FLOP/s
  hbm_bandwidth: float  # bytes/s
  device_kind: str  # what libtpu's devices report


CHIPS = {
    "v4": Chip("v4", 32 * GiB, 275e12, 1228e9, "TPU v4"),
    "v5e": Chip("v5e", 16 * GiB, 197e12, 819e9, "TPU v5 lite"),
    "v5p": Chip("v5p", 95 * GiB, 459e12, 2765e9, "TPU v5"),
    "v6e": Chip("v6e", 32 * GiB, 918e12, 1640e9, "TPU v6 lite"),
}
# a small multi-chip slice per generation: what tests and proxies compile against
SMALL_TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}


def chip_of(topology_name: str) -> Chip:
  """"v5p:2x2x1" -> CHIPS["v5p"]; a clear error for an unknown generation."""
  gen = topology_name.split(":", 1)[0]
  if gen not in CHIPS:
    raise ValueError(f"TPU topology {topology_name!r}: unknown generation {gen!r}; known: {sorted(CHIPS)} "
                     f"(names like 'v5p:2x2x1', 'v6e:2x2')")
  return CHIPS[gen]


ENV = {"TPU_SKIP_MDS_QUERY": "1",  # no GCE metadata query (it waits on the network)
       "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}  # no /tmp/libtpu_lockfile: compile-only processes may overlap


# XLA:TPU refuses a program whose arguments + temporaries exceed the chip's HBM ("Ran out of memory
# on HBM, the total memory required for HLO temporaries (X) exceeds available HBM (Y)": X counts the
# arguments too). A planner wants the numbers either way: with this flag the compile finishes and
# memory_analysis() reports what the program needs; the caller compares it with the HBM (measured on
# libtpu 0.0.42.1: a v5e program needing 18.6 GiB compiles and reports 9.3 + 9.3 GiB). The
# compiler's own memory-reduction passes still run first; a single buffer larger than HBM still fails.
PLANNING_COMPILE_OPTIONS = {"xla_tpu_no_crash_on_oom": True}


def _env() -> None:
  for k, v in ENV.items():
    os.environ.setdefault(k, v)


@functools.cache
def unavailable_reason() -> str | None:
  """None when libtpu can describe a TPU topology in this process, else why not."""
  _env()
  try:
    from jax.experimental import topologies
    topologies.get_topology_desc(platform="tpu", topology_name=SMALL_TOPOLOGIES["v5e"])
  except Exception as e:  # ImportError, RuntimeError from a missing/incompatible libtpu, ...
    return f"no deviceless TPU compiler ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
  return None


@functools.cache
def devices(topology_name: str) -> tuple[Any, ...]:
  """The TPU devices of a topology such as "v5p:2x2x1" (one per chip), for compilation only."""
  chip_of(topology_name)
  _env()
  from jax.experimental import topologies
  try:
    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology_name)
  except Exception as e:
    raise ValueError(f"TPU topology {topology_name!r}: libtpu could not describe it ({e})") from e
  return tuple(topo.devices)


def mesh(topology_name: str, axis_sizes: dict[str, int]) -> jax.sharding.Mesh:
  """A Mesh over the topology's chips with the given axes (their product must be the chip count)."""
  devs = devices(topology_name)
  n = math.prod(axis_sizes.values())
  if n != len(devs):
    raise ValueError(f"mesh {axis_sizes}: {n} devices, but topology {topology_name!r} has {len(devs)} chips")
  return jax.sharding.Mesh(np.array(devs).reshape(tuple(axis_sizes.values())), tuple(axis_sizes))


MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                 "temp_size_in_bytes", "generated_code_size_in_bytes")


def memory_stats(compiled) -> dict[str, int]:
  """memory_analysis() of a compiled program as a dict (per device), with peak = args + outputs −
  aliased + temporaries (what must fit in HBM at once)."""
  ma = compiled.memory_analysis()
  out = {f: int(getattr(ma, f)) for f in MEMORY_FIELDS if hasattr(ma, f)}
  out["peak_bytes"] = (out.get("argument_size_in_bytes", 0) + out.get("output_size_in_bytes", 0)
                       - out.get("alias_size_in_bytes", 0) + out.get("temp_size_in_bytes", 0))
  return out


def cost_stats(compiled) -> dict[str, float]:
  """flops / bytes accessed from cost_analysis() (per device; XLA counts a while-loop body once)."""
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) else ca
  return {"flops": float(ca.get("flops", 0.0)), "bytes_accessed": float(ca.get("bytes accessed", 0.0)),
          "transcendentals": float(ca.get("transcendentals", 0.0))}
