"""The Transformer on a mesh: expert parallelism and (optionally) pipeline stages, one init/apply.

    pm = ParallelModel.from_experiment(exp_cfg, mesh)
    variables = pm.init(rng, tokens_BT)                       # boxed, logical names (zero.py shards them)
    logits, aux = pm.apply(variables, tokens_BT, segment_ids_BT, positions_BT)   # as Transformer.apply

Same contract as `Transformer.init/apply` (aux stacked per MoE layer in layer order), so the train
step does not care which parallelism runs underneath.
  * mesh "expert" > 1: every LatentMoE gets `expert.make_expert_fn` (dispatch over "expert").
  * mesh "expert" == 1 with "data" or "tensor" > 1: `expert.make_local_expert_fn`, the dropless
    path on each device's own tokens (GSPMD would gather every token copy for the global sort).
  * mesh "pipeline" > 1: params["stages"] replaces the per-layer entries of the Transformer tree:
    {"mixer"|"ffn": {kind: stacked sublayer params, leaves [S, n_kind, ...] with logical names
    ("stage", "layers", ...)}} (pipeline.plan_stages); embedding, head, final site/norm stay as in
    the Transformer (replicated over "pipeline"). "moe_state" stays in the Transformer layout (tiny;
    restacked inside apply) so the balancing update does not depend on the pipeline.
    `to_model_layout` / `from_model_layout` convert params for checkpoints across meshes.
    The batch is cut into cfg.mesh.pipeline_microbatches (0: 2 x stages) strided microbatches
    (row r goes to microbatch r % M, so every microbatch spans all data shards), streamed through
    `pipeline.gpipe`; the carry is {AttnRes state | residual, segment_ids, positions, token_mask}.
    The final AttnRes site runs on the last stage; norm + LM head run after the pipeline.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from moonshot_jax import experiment
from moonshot_jax.config import ModelConfig
from moonshot_jax.layers import attn_res
from moonshot_jax.layers.balancing import load_metrics
from moonshot_jax.model import transformer as tfm
from moonshot_jax.parallel import expert as ep_lib
from moonshot_jax.parallel import pipeline as pp
from moonshot_jax.parallel.mesh import mesh_sizes

_GROUPS = ("mixer", "ffn")


def _is_box(x) -> bool:
  return isinstance(x, nn.meta.AxisMetadata)


def _kinds(cfg: ModelConfig) -> list[dict[str, str]]:
  return [dict(mixer=m, ffn=f) for m, f in cfg.layer_kinds]


@dataclasses.dataclass(frozen=True)
class ParallelModel:
  cfg: ModelConfig
  mesh: Mesh
  ep: ep_lib.EPConfig = ep_lib.EPConfig()
  microbatches: int = 0  # pipeline microbatches, 0 = 2 x stages
  # expert_fn returns (y, stats): LatentMoE merges the dispatch counters (ep_drop_fraction, ...)
  # into its aux, and the train step reports ep_drop_fraction
  ep_stats: bool = True

  @classmethod
  def from_experiment(cls, exp_cfg: Any, mesh: Mesh) -> "ParallelModel":
    if str(exp_cfg.mesh.pipeline_schedule) != "gpipe" and mesh_sizes(mesh)["pipeline"] > 1:
      raise ValueError(f"mesh.pipeline_schedule: only 'gpipe' is implemented, got "
                       f"{exp_cfg.mesh.pipeline_schedule!r}")
    return cls(experiment.model_config(exp_cfg), mesh, ep_lib.EPConfig.from_mesh_cfg(exp_cfg.mesh),
               int(exp_cfg.mesh.pipeline_microbatches))

  # -- derived ---------------------------------------------------------------------------------
  @property
  def stages(self) -> int:
    return mesh_sizes(self.mesh)["pipeline"]

  @property
  def num_microbatches(self) -> int:
    return self.microbatches or 2 * self.stages

  @property
  def plan(self) -> pp.StagePlan | None:
    return pp.plan_stages(_kinds(self.cfg), self.stages) if self.stages > 1 else None

  def expert_fn(self):
    sizes = mesh_sizes(self.mesh)
    if self.cfg.num_experts == 0:
      return None
    if sizes["expert"] == 1:  # dropless routed_experts on each device's own tokens
      return ep_lib.make_local_expert_fn(self.mesh) if sizes["data"] * sizes["tensor"] > 1 else None
    return ep_lib.make_expert_fn(self.mesh, self.ep, with_stats=self.ep_stats)

  def model(self, with_experts: bool = True) -> tfm.Transformer:
    return tfm.Transformer(self.cfg, expert_fn=self.expert_fn() if with_experts else None)

  # -- layouts ---------------------------------------------------------------------------------
  def from_model_layout(self, variables: dict) -> dict:
    """Transformer variables -> this model's layout (identity without pipeline). Boxed or not."""
    if self.plan is None:
      return variables
    plan = self.plan
    per_layer, rest = tfm.unstack_layers({"params": variables["params"]}, self.cfg)
    groups = [{g: pl["params"][g] for g in _GROUPS} for pl in per_layer]
    out = dict(variables)
    out["params"] = dict(rest["params"], stages=_stack_boxed(plan, groups))
    return out

  def to_model_layout(self, variables: dict) -> dict:
    if self.plan is None:
      return variables
    params = dict(variables["params"])
    stages = params.pop("stages")
    per_layer = [{"params": entry} for entry in _unstack_boxed(self.plan, stages)]
    out = dict(variables)
    out["params"] = tfm.stack_layers(per_layer, {"params": params}, self.cfg)["params"]
    return out

  # -- init / apply ----------------------------------------------------------------------------
  def init(self, rng: jax.Array, tokens_BT: jax.Array) -> dict:
    variables = self.model(with_experts=False).init(rng, tokens_BT)
    return self.from_model_layout(variables)

  def apply(self, variables: dict, tokens_BT: jax.Array, segment_ids_BT=None, positions_BT=None,
            token_mask_BT=None, targets_BT=None) -> tuple[Any, dict]:
    """As Transformer.apply: (logits, aux), or (head_stats, aux) when targets_BT is given."""
    if self.plan is None:
      return self.model().apply(variables, tokens_BT, segment_ids_BT, positions_BT, token_mask_BT, targets_BT)
    return self._apply_pipelined(variables, tokens_BT, segment_ids_BT, positions_BT, token_mask_BT, targets_BT)

  def _apply_pipelined(self, variables, tokens_BT, segment_ids_BT, positions_BT, token_mask_BT, targets_BT):
    cfg, plan, m_count = self.cfg, self.plan, self.num_microbatches
    B, T = tokens_BT.shape
    if B % m_count:
      raise ValueError(f"tokens_BT: batch {B} is not divisible by mesh.pipeline_microbatches={m_count}")
    model = self.model(with_experts=False)
    params = dict(variables["params"])
    stages = params.pop("stages")
    rest = {"params": params}
    x = model.apply(rest, tokens_BT, method=tfm.Transformer.embed)
    if token_mask_BT is None:
      token_mask_BT = (segment_ids_BT != 0) if segment_ids_BT is not None else jnp.ones((B, T), bool)
    split = lambda a: None if a is None else jnp.swapaxes(a.reshape((B // m_count, m_count) + a.shape[1:]), 0, 1)
    x_M = split(x)
    carry_M = dict(state=jax.vmap(lambda xm: _init_carry(xm, cfg))(x_M), seg=split(segment_ids_BT),
                   pos=split(positions_BT), mask=split(token_mask_BT))
    stage_vars = {g: {k: {"params": v} for k, v in stages[g].items()} for g in _GROUPS}
    if variables.get("moe_state"):  # Transformer layout -> stacked like the MoE sublayers' params
      per_layer, _ = tfm.unstack_layers({"moe_state": variables["moe_state"]}, cfg)
      ms = pp.stack_layers(plan, [{g: pl.get("moe_state", {}).get(g) for g in _GROUPS} for pl in per_layer])
      for g in _GROUPS:
        for k, v in ms[g].items():
          if jax.tree.leaves(v):
            stage_vars[g][k]["moe_state"] = v
    stage_fn = pp.make_stage_fn(plan, self._layer_fns(), _GROUPS)
    final = params.get("final_site")
    # with remat, a stage's backward recomputes its forward from the saved stage input (and the
    # sublayers' own checkpoints inside), so only M + S - 1 carries stay alive per stage
    out_M, aux_S = pp.gpipe(stage_fn, stage_vars, carry_M, self.mesh,
                            final_fn=lambda fp, c: _final_mix(fp, c["state"], cfg), final_params=final,
                            remat=cfg.remat_policy != "none")
    x_final = jnp.swapaxes(out_M, 0, 1).reshape((B,) + out_M.shape[2:])
    carry = _single_source(x_final, cfg)
    if targets_BT is None:
      out = model.apply(rest, carry, method=tfm.Transformer.head)
    else:
      out = model.apply(rest, carry, targets_BT, method=tfm.Transformer.head_stats)
    return out, self._layer_order_aux(aux_S.get("ffn"), m_count)

  def _layer_fns(self):
    cfg, policy = self.cfg, tfm.REMAT_POLICIES[self.cfg.remat_policy]
    expert_fn = self.expert_fn()
    wrap = (lambda f: jax.checkpoint(f, policy=policy)) if policy is not None else (lambda f: f)

    def mixer(kind):
      def f(v, c, layer):
        state = tfm.MixerSublayer(cfg, kind).apply(v, c["state"], c["seg"], c["pos"])
        return dict(c, state=state), None
      return wrap(f)

    def ffn(kind):
      def f(v, c, layer):
        state, aux = tfm.FFNSublayer(cfg, kind, expert_fn).apply(v, c["state"], layer, c["mask"])
        return dict(c, state=state), aux
      return wrap(f)

    return {"mixer": {k: mixer(k) for k in ("kda", "mla")}, "ffn": {k: ffn(k) for k in ("dense", "moe")}}

  def _layer_order_aux(self, aux_SP, m_count: int) -> dict:
    if not aux_SP:
      return {}
    moe_layers = [i for i, (_, f) in enumerate(self.cfg.layer_kinds) if f == "moe"]
    where = [_slot(self.plan, i) for i in moe_layers]
    aux = jax.tree.map(lambda a: jnp.stack([a[s, j] for s, j in where]), aux_SP)
    aux["aux_loss"] = aux["aux_loss"] / m_count  # per-microbatch means -> mean
    for k in aux:  # expert-parallel ratios (ep_drop_fraction, ...) average; ep_dropped stays a sum
      if k.startswith("ep_") and k != "ep_dropped":
        aux[k] = aux[k] / m_count
    # load metrics are not additive over microbatches: recompute from the summed counts
    aux["load_max_over_mean"], aux["load_entropy"] = jax.vmap(load_metrics)(aux["counts"])
    return aux


# ---- helpers ------------------------------------------------------------------------------------
def _init_carry(x_BTD, cfg: ModelConfig):
  return attn_res.AttnResState.init(x_BTD, cfg) if cfg.attn_res else x_BTD.astype(jnp.float32)


def _final_mix(final_params, state, cfg: ModelConfig):
  if not cfg.attn_res:
    return state
  return attn_res.AttnResMix(cfg).apply({"params": final_params}, state)


def _single_source(x_BTD, cfg: ModelConfig):
  """A carry whose final AttnRes site returns `x_BTD` exactly (one valid source: softmax weight 1),
  so `Transformer.head` applies just the final norm and LM head to the already-mixed output."""
  if not cfg.attn_res:
    return x_BTD.astype(jnp.float32)
  x = x_BTD.astype(jnp.float32)
  return attn_res.AttnResState(buffer=x[None], mask=jnp.ones((1,), bool), partial=jnp.zeros_like(x),
                               partial_valid=jnp.array(False), count=jnp.array(0, jnp.int32))


def _stack_boxed(plan: pp.StagePlan, per_layer: list[dict]) -> dict:
  """pipeline.stack_layers on boxed trees: boxes get ("stage", "layers") prepended to their names."""
  unboxed = [nn.meta.unbox(p) for p in per_layer]
  stacked = pp.stack_layers(plan, unboxed)
  boxed_example = {}
  for g, kinds in plan.kinds.items():
    for kid, k in enumerate(kinds):
      if plan.stack_size[g][k]:
        layer = next(l for l in range(plan.num_layers) if per_layer[l][g] is not None and
                     plan.kind_id[g][_slot(plan, l)] == kid)
        boxed_example.setdefault(g, {})[k] = per_layer[layer][g]

  def rebox(box, value):
    if _is_box(box):
      return box.replace(value=value, names=("stage", "layers") + tuple(box.names))
    return value

  return {g: {k: jax.tree.map(rebox, boxed_example[g][k], stacked[g][k], is_leaf=_is_box)
              for k in stacked[g]} for g in stacked}


def _unstack_boxed(plan: pp.StagePlan, stacked: dict) -> list[dict]:
  def strip(x):
    return x.replace(value=x.value, names=tuple(x.names)[2:]) if _is_box(x) else x

  values = jax.tree.map(lambda x: x.value if _is_box(x) else x, stacked, is_leaf=_is_box)
  per_layer = pp.unstack_layers(plan, values)
  has_boxes = any(_is_box(x) for x in jax.tree.leaves(stacked, is_leaf=_is_box))
  if not has_boxes:
    return per_layer
  out = []
  for layer, entry in enumerate(per_layer):
    s, j = _slot(plan, layer)
    boxed = {}
    for g, kinds in plan.kinds.items():
      k = kinds[plan.kind_id[g][s, j]]
      boxed[g] = jax.tree.map(lambda b, v: strip(b).replace(value=v) if _is_box(b) else v,
                              stacked[g][k], entry[g], is_leaf=_is_box)
    out.append(boxed)
  return out


def _slot(plan: pp.StagePlan, layer: int) -> tuple[int, int]:
  s, j = np.argwhere(plan.layer_id == layer)[0]
  return int(s), int(j)
