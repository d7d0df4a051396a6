"""The pure, jitted train step: microbatched gradients, NaN guard, optimizer, MoE balancing update.

    train_step(state, batch) -> (state, metrics)

Gradient accumulation: the [B, T] batch is split into M = train.microbatches microbatches (row r
goes to microbatch r % M, so every device keeps its rows) and a `lax.scan` sums their gradients.
Each microbatch contributes (ce_m + z_m) * n_m / N + aux_m / M, with n_m its loss tokens and N
the whole batch's: the sum over m is exactly the big-batch objective, so the accumulated gradient
equals the big-batch gradient (up to float summation order) -- except that with
model.router_norm == "batch" each microbatch (and each pipeline microbatch) routes on its own
router-input statistics, as BatchNorm would.

NaN guard: the update is applied only if the loss and every gradient leaf are finite; otherwise
params, optimizer state and moe_state stay as they were (jnp.where inside the jitted step) and
`bad_steps` counts up. The decision is taken before the optimizer runs, so the keep-or-revert
selects fuse into its elementwise passes instead of re-reading params and state afterwards. The
updated params are then checked too: finite gradients can still give non-finite params (a corrupt
optimizer state, an overflowing update); such a step is not "ok" ("applied" is true, "ok" false)
and the loop stops at once without saving it. Per-leaf flags ("grad_finite", "param_finite", in
`leaf_names` order) say which tensors were non-finite.

MoE balancing: the routing statistics ("counts", "hist", "shift_sum", sums over the global batch and all
microbatches) update every layer's "moe_state" bias with `update_balancing_bias` after the
optimizer step, from the same forward pass that produced the gradients; the same sums give the
running router-input statistics (cfg.router_norm == "batch") and the per-layer collapse
diagnostics in the metrics (balancing.routing_diagnostics). The forward pass is traced under
`moe.batch_routing()`: training routes on the batch's own router-input statistics.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from moonshot_jax.config import ModelConfig
from moonshot_jax.layers.balancing import (DIAG_KEYS, routing_diagnostics, update_balancing_bias,
                                           update_router_stats)
from moonshot_jax.layers.moe import batch_routing
from moonshot_jax.model.loss import lm_loss_from_stats
from moonshot_jax.model.transformer import layer_plan, layer_variables
from moonshot_jax.parallel import rules as rules_lib
from moonshot_jax.train import optim
from moonshot_jax.train.state import StateSetup, TrainState

Batch = dict[str, jax.Array]
ApplyFn = Callable[..., tuple[jax.Array, dict]]
BATCH_FIELDS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")
# loss_fn(stats, microbatch, cfg, aux) -> (token-mean objective, token-mean metrics, aux_loss, num_tokens)
LossFn = Callable[[dict, Batch, ModelConfig, dict], tuple[jax.Array, dict, jax.Array, jax.Array]]
BATCH_AXES = rules_lib.batch_axes()  # the "act_batch" rule: batches land where activations do


def leaf_names(tree: Any) -> list[str]:
  return [optim.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def batch_sharding(mesh) -> NamedSharding:
  axes = tuple(a for a in BATCH_AXES if a in mesh.shape)
  return NamedSharding(mesh, P(axes if axes else None))


def check_batch(batch: Batch, batch_size: int, seq_len: int) -> None:
  missing = [k for k in BATCH_FIELDS if k not in batch]
  if missing:
    raise ValueError(f"batch: missing field(s) {missing}; expected {BATCH_FIELDS}")
  for k in BATCH_FIELDS:
    x = batch[k]
    if tuple(x.shape) != (batch_size, seq_len) or not np.issubdtype(x.dtype, np.integer):
      raise ValueError(f"batch[{k!r}]: expected int [{batch_size}, {seq_len}], got {x.dtype}{tuple(x.shape)}")


# ---- MoE balancing ---------------------------------------------------------------------------
def moe_layer_order(cfg: ModelConfig) -> dict[int, int]:
  """global layer index -> its index in aux's stacked [n_moe_layers] axis (layer order)."""
  moe = [i for i, (_, ffn) in enumerate(cfg.layer_kinds) if ffn == "moe"]
  return {layer: j for j, layer in enumerate(moe)}


def update_moe_state(moe_state: Any, stats: dict[str, jax.Array], cfg: ModelConfig,
                     step: jax.Array | None = None) -> Any:
  """New balancing biases (and, with router_norm "batch", running router-input statistics) from
  global-batch stats ("counts" [L_moe, E], "hist" [L_moe, E, bins], balancing.DIAG_KEYS [L_moe, ...]).
  `step` (updates so far) makes the first updates a cumulative mean: rate max(rate, 1 / (step + 1))."""
  if not moe_state:
    return moe_state
  order = moe_layer_order(cfg)
  rate = jnp.float32(cfg.router_stats_rate)
  if step is not None:
    rate = jnp.maximum(rate, 1.0 / (jnp.asarray(step, jnp.float32) + 1.0))

  def one(layer, st):
    out = dict(layer, bias=update_balancing_bias(layer["bias"], st, cfg))
    if "input_mean" in layer and "num_tokens" in st:
      out["input_mean"], out["input_var"] = update_router_stats(layer["input_mean"], layer["input_var"], st, rate)
    return out

  update = jax.vmap(one)
  new = dict(moe_state)
  for seg in layer_plan(cfg):
    if seg.name not in moe_state:
      continue
    if not seg.scanned:
      j = np.asarray([order[seg.start]])
      layer = jax.tree.map(lambda a: a[None], moe_state[seg.name]["ffn"]["moe"])
      upd = jax.tree.map(lambda a: a[0], update(layer, {k: v[j] for k, v in stats.items()}))
      new[seg.name] = _replace_moe(moe_state[seg.name], upd)
      continue
    p = len(seg.unit)
    sub = dict(moe_state[seg.name])
    for m in range(p):
      key = f"layer_{m}"
      if key not in sub:
        continue
      idx = np.asarray([order[seg.start + r * p + m] for r in range(seg.repeats)])
      upd = update(sub[key]["ffn"]["moe"], {k: v[idx] for k, v in stats.items()})
      sub[key] = _replace_moe(sub[key], upd)
    new[seg.name] = sub
  return new


def moe_layer_stack(tree: Any, cfg: ModelConfig, leaf: str) -> jax.Array | None:
  """The `leaf` ("router" of params / grads, "bias" of moe_state) of every MoE layer stacked in
  layer order, [L_moe, ...] (the order of aux's stacked axis); None unless the tree is in the
  Transformer layout (a pipeline model's params are stage-stacked: no per-layer view here)."""
  rows = []
  for layer in moe_layer_order(cfg):
    try:
      rows.append(layer_variables({"t": tree}, cfg, layer)["t"]["ffn"]["moe"][leaf])
    except (KeyError, TypeError):
      return None
  return jnp.stack(rows).astype(jnp.float32) if rows else None


def router_dynamics(params: Any, grads: Any, old_state: Any, new_state: Any, cfg: ModelConfig
                    ) -> dict[str, jax.Array]:
  """Per-MoE-layer [L_moe] router weight / gradient Frobenius norms and the balancing bias's
  trajectory: its range (max - min), std across experts and the RMS of this step's update."""
  out = {}
  w, g = moe_layer_stack(params, cfg, "router"), moe_layer_stack(grads, cfg, "router")
  if w is not None and g is not None:
    norm = lambda a: jnp.sqrt(jnp.sum(a * a, axis=tuple(range(1, a.ndim))))
    out.update(router_weight_norm=norm(w), router_grad_norm=norm(g))
  b0, b1 = moe_layer_stack(old_state, cfg, "bias"), moe_layer_stack(new_state, cfg, "bias")
  if b0 is not None and b1 is not None:
    out.update(bias_range=jnp.max(b1, -1) - jnp.min(b1, -1), bias_std=jnp.std(b1, -1),
               bias_update_rms=jnp.sqrt(jnp.mean(jnp.square(b1 - b0), -1)))
  return out


def _replace_moe(layer_tree: dict, moe: dict) -> dict:
  out = dict(layer_tree)
  out["ffn"] = dict(out["ffn"], moe=moe)
  return out


# ---- gradients ---------------------------------------------------------------------------------
def lm_objective(stats: dict, mb: Batch, cfg: ModelConfig, aux: dict):
  """The default `LossFn`: next-token CE + z-loss over loss_mask (RL passes rl/grpo.py's instead)."""
  _, m = lm_loss_from_stats(stats, mb["loss_mask"], cfg, aux)
  return (m["ce"] + m["z_loss"], {"ce": m["ce"], "z_loss": m["z_loss"], "accuracy": m["accuracy"]},
          m["aux_loss"], m["num_tokens"])


def split_microbatches(batch: Batch, m: int, mesh=None) -> Batch:
  """[B, T] -> [M, B/M, T], row r in microbatch r % M: when each device holds a multiple of M
  rows, every microbatch takes the same number from each device (no resharding)."""
  def one(x):
    b = x.shape[0]
    if b % m:
      raise ValueError(f"train.microbatches: {m} does not divide the batch size {b}")
    y = x.reshape((b // m, m) + x.shape[1:]).swapaxes(0, 1)
    if mesh is not None:
      axes = tuple(a for a in BATCH_AXES if a in mesh.shape)
      n = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
      if axes and (b // m) % n == 0:  # else fewer rows than devices: let XLA place them
        y = jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, axes)))
    return y
  return {k: one(v) for k, v in batch.items()}


def loss_and_grads(apply_fn: ApplyFn, cfg: ModelConfig, params: Any, moe_state: Any, batch: Batch,
                   microbatches: int = 1, mesh=None, loss_fn: LossFn = lm_objective,
                   model_inputs: tuple[str, ...] = (), step: jax.Array | None = None
                   ) -> tuple[Any, dict[str, jax.Array], dict[str, jax.Array]]:
  """(grads of the big-batch loss, metrics, MoE stats summed over the batch). Token-mean terms of
  `loss_fn` are weighted by n_m / N, so any token-level loss aggregates over the whole batch.
  `model_inputs`: whole-batch fields (vision inputs) passed to apply_fn as keyword arguments, unsplit;
  every other field is per row and split into microbatches. `step`: the state's step (a decaying
  balance_jitter reads it)."""
  n_total = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
  inputs = {k: batch[k] for k in model_inputs}
  if inputs and microbatches != 1:
    raise ValueError(f"train.microbatches: batch fields {sorted(inputs)} cannot be split (need 1, got {microbatches})")
  mbs = split_microbatches({k: v for k, v in batch.items() if k not in inputs}, microbatches, mesh)

  def objective(p, mb):
    stats, aux = apply_fn({"params": p, "moe_state": moe_state}, mb["tokens"], mb["segment_ids"],
                          mb["positions"], targets_BT=mb["targets"], **inputs)  # chunked head: no [B, T, V] logits
    token_obj, token_metrics, aux_loss, num_tokens = loss_fn(stats, mb, cfg, aux)
    w = num_tokens / n_total
    obj = token_obj * w + aux_loss / microbatches
    parts = {"loss": obj, **{k: v * w for k, v in token_metrics.items()},
             "aux_loss": aux_loss / microbatches, "num_tokens": num_tokens}
    if "ep_drop_fraction" in aux:  # [n_moe_layers]; every layer routes the same copies: the mean
      parts["ep_drop_fraction"] = jnp.mean(aux["ep_drop_fraction"]) / microbatches  # is the overall
    stats = {k: aux[k] for k in ("counts", "hist", "shift_sum") + DIAG_KEYS if k in aux}
    return obj, (parts, stats)

  grad_fn = jax.grad(objective, has_aux=True)
  grad_fn_batch = lambda *a: _traced_with_batch_routing(grad_fn, step, *a)

  def body(carry, mb):
    g_acc, parts_acc, stats_acc = carry
    g, (parts, stats) = grad_fn_batch(params, mb)
    add = lambda a, b: jax.tree.map(jnp.add, a, b)
    return (add(g_acc, g), add(parts_acc, parts), add(stats_acc, stats)), None

  first = jax.tree.map(lambda x: x[0], mbs)
  parts0, stats0 = jax.eval_shape(lambda: _traced_with_batch_routing(objective, step, params, first)[1])
  zeros = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t)
  init = (jax.tree.map(jnp.zeros_like, params), zeros(parts0), zeros(stats0))
  if microbatches == 1:  # no scan: keeps the single-batch program simple
    (grads, parts, stats), _ = body(init, first)
  else:
    (grads, parts, stats), _ = jax.lax.scan(body, init, mbs)
  return grads, parts, stats


def _traced_with_batch_routing(fn, step, *args):
  """Training routes on the batch's own router-input statistics (layers/moe.py)."""
  with batch_routing(step=step):
    return fn(*args)


# ---- the step ----------------------------------------------------------------------------------
def _all_finite(tree: Any) -> tuple[jax.Array, jax.Array]:
  flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  flags_arr = jnp.stack(flags) if flags else jnp.ones((0,), bool)
  return jnp.all(flags_arr), flags_arr


def train_step_fn(apply_fn: ApplyFn, cfg: ModelConfig, setup: StateSetup, microbatches: int,
                  loss_fn: LossFn = lm_objective, model_inputs: tuple[str, ...] = ()
                  ) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
  """The un-jitted step (see `make_train_step` for the jitted, sharded one)."""
  tx, schedule, mesh = setup.tx, setup.schedule, setup.mesh

  def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
    grads, parts, stats = loss_and_grads(apply_fn, cfg, state.params, state.moe_state, batch,
                                         microbatches, mesh, loss_fn, model_inputs, state.step)
    grad_norm = optax.global_norm(grads)
    grads_ok, grad_flags = _all_finite(grads)
    # decided before the update: the selects below fuse into the optimizer's passes (module doc)
    applied = jnp.isfinite(parts["loss"]) & grads_ok
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    moe_state = update_moe_state(state.moe_state, stats, cfg, state.step) if stats else state.moe_state
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(applied, a, b), new, old)
    params = keep(params, state.params)
    params_ok, param_flags = _all_finite(params)
    ok = applied & params_ok
    new_state = TrainState(
        step=state.step + 1,
        params=params,
        opt_state=keep(opt_state, state.opt_state),
        moe_state=keep(moe_state, state.moe_state),
        rng=jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state.rng))[0]).astype(jnp.uint32),
        bad_steps=jnp.where(ok, 0, state.bad_steps + 1).astype(jnp.int32))
    metrics = dict(parts, grad_norm=grad_norm, lr=schedule(optim.applied_updates(state.opt_state)),
                   ok=ok, applied=applied, bad_steps=new_state.bad_steps, grad_finite=grad_flags,
                   param_finite=param_flags)
    if stats:  # per-MoE-layer [L_moe] collapse diagnostics from the global-batch sums
      drop = () if cfg.balancing == "quantile" else ("hist",)  # hist: the stored bias's own load
      metrics.update(jax.vmap(routing_diagnostics)({k: v for k, v in stats.items() if k not in drop}))
      metrics.update(router_dynamics(state.params, grads, state.moe_state, new_state.moe_state, cfg))
    return new_state, metrics

  return step


@contextlib.contextmanager
def step_context(setup: StateSetup) -> Iterator[None]:
  """The mesh and logical-axis rules a step is traced, lowered and run under (`jitted.lower(...)`
  outside the wrappers below needs it too: the model's sharding constraints name logical axes)."""
  with jax.set_mesh(setup.mesh), nn.logical_axis_rules(rules_lib.logical_axis_rules(setup.strategy)):
    yield


def _batch_shardings(mesh, extra_fields: tuple[str, ...] = (),
                     model_inputs: tuple[str, ...] = ()) -> dict[str, NamedSharding]:
  """[B, T] fields (BATCH_FIELDS + extra_fields) over the batch axes; whole-batch model inputs
  (packed images) replicated."""
  bs, replicated = batch_sharding(mesh), NamedSharding(mesh, P())
  return {**{k: bs for k in BATCH_FIELDS + tuple(extra_fields)}, **{k: replicated for k in model_inputs}}


def make_train_step(apply_fn: ApplyFn, cfg: ModelConfig, setup: StateSetup, microbatches: int = 1,
                    donate: bool = True, loss_fn: LossFn = lm_objective, extra_fields: tuple[str, ...] = (),
                    model_inputs: tuple[str, ...] = ()) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
  """jit(step) with explicit shardings; the state argument is donated. `extra_fields` name further
  [B, T] batch arrays `loss_fn` reads (RL: advantages, old / reference log-probs), sharded alike;
  `model_inputs` name whole-batch arrays passed to apply_fn as keyword arguments (vision), replicated."""
  if microbatches < 1:
    raise ValueError(f"train.microbatches: must be >= 1 (got {microbatches})")
  step = train_step_fn(apply_fn, cfg, setup, microbatches, loss_fn, model_inputs)
  replicated = NamedSharding(setup.mesh, P())
  shardings = _batch_shardings(setup.mesh, extra_fields, model_inputs)
  jitted = jax.jit(step, in_shardings=(setup.shardings, shardings),
                   out_shardings=(setup.shardings, replicated), donate_argnums=(0,) if donate else ())

  def run(state: TrainState, batch: Batch):
    with step_context(setup):
      return jitted(state, {k: batch[k] for k in shardings})

  run.jitted = jitted
  return run


def make_eval_step(apply_fn: ApplyFn, cfg: ModelConfig, setup: StateSetup,
                   model_inputs: tuple[str, ...] = ()) -> Callable:
  """eval(params, moe_state, batch) -> (sum of token CE, number of loss tokens)."""

  def ev(params, moe_state, batch):
    inputs = {k: batch[k] for k in model_inputs}
    stats, aux = apply_fn({"params": params, "moe_state": moe_state}, batch["tokens"],
                          batch["segment_ids"], batch["positions"], targets_BT=batch["targets"], **inputs)
    _, m = lm_loss_from_stats(stats, batch["loss_mask"], cfg, aux)
    return m["ce"] * m["num_tokens"], m["num_tokens"]

  replicated = NamedSharding(setup.mesh, P())
  shardings = _batch_shardings(setup.mesh, model_inputs=model_inputs)
  jitted = jax.jit(ev, in_shardings=(setup.shardings.params, setup.shardings.moe_state, shardings),
                   out_shardings=replicated)

  def run(params, moe_state, batch):
    with step_context(setup):
      return jitted(params, moe_state, {k: batch[k] for k in shardings})

  return run
