"""python -m launch.plan --config=experiments/k3.py [--json] [--seq_len=N] [--context=N]
       [--mesh=pipeline=16,data=8,expert=64 [--aot [--target=tpu:v5p]]] [--config.mesh.strategy=zero3 ...]

Parameters (total and active per token) per component from `jax.eval_shape` of the model's init
(nothing is allocated), the layer plan (which layers are scanned) and FLOPs per token, in seconds
for any config. With --json the LAST stdout line is one JSON object: total_params, active_params,
active_params_with_embedding, components {name: {total, active}}, flops {forward_per_token,
train_per_token, seq_len, components}, layer_plan.

Then the decode cache per sequence at --context tokens (default model.max_seq_len; 1M for k3),
hybrid vs all-MLA vs all-KDA (moonshot_jax/inference/plan_cache.py). With --mesh, per-device memory
(params, grads, optimizer state, activations) and traffic of a training step on that mesh, and
whether it fits each accelerator of --hbm (moonshot_jax/parallel/plan_memory.py); with --aot also
XLA's memory_analysis() of the real train step compiled for a same-per-device-shape proxy on 16
fake CPU devices (a subprocess running this script with --aot_worker; minutes for k3). With
--target=tpu:<generation>[:<topology>] the proxy is compiled by XLA:TPU for a 16-chip slice instead
(libtpu, no TPU needed), Pallas KDA kernels inside: memory and cost per chip, fits, roofline
(moonshot_jax/parallel/plan_tpu.py). `--aot_decode --target=tpu:v5p --context=1048576` compiles one
decode step at that context instead (moonshot_jax/parallel/plan_tpu_decode.py). --aot_cache=DIR keeps
finished XLA:TPU results and reuses them (K3's proxy needs a host with > 16 GB free to compile).

Then the weight memory to serve (routed experts in MXFP4, as the released checkpoint, vs all
bf16) and to fine-tune, and the chips of each --hbm kind that hold it (`serving_section`).

Sections are functions `section(cfg, model_cfg) -> (report dict, text lines)` in SECTIONS.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable

if __package__ in (None, ""):  # `python launch/plan.py`: make the repo root importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from moonshot_jax import experiment, flops, params  # noqa: E402
from moonshot_jax.config import ModelConfig  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
_JSON = flags.DEFINE_bool("json", False, "print the report as one JSON object on the last line")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 0, "sequence length for FLOPs (0 = data.seq_len)")
_CONTEXT = flags.DEFINE_integer("context", 0, "context length for the decode-cache plan (0 = model.max_seq_len)")
_MESH = flags.DEFINE_string("mesh", "", "training mesh for the memory plan, e.g. pipeline=16,data=8,expert=64")
_HBM = flags.DEFINE_string("hbm", "H200=141e9,v5p=95e9,v6e=32e9", "accelerators to check the --mesh plan against: name=bytes,...")
_AOT = flags.DEFINE_bool("aot", False, "with --mesh: also AOT-compile the proxy train step (subprocess, minutes)")
_AOT_WORKER = flags.DEFINE_bool("aot_worker", False, "internal: be the --aot subprocess")
_AOT_DECODE = flags.DEFINE_bool("aot_decode", False, "with --target: compile one decode step at --context for "
                                 "the TPU instead of the train step (moonshot_jax/parallel/plan_tpu_decode.py)")
_SERVE_EXPERT = flags.DEFINE_integer("serve_expert", 64, "--aot_decode: expert-parallel ways of the serving mesh")
_DECODE_MXFP4 = flags.DEFINE_bool("aot_decode_mxfp4", True, "--aot_decode: routed experts in MXFP4 (else bf16)")
_AOT_CACHE = flags.DEFINE_string("aot_cache", "", "with --target: keep each finished XLA:TPU compile's result "
                                 "in this directory and reuse it (keyed by the flags and jax/libtpu versions)")
_TARGET = flags.DEFINE_string("target", "", "with --aot: compile the proxy for a TPU instead of XLA:CPU, e.g. "
                              "tpu:v5p or tpu:v6e:4x4 (needs libtpu; moonshot_jax/parallel/plan_tpu.py)")

Section = Callable[[Any, ModelConfig], tuple[dict, list[str]]]


def _fmt(n: float) -> str:
  for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if abs(n) >= div:
      return f"{n / div:.2f}{unit}"
  return f"{n:.0f}"


def params_section(cfg, m: ModelConfig) -> tuple[dict, list[str]]:
  t0 = time.time()
  s = params.summary(m)
  lines = [f"parameters (eval_shape of init, {time.time() - t0:.1f}s)",
           f"  {'component':<16}{'total':>12}{'active/token':>14}"]
  for c, v in s["components"].items():
    if v["total"]:
      lines.append(f"  {c:<16}{_fmt(v['total']):>12}{_fmt(v['active']):>14}")
  lines.append(f"  {'TOTAL':<16}{_fmt(s['total_params']):>12}{_fmt(s['active_params']):>14}"
               f"   (active incl. embedding table: {_fmt(s['active_params_with_embedding'])})")
  return s, lines


def layers_section(cfg, m: ModelConfig) -> tuple[dict, list[str]]:
  from moonshot_jax.model.transformer import layer_plan
  plan = layer_plan(m)
  out = [dict(start=seg.start, end=seg.end, unit=[list(k) for k in seg.unit], repeats=seg.repeats,
              scanned=seg.scanned) for seg in plan]
  lines = [f"layer plan ({m.n_layers} layers, 1-indexed)"]
  for seg in plan:
    unit = " ".join(f"{a.upper()}+{b}" for a, b in seg.unit)
    what = f"scan {seg.repeats} x [{unit}]" if seg.scanned else unit
    lines.append(f"  {seg.start + 1:>3}-{seg.end:<3} {what}")
  return {"layer_plan": out}, lines


def flops_section(cfg, m: ModelConfig) -> tuple[dict, list[str]]:
  seq = _SEQ_LEN.value or int(cfg.data.seq_len)
  comp = flops.forward_flops_per_token(m, seq)
  fwd = sum(comp.values())
  lines = [f"FLOPs per token at seq_len {seq} (forward; training = 3x)"]
  lines += [f"  {c:<16}{_fmt(v):>12}" for c, v in comp.items() if v]
  lines.append(f"  {'forward':<16}{_fmt(fwd):>12}   train {_fmt(3 * fwd)}")
  return {"flops": dict(seq_len=seq, forward_per_token=fwd, train_per_token=3 * fwd, components=comp)}, lines


def cache_section(cfg, m: ModelConfig) -> tuple[dict, list[str]]:
  from moonshot_jax.inference import plan_cache
  context = _CONTEXT.value or m.max_seq_len
  plans = plan_cache.compare(m, context)
  return ({"kv_cache": {k: p.to_dict() for k, p in plans.items()}},
          [f"decode cache per sequence at {context} tokens"] + plan_cache.format_table(plans).splitlines())


def serving_section(cfg, m: ModelConfig) -> tuple[dict, list[str]]:
  """Weight memory to serve the model (routed experts in MXFP4 as released, or all bf16) and to
  fine-tune it (fp32 master weights + fp32 grads + the optimizer's state, from eval_shape of its
  init), and the chips of each --hbm kind that hold it at 90% of HBM (the rest for the KV cache /
  activations; weights only, evenly sharded: a lower bound on the chip count)."""
  import math

  import jax
  import numpy as np

  from moonshot_jax.layers import mxfp4
  from moonshot_jax.train import optim
  boxed = params.abstract_params(m)["params"]
  counts = params.tree_param_counts(boxed)
  total, routed = sum(counts.values()), counts["routed_experts"]
  serve = {"mxfp4": (total - routed) * 2 + routed * mxfp4.nbytes((1, 32)) / 32, "bf16": total * 2}
  tx, _ = optim.make_optimizer(cfg.optimizer, boxed, max(int(cfg.train.steps), 1))
  unboxed = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nn_unbox(boxed))
  opt = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(jax.eval_shape(tx.init, unboxed)))
  tune = total * 4 * 2 + opt
  hbm = _parse_hbm(_HBM.value)
  chips = {what: {name: math.ceil(b / (0.9 * cap)) for name, cap in hbm.items()}
           for what, b in (("serve_mxfp4", serve["mxfp4"]), ("serve_bf16", serve["bf16"]), ("fine_tune", tune))}
  lines = ["weights to serve / fine-tune (chips at 90% HBM, weights only, evenly sharded)",
           f"  {'':<26}{'bytes':>10}" + "".join(f"{n:>10}" for n in hbm)]
  for what, b in (("serve_mxfp4", serve["mxfp4"]), ("serve_bf16", serve["bf16"]), ("fine_tune", tune)):
    label = {"serve_mxfp4": "serve, experts MXFP4", "serve_bf16": "serve, all bf16",
             "fine_tune": f"fine-tune ({cfg.optimizer.name}, fp32)"}[what]
    lines.append(f"  {label:<26}{_fmt(b) + 'B':>10}" + "".join(f"{chips[what][n]:>10}" for n in hbm))
  return ({"serving": {"bytes": serve, "fine_tune_bytes": tune, "optimizer_bytes": opt, "chips": chips}}, lines)


def nn_unbox(tree):
  import flax.linen as nn
  return nn.meta.unbox(tree)


def vision_section(cfg, m: ModelConfig) -> tuple[dict, list[str]]:
  """The vision tower's parameters and forward FLOPs per image size (configs with a `vision` section)."""
  vcfg = experiment.vision_config(cfg)
  if vcfg is None:
    return {}, []
  from moonshot_jax.vision import plan as vplan
  counts = vplan.param_counts(vcfg)
  enc = sum(v for k, v in counts.items() if k != "projector")
  lines = [f"vision tower ({vcfg.n_layers} layers, width {vcfg.width}, {vcfg.num_heads}x{vcfg.head_dim} heads)",
           f"  {'encoder':<16}{enc:>16,}", f"  {'merger+projector':<16}{counts['projector']:>16,}",
           f"  forward FLOPs per image (square, single frame)", f"  {'pixels':<12}{'patches':>9}{'tokens':>8}"
           f"{'encoder':>12}{'projector':>12}"]
  per_size = {}
  for px in vplan.PLAN_SIDES_PX:
    g = px // vcfg.patch_size
    f = vplan.forward_flops(vcfg, 1, g, g)
    per_size[px] = f
    lines.append(f"  {px}x{px:<7}{g * g:>9}{g * g // vcfg.merge_size:>8}"
                 f"{_fmt(sum(v for k, v in f.items() if k != 'projector')):>12}{_fmt(f['projector']):>12}")
  return {"vision": dict(params=counts, encoder_params=enc, forward_flops_per_image=per_size)}, lines


SECTIONS: list[Section] = [params_section, layers_section, flops_section, cache_section, serving_section,
                           vision_section]


def _parse_hbm(text: str) -> dict[str, float]:
  out = {}
  for item in filter(None, (t.strip() for t in text.split(","))):
    name, _, value = item.partition("=")
    try:
      out[name] = float(value)
    except ValueError:
      raise app.UsageError(f"--hbm: expected name=bytes items, got {item!r}") from None
  return out


def _tpu_target(sections: list[Section]) -> None:
  """--target=tpu:...: the --mesh estimate, then the proxy compiled by XLA:TPU (plan_tpu.py)."""
  from moonshot_jax.parallel import plan_memory, plan_tpu
  try:
    plan_tpu.parse_target(_TARGET.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  if _AOT_DECODE.value:
    _tpu_decode(sections)
    return
  if not (_MESH.value and (_AOT.value or _AOT_WORKER.value)):
    raise app.UsageError("--target needs --mesh and --aot (train step) or --aot_decode (decode step)")
  if _AOT_WORKER.value:
    print(json.dumps(plan_tpu.worker(_CONFIG.value, _MESH.value, _TARGET.value)), flush=True)
    sys.exit(0)
  sections.append(plan_memory.make_section(_MESH.value, None, _parse_hbm(_HBM.value)))
  sections.append(plan_tpu.make_section(_MESH.value, _TARGET.value, plan_memory.worker_argv(sys.argv[1:]),
                                        _AOT_CACHE.value))


def _tpu_decode(sections: list[Section]) -> None:
  """--aot_decode --target=tpu:...: one decode step at --context compiled by XLA:TPU (plan_tpu_decode.py)."""
  from moonshot_jax.parallel import plan_memory, plan_tpu, plan_tpu_decode, tpu_aot
  cfg = _CONFIG.value
  context = _CONTEXT.value or experiment.model_config(cfg).max_seq_len
  args = (_TARGET.value, context, _SERVE_EXPERT.value, _DECODE_MXFP4.value)
  if _AOT_WORKER.value:
    print(json.dumps(plan_tpu_decode.worker(cfg, *args)), flush=True)
    sys.exit(0)
  argv = plan_memory.worker_argv(sys.argv[1:])

  def section(cfg, m):
    xla = plan_tpu.run_worker(argv, cache_dir=_AOT_CACHE.value)
    full = plan_tpu_decode.full_model_estimate(m, context, _SERVE_EXPERT.value, _DECODE_MXFP4.value)
    chip = tpu_aot.chip_of(xla["topology"])
    return ({"tpu_aot_decode": dict(xla=xla, full_model=full)},
            plan_tpu_decode.format_decode(xla, full, chip, _SERVE_EXPERT.value))
  sections.append(section)


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  cfg = _CONFIG.value
  if cfg is None:
    raise app.UsageError("--config is required, e.g. --config=experiments/k3.py")
  m = experiment.validate(cfg)
  sections = list(SECTIONS)
  if _TARGET.value:
    _tpu_target(sections)
  elif _MESH.value:
    from moonshot_jax.parallel import plan_memory
    if _AOT_WORKER.value:  # inside the subprocess, on the proxy's fake devices
      sizes = plan_memory.parse_mesh(_MESH.value)
      print(json.dumps(plan_memory.aot_memory_analysis(plan_memory.proxy_config(cfg, sizes))), flush=True)
      return
    worker = plan_memory.worker_argv(sys.argv[1:]) if _AOT.value else None
    sections.append(plan_memory.make_section(_MESH.value, worker, _parse_hbm(_HBM.value)))
  elif _AOT.value or _AOT_WORKER.value:
    raise app.UsageError("--aot needs --mesh")
  report: dict[str, Any] = {}
  for section in sections:
    data, lines = section(cfg, m)
    report.update(data)
    if lines:
      print("\n".join(lines), flush=True)
  if _JSON.value:
    print(json.dumps(report, sort_keys=True), flush=True)


if __name__ == "__main__":
  app.run(main)
