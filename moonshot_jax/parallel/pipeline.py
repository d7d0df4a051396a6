"""Pipeline parallelism over the "pipeline" mesh axis: GPipe with `ppermute` inside `jax.shard_map`.

Engine (`gpipe`): stage s (device group s of the "pipeline" axis) holds its slice of the stacked
stage parameters ([S, ...] leaves, sharded over "pipeline"). M microbatches stream through
M + S - 1 iterations of a `lax.scan`: at iteration i stage s runs microbatch i - s, then every stage
hands its output to stage s + 1 with one `ppermute`. The carried value is an arbitrary static-shaped
pytree — for the model it is (activations, AttnResState): Block AttnRes' source buffer (embedding +
completed block sums, fixed [N_slots, B, T, D] with a validity mask) travels with the activations,
so stage boundaries need not align with AttnRes blocks. Idle ("bubble") iterations compute on real
data (stage 0 re-reads a valid microbatch, the others start from microbatch 0's input) and are
masked out, so they cannot inject NaN/Inf into the gradients. The backward pass is autodiff of
the scan (ppermute transposes to the reverse ppermute): GPipe's all-forward-then-all-backward,
keeping M microbatch carries per stage (plus the stage internals unless `remat=True`).
Other mesh axes stay automatic inside the stage (axis_names={"pipeline"}): tensor/data sharding
and the expert-parallel shard_map (nested, over data/expert/tensor) work unchanged.
Bubble fraction: (S - 1) / (M + S - 1) (`bubble_fraction`).

Heterogeneous stages (`plan_stages`, `stack_layers`, `unstack_layers`): layers are split into S
contiguous stages of at most P = ceil(n_layers / S) slots (earlier stages take the extra layers;
a missing layer is an identity slot). Each layer is described by one kind per *group* (e.g.
{"mixer": "kda" | "mla", "ffn": "dense" | "moe"}); parameters are stacked PER GROUP AND KIND:
group g, kind k -> leaves [S, n_gk, ...] with n_gk = max over stages of the number of layers of
kind k in that stage. A static slot program (kind id and stack index per stage and slot, indexed
by the traced stage id) picks the right stack entry. A slot whose kind differs between stages runs
every kind present there on every stage and selects its own result: a `lax.switch` would let stages
take different branches, and the collectives inside them (expert all-to-all, tensor-parallel
reductions) then never meet — XLA:CPU deadlocks on it. The extra compute is confined to those
mismatched slots (contiguous stages make them rare). Padding costs memory only where the stages' compositions differ
(e.g. K3 on 16 stages: 2 MLA + 5 KDA stacked for 6 slots); padded entries are zeros and get zero
gradients. `unstack_layers` restores the per-layer (model) layout, e.g. for checkpoints.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from moonshot_jax.layers.varying import varying_axes

AXIS = "pipeline"


def bubble_fraction(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> float:
  """Idle fraction of a GPipe (virtual_stages=1) or circular schedule: (S-1) / (V·M + S-1)."""
  if num_stages < 1 or num_microbatches < 1 or virtual_stages < 1:
    raise ValueError(f"bubble_fraction: sizes must be >= 1, got S={num_stages}, M={num_microbatches}, "
                     f"V={virtual_stages}")
  return (num_stages - 1) / (virtual_stages * num_microbatches + num_stages - 1)


# ---- stage plan ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StagePlan:
  num_stages: int
  slots: int  # P, layer slots per stage
  stage_layers: tuple[tuple[int, ...], ...]  # global layer indices per stage
  kinds: Mapping[str, tuple[str, ...]]  # group -> kind names (id = position)
  kind_id: Mapping[str, np.ndarray]  # group -> [S, P] kind id, -1 = empty slot
  index: Mapping[str, np.ndarray]  # group -> [S, P] index into that kind's stack
  stack_size: Mapping[str, Mapping[str, int]]  # group -> kind -> n_gk
  layer_id: np.ndarray  # [S, P] global layer index, -1 = empty slot

  @property
  def num_layers(self) -> int:
    return sum(len(s) for s in self.stage_layers)

  def padding_fraction(self, group: str) -> float:
    """Stacked entries of `group` that hold no real layer, over all stacked entries."""
    total = self.num_stages * sum(self.stack_size[group].values())
    return 1.0 - self.num_layers / total if total else 0.0


def plan_stages(layer_kinds: Sequence[Mapping[str, str]], num_stages: int) -> StagePlan:
  """Contiguous split of `layer_kinds` (one {group: kind} per layer) into `num_stages` stages."""
  n = len(layer_kinds)
  if num_stages < 1 or num_stages > n:
    raise ValueError(f"mesh.pipeline: need 1 <= stages <= n_layers={n}, got {num_stages}")
  groups = tuple(layer_kinds[0]) if n else ()
  for i, lk in enumerate(layer_kinds):
    if tuple(lk) != groups:
      raise ValueError(f"layer_kinds[{i}]: groups {tuple(lk)} differ from layer 0's {groups}")
  slots = -(-n // num_stages)
  extra = n - (slots - 1) * num_stages  # stages that get `slots` layers; the rest get slots - 1
  bounds, start = [], 0
  for s in range(num_stages):
    size = slots if s < extra else slots - 1
    bounds.append(tuple(range(start, start + size)))
    start += size
  kinds = {g: tuple(sorted({lk[g] for lk in layer_kinds})) for g in groups}
  kind_id = {g: np.full((num_stages, slots), -1, np.int32) for g in groups}
  index = {g: np.zeros((num_stages, slots), np.int32) for g in groups}
  stack = {g: {k: 0 for k in kinds[g]} for g in groups}
  layer_id = np.full((num_stages, slots), -1, np.int32)
  for s, layers in enumerate(bounds):
    used = {g: {k: 0 for k in kinds[g]} for g in groups}
    for j, layer in enumerate(layers):
      layer_id[s, j] = layer
      for g in groups:
        k = layer_kinds[layer][g]
        kind_id[g][s, j] = kinds[g].index(k)
        index[g][s, j] = used[g][k]
        used[g][k] += 1
    for g in groups:
      for k in kinds[g]:
        stack[g][k] = max(stack[g][k], used[g][k])
  return StagePlan(num_stages, slots, tuple(bounds), kinds, kind_id, index, stack, layer_id)


def stack_layers(plan: StagePlan, per_layer: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
  """Per-layer {group: params} -> {group: {kind: params with leading [S, n_gk] axes}}."""
  if len(per_layer) != plan.num_layers:
    raise ValueError(f"per_layer: expected {plan.num_layers} layers, got {len(per_layer)}")
  out: dict[str, dict[str, Any]] = {}
  for g, kinds in plan.kinds.items():
    out[g] = {}
    for kid, k in enumerate(kinds):
      n_gk = plan.stack_size[g][k]
      if n_gk == 0:
        continue
      example = next(per_layer[l][g] for l in range(plan.num_layers)
                     if plan.kind_id[g][_where(plan, l)] == kid)
      rows = []
      for s in range(plan.num_stages):
        entries = [jax.tree.map(jnp.zeros_like, example)] * n_gk
        for j in range(plan.slots):
          if plan.layer_id[s, j] >= 0 and plan.kind_id[g][s, j] == kid:
            entries[plan.index[g][s, j]] = per_layer[plan.layer_id[s, j]][g]
        rows.append(jax.tree.map(lambda *xs: jnp.stack(xs), *entries))
      out[g][k] = jax.tree.map(lambda *xs: jnp.stack(xs), *rows)
  return out


def _where(plan: StagePlan, layer: int) -> tuple[int, int]:
  s, j = np.argwhere(plan.layer_id == layer)[0]
  return int(s), int(j)


def unstack_layers(plan: StagePlan, stacked: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
  """Inverse of `stack_layers` (drops the padding entries)."""
  out = []
  for layer in range(plan.num_layers):
    s, j = _where(plan, layer)
    entry = {}
    for g, kinds in plan.kinds.items():
      k = kinds[plan.kind_id[g][s, j]]
      i = plan.index[g][s, j]
      entry[g] = jax.tree.map(lambda a: a[s, i], stacked[g][k])
    out.append(entry)
  return out


def make_stage_fn(plan: StagePlan, apply: Mapping[str, Mapping[str, Callable]],
                  group_order: Sequence[str] | None = None,
                  aux_template: Mapping[str, Any] | None = None) -> Callable:
  """Stage body for `gpipe` from per-(group, kind) layer functions
  `apply[g][k](params, carry, layer_idx) -> (carry, aux_g | None)` (layer_idx: traced global index).
  Kinds of a group return the same aux structure, or None for "no aux" (zeros of
  `aux_template[g]`, a pytree of ShapeDtypeStructs; default: the first kind's aux at that slot).
  Returns `stage_fn(stacked_stage_params, carry, stage) -> (carry, {g: aux stacked over slots
  [P, ...]})` for the groups that have aux; empty slots return the carry unchanged and zero aux."""
  aux_template = dict(aux_template or {})
  groups = tuple(plan.kinds) if group_order is None else tuple(group_order)
  idx_tab = {g: jnp.asarray(plan.index[g]) for g in groups}
  layer_tab = jnp.asarray(plan.layer_id)

  def stage_fn(params, carry, stage):
    auxes = {g: [] for g in groups}
    for j in range(plan.slots):
      layer = layer_tab[stage, j]
      for g in groups:
        present = sorted({int(v) for v in plan.kind_id[g][:, j]})
        i = idx_tab[g][stage, j]

        def branch(k_id, c, p=params, g=g, i=i, layer=layer):
          if k_id < 0:
            return c, None
          k = plan.kinds[g][k_id]
          p_layer = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), p[g][k])
          return apply[g][k](p_layer, c, layer)

        if g not in aux_template:  # every slot of the group stacks the same structure
          aux_template[g] = _group_aux_shape(plan, apply, g, params, carry)
        aux_shape = aux_template[g]
        zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shape)

        def run(k_id, c):  # branches must agree on types, "varying over pipeline" included
          c2, a = branch(k_id, c)
          return _vary((c2, zeros() if a is None else a), AXIS)

        if len(present) == 1:
          carry, a = run(present[0], carry)
        else:  # every stage runs every kind present at this slot and keeps its own (see above)
          pos = jnp.asarray([present.index(int(v)) for v in plan.kind_id[g][:, j]], jnp.int32)[stage]
          outs = [run(v, carry) for v in present]
          carry, a = jax.tree.map(lambda *xs: jax.lax.select_n(pos, *xs), *outs)
        auxes[g].append(a)
    return carry, {g: jax.tree.map(lambda *xs: jnp.stack(xs), *auxes[g]) for g in groups
                   if jax.tree.leaves(auxes[g])}

  return stage_fn


def _group_aux_shape(plan, apply, g, params, carry):
  """Aux structure of group g: that of the first kind whose layer function returns one."""
  for k in plan.kinds[g]:
    if k not in params[g]:
      continue
    p0 = jax.tree.map(lambda a: a[0], params[g][k])
    shape = jax.eval_shape(lambda c: apply[g][k](p0, c, jnp.int32(0))[1], carry)
    if jax.tree.leaves(shape):
      return shape
  return None


# ---- GPipe engine -------------------------------------------------------------------------------
def _vary(tree: Any, axis: str) -> Any:
  """Mark values as varying over `axis` (scan carries and switch branches must agree on it).
  The varying-axes attribute moved between jax versions; the arithmetic fallback always works."""
  def one(x):
    vma = varying_axes(x)
    if vma is not None and axis in vma:
      return x
    if vma is not None and hasattr(jax.lax, "pcast"):
      return jax.lax.pcast(x, axis, to="varying")
    zero = jax.lax.axis_index(axis) * 0
    return (x | zero.astype(bool)) if x.dtype == jnp.bool_ else x + zero.astype(x.dtype)
  return jax.tree.map(one, tree)


def gpipe(stage_fn: Callable, stage_params: Any, inputs_M: Any, mesh: Mesh, *,
          final_fn: Callable | None = None, final_params: Any = None, remat: bool = False):
  """Runs `stage_fn(params_s, carry, stage) -> (carry, aux)` for every microbatch through all stages.

  stage_params: leaves [S, ...] (stage s's slice goes to pipeline rank s); inputs_M: leaves [M, ...]
  (the carry of each microbatch entering stage 0); `final_fn(final_params, carry) -> out` runs on
  the last stage as each microbatch finishes (default: identity). Returns (outs_M, aux_S): the
  final outputs per microbatch (replicated over "pipeline") and per-stage aux summed over the
  microbatches (leaves [S, ...]).
  """
  s_count = int(mesh.shape.get(AXIS, 1))
  leaves = jax.tree.leaves(stage_params)
  if not leaves or any(x.shape[0] != s_count for x in leaves):
    raise ValueError(f"stage_params: every leaf needs a leading axis of size pipeline={s_count}, got "
                     f"{sorted({x.shape[0] for x in leaves})}")
  m_count = jax.tree.leaves(inputs_M)[0].shape[0]
  if final_fn is None:
    final_fn = lambda _, c: c

  # final_fn runs inside the (rematerialised) body: outside it, autodiff would save every
  # iteration's stage output for final_fn's backward -- a second [M+S-1, carry] stack next to the
  # saved stage inputs (XLA:TPU's buffer assignment for K3 showed both, 13.8 GiB each).
  def body(params, carry, stage, fparams):
    out, a = stage_fn(params, carry, stage)
    return out, a, final_fn(fparams, out)
  body_fn = jax.checkpoint(body) if remat else body

  def local(params, xs, fparams):
    params = jax.tree.map(lambda a: a[0], params)
    stage = jax.lax.axis_index(AXIS)
    first = jax.tree.map(lambda a: a[0], xs)
    _, aux_shape, out_shape = jax.eval_shape(lambda c: body_fn(params, c, stage, fparams), first)
    outs = jax.tree.map(lambda s: jnp.zeros((m_count,) + s.shape, s.dtype), out_shape)
    aux = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shape)
    perm = [(i, i + 1) for i in range(s_count - 1)]

    def step(state, i):
      recv, outs, aux = state
      x_in = jax.tree.map(lambda a: a[jnp.minimum(i, m_count - 1)], xs)
      inp = jax.tree.map(lambda a, b: jnp.where(stage == 0, a, b), x_in, recv)
      out, a, f = body_fn(params, inp, stage, fparams)
      mb = i - stage
      valid = (mb >= 0) & (mb < m_count)
      aux = jax.tree.map(lambda acc, v: acc + jnp.where(valid, v, jnp.zeros_like(v)), aux, a)
      done = i - (s_count - 1)
      is_out = (stage == s_count - 1) & (done >= 0)
      slot = jnp.clip(done, 0, m_count - 1)

      def put(buf, v):  # O(1) per iteration: rewrite one slot with itself unless finished here
        old = jax.lax.dynamic_index_in_dim(buf, slot, 0, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(is_out, v.astype(buf.dtype), old), slot, 0)

      outs = jax.tree.map(put, outs, f)
      recv = jax.tree.map(lambda v: jax.lax.ppermute(v, AXIS, perm), out) if perm else out
      return (recv, outs, aux), None

    init = _vary((first, outs, aux), AXIS)
    (_, outs, aux), _ = jax.lax.scan(step, init, jnp.arange(m_count + s_count - 1))
    return jax.tree.map(lambda a: a[None], (outs, aux))

  p_specs = jax.tree.map(lambda _: P(AXIS), stage_params)
  rep = lambda t: jax.tree.map(lambda _: P(), t)
  am = jax.sharding.get_abstract_mesh()
  ctx_mesh = mesh if (am is None or am.empty) else am
  # check_vma=False: the layers' own scans (e.g. the KDA chunk scan) start from fresh zeros that
  # would need explicit "varying over pipeline" casts; the engine's collectives (ppermute only,
  # no psum) transpose the same way either way.
  outs, aux = jax.shard_map(local, mesh=ctx_mesh, axis_names=frozenset({AXIS}), check_vma=False,
                            in_specs=(p_specs, rep(inputs_M), rep(final_params)),
                            out_specs=(P(AXIS), P(AXIS)))(stage_params, inputs_M, final_params)
  return jax.tree.map(lambda b: b[-1], outs), aux  # the last stage's buffer holds the results
