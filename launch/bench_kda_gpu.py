"""Benchmark of the KDA chunked delta rule on one GPU: our Pallas (Triton) kernels vs our "xla" path vs
fla's Triton `chunk_kda` (when `fla` + torch + CUDA are importable), forward and forward+backward.

    python launch/bench_kda_gpu.py            # the H200 table (< 8 minutes)
    python launch/bench_kda_gpu.py --smoke    # tiny sizes, Pallas interpreter: runs on CPU

Sizes: B=1, T ∈ {8192, 32768}, H=HV ∈ {32, 64}, K=V=128, bf16 q/k/v, safe gate g = −5·sigmoid(x)
(fp32), β = sigmoid(x). Times are medians over --iters runs after one warm-up (compile) run, synced
with block_until_ready / torch.cuda.synchronize. The same run measures the chip's ceilings (a big
bf16 matmul, a big device copy) and reports each implementation's achieved FLOP/s and bandwidth
against them, using the model counts below (not what any implementation really executes):
  bytes  = inputs read once + outputs written once (fwd: q,k,v,g,β → o, final state; fwd+bwd adds dO
           read and dq,dk,dv,dg,dβ written);
  FLOPs  = the chunked algorithm, per chunk of C tokens and head: relations 2·C²·K, W/U C²·(K+V),
           state terms 6·C·K·V, intra output C²·V; backward counted as 2× forward.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave memory for torch / fla
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

FLAGS = flags.FLAGS
C = 64


def _define_flags() -> None:
  """Only when run as a script: importing this module (the smoke test does) must not register
  absl flags that could collide with other entry points'."""
  flags.DEFINE_bool("smoke", False, "tiny sizes in the Pallas interpreter (CPU), to keep the script alive")
  flags.DEFINE_integer("iters", 5, "timed iterations per measurement (median reported)")
  flags.DEFINE_float("budget_s", 360.0, "skip the remaining measurements once this much time is spent")
  flags.DEFINE_string("impls", "pallas_gpu,xla,fla", "comma-separated implementations to time")
  flags.DEFINE_enum("gpu_exact", "tf32x3", ["tf32x3", "highest"],
                    "precision of the Pallas GPU kernels' fp32-exact products (IEEE 'highest' is the "
                    "fallback should TF32x3 not compile)")


def configs(smoke: bool) -> list[dict]:
  if smoke:
    return [dict(B=1, T=128, H=2, K=64, V=64)]
  # most informative first: the time budget may cut the tail (each new shape recompiles everything)
  return [dict(B=1, T=T, H=H, K=128, V=128) for T, H in ((8192, 32), (32768, 64), (32768, 32), (8192, 64))]


def model_bytes(cfg: dict, bwd: bool) -> int:
  B, T, H, K, V = (cfg[x] for x in "BTHKV")
  fwd = B * T * H * (2 * K * 2 + V * 2 + K * 4 + 4) + B * T * H * V * 2 + B * H * K * V * 4
  return fwd + (B * T * H * (V * 2 + 2 * K * 2 + V * 2 + K * 4 + 4) if bwd else 0)


def model_flops(cfg: dict, bwd: bool) -> float:
  B, T, H, K, V = (cfg[x] for x in "BTHKV")
  per_chunk = 2 * C * C * K + C * C * (K + V) + 6 * C * K * V + C * C * V
  return B * H * (T / C) * per_chunk * (3 if bwd else 1)


def make_inputs(cfg: dict, seed: int = 0):
  B, T, H, K, V = (cfg[x] for x in "BTHKV")
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  l2 = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = l2(jax.random.normal(ks[0], (B, T, H, K))).astype(jnp.bfloat16)
  k = l2(jax.random.normal(ks[1], (B, T, H, K))).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], (B, T, H, V), jnp.bfloat16)
  g = -5.0 * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H, K)))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
  return q, k, v, g, beta


def _median_time(fn, sync, iters: int) -> float:
  sync(fn())  # warm-up: compile / autotune
  ts = []
  for _ in range(iters):
    t0 = time.perf_counter()
    sync(fn())
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts)


def _jax_sync(x):
  jax.block_until_ready(x)


def measure_ceilings(smoke: bool, iters: int) -> dict:
  """Measured bf16 matmul FLOP/s and device copy bandwidth (read + write bytes / s)."""
  n = 256 if smoke else 8192
  a = jnp.ones((n, n), jnp.bfloat16)
  mm = jax.jit(lambda a: a @ a)
  t_mm = _median_time(lambda: mm(a), _jax_sync, iters)
  m = (1 << 20) if smoke else (1 << 30)  # elements (4 GiB fp32 on the GPU)
  x = jnp.ones((m,), jnp.float32)
  cp = jax.jit(lambda x: x * 1.0001)
  t_cp = _median_time(lambda: cp(x), _jax_sync, iters)
  return dict(flops=2 * n ** 3 / t_mm, bw=2 * m * 4 / t_cp)


def jax_impl(name: str, interpret: bool):
  """(fwd, fwd+bwd) jitted callables for one of our implementations, or None if unavailable."""
  try:
    from pallas_kernels.kda import api
    run = lambda q, k, v, g, beta: api.chunk_kda(q, k, v, g, beta, output_final_state=True, chunk_size=C,
                                                 implementation=name, interpret=interpret)
  except ImportError:
    if name != "pallas_gpu":
      return None
    from pallas_kernels.kda import pallas_gpu
    run = lambda q, k, v, g, beta: pallas_gpu.chunk_kda(q, k, v, g, beta, output_final_state=True,
                                                        chunk_size=C, interpret=interpret)

  def loss(q, k, v, g, beta, do):
    o, s = run(q, k, v, g, beta)
    return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(s)

  fwd = jax.jit(run)
  fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
  return fwd, fwd_bwd


def fla_impl():
  """fla's Triton chunk_kda on torch tensors, or None when fla / torch / CUDA are missing."""
  try:
    import torch
    from fla.ops.kda import chunk_kda
  except Exception:  # noqa: BLE001 - any import problem means "not available"
    return None
  if not torch.cuda.is_available():
    return None
  return torch, chunk_kda


def time_config(cfg: dict, impls: list[str], smoke: bool, iters: int, deadline: float) -> list[dict]:
  rows = []
  q, k, v, g, beta = make_inputs(cfg)
  do = jax.random.normal(jax.random.PRNGKey(9), q.shape[:3] + (cfg["V"],), jnp.float32)
  for name in impls:
    if time.perf_counter() > deadline:
      rows.append(dict(impl=name, note="skipped: time budget"))
      continue
    try:
      if name == "fla":
        rows.append(_time_fla(cfg, (q, k, v, g, beta, do), iters))
        continue
      fns = jax_impl(name, interpret=smoke)
      if fns is None:
        rows.append(dict(impl=name, note="unavailable"))
        continue
      fwd, fwd_bwd = fns
      t_f = _median_time(lambda: fwd(q, k, v, g, beta), _jax_sync, iters)
      t_fb = _median_time(lambda: fwd_bwd(q, k, v, g, beta, do), _jax_sync, iters)
      rows.append(dict(impl=name, fwd=t_f, fwd_bwd=t_fb))
    except Exception as e:  # noqa: BLE001 - one failing implementation must not sink the table
      rows.append(dict(impl=name, note=f"failed: {type(e).__name__}: {str(e)[:120]}"))
  return rows


def _time_fla(cfg, jax_inputs, iters):
  got = fla_impl()
  if got is None:
    return dict(impl="fla", note="unavailable (needs torch + CUDA + fla-core)")
  torch, chunk_kda = got
  import numpy as np
  to_t = lambda x, dt: torch.from_numpy(np.asarray(x.astype(jnp.float32))).to("cuda", dt)
  q, k, v, g, beta, do = jax_inputs
  bf = torch.bfloat16
  tq, tk, tv = (to_t(x, bf).requires_grad_() for x in (q, k, v))
  tg, tb = to_t(g, torch.float32).requires_grad_(), to_t(beta, bf).requires_grad_()
  tdo = to_t(do, bf)
  fwd = lambda: chunk_kda(tq, tk, tv, tg, tb, output_final_state=True)

  def fwd_bwd():
    o, s = fwd()
    torch.autograd.backward([o, s], [tdo, torch.ones_like(s)])
    return o

  sync = lambda _: torch.cuda.synchronize()
  with torch.no_grad():
    t_f = _median_time(fwd, sync, iters)
  t_fb = _median_time(fwd_bwd, sync, iters)
  return dict(impl="fla", fwd=t_f, fwd_bwd=t_fb)


def run_suite(smoke: bool = False, iters: int = 5, budget_s: float = 360.0,
              impls: tuple[str, ...] = ("pallas_gpu", "xla", "fla")) -> list[dict]:
  """Times every config; returns table rows (and prints the table)."""
  start = time.perf_counter()
  deadline = start + budget_s
  ceil = measure_ceilings(smoke, iters)
  print(f"device: {jax.devices()[0].device_kind}  ceilings: bf16 matmul {ceil['flops'] / 1e12:.1f} TFLOP/s, "
        f"copy {ceil['bw'] / 1e9:.0f} GB/s", flush=True)
  table = []
  for cfg in configs(smoke):
    for r in time_config(cfg, list(impls), smoke, iters, deadline):
      table.append(dict(cfg, **r))
      _print_row(table[-1], table, ceil)
  print(f"total {time.perf_counter() - start:.0f} s", flush=True)
  return table


_HEADER = (f"{'T':>6} {'H':>3} {'impl':>10} | {'fwd ms':>8} {'/ours':>6} {'TFLOP/s':>8} {'%pk':>5} "
           f"{'GB/s':>6} {'%bw':>5} | {'fwd+bwd ms':>10} {'/ours':>6} {'TFLOP/s':>8} {'%pk':>5} {'GB/s':>6} "
           f"{'%bw':>5}")


def _print_row(row: dict, table: list[dict], ceil: dict) -> None:
  """One table line; '/ours' is time over our Pallas time, %pk / %bw are against the ceilings."""
  if len(table) == 1:
    print(_HEADER, flush=True)
  head = f"{row['T']:>6} {row['H']:>3} {row['impl']:>10} |"
  if "note" in row:
    print(f"{head} {row['note']}", flush=True)
    return
  ours = next((r for r in table if (r["T"], r["H"], r["impl"]) == (row["T"], row["H"], "pallas_gpu")
               and "fwd" in r), None)
  cells = []
  for key, bwd, w in (("fwd", False, 8), ("fwd_bwd", True, 10)):
    t = row[key]
    fl, by = model_flops(row, bwd) / t, model_bytes(row, bwd) / t
    ratio = f"{t / ours[key]:6.2f}" if ours else f"{'-':>6}"
    cells.append(f"{t * 1e3:{w}.3f} {ratio} {fl / 1e12:8.2f} {100 * fl / ceil['flops']:5.1f} "
                 f"{by / 1e9:6.0f} {100 * by / ceil['bw']:5.1f}")
  print(f"{head} " + " | ".join(cells), flush=True)


def set_gpu_exact(mode: str) -> None:
  """Swap the precision of pallas_gpu's fp32-exact products (read at call time)."""
  import dataclasses
  from pallas_kernels.kda import pallas_gpu
  pallas_gpu.BACKEND = dataclasses.replace(pallas_gpu.BACKEND, exact_dot=mode)


def main(argv) -> None:
  del argv
  set_gpu_exact(FLAGS.gpu_exact)
  run_suite(FLAGS.smoke, FLAGS.iters if not FLAGS.smoke else 1, FLAGS.budget_s,
            tuple(x for x in FLAGS.impls.split(",") if x))


if __name__ == "__main__":
  _define_flags()
  app.run(main)
