"""Optimizers (AdamW; Muon for matrices + AdamW for the rest), LR schedules, weight-decay masks.

Which leaf gets what is decided from its path and its logical axis names (the boxed tree from
`jax.eval_shape(model.init)`), never from shapes alone:
  * batch axes: "layers" (nn.scan stack), "stage" (pipeline) and "expert" index independent
    matrices, so Muon orthogonalises every [a, b] slice of an [L, E, a, b] weight separately.
  * Muon: >= 2 non-batch dims, no "vocab" axis (embedding / LM head), not 1-wide, not matched by
    ADAMW_PATTERNS (router, short convolutions, ...). A weight with > 2 non-batch dims is one matrix
    over (first dim) x (the rest), or (the rest) x (embed) when its last dim is "embed" (an output
    projection [heads, head_dim, embed]).
  * weight decay: every leaf except norm scales, biases (`bias`, `*_bias`), `A_log`, AttnRes
    queries and 1-D vectors. The router bias is not a parameter at all ("moe_state").

Update (both optimizers, decoupled decay as AdamW): p <- p - lr_t * g * (u + wd * mask * p), with
u = Adam's m/sqrt(v) or, for Muon leaves, muon_lr_scale * 0.2 * sqrt(max(fan_in, fan_out)) *
NS5(momentum) — Moonlight's RMS matching, so one lr and one wd serve both. g is the leaf's group
lr factor: vision_lr_scale under params["vision"] (a vision-language model's encoder + projector),
optionally ramped linearly to vision_lr_scale_to (optimizer.vision_lr_ramp_*), except that
vision_local_lr_scale (when > 0) replaces it for the patch embedding and the projector; router_lr_scale for the
MoE routers (leaves named "router"), else 1 (the LM).
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers, scale_by_muon

BATCH_AXES = ("layers", "stage", "expert")
# Leaf-path regexes (on "a/b/c") that stay on AdamW even when they are matrices.
# Gates with one output per head / expert (MoE router, KDA beta) count as gates, not matrices.
ADAMW_PATTERNS = (r"(^|/)router$", r"(^|/)b_proj$", r"conv", r"(^|/)embed", r"lm_head", r"(^|/)A_log$",
                  r"bias$")
NO_DECAY_PATTERNS = (r"(^|/)scale$", r"bias$", r"(^|/)A_log$", r"(^|/)dt_bias$", r"(^|/)query$")
MUON_RMS = 0.2  # Moonlight: match AdamW's update RMS

Schedule = Callable[[jax.Array], jax.Array]


def _is_box(x: Any) -> bool:
  return isinstance(x, nn.LogicallyPartitioned)


def path_str(path: tuple) -> str:
  parts = []
  for k in path:
    parts.append(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))))
  return "/".join(parts)


def _leaf_info(boxed_params: Any) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
  """path -> (shape, logical names) for every leaf (names all None when unannotated)."""
  out = {}

  def visit(path, x):
    if _is_box(x):
      shape, names = tuple(x.value.shape), tuple(x.names)
    else:
      shape = tuple(x.shape)
      names = (None,) * len(shape)
    out[path_str(path)] = (shape, names)

  jax.tree_util.tree_map_with_path(visit, boxed_params, is_leaf=_is_box)
  return out


def muon_dims(path: str, shape: tuple[int, ...],
              names: tuple[str | None, ...]) -> MuonDimensionNumbers | None:
  """Muon's (reduction, output) axes for one leaf, or None for an AdamW leaf."""
  if any(re.search(p, path) for p in ADAMW_PATTERNS) or "vocab" in names:
    return None
  mat = [i for i, n in enumerate(names) if n not in BATCH_AXES]
  if len(mat) < 2 or any(shape[i] == 1 for i in mat):
    return None
  if names[mat[-1]] == "embed" and names[mat[0]] != "embed":
    return MuonDimensionNumbers(reduction_axis=tuple(mat[:-1]), output_axis=mat[-1])
  return MuonDimensionNumbers(reduction_axis=mat[0], output_axis=tuple(mat[1:]))


def leading_batch_axes(names: tuple[str | None, ...]) -> int:
  """How many leading axes are batch axes (layers / stage / expert), when no batch axis follows a
  matrix axis (else 0: optax's own reshape handles that leaf)."""
  n = 0
  while n < len(names) and names[n] in BATCH_AXES:
    n += 1
  return 0 if any(x in BATCH_AXES for x in names[n:]) else n


def per_matrix(make_muon: Callable[[Any], optax.GradientTransformation],
               leaf_fn: Callable[[str], tuple[int, Any]]) -> optax.GradientTransformation:
  """optax's Muon applied leaf by leaf, each under nested `jax.vmap`s over its leading batch axes.

  `make_muon(dims)` builds `optax.contrib.scale_by_muon` for one leaf's dimension numbers;
  `leaf_fn(path) -> (n_batch, dims of the leaf without those axes)`. The state is one MuonState
  over the whole tree, as scale_by_muon's own, so the optimizer-state sharding rules apply.

  Why: optax merges batch axes with a reshape, [S, L, E, a, b] -> [S*L*E, a, b]. When E is sharded
  over "expert" but is not the major axis, the merged axis has no block sharding and XLA gathers
  all experts onto every expert-parallel rank (at K3 size a 12.7 GB transient per MoE leaf). vmap
  keeps each axis, and its sharding, in place; the math is the same (each matrix on its own)."""
  base = make_muon(None)

  def update(updates, state, params=None):
    del params
    flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
    mus = treedef.flatten_up_to(state.mu)
    new_u, new_mu, count = [], [], state.count
    for (path, u), mu in zip(flat, mus):
      n, dims = leaf_fn(path_str(path))
      tx = make_muon(dims)

      def one(u, mu, tx=tx):
        out, st = tx.update(u, state._replace(mu=mu))
        return out, st.mu, st.count

      fn = one
      for _ in range(n):
        fn = jax.vmap(fn, out_axes=(0, 0, None))
      u2, mu2, count = fn(u, mu)
      new_u.append(u2)
      new_mu.append(mu2)
    if not flat:
      count = optax.safe_increment(state.count)
    return treedef.unflatten(new_u), state._replace(count=count, mu=treedef.unflatten(new_mu))

  return optax.GradientTransformation(base.init, update)


def decays(path: str, shape: tuple[int, ...], names: tuple[str | None, ...]) -> bool:
  if any(re.search(p, path) for p in NO_DECAY_PATTERNS):
    return False
  return sum(1 for n in names if n not in BATCH_AXES) >= 2


def _tree_like(boxed_params: Any, fn: Callable[[str, tuple, tuple], Any]) -> Any:
  """A tree with the UNBOXED params' structure, leaf = fn(path, shape, names)."""
  info = _leaf_info(boxed_params)
  unboxed = nn.meta.unbox(boxed_params)
  return jax.tree_util.tree_map_with_path(lambda p, _: fn(path_str(p), *info[path_str(p)]), unboxed)


def labels(boxed_params: Any, name: str) -> Any:
  """"muon" / "adamw" per leaf (all "adamw" unless name == "muon")."""
  if name == "adamw":
    return _tree_like(boxed_params, lambda *_: "adamw")
  return _tree_like(boxed_params, lambda p, s, n: "adamw" if muon_dims(p, s, n) is None else "muon")


def decay_mask(boxed_params: Any) -> Any:
  return _tree_like(boxed_params, decays)


ROUTER_PATTERN = r"(^|/)router$"  # the MoE routers' weights (layers/moe.py), router_lr_scale's group
# the tower's per-patch / per-token maps, vision_local_lr_scale's group: the patch embedding (+ its norm) and
# the merger's projector; never the blocks (their attention mixes patches) nor the position grid
VISION_LOCAL_PATTERN = r"^vision/(encoder/patch_(embed|norm)|projector)/"


def lr_groups(boxed_params: Any) -> Any:
  """Per leaf, its learning-rate group: "vision_local" for the tower's patch embedding and projector,
  "vision" for the rest of the vision tower, "router" for an MoE router outside it, "lm" elsewhere."""
  def group(p, *_):
    if p.split("/")[0] == "vision":
      return "vision_local" if re.search(VISION_LOCAL_PATTERN, p) else "vision"
    return "router" if re.search(ROUTER_PATTERN, p) else "lm"
  return _tree_like(boxed_params, group)


def make_schedule(ocfg: Mapping[str, Any], total_steps: int) -> Schedule:
  """Linear warmup from 0, then cosine / WSD / constant; lr(count) for count = applied updates."""
  lr, warm = float(ocfg["lr"]), int(ocfg["warmup_steps"])
  low = lr * float(ocfg["min_lr_ratio"])
  total = max(int(total_steps), warm + 1)
  kind = ocfg["schedule"]
  if kind == "cosine":
    main = optax.cosine_decay_schedule(lr, total - warm, alpha=low / lr)
  elif kind == "wsd":
    decay = max(1, int(round(float(ocfg["decay_fraction"]) * (total - warm))))
    main = optax.join_schedules(
        [optax.constant_schedule(lr), optax.linear_schedule(lr, low, decay)], [total - warm - decay])
  elif kind == "constant":
    main = optax.constant_schedule(lr)
  else:
    raise ValueError(f"optimizer.schedule: expected cosine, wsd or constant, got {kind!r}")
  if warm == 0:
    return main
  # the first update already gets lr/warm, never exactly 0
  return optax.join_schedules([optax.linear_schedule(lr / warm, lr, warm - 1) if warm > 1
                               else optax.constant_schedule(lr), main], [warm])


def _scale_by_rms_shape(dims_fn: Callable[[Any], Any], rms: float) -> optax.GradientTransformation:
  """u *= rms * sqrt(max(fan_in, fan_out)) per Muon leaf (fans from its dimension numbers)."""

  def factor(x, dims: MuonDimensionNumbers) -> float:
    red = dims.reduction_axis if isinstance(dims.reduction_axis, tuple) else (dims.reduction_axis,)
    out = dims.output_axis if isinstance(dims.output_axis, tuple) else (dims.output_axis,)
    fan_in, fan_out = math.prod(x.shape[i] for i in red), math.prod(x.shape[i] for i in out)
    return rms * math.sqrt(max(fan_in, fan_out))

  def update(updates, state, params=None):
    del params
    dims = dims_fn(updates)
    return jax.tree.map(lambda u, d: u * factor(u, d), updates, dims,
                        is_leaf=lambda d: isinstance(d, MuonDimensionNumbers)), state

  return optax.GradientTransformation(optax.init_empty_state, update)


def _vision_factor(ocfg: Mapping[str, Any]) -> optax.GradientTransformation | None:
  """The vision tower's lr factor: None at a constant 1 (so every other run's optimizer state keeps its
  structure), a stateless optax.scale when constant, else a linear ramp counted by its own state (the
  number of updates it has seen: checkpointed with the rest, so a resumed run goes on along the ramp; a
  constant-factor run's checkpoint has no count and does not restore into a ramp run)."""
  vscale = float(ocfg.get("vision_lr_scale", 1.0))
  vto, begin = float(ocfg.get("vision_lr_scale_to", 0.0)), int(ocfg.get("vision_lr_ramp_begin", 0))
  steps = int(ocfg.get("vision_lr_ramp_steps", 0))
  if vscale <= 0:
    raise ValueError(f"optimizer.vision_lr_scale: must be positive, got {vscale}")
  if vto < 0 or (vto > 0) != (steps > 0) or begin < 0:
    raise ValueError(f"optimizer.vision_lr_scale_to / vision_lr_ramp_steps / vision_lr_ramp_begin: a ramp needs "
                     f"scale_to > 0, steps >= 1 and begin >= 0, no ramp scale_to = steps = 0; "
                     f"got {vto}, {steps}, {begin}")
  if vto > 0:
    return optax.scale_by_schedule(optax.linear_schedule(vscale, vto, steps, begin))
  return optax.scale(vscale) if vscale != 1.0 else None


def _vision_local_factor(ocfg: Mapping[str, Any]) -> optax.GradientTransformation | None:
  """The constant lr factor of the tower's patch embedding and projector; None at 0 (they follow the
  vision factor: the group does not exist, so other runs' optimizer state keeps its structure)."""
  f = float(ocfg.get("vision_local_lr_scale", 0.0))
  if f < 0:
    raise ValueError(f"optimizer.vision_local_lr_scale: must be >= 0 (0 = as vision_lr_scale), got {f}")
  return optax.scale(f) if f > 0 else None


def _router_factor(ocfg: Mapping[str, Any]) -> optax.GradientTransformation | None:
  """The MoE routers' constant lr factor; None at 1 (no group, as for the vision factor)."""
  f = float(ocfg.get("router_lr_scale", 1.0))
  if f <= 0:
    raise ValueError(f"optimizer.router_lr_scale: must be positive, got {f}")
  return optax.scale(f) if f != 1.0 else None


def make_optimizer(ocfg: Mapping[str, Any], boxed_params: Any,
                   total_steps: int) -> tuple[optax.GradientTransformation, Schedule]:
  """(tx, schedule). `boxed_params`: the (abstract) params with their LogicallyPartitioned boxes;
  the returned tx is applied to the unboxed params."""
  name = ocfg["name"]
  if name not in ("adamw", "muon"):
    raise ValueError(f"optimizer.name: expected 'adamw' or 'muon', got {name!r}")
  sched = make_schedule(ocfg, total_steps)
  adam = optax.scale_by_adam(b1=float(ocfg["b1"]), b2=float(ocfg["b2"]), eps=float(ocfg["eps"]))
  parts = []
  if float(ocfg["clip_norm"]) > 0:
    parts.append(optax.clip_by_global_norm(float(ocfg["clip_norm"])))
  if name == "adamw":
    parts.append(adam)
  else:
    info = _leaf_info(boxed_params)

    def dims_fn(tree):  # tree: the muon partition (MaskedNode at AdamW leaves)
      return jax.tree_util.tree_map_with_path(lambda p, _: muon_dims(path_str(p), *info[path_str(p)]), tree)

    def leaf_fn(path):  # leading batch axes are vmapped, so optax never merges them
      shape, names = info[path]
      n = leading_batch_axes(names)
      return n, muon_dims(path, shape[n:], names[n:])

    def make(dims):
      return scale_by_muon(beta=float(ocfg["muon_beta"]), nesterov=True, weight_dimension_numbers=dims)

    muon = optax.chain(
        per_matrix(make, leaf_fn),
        _scale_by_rms_shape(dims_fn, MUON_RMS),
        optax.scale(float(ocfg["muon_lr_scale"])))
    parts.append(optax.partition({"muon": muon, "adamw": adam}, labels(boxed_params, "muon")))
  if float(ocfg["weight_decay"]) > 0:
    parts.append(optax.add_decayed_weights(float(ocfg["weight_decay"]), decay_mask(boxed_params)))
  factors = {"vision": _vision_factor(ocfg), "vision_local": _vision_local_factor(ocfg),
             "router": _router_factor(ocfg)}
  factors = {g: t for g, t in factors.items() if t is not None}
  if factors:  # only then, and only those groups: other runs' optimizer state (checkpoints) keeps its structure
    def group(g):  # a vision_local leaf without its own factor follows the tower's
      g = "vision" if g == "vision_local" and g not in factors else g
      return g if g in factors else "lm"
    groups = jax.tree.map(group, lr_groups(boxed_params))
    parts.append(optax.partition(factors | {"lm": optax.identity()}, groups))
  parts.append(optax.scale_by_learning_rate(sched))
  return optax.chain(*parts), sched


def applied_updates(opt_state: Any) -> jax.Array:
  """Number of updates applied so far: the count of the final scale_by_learning_rate (the
  schedule's input); skipped non-finite steps never reach it."""
  return opt_state[-1].count


def describe(boxed_params: Any, name: str) -> list[tuple[str, tuple[int, ...], str, bool]]:
  """(path, shape, "muon"/"adamw", decays) per leaf: a readable optimizer plan."""
  info = _leaf_info(boxed_params)
  rows = []
  for p, (s, n) in info.items():
    kind = "muon" if name == "muon" and muon_dims(p, s, n) is not None else "adamw"
    rows.append((p, s, kind, decays(p, s, n)))
  return rows
