"""The layer stack (`Transformer`) and the LM loss (`lm_loss`)."""
from moonshot_jax.model.loss import head_token_stats, lm_loss, lm_loss_from_stats
from moonshot_jax.model.transformer import (REMAT_POLICIES, Block, FFNSublayer, MixerSublayer, Segment,
                                            Transformer, block_for_layer, layer_plan, layer_variables,
                                            segment_bounds, stack_layers, unstack_layers)

__all__ = ["REMAT_POLICIES", "Block", "FFNSublayer", "MixerSublayer", "Segment", "Transformer",
           "block_for_layer", "head_token_stats", "layer_plan", "layer_variables", "lm_loss", "lm_loss_from_stats",
           "segment_bounds", "stack_layers", "unstack_layers"]
