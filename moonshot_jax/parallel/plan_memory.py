"""Per-device memory and communication of a training step on a mesh, on paper and from XLA.

    python -m launch.plan --config=experiments/k3.py --mesh=pipeline=16,data=8,expert=64 \
        [--config.mesh.strategy=zero3] [--config.mesh.pipeline_microbatches=8] [--aot] [--json]

Estimate (`plan_memory`; nothing allocated, shapes from `jax.eval_shape` of the init):
  params / grads   fp32 master weights and gradients, each leaf's shard under the strategy's rules
                   (pipeline stage layout included, with its padding);
  optimizer state  the real optimizer's state (train.optim.make_optimizer), shards by the
                   optimizer-state rules (ZeRO: moments split over "data");
  activations      at the configured microbatch: t = rows per device per microbatch x seq_len
                   tokens. The carry between sublayers is the AttnRes state, (slots + 1) x t x d fp32.
                   Pipelined with remat: gpipe saves each stage iteration's input carry
                   ((M + S - 1) of them), and the backward of one stage re-saves its 2 x slots
                   sublayer inputs; plus the largest transient working set: MoE dispatch buffers
                   and expert hidden, or one loss chunk of fp32 logits and their gradient.
  traffic          per step and device: MoE all_to_all bytes (dense dispatch: capacity buffers
                   there and back, forward and backward), pipeline ppermute bytes, gradient
                   all-reduce bytes over "data".
AOT (`--aot`): lowers and compiles the real train step (parallel_model + train.step) for a proxy
with the SAME per-device shapes where possible — 2 pipeline stages of the same slots (the first
2 x slots layers), experts per device, tokens per device, expert axis 4, data 2 — on 16 fake CPU
devices in a subprocess, and prints XLA's `memory_analysis()` next to the estimate of that proxy
(differences: "data" = 2 instead of 8 changes the ZeRO shards; fewer AttnRes blocks).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from moonshot_jax import experiment
from moonshot_jax.config import ModelConfig
from moonshot_jax.layers import attn_res
from moonshot_jax.model.loss import effective_chunk
from moonshot_jax.parallel import pipeline as pp
from moonshot_jax.parallel import rules as rules_lib
from moonshot_jax.parallel import zero
from moonshot_jax.parallel.expert import dense_capacity
from moonshot_jax.parallel.rules import MESH_AXES

GiB = 1024 ** 3


def parse_mesh(text: str) -> dict[str, int]:
  """"pipeline=16,data=8,expert=64" -> sizes for all four axes (missing ones = 1)."""
  sizes = {a: 1 for a in MESH_AXES}
  for part in filter(None, (p.strip() for p in text.split(","))):
    if "=" not in part:
      raise ValueError(f"--mesh: expected axis=size items, got {part!r}")
    k, v = part.split("=", 1)
    if k not in sizes:
      raise ValueError(f"--mesh: unknown axis {k!r}; axes are {MESH_AXES}")
    sizes[k] = int(v)
    if sizes[k] < 1:
      raise ValueError(f"--mesh: {k} must be >= 1, got {v}")
  return sizes


def _tree_bytes(shapes_specs, mesh_shape) -> float:
  total = 0.0
  for (shape, dtype), spec in shapes_specs:
    total += zero.shard_elements(shape, spec, mesh_shape) * jnp.dtype(dtype).itemsize
  return total


def _pm(mcfg: ModelConfig, sizes: dict[str, int], exp_cfg: Any):
  from moonshot_jax.parallel.parallel_model import ParallelModel  # local: imports the model stack
  mesh = AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)
  return ParallelModel(mcfg, mesh, microbatches=int(exp_cfg.mesh.pipeline_microbatches)), mesh


def default_microbatches(exp_cfg: Any, sizes: dict[str, int]) -> int:
  """Pipeline microbatches: mesh.pipeline_microbatches (0 = 2 x stages), capped so that every
  device still gets >= 1 row of each microbatch."""
  s = sizes["pipeline"]
  want = int(exp_cfg.mesh.pipeline_microbatches) or 2 * s
  rows = int(exp_cfg.data.batch_size) // (sizes["data"] * sizes["expert"])
  return max(1, min(want, rows)) if s > 1 else int(exp_cfg.train.microbatches)


def plan_memory(exp_cfg: Any, sizes: dict[str, int], microbatches: int | None = None,
                model_cfg: ModelConfig | None = None) -> dict[str, Any]:
  """The estimate (bytes per device unless noted); see the module docstring."""
  from moonshot_jax.train import optim  # local: optax-heavy

  mcfg = model_cfg or experiment.model_config(exp_cfg)
  strategy = str(exp_cfg.mesh.strategy)
  m_count = microbatches or default_microbatches(exp_cfg, sizes)
  pm, mesh = _pm(mcfg, sizes, exp_cfg)
  boxed = jax.eval_shape(pm.init, jax.random.key(0), jnp.zeros((1, 16), jnp.int32))
  leaves = jax.tree.leaves(boxed["params"], is_leaf=lambda x: hasattr(x, "names"))
  p_rules = rules_lib.logical_axis_rules(strategy)
  p_items = [((tuple(b.value.shape), jnp.float32), zero.spec_for(b.names, b.value.shape, p_rules, mesh))
             for b in leaves]
  params_b = _tree_bytes(p_items, sizes)
  n_params_total = sum(math.prod(s) for (s, _), _ in p_items)
  tx, _ = optim.make_optimizer(exp_cfg.optimizer, boxed["params"], int(exp_cfg.train.steps))
  opt_abs = jax.eval_shape(tx.init, jax.tree.map(lambda b: jax.ShapeDtypeStruct(b.value.shape, jnp.float32),
                                                 boxed["params"], is_leaf=lambda x: hasattr(x, "names")))
  o_specs = zero.opt_state_specs(tx, opt_abs, boxed["params"], strategy, mesh)
  o_items = [((tuple(a.shape), a.dtype), s) for a, s in
             zip(jax.tree.leaves(opt_abs), jax.tree.leaves(o_specs, is_leaf=lambda s: isinstance(s, jax.P)))]
  opt_b = _tree_bytes(o_items, sizes)

  # activations ---------------------------------------------------------------------------------
  stages = sizes["pipeline"]
  plan = pm.plan
  slots = plan.slots if plan else mcfg.n_layers
  ranks = sizes["data"] * sizes["expert"]  # the batch is split over both (experts see every rank's rows)
  batch = int(exp_cfg.data.batch_size)
  if batch % ranks or (batch // ranks) % m_count:
    raise ValueError(f"data.batch_size={batch} must split into data x expert = {ranks} ranks and then into "
                     f"{m_count} microbatches of whole rows (rows per rank {batch / ranks:g}); change "
                     f"data.batch_size, the mesh or the microbatch count")
  rows_dev = batch // ranks // m_count
  seq = int(exp_cfg.data.seq_len)
  t_dev = rows_dev * seq
  d = mcfg.d_model
  cdt = jnp.dtype(mcfg.dtype).itemsize
  sources = attn_res.num_slots(mcfg) + 1 if mcfg.attn_res else 1
  carry_b = sources * t_dev * d * 4
  iters = m_count + stages - 1 if stages > 1 else m_count
  remat = mcfg.remat_policy != "none"
  saved_stage_inputs = (iters if stages > 1 else 1) * carry_b
  saved_sublayers = 2 * slots * carry_b if remat else float("nan")
  ep = sizes["expert"]
  k, e = mcfg.num_experts_per_tok, mcfg.num_experts
  lat = mcfg.moe_latent_dim or d
  copies = t_dev * k
  cf = float(exp_cfg.mesh.capacity_factor)
  n_slots = e + int(exp_cfg.mesh.redundant_experts)
  buf_rows = n_slots * dense_capacity(int(copies), n_slots, cf) if ep > 1 else copies
  f_loc = mcfg.expert_ff_dim / sizes["tensor"]
  moe_ws = 2 * buf_rows * lat * cdt + buf_rows * f_loc * 3 * 4
  heads_loc = mcfg.mla_num_heads / sizes["tensor"]
  mla_scores = rows_dev * heads_loc * seq * seq * 4  # only if attention materialises scores
  # loss head: one chunk of fp32 logits and their gradient, for all rows the head sees at once
  # (pipelined: every microbatch, after the last stage)
  head_rows = rows_dev * (m_count if stages > 1 else 1)
  chunk = effective_chunk(mcfg.loss_chunk_size, seq)
  head_ws = 2 * head_rows * chunk * mcfg.vocab_size / sizes["tensor"] * 4
  working = max(moe_ws, head_ws)
  act_b = saved_stage_inputs + (0 if math.isnan(saved_sublayers) else saved_sublayers) + working

  # traffic -------------------------------------------------------------------------------------
  moe_layers_dev = (sum(1 for f in (kd["ffn"] for kd in _stage_kinds(mcfg, plan, 0)) if f == "moe")
                    if plan else sum(1 for _, f in mcfg.layer_kinds if f == "moe"))
  a2a_per_layer_mb = 4 * buf_rows * lat * cdt * (ep - 1) / ep if ep > 1 else 0.0
  a2a_step = a2a_per_layer_mb * moe_layers_dev * m_count
  pp_step = 2 * iters * carry_b if stages > 1 else 0.0
  dp = sizes["data"]
  # data-axis traffic from the gradient size before any "data" split (the zero1 param layout)
  z1 = rules_lib.logical_axis_rules("zero1")
  full_b = _tree_bytes([((tuple(b.value.shape), jnp.float32), zero.spec_for(b.names, b.value.shape, z1, mesh))
                        for b in leaves], sizes)
  frac = (dp - 1) / dp
  # zero1: all-reduce of grads (2x) + all-gather of updated params; zero3: reduce-scatter of grads
  # + all-gather of params in the forward and again in the backward
  grad_allreduce = 3 * full_b * frac if dp > 1 else 0.0  # both: ~3 x (dp-1)/dp x gradient bytes
  total = 2 * params_b + opt_b + act_b  # params + grads + optimizer + activations
  return dict(
      mesh=sizes, strategy=strategy, devices=math.prod(sizes.values()), microbatches=m_count,
      rows_per_device_per_microbatch=rows_dev, tokens_per_device_per_microbatch=t_dev,
      bubble_fraction=pp.bubble_fraction(stages, m_count) if stages > 1 else 0.0,
      stage_slots=slots, stage_padding={g: plan.padding_fraction(g) for g in plan.kinds} if plan else {},
      params_total=n_params_total,
      bytes=dict(params=params_b, grads=params_b, optimizer=opt_b, activations=act_b, total=total),
      activations_detail=dict(carry=carry_b, saved_stage_inputs=saved_stage_inputs,
                              saved_sublayer_inputs=saved_sublayers, moe_working_set=moe_ws, head_working_set=head_ws,
                              mla_scores_if_materialised=mla_scores),
      traffic_per_step=dict(moe_all_to_all=a2a_step, pipeline_ppermute=pp_step,
                            data_axis=grad_allreduce))


def _stage_kinds(mcfg: ModelConfig, plan: pp.StagePlan, stage: int):
  kinds = [dict(mixer=m, ffn=f) for m, f in mcfg.layer_kinds]
  return [kinds[l] for l in plan.stage_layers[stage]]


def _human(b: float) -> str:
  if math.isnan(b):
    return "n/a"
  for unit, div in (("GiB", GiB), ("MiB", 1024 ** 2), ("KiB", 1024)):
    if abs(b) >= div:
      return f"{b / div:.2f} {unit}"
  return f"{b:.0f} B"


def format_report(rep: dict[str, Any], title: str = "") -> list[str]:
  g = lambda b: _human(b).rjust(11)
  b, a, t = rep["bytes"], rep["activations_detail"], rep["traffic_per_step"]
  lines = [f"memory per device{(' — ' + title) if title else ''}: mesh {rep['mesh']} ({rep['devices']} devices), "
           f"{rep['strategy']}, {rep['microbatches']} microbatches of {rep['rows_per_device_per_microbatch']:g} "
           f"row(s)/device; pipeline bubble {rep['bubble_fraction']:.1%}",
           f"  params (fp32)     {g(b['params'])}",
           f"  grads (fp32)      {g(b['grads'])}",
           f"  optimizer state   {g(b['optimizer'])}",
           f"  activations       {g(b['activations'])}   (carry {g(a['carry']).strip()}: stage inputs "
           f"{g(a['saved_stage_inputs']).strip()}, sublayer inputs {g(a['saved_sublayer_inputs']).strip()}, "
           f"largest working set: MoE {g(a['moe_working_set']).strip()} / loss head "
           f"{g(a['head_working_set']).strip()})",
           f"  TOTAL             {g(b['total'])}",
           f"  (MLA scores if materialised: {g(a['mla_scores_if_materialised']).strip()} per layer)",
           f"traffic per step and device: MoE all_to_all {g(t['moe_all_to_all']).strip()}, pipeline ppermute "
           f"{g(t['pipeline_ppermute']).strip()}, data axis (grads/ZeRO gathers) {g(t['data_axis']).strip()}"]
  if rep["stage_padding"]:
    lines.append("  stage-stack padding: " + ", ".join(f"{k} {v:.0%}" for k, v in rep["stage_padding"].items()))
  return lines


# ---- AOT proxy ----------------------------------------------------------------------------------
PROXY_MESH = dict(pipeline=2, data=2, expert=4, tensor=1)


def proxy_config(exp_cfg: Any, sizes: dict[str, int], proxy_mesh: dict[str, int] | None = None) -> Any:
  """A config whose per-device shapes match `exp_cfg` on `sizes` on `proxy_mesh` (default
  PROXY_MESH): the first 2 x slots layers (= two stages of the real plan), experts per device,
  tokens per device."""
  proxy_mesh = proxy_mesh or PROXY_MESH
  mcfg = experiment.model_config(exp_cfg)
  s_full = sizes["pipeline"]
  slots = -(-mcfg.n_layers // s_full)
  n_layers = min(mcfg.n_layers, proxy_mesh["pipeline"] * slots)
  e_dev = mcfg.num_experts // sizes["expert"]
  m_full = default_microbatches(exp_cfg, sizes)
  rows_dev = max(1, int(exp_cfg.data.batch_size) // m_full // (sizes["data"] * sizes["expert"]))
  blocks = max(1, attn_res.num_blocks(mcfg))
  cfg = exp_cfg.copy_and_resolve_references()
  cfg.unlock()
  m = cfg.model
  m.n_layers = n_layers
  m.mla_layers = tuple(l for l in mcfg.mla_layers if l <= n_layers)
  m.dense_layers = tuple(l for l in mcfg.dense_layers if l <= n_layers)
  m.num_experts = e_dev * proxy_mesh["expert"]
  m.num_experts_per_tok = min(mcfg.num_experts_per_tok, m.num_experts)
  m.attn_res_block_size = max(1, -(-n_layers // blocks))  # about as many AttnRes sources
  for a, v in proxy_mesh.items():
    cfg.mesh[a] = v
  cfg.mesh.pipeline_microbatches = m_full
  cfg.data.batch_size = rows_dev * m_full * proxy_mesh["data"] * proxy_mesh["expert"]
  cfg.lock()
  return cfg


def compile_train_step(exp_cfg: Any, devices=None, compiler_options: dict[str, Any] | None = None):
  """Lower + compile the real train step for `exp_cfg` on `devices` (default: this process's) from
  abstract inputs -> (compiled, lower seconds, compile seconds). `devices` may be a deviceless TPU
  topology's (parallel/tpu_aot.py): then XLA:TPU compiles it, with `compiler_options` (XLA flags)."""
  from moonshot_jax.parallel.mesh import make_mesh
  from moonshot_jax.parallel.parallel_model import ParallelModel
  from moonshot_jax.train import optim, state as state_lib, step as step_lib

  import time
  mcfg = experiment.model_config(exp_cfg)
  mesh = make_mesh(exp_cfg, devices)
  pm = ParallelModel.from_experiment(exp_cfg, mesh)
  seq, b = int(exp_cfg.data.seq_len), int(exp_cfg.data.batch_size)
  init_fn = lambda rng: pm.init(rng, jnp.zeros((1, seq), jnp.int32))
  setup = state_lib.setup_state(init_fn, lambda bp: optim.make_optimizer(exp_cfg.optimizer, bp, 1000), mesh,
                                str(exp_cfg.mesh.strategy))
  jitted = step_lib.make_train_step(pm.apply, mcfg, setup, int(exp_cfg.train.microbatches)).jitted
  bs = step_lib.batch_sharding(mesh)
  batch = {k: jax.ShapeDtypeStruct((b, seq), jnp.int32, sharding=bs) for k in step_lib.BATCH_FIELDS}
  t0 = time.time()
  with step_lib.step_context(setup):
    lowered = jitted.lower(setup.abstract, batch)
    t1 = time.time()
    compiled = lowered.compile(compiler_options) if compiler_options else lowered.compile()
  return compiled, t1 - t0, time.time() - t1


def aot_memory_analysis(exp_cfg: Any, devices=None) -> dict[str, Any]:
  """memory_analysis() of the compiled train step (compile_train_step) as a dict."""
  compiled, lower_s, compile_s = compile_train_step(exp_cfg, devices)
  ma = compiled.memory_analysis()
  fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
            "generated_code_size_in_bytes")
  out = {f: int(getattr(ma, f)) for f in fields if hasattr(ma, f)}
  out.update(lower_s=lower_s, compile_s=compile_s)
  return out


def worker_argv(argv: list[str]) -> list[str]:
  """launch/plan.py's flags for the --aot subprocess (same config file and overrides), minus the
  flags that only shape the parent's output."""
  drop = {"--aot", "--noaot", "--json", "--nojson"}
  return [a for a in argv if a.split("=", 1)[0] not in drop]


def run_plan_worker(argv: list[str], env: dict[str, str], *, timeout: int, what: str) -> dict[str, Any]:
  """`python -m launch.plan <argv> --aot_worker` in a subprocess with `env` (device count and platform
  are fixed at backend start); returns its last stdout line as JSON, or raises with its stderr tail."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  cmd = [sys.executable, "-m", "launch.plan", *argv, "--aot_worker"]
  res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=root)
  if res.returncode != 0:
    raise RuntimeError(f"{what} failed ({' '.join(cmd[2:])}):\n{res.stderr[-4000:]}")
  return json.loads(res.stdout.strip().splitlines()[-1])


def run_aot_worker(argv: list[str], timeout: int = 3000) -> dict[str, Any]:
  """The --aot worker on PROXY_MESH's fake CPU devices."""
  n = math.prod(PROXY_MESH.values())
  # the caller's other XLA flags (e.g. the tests' --xla_backend_optimization_level=0) reach the
  # worker; only the device count is the proxy's
  count = "--xla_force_host_platform_device_count"
  keep = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(count)]
  env = dict(os.environ, XLA_FLAGS=" ".join(keep + [f"{count}={n}"]), JAX_PLATFORMS="cpu")
  return run_plan_worker(argv, env, timeout=timeout, what="AOT worker")


def _load(path: str) -> Any:
  import importlib.util
  spec = importlib.util.spec_from_file_location("exp", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def make_section(mesh_text: str, aot_worker_argv: list[str] | None = None, hbm: dict[str, float] | None = None):
  """A launch/plan.py section `section(cfg, model_cfg) -> (report, lines)`: the estimate on the mesh,
  whether it fits each accelerator in `hbm` (name -> bytes), and with `aot_worker_argv` XLA's
  memory_analysis of the proxy train step next to the proxy's own estimate."""
  sizes = parse_mesh(mesh_text)

  def section(cfg, mcfg):
    rep = plan_memory(cfg, sizes, model_cfg=mcfg)
    lines = format_report(rep)
    out = {"mesh_plan": rep}
    if hbm:
      fits = {name: rep["bytes"]["total"] <= b for name, b in hbm.items()}
      out["fits"] = fits
      lines.append("  fits: " + ", ".join(f"{n} ({_human(hbm[n])}) {'yes' if f else 'NO'}" for n, f in fits.items()))
    if aot_worker_argv is not None:
      proxy = proxy_config(cfg, sizes)
      prep = plan_memory(proxy, PROXY_MESH)
      xla = run_aot_worker(aot_worker_argv)
      lines += format_report(prep, "AOT proxy estimate") + _format_xla(xla, prep)
      out["aot"] = dict(proxy_estimate=prep, xla=xla)
    return out, lines

  return section


def _format_xla(xla: dict[str, Any], prep: dict[str, Any]) -> list[str]:
  g = _human
  args, temp = xla.get("argument_size_in_bytes", 0), xla.get("temp_size_in_bytes", 0)
  est_state = prep["bytes"]["params"] + prep["bytes"]["optimizer"]
  est_temp = prep["bytes"]["grads"] + prep["bytes"]["activations"]
  return [f"XLA memory_analysis of the proxy train step (lower {xla['lower_s']:.0f}s, "
          f"compile {xla['compile_s']:.0f}s) vs the proxy estimate:",
          f"  arguments (params+optimizer)   XLA {g(args):>11}   estimate {g(est_state):>11}",
          f"  temporaries (grads+activations) XLA {g(temp):>10}   estimate {g(est_temp):>11}",
          f"  outputs {g(xla.get('output_size_in_bytes', 0))}, aliased with arguments "
          f"{g(xla.get('alias_size_in_bytes', 0))}; peak ~ arguments + temporaries = {g(args + temp)}"]
