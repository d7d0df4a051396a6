"""Vision tokens into the LM: placeholder positions take the projector's tokens, in order.

  x_BTD[b, t] = vision_MD[k]   for the k-th True of image_mask_BT (row-major), else the text embedding.

The placeholder count must equal the number of real vision tokens (`check_placeholders`, on the host,
names both counts); the device side never checks (static shapes: vision_MD may be padded to a token
budget, and the extra rows are never read). Positions whose *target* is a placeholder carry no loss
(`text_loss_mask`): an image token cannot be predicted from text.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def check_placeholders(tokens, image_token_id: int, n_vision_tokens: int) -> None:
  n = int(np.sum(np.asarray(tokens) == image_token_id))
  if n != n_vision_tokens:
    raise ValueError(f"image placeholders: the tokens hold {n} placeholder(s) (id {image_token_id}) but the "
                     f"images give {n_vision_tokens} vision token(s); the counts must match")


def merge_vision_embeddings(x_BTD: jax.Array, image_mask_BT: jax.Array, vision_MD: jax.Array) -> jax.Array:
  if image_mask_BT.shape != x_BTD.shape[:2]:
    raise ValueError(f"image_mask_BT: expected shape {x_BTD.shape[:2]}, got {image_mask_BT.shape}")
  if vision_MD.ndim != 2 or vision_MD.shape[1] != x_BTD.shape[2]:
    raise ValueError(f"vision_MD: expected [n_tokens, d_model={x_BTD.shape[2]}], got {vision_MD.shape}")
  flat = image_mask_BT.reshape(-1)
  idx = jnp.clip(jnp.cumsum(flat.astype(jnp.int32)) - 1, 0, vision_MD.shape[0] - 1)
  picked = vision_MD.astype(x_BTD.dtype)[idx].reshape(x_BTD.shape)
  return jnp.where(image_mask_BT[..., None], picked, x_BTD)


def text_loss_mask(loss_mask_BT: jax.Array, targets_BT: jax.Array, image_token_id: int) -> jax.Array:
  """loss_mask with every position whose target is an image placeholder switched off."""
  return loss_mask_BT * (targets_BT != image_token_id).astype(loss_mask_BT.dtype)
