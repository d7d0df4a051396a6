"""Plots of a run: `python -m launch.plot WORKDIR` -> WORKDIR/plots/{loss,mfu,expert_load,moe_router}.png,
and for agent RL runs (metrics with "reward") rl.png.

expert_load.png: per-MoE-layer heatmaps over steps of load max/mean (E/k = every token on the same
k experts; the training routing, and the stored bias's alone = eval / decode routing) and of dead
experts (below 10% of the mean load). moe_router.png: the router's view per layer: logit std across
tokens, the token-independent logit offset, the mean pairwise cosine of the MoE input and of the
router input (a collapse shows as cosine -> 1 and logit std -> 0), router weight and gradient norms,
the balancing bias's range and per-step update, and the fraction of saturated sigmoid scores.
rl.png: reward / success, held-out success, response length, tool calls per episode, KL to the
reference, clip fraction, rollout tokens/s, environment latency.

Reads WORKDIR/metrics.jsonl (one JSON object per logged step, see moonshot_jax/train/metrics.py).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


def _series(rows, key):
  pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
  return [p[0] for p in pts], [p[1] for p in pts]


def _layer_series(rows, key):
  """(steps, [steps, layers] array) of the per-MoE-layer list metric moe/<key>; ([], None) if absent."""
  import numpy as np
  pts = [(r["step"], r[f"moe/{key}"]) for r in rows if isinstance(r.get(f"moe/{key}"), list)]
  pts = [(s, v) for s, v in pts if len(v) == len(pts[0][1])] if pts else []
  if not pts:
    return [], None
  return [s for s, _ in pts], np.asarray([v for _, v in pts], np.float64)


ROUTER_PANELS = ("router_logit_std", "router_logit_offset", "input_cos", "router_input_cos",
                 "router_weight_norm", "router_grad_norm", "bias_range", "bias_update_rms",
                 "sigmoid_saturation")


def plot(workdir: str | os.PathLike) -> list[Path]:
  """Writes the PNGs and returns their paths; raises ValueError when there is nothing to plot."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  from moonshot_jax.train.metrics import read_metrics

  rows = read_metrics(workdir)
  if not rows:
    raise ValueError(f"workdir: no metrics in {Path(workdir) / 'metrics.jsonl'}")
  out = Path(workdir) / "plots"
  out.mkdir(parents=True, exist_ok=True)
  written = []

  fig, ax = plt.subplots(figsize=(7, 4))
  for key, style in (("loss", "-"), ("eval_loss", "o-")):
    x, y = _series(rows, key)
    if x:
      ax.plot(x, y, style, label=key, markersize=4)
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats/token)")
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(out / "loss.png", dpi=120)
  written.append(out / "loss.png")
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(7, 4))
  x, y = _series(rows, "mfu")
  ax.plot(x, [100 * v for v in y], "-", color="C2", label="MFU (%)")
  ax.set_xlabel("step")
  ax.set_ylabel("MFU (%)")
  ax2 = ax.twinx()
  x2, y2 = _series(rows, "tokens_per_s")
  ax2.plot(x2, y2, "--", color="C1", label="tokens/s")
  ax2.set_ylabel("tokens/s")
  fig.legend(loc="upper right")
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(out / "mfu.png", dpi=120)
  written.append(out / "mfu.png")
  plt.close(fig)

  heat = [k for k in ("load_max_over_mean", "stored_load_max_over_mean", "dead_experts")
          if _layer_series(rows, k)[0]]
  if heat:
    fig, axes = plt.subplots(len(heat), 1, figsize=(8, 2.2 + 1.8 * len(heat)), squeeze=False)
    for ax, key in zip(axes[:, 0], heat):
      steps, mat = _layer_series(rows, key)  # mat [steps, moe layers]
      im = ax.imshow(mat.T, aspect="auto", origin="lower", interpolation="nearest", cmap="magma",
                     extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, mat.shape[1] - 0.5),
                     vmin=0.0 if key == "dead_experts" else 1.0,
                     vmax=None if key == "dead_experts" else max(2.0, float(np.nanmax(mat))))
      ax.set_ylabel("MoE layer")
      ax.set_title(f"moe/{key}", fontsize=9)
      fig.colorbar(im, ax=ax)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out / "expert_load.png", dpi=120)
    written.append(out / "expert_load.png")
    plt.close(fig)
  panels = [k for k in ROUTER_PANELS if _layer_series(rows, k)[0]]
  if panels:
    cols = min(4, len(panels))
    nrow = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrow, cols, figsize=(3.6 * cols, 3.2 * nrow), squeeze=False)
    for ax in axes.flat[len(panels):]:
      ax.axis("off")
    for ax, key in zip(axes.flat, panels):
      steps, mat = _layer_series(rows, key)
      for j in range(mat.shape[1]):
        ax.plot(steps, mat[:, j], label=f"layer {j}", lw=1)
      ax.set_title(f"moe/{key}", fontsize=9)
      ax.set_xlabel("step")
      ax.grid(alpha=0.3)
      if key == "router_grad_norm":
        ax.set_yscale("log")
    axes[0, 0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "moe_router.png", dpi=120)
    written.append(out / "moe_router.png")
    plt.close(fig)
  if any("reward" in r for r in rows):
    written.append(_plot_rl(rows, out, plt))
  return written


RL_PANELS = (  # (metric keys, y label)
    (("reward", "success_rate"), "train reward / success"), (("heldout_success",), "held-out success"),
    (("response_tokens",), "response tokens / episode"), (("tool_calls",), "tool calls / episode"),
    (("kl",), "KL to reference (k3)"), (("clip_fraction",), "clip fraction"),
    (("rollout_tokens_per_s",), "rollout sampled tokens/s"), (("env_latency_ms",), "env step latency (ms)"))


def _plot_rl(rows, out: Path, plt) -> Path:
  fig, axes = plt.subplots(2, 4, figsize=(16, 6.5))
  for ax, (keys, label) in zip(axes.flat, RL_PANELS):
    for key in keys:
      x, y = _series(rows, key)
      if x:
        ax.plot(x, y, "o-" if key == "heldout_success" else "-", label=key, markersize=3)
    ax.set_title(label, fontsize=9)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if len(keys) > 1:
      ax.legend(fontsize=7)
  fig.tight_layout()
  path = out / "rl.png"
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def main(argv: list[str]) -> None:
  if len(argv) != 2:
    print(__doc__)
    raise SystemExit(2)
  for p in plot(argv[1]):
    print(p)


if __name__ == "__main__":
  main(sys.argv)
