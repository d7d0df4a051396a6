"""Peak FLOP/s for MFU: dense per-chip numbers for known accelerators, a measured matmul rate on CPU.

MFU = model FLOP/s (analytic FLOPs per token x tokens/s) / total peak of the devices used. On
CPU the "devices" of `--xla_force_host_platform_device_count` share the same cores, so the peak
is the machine's measured rate, not a per-device number times the device count.
"""
from __future__ import annotations

import time
from typing import Sequence

import jax
import jax.numpy as jnp

# device_kind substring (lower-case) -> (bf16 dense TFLOP/s, fp32 TFLOP/s as XLA runs fp32 matmuls
# by default: TF32 on Ampere/Hopper, one bf16 pass on TPU). Order matters: first match wins.
_TABLE = (
    ("h200", 989.0, 494.7),
    ("h100 pcie", 756.0, 378.0),
    ("h100", 989.0, 494.7),
    ("a100", 312.0, 156.0),
    ("tpu v6 lite", 918.0, 918.0),  # v6e (Trillium)
    ("tpu v6e", 918.0, 918.0),
    ("tpu v5 lite", 197.0, 197.0),  # v5e
    ("tpu v5e", 197.0, 197.0),
    ("tpu v5p", 459.0, 459.0),
    ("tpu v5", 459.0, 459.0),
    ("tpu v4", 275.0, 275.0),
)

_CPU_RATE: dict[tuple[int, str], float] = {}


def chip_peak(device_kind: str, dtype: str = "bfloat16") -> float | None:
  """Peak FLOP/s of one chip of this kind for `dtype` matmuls, or None when unknown."""
  kind = device_kind.lower()
  for key, bf16, fp32 in _TABLE:
    if key in kind:
      return 1e12 * (fp32 if dtype == "float32" else bf16)
  return None


def measure_matmul_flops(n: int = 2048, dtype: str = "float32", reps: int = 3) -> float:
  """Best-of-`reps` FLOP/s of an [n, n] @ [n, n] matmul on the default device (cached)."""
  key = (n, dtype)
  if key not in _CPU_RATE:
    k1, k2 = jax.random.split(jax.random.key(0))
    a = jax.random.normal(k1, (n, n), jnp.dtype(dtype))
    b = jax.random.normal(k2, (n, n), jnp.dtype(dtype))
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(reps):
      t0 = time.perf_counter()
      f(a, b).block_until_ready()
      best = min(best, time.perf_counter() - t0)
    _CPU_RATE[key] = 2.0 * n ** 3 / best
  return _CPU_RATE[key]


def peak_flops(devices: Sequence[jax.Device] | None = None, dtype: str = "float32") -> tuple[float, str]:
  """(total peak FLOP/s of `devices`, where the number came from)."""
  devs = list(jax.devices() if devices is None else devices)
  if not devs:
    raise ValueError("devices: expected at least one device")
  d0 = devs[0]
  if d0.platform == "cpu":
    return measure_matmul_flops(dtype="float32"), "measured fp32 matmul (CPU)"
  per_chip = chip_peak(d0.device_kind, dtype)
  if per_chip is None:
    # unknown accelerator: a measured rate is still a meaningful denominator
    return measure_matmul_flops(n=8192, dtype=dtype) * len(devs), f"measured {dtype} matmul ({d0.device_kind})"
  return per_chip * len(devs), f"table: {d0.device_kind} x{len(devs)} ({dtype})"
