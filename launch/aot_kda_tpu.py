"""python -m launch.aot_kda_tpu [--generations=v5e,v5p,v6e] [--dims=64,128] [--dtypes=bfloat16,float32]

Compiles every Pallas TPU KDA kernel (`chunk_kda(implementation="pallas_tpu")`), forward and
forward+backward, with segment ids and an initial state, inside `shard_map` over a 4-chip slice of
each TPU generation, for real XLA:TPU + Mosaic without a TPU (libtpu's deviceless topologies;
needs `pip install "jax[tpu]"`). Prints one row per case: compile seconds and XLA:TPU's
memory_analysis per chip (arguments / outputs / temporaries / generated code). A kernel whose VMEM
working set exceeds the chip's scoped-VMEM limit fails Mosaic's compile: the row says FAILED and the
script exits 1. With --json the last line is a JSON list of the rows.

The mesh is ("batch", "heads") = (2, 2): each chip holds B=1 row of T tokens and H=2 q/k heads with
HV=4 value heads (grouped), so the group index map is compiled too.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

from absl import app, flags  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from moonshot_jax.parallel import tpu_aot  # noqa: E402
from pallas_kernels.kda import api  # noqa: E402

GENERATIONS = ("v5e", "v5p", "v6e")
MESH_AXES = {"batch": 2, "heads": 2}
LOCAL = dict(B=1, H=2, group=2)  # per chip


def case_args(mesh: jax.sharding.Mesh, T: int, K: int, dtype) -> list[jax.ShapeDtypeStruct]:
  """Global abstract inputs q, k, v, g, beta, initial_state, segment_ids sharded over the mesh."""
  B, H = LOCAL["B"] * MESH_AXES["batch"], LOCAL["H"] * MESH_AXES["heads"]
  HV = H * LOCAL["group"]
  tok, st, seg = P("batch", None, "heads", None), P("batch", "heads", None, None), P("batch", None)
  sd = lambda shape, dt, spec: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))
  return [sd((B, T, H, K), dtype, tok), sd((B, T, H, K), dtype, tok), sd((B, T, HV, K), dtype, tok),
          sd((B, T, HV, K), jnp.float32, tok), sd((B, T, HV), dtype, P("batch", None, "heads")),
          sd((B, HV, K, K), jnp.float32, st), sd((B, T), jnp.int32, seg)]


def _local_kda(q, k, v, g, beta, h0, seg):
  return api.chunk_kda(q, k, v, g, beta, initial_state=h0, segment_ids=seg, output_final_state=True,
                       implementation="pallas_tpu")


def program(mesh: jax.sharding.Mesh, mode: str):
  """jit(shard_map(...)) of the forward ("fwd": o and the final state) or of a loss's value and
  gradient wrt every differentiable input ("fwd_bwd")."""
  tok, st, seg = P("batch", None, "heads", None), P("batch", "heads", None, None), P("batch", None)
  in_specs = (tok, tok, tok, tok, P("batch", None, "heads"), st, seg)
  fwd = jax.shard_map(_local_kda, mesh=mesh, in_specs=in_specs, out_specs=(tok, st))
  if mode == "fwd":
    return jax.jit(fwd)

  def loss(q, k, v, g, beta, h0, seg):
    o, hT = fwd(q, k, v, g, beta, h0, seg)
    return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(hT ** 2)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5)))


def compile_case(generation: str, K: int, dtype: str, mode: str, T: int = 1024) -> dict[str, Any]:
  """Lower + compile one case for a 4-chip slice of `generation`; raises if XLA:TPU/Mosaic refuses."""
  topology = tpu_aot.SMALL_TOPOLOGIES[generation]
  mesh = tpu_aot.mesh(topology, MESH_AXES)
  args = case_args(mesh, T, K, jnp.dtype(dtype))
  t0, c0 = time.perf_counter(), time.process_time()
  lowered = program(mesh, mode).lower(*args)
  text = lowered.as_text()
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  kernels = sorted({name for name in ("kda_prepare", "kda_fwd_rec", "kda_output", "kda_bwd_rec", "kda_grads")
                    if name in text})
  return dict(generation=generation, topology=topology, K=K, V=K, dtype=dtype, mode=mode, T=T,
              kernels=kernels, tpu_custom_calls=text.count("tpu_custom_call"), lower_s=t1 - t0,
              compile_s=t2 - t1, cpu_s=time.process_time() - c0, memory=tpu_aot.memory_stats(compiled))


def _row(r: dict[str, Any]) -> str:
  if "error" in r:
    return f"  {r['generation']:<5}{r['K']:>5}  {r['dtype']:<9}{r['mode']:<9} FAILED: {r['error'][:300]}"
  m = r["memory"]
  mib = lambda b: f"{b / 2**20:9.2f}"
  return (f"  {r['generation']:<5}{r['K']:>5}  {r['dtype']:<9}{r['mode']:<9}{r['lower_s']:7.1f}{r['compile_s']:9.1f}{r['cpu_s']:7.1f}"
          f"{mib(m['argument_size_in_bytes'])}{mib(m['output_size_in_bytes'])}{mib(m['temp_size_in_bytes'])}"
          f"{mib(m['generated_code_size_in_bytes'])}  {len(r['kernels'])} kernels")


_GENS = flags.DEFINE_list("generations", list(GENERATIONS), "TPU generations (v4, v5e, v5p, v6e)")
_DIMS = flags.DEFINE_list("dims", ["64", "128"], "head dims K = V")
_DTYPES = flags.DEFINE_list("dtypes", ["bfloat16", "float32"], "q/k/v/beta dtypes")
_T = flags.DEFINE_integer("seq_len", 1024, "tokens per row (per chip: B=1 row)")
_JSON = flags.DEFINE_bool("json", False, "last line: the rows as one JSON list")


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if (reason := tpu_aot.unavailable_reason()) is not None:
    raise app.UsageError(f"{reason}; install it with pip install 'jax[tpu]'")
  print(f"Pallas KDA on TPU, deviceless AOT (jax {jax.__version__}); per chip B=1, T={_T.value}, H=2, HV=4, "
        f"mesh {MESH_AXES} of a 4-chip slice; MiB per chip from memory_analysis", flush=True)
  print(f"  {'gen':<5}{'K=V':>5}  {'dtype':<9}{'mode':<9}{'lower':>7}{'compile':>9}{'cpu':>7}{'args':>9}{'outputs':>9}"
        f"{'temps':>9}{'code':>9}", flush=True)
  rows, t0, c0 = [], time.perf_counter(), time.process_time()
  for gen in _GENS.value:
    for K in map(int, _DIMS.value):
      for dtype in _DTYPES.value:
        for mode in ("fwd", "fwd_bwd"):
          try:
            r = compile_case(gen, K, dtype, mode, _T.value)
          except Exception as e:  # report every case, then fail
            r = dict(generation=gen, K=K, dtype=dtype, mode=mode, error=f"{type(e).__name__}: {e}")
          rows.append(r)
          print(_row(r), flush=True)
  print(f"total {time.perf_counter() - t0:.1f}s wall, {time.process_time() - c0:.1f}s CPU (all threads) for "
        f"{len(rows)} programs; seconds are wall unless 'cpu'", flush=True)
  if _JSON.value:
    print(json.dumps(rows), flush=True)
  if any("error" in r for r in rows):
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
