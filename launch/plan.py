"""python -m launch.plan --config=experiments/k3.py [--json] [--seq_len=N]

Parameters (total and active per token) per component from `jax.eval_shape` of the model's init
(nothing is allocated), the layer plan (which layers are scanned) and FLOPs per token, in seconds
for any config. With --json the LAST stdout line is one JSON object: total_params, active_params,
active_params_with_embedding, components {name: {total, active}}, flops {forward_per_token,
train_per_token, seq_len, components}, layer_plan.

Sections are functions `section(cfg, model_cfg) -> (report dict, text lines)` in SECTIONS, so the
memory (--mesh) and KV-cache planners plug in by appending theirs.
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


SECTIONS: list[Section] = [params_section, layers_section, flops_section]


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  cfg = _CONFIG.value
  if cfg is None:
    raise app.UsageError("--config is required, e.g. --config=experiments/k3.py")
  m = experiment.validate(cfg)
  report: dict[str, Any] = {}
  for section in SECTIONS:
    data, lines = section(cfg, m)
    report.update(data)
    print("\n".join(lines), flush=True)
  if _JSON.value:
    print(json.dumps(report, sort_keys=True), flush=True)


if __name__ == "__main__":
  app.run(main)
