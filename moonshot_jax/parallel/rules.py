"""The one table that maps logical axis names to mesh axes.

Every weight is annotated with logical names only (`nn.with_logical_partitioning`), every activation
constraint uses `nn.with_logical_constraint`; this file decides where they land on the mesh
("pipeline", "data", "expert", "tensor").

Logical names (weights):
  vocab, embed, heads (KDA q/k heads, MLA heads), v_heads (KDA value heads), head_dim, mlp,
  expert, latent (LatentMoE latent dim), q_lora, kv_lora, conv (short-conv taps), layers (scan
  axis), stage (pipeline stage axis), norm (small vectors, replicated); vision tower: vit_patch,
  vit_pos, vit_merged.
Logical names (activations):
  act_batch, act_length, act_embed, act_heads, act_mlp, act_expert.

Two tables per strategy: one for the parameters, one for the optimizer state (moments have the
parameters' logical names; `zero.opt_state_shardings` applies this second table to them).
  zero1: params replicated over "data"; optimizer moments sharded over "data" on their model
         dimension (embed, else latent) — the classic ZeRO-1 split.
  zero3: params sharded like the moments (FSDP); XLA all-gathers each layer's weights where used
         (inside the layer scan, so one layer's full weights are live at a time).
"data" never lands on a dimension that it does not divide: `zero.spec_for` drops it there.
"""
from __future__ import annotations

MESH_AXES = ("pipeline", "data", "expert", "tensor")

# Shared by all strategies; the strategies below only override entries.
_BASE = {
    "act_batch": ("data", "expert"),
    "act_length": None,
    "act_embed": None,
    "act_heads": "tensor",
    "act_mlp": "tensor",
    "act_expert": "expert",
    "vocab": "tensor",
    "embed": None,
    "heads": "tensor",
    "v_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "expert": "expert",
    "latent": None,
    "q_lora": None,
    "kv_lora": None,
    "conv": None,
    "layers": None,
    "stage": "pipeline",
    "norm": None,
    # Vision tower (moonshot_jax/vision): flattened patch pixels, the learned position grid's two
    # spatial axes, the merged 2x2 neighbourhood; its widths reuse embed / heads / head_dim / mlp.
    "vit_patch": None,
    "vit_pos": None,
    "vit_merged": None,
}

# Model dimension(s) that carry the "data" split of sharded state. flax assigns a mesh axis to the
# first logical dim (in array order) that asks for it, so a [embed, latent] kernel splits embed.
_DATA_SHARDED = dict(embed="data", latent="data")

STRATEGIES = {
    "zero1": dict(_BASE),
    "zero3": dict(_BASE, **_DATA_SHARDED),
}
OPT_STATE_STRATEGIES = {
    "zero1": dict(_BASE, **_DATA_SHARDED),
    "zero3": dict(_BASE, **_DATA_SHARDED),
}


def batch_axes() -> tuple[str, ...]:
  """Mesh axes the batch dimension of activations (and of the input batch) is split over."""
  axes = _BASE["act_batch"]
  return (axes,) if isinstance(axes, str) else tuple(axes or ())


def _check(strategy: str) -> None:
  if strategy not in STRATEGIES:
    raise ValueError(f"mesh.strategy: unknown strategy {strategy!r}; choose one of {sorted(STRATEGIES)}")


def logical_axis_rules(strategy: str = "zero1") -> tuple[tuple[str, object], ...]:
  """Rules for parameters and activations, in the form `flax.linen.logical_axis_rules` expects."""
  _check(strategy)
  return tuple(STRATEGIES[strategy].items())


def opt_state_axis_rules(strategy: str = "zero1") -> tuple[tuple[str, object], ...]:
  """Rules for optimizer moments (same logical names as the parameters they track)."""
  _check(strategy)
  return tuple(OPT_STATE_STRATEGIES[strategy].items())
