"""Metrics sinks: WORKDIR/metrics.jsonl (one JSON object per logged step), TensorBoard, throughput.

metrics.jsonl is append-only while training; on resume from step s, `MetricsWriter(...,
resume_step=s)` first rewrites it (atomically: temp file + rename) without the lines of steps > s,
which the restarted run will log again, and without a torn last line left by a kill.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

METRICS_FILE = "metrics.jsonl"


def _jsonable(v: Any) -> Any:
  if isinstance(v, (np.generic, np.ndarray)):
    v = v.tolist()
  if isinstance(v, float) and not math.isfinite(v):
    return str(v)  # JSON has no NaN/Inf literals; keep the line parseable by strict readers
  if isinstance(v, (list, tuple)):
    return [_jsonable(x) for x in v]
  return v


def read_metrics(workdir: str | os.PathLike) -> list[dict[str, Any]]:
  """All complete lines of WORKDIR/metrics.jsonl (a torn last line is skipped)."""
  path = Path(workdir) / METRICS_FILE
  if not path.is_file():
    return []
  rows = []
  for line in path.read_text().splitlines():
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return rows


def truncate_after(workdir: str | os.PathLike, step: int) -> int:
  """Drops lines with step > `step` (and unparseable ones); returns how many lines remain."""
  path = Path(workdir) / METRICS_FILE
  if not path.is_file():
    return 0
  keep = [r for r in read_metrics(workdir) if int(r.get("step", 0)) <= step]
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  with open(tmp, "w") as f:
    for r in keep:
      f.write(json.dumps(r) + "\n")
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  return len(keep)


class MetricsWriter:
  """Writes scalar dicts to metrics.jsonl and (optionally) TensorBoard under WORKDIR/tb."""

  def __init__(self, workdir: str | os.PathLike, *, resume_step: int = 0, tensorboard: bool = True,
               enabled: bool = True):
    self.workdir = Path(workdir)
    self.enabled = enabled
    self._tb = None
    if not enabled:
      return
    self.workdir.mkdir(parents=True, exist_ok=True)
    truncate_after(self.workdir, resume_step)
    self._f = open(self.workdir / METRICS_FILE, "a")
    if tensorboard:
      from tensorboardX import SummaryWriter  # local: optional, slow import
      # purge_step hides events of steps the restarted run will write again
      self._tb = SummaryWriter(str(self.workdir / "tb"), purge_step=resume_step + 1 if resume_step else None)

  def write(self, step: int, scalars: Mapping[str, Any]) -> None:
    if not self.enabled:
      return
    row = {"step": int(step)}
    row.update({k: _jsonable(v) for k, v in scalars.items()})
    self._f.write(json.dumps(row) + "\n")
    self._f.flush()
    if self._tb is not None:
      for k, v in scalars.items():
        if isinstance(v, (int, float, np.integer, np.floating)) and math.isfinite(float(v)):
          self._tb.add_scalar(k, float(v), int(step))
        elif isinstance(v, (list, tuple, np.ndarray)) and len(v) and k.startswith("moe/"):
          for i, x in enumerate(np.asarray(v, np.float64).reshape(-1)):
            self._tb.add_scalar(f"{k}/layer{i}", float(x), int(step))

  def flush(self) -> None:
    if self.enabled:
      self._f.flush()
      os.fsync(self._f.fileno())
      if self._tb is not None:
        self._tb.flush()

  def close(self) -> None:
    if self.enabled:
      self.flush()
      self._f.close()
      if self._tb is not None:
        self._tb.close()


def model_flops_utilization(tokens_per_s: float, train_flops_per_token: float, peak_flops: float) -> float:
  return tokens_per_s * train_flops_per_token / peak_flops if peak_flops > 0 else float("nan")
