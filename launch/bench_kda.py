"""python launch/bench_kda.py [--T=1024,4096,16384] [--H=4] [--K=128] [--repeats=3] [--cpu_time] [--devices=1,2]

CPU benchmark of the KDA ops: chunked `chunk_kda(implementation="xla")` vs the token-by-token
`recurrent_kda` vs fla's naive torch `naive_chunk_kda` (when torch and fla-core are importable), forward
and forward+backward, all in this one process on the same CPU so the ratios compare like with like.
Quick check: --T=256 --H=1 --K=32 --repeats=1.

Sizes: B=1, H=HV=4, K=V=128, fp32, q/k L2-normalised, g = logsigmoid(randn), β = sigmoid(randn).
Times: median over --repeats runs after one warm-up (compile) run; wall clock, or process CPU time
with --cpu_time (steadier on a shared machine: it does not count time spent waiting for a core).
recurrent fwd+bwd is skipped above --recurrent_bwd_max_T (it is the oracle, ~T sequential steps with
per-step overhead, and only gets slower).

FLOP counts (per head; d = K = V, C = chunk; 2 per multiply-add; triangular products at half):
  forward  = 6·T·d² + 5·T·C·d + T·C²/3, the chunked forward's useful matmul work per chunk:
             W·S, (e^G⊙Q)·S, (e^{G_C−G}⊙K)ᵀ·V' 6·C·d²; the lower-triangular Aqk and L 2·C²·d;
             W = A·(..), U = A·(..) with A lower-triangular 2·C²·d; Aqk·V' C²·d; the UT inverse ≈ C³/3;
  fwd+bwd  = paper Eq. 13, 6·T·d² + 3·T·C·d + T·C² per head "for training", as given (it is below
             twice the forward count, so the fwd+bwd rate reads low by that convention).
Rates are shown against a large fp32 matmul timed in the same run.
--devices=1,2 times the JAX rows once per entry: with N > 1 the process has N CPU devices
(`jax_num_cpu_devices`) and both xla and recurrent run under `jax.shard_map` with the heads split over
them, the CPU's analogue of the GPU kernels' grid over heads. XLA:CPU runs one op at a time per device
and most of KDA's chunk-sized ops on one thread, so a second device is how a second core gets work;
the reference matmul uses every core on its own (Eigen's intra-op pool), with N devices or one.
Goals (issue #2): chunked ≥ 20× recurrent at T=4096 fwd+bwd; ≥ 2× fla's torch chunk reference;
forward ≥ 35% of the matmul rate.
"""
from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from moonshot_jax import host_memory  # noqa: E402

_T = flags.DEFINE_list("T", ["1024", "4096", "16384"], "sequence lengths")
_B = flags.DEFINE_integer("B", 1, "batch")
_H = flags.DEFINE_integer("H", 4, "heads (H = HV)")
_K = flags.DEFINE_integer("K", 128, "head dim (K = V)")
_CHUNK = flags.DEFINE_integer("chunk", 64, "chunk size")
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed runs per point (median reported)")
_IMPLS = flags.DEFINE_list("impls", ["xla", "recurrent", "fla"], "implementations to time")
_MODES = flags.DEFINE_list("modes", ["fwd", "fwd_bwd"], "fwd and/or fwd_bwd")
_REC_BWD_MAX_T = flags.DEFINE_integer("recurrent_bwd_max_T", 4096, "skip recurrent fwd+bwd above this T")
_MATMUL_N = flags.DEFINE_integer("matmul_n", 2048, "size of the reference fp32 matmul")
_CPU_TIME = flags.DEFINE_bool("cpu_time", False, "time with process CPU time instead of wall clock")
_JSON = flags.DEFINE_bool("json", False, "print a JSON line with all results at the end")
_DEVICES = flags.DEFINE_list("devices", ["1"], "CPU device counts to time the JAX rows on (heads split)")


def _clock() -> float:
  return time.process_time() if _CPU_TIME.value else time.perf_counter()


def _time(fn, sync) -> float:
  """Median seconds of fn() over --repeats runs, after one warm-up run."""
  sync(fn())
  ts = []
  for _ in range(_REPEATS.value):
    t0 = _clock()
    sync(fn())
    ts.append(_clock() - t0)
  return statistics.median(ts)


def flops_fwd(B: int, T: int, H: int, d: int, C: int) -> float:
  return B * H * (6 * T * d * d + 5 * T * C * d + T * C * C / 3)


def flops_eq13(B: int, T: int, H: int, d: int, C: int) -> float:
  return B * H * (6 * T * d * d + 3 * T * C * d + T * C * C)


def matmul_rate() -> float:
  import jax
  import jax.numpy as jnp
  n = _MATMUL_N.value
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
  f = jax.jit(lambda a, b: jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST))
  return 2 * n ** 3 / _time(lambda: f(a, a), jax.block_until_ready)


def make_inputs(B: int, T: int, H: int, d: int):
  import numpy as np
  rng = np.random.default_rng(0)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(rng.standard_normal((B, T, H, d))).astype(np.float32)
  k = unit(rng.standard_normal((B, T, H, d))).astype(np.float32)
  v = rng.standard_normal((B, T, H, d)).astype(np.float32)
  g = (-np.logaddexp(0, -rng.standard_normal((B, T, H, d)))).astype(np.float32)  # logsigmoid
  beta = (1 / (1 + np.exp(-rng.standard_normal((B, T, H))))).astype(np.float32)
  ct = rng.standard_normal((B, T, H, d)).astype(np.float32)
  return (q, k, v, g, beta), ct


def jax_timer(impl: str, mode: str, args, ct, ndev: int = 1):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from pallas_kernels.kda import chunk_kda, recurrent_kda
  fn = {"xla": lambda *a: chunk_kda(*a, chunk_size=_CHUNK.value, implementation="xla")[0],
        "recurrent": lambda *a: recurrent_kda(*a)[0]}[impl]
  args, ct = tuple(jnp.asarray(a) for a in args), jnp.asarray(ct)
  if ndev > 1:  # heads over devices; every array here has heads on axis 2
    mesh = Mesh(np.array(jax.devices()[:ndev]), ("h",))
    spec = P(None, None, "h")
    fn = jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(args), out_specs=spec)
    args, ct = jax.device_put((args, ct), NamedSharding(mesh, spec))
  if mode == "fwd":
    f = jax.jit(fn)
    return lambda: f(*args), jax.block_until_ready
  g = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * ct), argnums=(0, 1, 2, 3, 4)))
  return lambda: g(*args), jax.block_until_ready


def fla_naive():
  """fla's naive.py loaded by path (imports only torch and einops), or None."""
  try:
    import torch  # noqa: F401
    spec = importlib.util.find_spec("fla")
  except ImportError:
    return None
  if spec is None or not spec.submodule_search_locations:
    return None
  path = os.path.join(list(spec.submodule_search_locations)[0], "ops", "kda", "naive.py")
  mspec = importlib.util.spec_from_file_location("fla_kda_naive", path)
  mod = importlib.util.module_from_spec(mspec)
  mspec.loader.exec_module(mod)
  return mod


def fla_timer(naive, mode: str, args, ct):
  import torch
  ts = [torch.from_numpy(a) for a in args]
  ct = torch.from_numpy(ct)
  C = _CHUNK.value
  if mode == "fwd":
    def run():
      with torch.no_grad():
        return naive.naive_chunk_kda(*ts, chunk_size=C)[0]
    return run, lambda x: x

  def run_bwd():
    xs = [t.clone().requires_grad_(True) for t in ts]
    (naive.naive_chunk_kda(*xs, chunk_size=C)[0] * ct).sum().backward()
    return xs[0].grad
  return run_bwd, lambda x: x


def main(argv):
  del argv
  import jax
  B, H, d, C = _B.value, _H.value, _K.value, _CHUNK.value
  devs = [int(n) for n in _DEVICES.value]
  if any(n < 1 or H % n for n in devs):
    raise app.UsageError(f"--devices: every entry must be >= 1 and divide --H={H}, got {devs}")
  if max(devs) > 1:  # before the backend starts
    jax.config.update("jax_num_cpu_devices", max(devs))
  naive = fla_naive() if "fla" in _IMPLS.value else None
  clock = "process CPU time" if _CPU_TIME.value else "wall clock"
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, {os.cpu_count()} cores; {clock}; "
        f"B={B} H=HV={H} K=V={d} C={C} fp32; median of {_REPEATS.value}")
  if "fla" in _IMPLS.value and naive is None:
    print("fla naive reference: unavailable (needs torch and fla-core); its columns are empty")
  mm = matmul_rate()
  print(f"reference fp32 matmul {_MATMUL_N.value}^3: {mm / 1e9:.1f} GFLOP/s")
  rows, notes = [], []
  for T in (int(t) for t in _T.value):
    args, ct = make_inputs(B, T, H, d)
    for mode in _MODES.value:
      fla_s = None
      for ndev in devs:
        r = dict(T=T, mode=mode, devices=ndev)
        for impl in _IMPLS.value:
          if impl == "recurrent" and mode == "fwd_bwd" and T > _REC_BWD_MAX_T.value:
            if ndev == devs[0]:
              notes.append(f"recurrent fwd+bwd skipped at T={T} (> --recurrent_bwd_max_T="
                           f"{_REC_BWD_MAX_T.value}; it grows linearly from the smaller T)")
            continue
          if impl == "fla":  # torch: no JAX devices; timed once, shown on every row
            if naive is None or T % C:
              continue
            if fla_s is None:
              fla_s = _time(*fla_timer(naive, mode, args, ct))
              print(f"  T={T} {mode} fla: {fla_s * 1e3:.1f} ms", flush=True)
            r["fla"] = fla_s
            continue
          r[impl] = _time(*jax_timer(impl, mode, args, ct, ndev))
          # progress line per point, so a run cut short still leaves its measurements
          print(f"  T={T} {mode} {impl} devices={ndev}: {r[impl] * 1e3:.1f} ms", flush=True)
        rows.append(r)
  for r in rows:
    if "xla" in r:
      fl = (flops_fwd if r["mode"] == "fwd" else flops_eq13)(B, r["T"], H, d, C)
      r["gflops"] = fl / r["xla"] / 1e9
      r["pct_matmul"] = 100 * fl / r["xla"] / mm
      for other in ("recurrent", "fla"):
        if other in r:
          r[f"x_vs_{other}"] = r[other] / r["xla"]

  def cell(key, fmt, scale=1.0):
    return fmt.format(r[key] * scale) if key in r else "-"

  print("\n| T | mode | devices | xla ms | recurrent ms | fla naive ms | xla vs recurrent | xla vs fla "
        "| xla GFLOP/s | % of matmul |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    cells = [str(r["devices"]), cell("xla", "{:.1f}", 1e3), cell("recurrent", "{:.1f}", 1e3),
             cell("fla", "{:.1f}", 1e3),
             cell("x_vs_recurrent", "{:.1f}x"), cell("x_vs_fla", "{:.1f}x"), cell("gflops", "{:.1f}"),
             cell("pct_matmul", "{:.0f}%")]
    print(f"| {r['T']} | {r['mode']} | " + " | ".join(cells) + " |")
  for n in notes:
    print("note:", n)
  if _JSON.value:
    print(json.dumps(dict(matmul_gflops=mm / 1e9, rows=rows)))


if __name__ == "__main__":
  host_memory.reexec_with_huge_pages()  # before any jax work: glibc reads it at start-up
  app.run(main)
