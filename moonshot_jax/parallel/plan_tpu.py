"""`launch/plan.py --mesh=... --aot --target=tpu:<topology>`: the proxy train step compiled by XLA:TPU.

    python -m launch.plan --config=experiments/k3.py --mesh=pipeline=16,data=8,expert=64 \\
        --config.mesh.strategy=zero3 --config.mesh.pipeline_microbatches=8 --config.data.seq_len=4096 \\
        --aot --target=tpu:v5p

(K3 at 4096 tokens per sequence, K2's pre-training length: XLA:TPU's buffer assignment puts the
proxy at 58.2 GiB per v5p chip; at 8192 it does not fit. WORKSPACE_NOTES, session 12.)

The proxy is plan_memory's (same per-device shapes: 2 stages of the real stage's slots, experts and
tokens per device) on pipeline 2 x data D x expert 4 with D the real "data" size up to 8 (so the
ZeRO shards are the real ones: `tpu_proxy_mesh`), compiled in a subprocess for an 8·D-chip slice of
the target (SLICES below; or name one, e.g. tpu:v6e:8x8) from libtpu's deviceless topology, with the Pallas KDA kernels inside (chosen from the target; an error, not a fallback,
if the compiled step has none). Printed next to plan_memory's estimate of the proxy:
  memory   XLA:TPU memory_analysis per chip (arguments, temporaries, peak) and a fits line against
           the chip's HBM (v5p 95 GiB, v6e 32 GiB, ...);
  cost     cost_analysis FLOPs / bytes per chip against flops.py's count for the same tokens, and a
           roofline step time and MFU upper bound (ESTIMATES: peak FLOP/s and HBM bandwidth of the
           chip, no communication, the REAL mesh's GPipe bubble fraction; v5p and v6e both printed).
--aot_cache=DIR keeps each finished compile's result (keyed by the flags and jax / libtpu versions)
and reuses it: memory_analysis() exists only after XLA:TPU's whole code generation, which for K3's
proxy needs more than 16 GB of host memory and 10+ CPU-minutes (WORKSPACE_NOTES, session 13), so a
result compiled once is kept (also one from a background `launch.plan ... --aot_worker` run, stored
with `store(cache_file(DIR, flags), result)`).
"""
from __future__ import annotations

import glob
import json
import math
import os
import re
import tempfile
from typing import Any

from moonshot_jax import experiment, flops
from moonshot_jax.parallel import plan_memory as pmem
from moonshot_jax.parallel import tpu_aot

# slices per generation and chip count (the proxy mesh's device count; 16 = the decode proxy's)
SLICES = {8: {"v4": "v4:2x2x2", "v5e": "v5e:2x4", "v5p": "v5p:2x2x2", "v6e": "v6e:2x4"},
          16: {"v4": "v4:2x2x4", "v5e": "v5e:4x4", "v5p": "v5p:2x2x4", "v6e": "v6e:4x4"},
          32: {"v4": "v4:2x4x4", "v5e": "v5e:4x8", "v5p": "v5p:2x4x4", "v6e": "v6e:4x8"},
          64: {"v4": "v4:4x4x4", "v5e": "v5e:8x8", "v5p": "v5p:4x4x4", "v6e": "v6e:8x8"}}
PROXY_TOPOLOGIES = SLICES[16]


def tpu_proxy_mesh(sizes: dict[str, int]) -> dict[str, int]:
  """plan_memory's PROXY_MESH with the real "data" size (up to 8): ZeRO shards over "data" then
  have the real per-chip size (the 16-device CPU proxy's data = 2 makes them 4x), at 8 x data chips."""
  data = sizes["data"] if sizes["data"] in (1, 2, 4, 8) else (8 if sizes["data"] % 8 == 0 else 2)
  return dict(pmem.PROXY_MESH, data=data)


def parse_target(text: str, chips: int = 16) -> str:
  """"tpu:v5p" -> the `chips`-chip v5p slice ("v5p:2x2x4" for 16); "tpu:v6e:4x4" -> "v6e:4x4";
  anything else is a ValueError."""
  kind, _, topo = text.partition(":")
  if kind != "tpu" or not topo:
    raise ValueError(f"--target: expected tpu:<generation> or tpu:<generation>:<topology> (e.g. tpu:v5p, "
                     f"tpu:v6e:4x4), got {text!r}")
  topo = SLICES.get(chips, PROXY_TOPOLOGIES).get(topo, topo)
  tpu_aot.chip_of(topo)
  return topo


def tpu_proxy_config(exp_cfg: Any, sizes: dict[str, int]) -> Any:
  """plan_memory's proxy with model.kda_implementation None: the train step, traced under the TPU
  mesh, picks the Pallas TPU kernels from its target (the shape-only init trace, on this CPU
  process, takes the XLA path). The worker fails if the compiled step has no Mosaic call."""
  cfg = pmem.proxy_config(exp_cfg, sizes, tpu_proxy_mesh(sizes))
  if cfg.model.kda_implementation not in (None, "pallas_tpu"):
    raise ValueError(f"--target=tpu: model.kda_implementation={cfg.model.kda_implementation!r}; the TPU "
                     f"proxy compiles the Pallas TPU kernels (leave it unset or 'pallas_tpu')")
  cfg.unlock()
  cfg.model.kda_implementation = None
  cfg.lock()
  return cfg


def worker(exp_cfg: Any, mesh_text: str, target: str) -> dict[str, Any]:
  """In the --aot_worker subprocess: compile the proxy for the target; memory, cost, kernel count."""
  sizes = pmem.parse_mesh(mesh_text)
  n = math.prod(tpu_proxy_mesh(sizes).values())
  topo = parse_target(target, n)
  devices = tpu_aot.devices(topo)
  if len(devices) != n:
    raise ValueError(f"--target={target}: topology {topo} has {len(devices)} chips; the proxy needs {n} "
                     f"(e.g. {', '.join(SLICES.get(n, PROXY_TOPOLOGIES).values())})")
  proxy = tpu_proxy_config(exp_cfg, sizes)
  compiled, lower_s, compile_s = pmem.compile_train_step(proxy, devices, tpu_aot.PLANNING_COMPILE_OPTIONS)
  text = compiled.as_text()
  mosaic = text.count('custom_call_target="tpu_custom_call"')
  if mosaic == 0 and any(m == "kda" for m, _ in experiment.model_config(proxy).layer_kinds):
    raise RuntimeError("the TPU proxy train step compiled without a Pallas KDA kernel (the XLA path was "
                       "chosen): the target was not visible while tracing")
  return dict(topology=topo, device_kind=devices[0].device_kind, lower_s=lower_s, compile_s=compile_s,
              memory=tpu_aot.memory_stats(compiled), cost=tpu_aot.cost_stats(compiled),
              mosaic_calls=mosaic, libtpu_init_args=os.environ.get("LIBTPU_INIT_ARGS", ""))


_UNITS = {"B": 1, "KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3, "TiB": 1024 ** 4}
_ALLOC = re.compile(r"^\s*[\d.]+\w+\(\s*\d+%\);\s*([\d.]+)(\w+);\s*\d+;\s*\d+;\s*(.*)$")
_SHAPE = re.compile(r"(?:(\d+)\u00d7)?(\w+)\[([\d,]*)\]")
_ITEM = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1, "s64": 8, "u64": 8, "f64": 8}


def largest_allocations(dump_dir: str, n: int = 12) -> list[dict[str, Any]]:
  """The step's n largest temporary allocations from XLA:TPU's buffer-assignment report
  (`--xla_dump_to`, *memory-usage-report.txt of the largest dumped module, first table): size and the largest value shapes that share
  it over the program (an allocation is reused by values whose live ranges do not overlap)."""
  files = sorted(glob.glob(os.path.join(dump_dir, "*memory-usage-report.txt")), key=os.path.getsize)
  if not files:
    return []
  out = []
  with open(files[-1]) as f:
    headers = 0
    for line in f:  # the first table of the HBM section: the temporaries' heap (arguments follow,
      headers += line.lstrip().startswith("cumulative_size")  # one table each)
      if headers > 1:
        break
      m = _ALLOC.match(line)
      if not m:
        continue
      shapes = []
      for count, dt, dims in _SHAPE.findall(m.group(3)):
        elems = math.prod(int(d) for d in dims.split(",")) if dims else 1
        shapes.append((elems * _ITEM.get(dt, 4), f"{count + 'x' if count else ''}{dt}[{dims}]"))
      shapes.sort(reverse=True)
      out.append(dict(bytes=float(m.group(1)) * _UNITS.get(m.group(2), 1), values=[s for _, s in shapes[:3]]))
      if len(out) == n:
        break
  return out


def cache_file(cache_dir: str, argv: list[str]) -> str:
  """Where a compile's result is kept under --aot_cache: keyed by the worker's flags (order-free)
  and the jax / libtpu versions, so a changed config, mesh or compiler never hits an old entry."""
  import hashlib
  import importlib.metadata as md
  versions = []
  for pkg in ("jax", "jaxlib", "libtpu"):
    try:
      versions.append(f"{pkg}={md.version(pkg)}")
    except md.PackageNotFoundError:
      versions.append(f"{pkg}=none")
  key = json.dumps([sorted(a for a in argv if not a.startswith("--aot_cache")), versions])
  return os.path.join(cache_dir, f"tpu_aot_{hashlib.sha1(key.encode()).hexdigest()[:16]}.json")


def run_worker(argv: list[str], timeout: int = 3600, cache_dir: str = "") -> dict[str, Any]:
  """The --aot worker with the TPU compiler's env (no fake CPU devices); XLA dumps the train (or
  decode) step's buffer assignment into a temporary directory, whose largest allocations join the result.
  With `cache_dir` a finished compile's result is stored there and reused (K3's proxy compiles
  for over half an hour on a small CPU host); the printout says when a result came from the cache."""
  argv = [a for a in argv if not a.startswith("--aot_cache")]
  path = cache_file(cache_dir, argv) if cache_dir else ""
  if path and os.path.isfile(path):
    with open(path) as f:
      return dict(json.load(f), cached=path)
  with tempfile.TemporaryDirectory(prefix="plan_tpu_dump_") as dump:
    flags = f"--xla_dump_to={dump} --xla_dump_hlo_module_re=jit_step|jit__decode_impl --xla_dump_hlo_pass_re=^$"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, **tpu_aot.ENV)
    res = pmem.run_plan_worker(argv, env, timeout=timeout, what="TPU AOT worker")
    res["largest_allocations"] = largest_allocations(dump)
  if path:
    store(path, res)
  return res


def store(path: str, result: dict[str, Any]) -> None:
  """Writes one --aot_cache entry atomically."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(result, f)
  os.replace(path + ".tmp", path)


def cost_report(proxy_cfg: Any, prep: dict[str, Any], xla: dict[str, Any], chip: tpu_aot.Chip,
                bubble: float | None = None) -> dict[str, Any]:
  """flops.py's per-chip count of one proxy step vs XLA's, and roofline estimates on `chip`.
  `bubble`: the REAL mesh's GPipe idle fraction (the proxy's 2 stages idle far less); default the proxy's."""
  mcfg = experiment.model_config(proxy_cfg)
  seq, batch = int(proxy_cfg.data.seq_len), int(proxy_cfg.data.batch_size)
  devices = prep["devices"]
  fwd = sum(flops.forward_flops_per_token(mcfg, seq).values())
  model_flops = 3 * fwd * batch * seq / devices  # fwd + bwd, per chip
  remat = 4 / 3 if mcfg.remat_policy != "none" else 1.0  # full remat runs the forward twice
  executed = model_flops * remat
  t_compute = executed / chip.bf16_flops
  t_memory = xla["cost"]["bytes_accessed"] / chip.hbm_bandwidth
  bubble = prep["bubble_fraction"] if bubble is None else bubble
  step = max(t_compute, t_memory) / (1 - bubble)
  return dict(model_flops_per_chip=model_flops, executed_flops_per_chip=executed,
              xla_flops_per_chip=xla["cost"]["flops"], xla_bytes_per_chip=xla["cost"]["bytes_accessed"],
              t_compute_s=t_compute, t_memory_s=t_memory, bubble_fraction=bubble, step_time_estimate_s=step,
              mfu_upper_bound=model_flops / (step * chip.bf16_flops))


def make_section(mesh_text: str, target: str, worker_argv: list[str], cache_dir: str = ""):
  """A launch/plan.py section: the proxy's estimate, XLA:TPU's memory and cost, fits, roofline."""
  sizes = pmem.parse_mesh(mesh_text)
  pmesh = tpu_proxy_mesh(sizes)
  topo = parse_target(target, math.prod(pmesh.values()))
  chip = tpu_aot.chip_of(topo)

  def section(cfg, mcfg):
    proxy = pmem.proxy_config(cfg, sizes, pmesh)  # the estimate does not depend on the KDA implementation
    prep = pmem.plan_memory(proxy, pmesh)
    xla = run_worker(worker_argv, cache_dir=cache_dir)
    real_bubble = pmem.plan_memory(cfg, sizes, model_cfg=mcfg)["bubble_fraction"]
    cost = cost_report(proxy, prep, xla, chip, real_bubble)
    # the same per-chip work on the other training chips (memory fit is only known for the target)
    cost["other_chips"] = {n: cost_report(proxy, prep, xla, tpu_aot.CHIPS[n], real_bubble)
                           for n in ("v5p", "v6e") if n != chip.name}
    lines = pmem.format_report(prep, f"AOT proxy estimate for {topo}") + format_tpu(xla, prep, cost, chip)
    fits = xla["memory"]["peak_bytes"] <= chip.hbm_bytes
    return {"tpu_aot": dict(topology=topo, proxy_estimate=prep, xla=xla, cost=cost, fits=fits)}, lines

  return section


def format_tpu(xla: dict[str, Any], prep: dict[str, Any], cost: dict[str, Any], chip: tpu_aot.Chip) -> list[str]:
  g, m = pmem._human, xla["memory"]
  est_args = prep["bytes"]["params"] + prep["bytes"]["optimizer"]
  est_temp = prep["bytes"]["grads"] + prep["bytes"]["activations"]
  peak = m["peak_bytes"]
  e = lambda x: f"{x:.3g}"
  return [
      f"XLA:TPU ({xla['topology']}, {xla['device_kind']}; lower {xla['lower_s']:.0f}s, compile "
      f"{xla['compile_s']:.0f}s; {xla['mosaic_calls']} Mosaic kernel calls"
      f"{'; LIBTPU_INIT_ARGS ' + xla['libtpu_init_args'] if xla.get('libtpu_init_args') else ''}"
      f"{'; from --aot_cache ' + xla['cached'] if xla.get('cached') else ''}) memory_analysis per chip vs the estimate:",
      f"  arguments (params+optimizer)    XLA {g(m['argument_size_in_bytes']):>11}   estimate {g(est_args):>11}"
      f"   ({m['argument_size_in_bytes'] / est_args - 1:+.1%})",
      f"  temporaries (grads+activations) XLA {g(m['temp_size_in_bytes']):>11}   estimate {g(est_temp):>11}"
      f"   ({m['temp_size_in_bytes'] / est_temp - 1:+.1%})",
      f"  outputs {g(m['output_size_in_bytes'])}, aliased {g(m['alias_size_in_bytes'])}, peak {g(peak)}",
      f"  fits {chip.name} ({g(chip.hbm_bytes)} HBM): {'yes' if peak <= chip.hbm_bytes else 'NO'} "
      f"({peak / chip.hbm_bytes:.0%} of HBM)",
      *[f"  fits {n} ({g(tpu_aot.CHIPS[n].hbm_bytes)} HBM) at the same per-chip peak, not compiled for it: "
        f"{'yes' if peak <= tpu_aot.CHIPS[n].hbm_bytes else 'NO'} ({peak / tpu_aot.CHIPS[n].hbm_bytes:.0%})"
        for n in ("v5p", "v6e") if n != chip.name],
      "  largest allocations (XLA:TPU buffer assignment; the largest values that share each one):",
      *[f"    {g(a['bytes']):>11}  {', '.join(a['values'])}" for a in xla.get("largest_allocations", [])],
      "cost per chip and step (XLA's cost_analysis counts each while-loop body once: scanned layers, "
      "pipeline iterations and loss chunks run many times more than it says):",
      f"  FLOPs: flops.py {e(cost['model_flops_per_chip'])} (x4/3 with full remat: "
      f"{e(cost['executed_flops_per_chip'])}), XLA {e(cost['xla_flops_per_chip'])}; "
      f"bytes accessed XLA {e(cost['xla_bytes_per_chip'])}",
      f"  ESTIMATE (roofline, {chip.name}: {chip.bf16_flops / 1e12:.0f} TFLOP/s bf16, "
      f"{chip.hbm_bandwidth / 1e9:.0f} GB/s; no communication): compute {cost['t_compute_s']:.3g}s, "
      f"HBM {cost['t_memory_s']:.3g}s, GPipe bubble of the real mesh {cost['bubble_fraction']:.0%} -> step >= "
      f"{cost['step_time_estimate_s']:.3g}s, MFU <= {cost['mfu_upper_bound']:.1%}",
      *[f"  ESTIMATE (same work per chip on {n}: {tpu_aot.CHIPS[n].bf16_flops / 1e12:.0f} TFLOP/s, "
        f"{tpu_aot.CHIPS[n].hbm_bandwidth / 1e9:.0f} GB/s; memory fit not compiled): step >= "
        f"{c['step_time_estimate_s']:.3g}s, MFU <= {c['mfu_upper_bound']:.1%}"
        for n, c in cost.get("other_chips", {}).items()]]
