"""python -m launch.moe_route_probe --config=CONFIG --workdir=WORKDIR [--batches=2] [--config.X=...]

What limits the balance of the training routing (issue #23): restores WORKDIR's latest checkpoint,
runs the model on the next training batches (the data state saved with the checkpoint), captures
every MoE layer's input and prints, per layer, the load max/mean of this batch's top-k
  - under the stored bias alone (eval / decode routing),
  - with the in-batch shift (balancing.in_batch_shift) for 1, 2, 4, 8 steps, and 4 steps of a
    512-bin histogram (resolution of the 64-bin quantile),
  - with the same number of steps of exact per-expert quantiles (sorted, no histogram),
and the token-identity bound: tokens of the same id whose router inputs are (nearly) the same go
to the same experts, so one id making up a fraction f of the batch's tokens puts >= f * E / k
times the mean load on each expert it picks. Printed: the largest f * E / k over token ids, and
the share of the most-loaded expert's copies that carry its single most common token id; and the
4-step in-batch shift on scores plus Gaussian selection noise of std 0.003 / 0.01 / 0.03 (what
splitting such tokens by a train-time selection jitter would give).
Router inputs are normalised with the batch's own statistics as in training (router_norm "batch").
"""
from __future__ import annotations

import dataclasses
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from moonshot_jax.layers import balancing
from moonshot_jax.layers.moe import LatentMoE, router_input
from moonshot_jax.model.transformer import Transformer, stack_layers, unstack_layers
from moonshot_jax.train import loop
from moonshot_jax.train.checkpoint import Checkpointer
from moonshot_jax.train.data import make_data


def _define_flags() -> None:
  # Defined only when run as a script: the tests import this module next to other launch
  # scripts that own a "config" flag too (absl's flag registry is process-global).
  config_flags.DEFINE_config_file("config", None, "experiment config file")
  flags.DEFINE_string("workdir", None, "a run's workdir (its checkpoints/ are restored)")
  flags.DEFINE_integer("batches", 2, "training batches to probe (results per batch)")


ITERS = (1, 2, 4, 8)
JITTER = (0.003, 0.01, 0.03)  # selection-noise std, in score units (sigmoid scores in (0, 1))


def capture_moe_inputs(cfg, variables, batch) -> list[dict]:
  """[per MoE layer] {"x": [T, D] input, "w": [T] valid weights, "router", "bias", ...} of one
  eager forward pass of the unscanned model (a scan body's values cannot be taken out)."""
  flat = dataclasses.replace(cfg, scan_layers=False)
  per_layer, rest = unstack_layers(variables, cfg)
  flat_vars = jax.tree.map(jnp.asarray, stack_layers(per_layer, rest, flat))
  seen = []

  def grab(next_fun, args, kwargs, context):
    if isinstance(context.module, LatentMoE) and context.method_name == "__call__":
      x_BTD, mask_BT = args[0], (args[1] if len(args) > 1 else kwargs.get("token_mask_BT"))
      v = context.module.variables
      b, t, d = x_BTD.shape
      mask = np.ones((b * t,), np.float32) if mask_BT is None else np.asarray(mask_BT, np.float32).reshape(-1)
      seen.append({"x": np.asarray(x_BTD, np.float32).reshape(b * t, d), "w": mask,
                   "router": np.asarray(v["params"]["router"]), "bias": np.asarray(v["moe_state"]["bias"])})
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(grab):
    Transformer(flat).apply(flat_vars, jnp.asarray(batch["tokens"]), jnp.asarray(batch["segment_ids"]),
                            jnp.asarray(batch["positions"]))
  return seen


def load_ratio(scores, bias, w, k) -> tuple[float, np.ndarray]:
  """(max / mean load of the valid tokens' top-k of scores + bias, the top-k indices [T, k])."""
  idx = np.asarray(jax.lax.top_k(jnp.asarray(scores + bias), k)[1])
  counts = np.bincount(idx[w > 0].reshape(-1), minlength=scores.shape[1]).astype(np.float64)
  return float(counts.max() / counts.mean()), idx


def exact_shift(scores, bias, w, k, iters) -> np.ndarray:
  """As balancing.in_batch_shift, with each expert's k/E quantile of d taken exactly (np.quantile)."""
  e = scores.shape[1]
  shift = np.zeros((e,), np.float64)
  s = scores[w > 0].astype(np.float64)
  for _ in range(iters):
    biased = s + bias + shift
    alpha = -np.sort(-biased, -1)[:, k]
    d = alpha[:, None] - biased
    shift = shift + np.quantile(d, k / e, axis=0)
  return shift - shift.mean()


def probe_layer(layer: dict, tokens: np.ndarray, k: int) -> dict:
  x, w = jnp.asarray(layer["x"]), jnp.asarray(layer["w"])
  d = x.shape[1]
  r = router_input(x, w, jnp.zeros((d,)), jnp.ones((d,)), use_batch=True)
  scores = np.asarray(jax.nn.sigmoid(r @ jnp.asarray(layer["router"], jnp.float32)))
  bias, wn = layer["bias"].astype(np.float32), np.asarray(layer["w"])
  e = scores.shape[1]
  out = {"copies_per_expert": float(wn.sum() * k / e), "stored": load_ratio(scores, bias, wn, k)[0]}
  for it in ITERS:
    sh = np.asarray(balancing.in_batch_shift(jnp.asarray(scores), jnp.asarray(bias), w, k, iters=it))
    out[f"hist64_{it}"], idx = load_ratio(scores, bias + sh, wn, k)
    if it == 4:
      top_idx = idx
  sh = np.asarray(balancing.in_batch_shift(jnp.asarray(scores), jnp.asarray(bias), w, k, n_bins=512, iters=4))
  out["hist512_4"] = load_ratio(scores, bias + sh, wn, k)[0]
  for it in (2, 4, 8):
    sh = exact_shift(scores, bias, wn, k, it).astype(np.float32)
    out[f"exact_{it}"] = load_ratio(scores, bias + sh, wn, k)[0]
  for sigma in JITTER:  # train-time selection noise: splits near-identical tokens across experts
    noisy = scores + sigma * np.random.default_rng(0).standard_normal(scores.shape).astype(np.float32)
    sh = np.asarray(balancing.in_batch_shift(jnp.asarray(noisy), jnp.asarray(bias), w, k, iters=4))
    out[f"jitter{sigma:g}_4"] = load_ratio(noisy, bias + sh, wn, k)[0]
  ids = tokens.reshape(-1)[wn > 0]
  freq = np.bincount(ids).max() / len(ids)
  out["id_bound"] = float(freq * e / k)
  sel = top_idx[wn > 0]
  counts = np.bincount(sel.reshape(-1), minlength=e)
  jmax = int(counts.argmax())
  rows = np.nonzero((sel == jmax).any(-1))[0]
  out["top_expert_one_id_share"] = float(np.bincount(ids[rows]).max() / max(len(rows), 1))
  out["logit_std"] = float(np.log(scores / (1 - scores)).std(0).mean())
  return out


def main(argv) -> None:
  del argv
  cfg, workdir, n_batches = flags.FLAGS.config, flags.FLAGS.workdir, flags.FLAGS.batches
  trainer = loop.build(cfg)
  mcfg = trainer.model_cfg
  if mcfg.router_norm != "batch":
    raise SystemExit("model.router_norm: this probe routes like router_norm='batch' trains")
  data = make_data(cfg, workdir)
  restored = Checkpointer(f"{workdir}/checkpoints").restore_latest(trainer.setup.abstract)
  if restored is None:
    raise SystemExit(f"workdir: no checkpoint under {workdir}/checkpoints")
  step, state, data_state = restored[0], restored[1], restored[2]
  variables = trainer.model.to_model_layout({"params": state.params, "moe_state": state.moe_state})
  variables = jax.tree.map(np.asarray, nn.meta.unbox(variables))
  it = data.train_iter()
  if data_state:
    it.set_state(data_state)
  k = mcfg.num_experts_per_tok
  cols = (["copies_per_expert", "stored"] + [f"hist64_{i}" for i in ITERS] + ["hist512_4"]
          + [f"exact_{i}" for i in (2, 4, 8)] + [f"jitter{s:g}_4" for s in JITTER]
          + ["id_bound", "top_expert_one_id_share", "logit_std"])
  print(f"checkpoint step {step}; E={mcfg.num_experts} k={k}; load max/mean of one batch's top-k")
  print("| batch | layer | " + " | ".join(cols) + " |")
  print("|" + "---|" * (len(cols) + 2))
  for bi in range(n_batches):
    batch = next(it)
    for j, layer in enumerate(capture_moe_inputs(mcfg, variables, batch)):
      res = probe_layer(layer, np.asarray(batch["tokens"]), k)
      print(f"| {bi} | {j} | " + " | ".join(f"{res[c]:.2f}" for c in cols) + " |", flush=True)
  sys.stdout.flush()


if __name__ == "__main__":
  _define_flags()
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main)
