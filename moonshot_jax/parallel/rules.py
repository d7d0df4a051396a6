"""The one table that maps logical axis names to mesh axes.

Every weight is annotated with logical names only (`nn.with_logical_partitioning`), every activation
constraint uses `nn.with_logical_constraint`; this file decides where they land on the mesh
("pipeline", "data", "expert", "tensor").

Logical names (weights):
  vocab, embed, heads (KDA q/k heads, MLA heads), v_heads (KDA value heads), head_dim, mlp,
  expert, latent (LatentMoE latent dim), q_lora, kv_lora, conv (short-conv taps), layers (scan
  axis), stage (pipeline stage axis), norm (small vectors, replicated).
Logical names (activations):
  act_batch, act_length, act_embed, act_heads, act_mlp, act_expert.
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
}

STRATEGIES = {
    # ZeRO-1: params replicated over "data"; the optimizer-state rules shard "embed" over data.
    "zero1": dict(_BASE),
    # ZeRO-3 / FSDP: params themselves sharded over "data" on their model dimension.
    "zero3": dict(_BASE, embed="data"),
}


def logical_axis_rules(strategy: str = "zero1") -> tuple[tuple[str, object], ...]:
  """Rules in the form `flax.linen.logical_axis_rules` / `logical_to_mesh_sharding` expect."""
  if strategy not in STRATEGIES:
    raise ValueError(f"mesh.strategy: unknown strategy {strategy!r}; choose one of {sorted(STRATEGIES)}")
  return tuple(STRATEGIES[strategy].items())
