"""The decode cache: one entry per layer plus the per-row fill level.

  DecodeCache.layers[l]   KDA layer: {"conv": [B, W-1, 2·H·K + HV·V] cfg.dtype, "state": [B, HV, K, V] fp32}
                          (layout owned by layers/kda.py: the last W-1 pre-conv q|k|v projections and
                          the delta-rule state), constant size whatever the context length;
                          MLA layer: {"latent": [B, S_max, kv_lora_rank + qk_rope_head_dim] cfg.dtype},
                          row s < lengths[b] holds token s's [normed kv latent | shared rope key].
  DecodeCache.lengths     [B] int32: tokens of the current document held in the cache, i.e. the
                          position of the next token (MLA rows filled, RoPE position).

AttnRes needs no entry: it mixes, for ONE token, the outputs of that token's own earlier sublayers
(a softmax over depth, never over time), so a decode step rebuilds its source buffer from scratch
with T = 1 (`Transformer.init_carry` of the new token's embedding) and every cross-token dependency
lives in the KDA / MLA caches above. MoE routing and FFNs are per token too. tests/test_inference.py
checks this end to end (decode logits == full-forward logits with AttnRes on).

After a packed prefill (several documents per row) the cache holds each row's LAST document only:
KDA layers reset at document starts, and the MLA rows of that document are moved to the front.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from moonshot_jax.config import ModelConfig
from moonshot_jax.layers.kda import kda_init_cache

# Logical axes of the cache arrays (batch like activations, KDA value heads like the weights).
KDA_AXES = {"conv": ("act_batch", None, None), "state": ("act_batch", "act_heads", None, None)}
MLA_AXES = {"latent": ("act_batch", "act_length", None)}


@flax.struct.dataclass
class DecodeCache:
  layers: tuple[dict[str, jax.Array], ...]
  lengths: jax.Array  # [B] int32

  @property
  def batch_size(self) -> int:
    return int(self.lengths.shape[0])

  @property
  def max_len(self) -> int:
    """S_max of the MLA latent buffers (0 for an all-KDA model: no length limit)."""
    return max((int(c["latent"].shape[1]) for c in self.layers if "latent" in c), default=0)


def mla_latent_dim(cfg: ModelConfig) -> int:
  return cfg.kv_lora_rank + cfg.qk_rope_head_dim


def init_cache(cfg: ModelConfig, batch_size: int, max_len: int) -> DecodeCache:
  """Empty cache (zeros, lengths 0) for `batch_size` rows of up to `max_len` tokens."""
  if not (isinstance(batch_size, int) and batch_size > 0):
    raise ValueError(f"batch_size: expected a positive int, got {batch_size!r}")
  if not (isinstance(max_len, int) and max_len > 0):
    raise ValueError(f"max_len: expected a positive int, got {max_len!r}")
  layers = []
  for mixer, _ in cfg.layer_kinds:
    if mixer == "kda":
      layers.append(kda_init_cache(cfg, batch_size))
    else:
      layers.append({"latent": jnp.zeros((batch_size, max_len, mla_latent_dim(cfg)), jnp.dtype(cfg.dtype))})
  return DecodeCache(layers=tuple(layers), lengths=jnp.zeros((batch_size,), jnp.int32))


def constrain(cache: DecodeCache) -> DecodeCache:
  """Sharding constraints by logical name (no-ops without a mesh and logical_axis_rules)."""
  def one(entry):
    axes = KDA_AXES if "state" in entry else MLA_AXES
    return {k: nn.with_logical_constraint(v, axes[k]) for k, v in entry.items()}
  return cache.replace(layers=tuple(one(e) for e in cache.layers))


def cache_bytes(cache: Any) -> int:
  """Bytes of every array in `cache` (a DecodeCache, or its abstract eval_shape)."""
  return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(cache))


def check_cache(cache: DecodeCache, cfg: ModelConfig) -> None:
  """ValueError naming the first entry whose shape does not fit `cfg`."""
  if not isinstance(cache, DecodeCache):
    raise ValueError(f"cache: expected a DecodeCache, got {type(cache).__name__}")
  if len(cache.layers) != cfg.n_layers:
    raise ValueError(f"cache.layers: expected {cfg.n_layers} entries (one per layer), got {len(cache.layers)}")
  if cache.lengths.ndim != 1 or not jnp.issubdtype(cache.lengths.dtype, jnp.integer):
    raise ValueError(f"cache.lengths: expected an integer [B] array, got {cache.lengths.dtype}{cache.lengths.shape}")
  B, S = cache.lengths.shape[0], cache.max_len
  kda = {k: tuple(v.shape) for k, v in jax.eval_shape(lambda: kda_init_cache(cfg, B)).items()}
  mla = {"latent": (B, S, mla_latent_dim(cfg))}
  for l, (entry, (mixer, _)) in enumerate(zip(cache.layers, cfg.layer_kinds)):
    want = kda if mixer == "kda" else mla
    got = {k: tuple(v.shape) for k, v in entry.items()}
    if got != want:
      raise ValueError(f"cache.layers[{l}] ({mixer}): expected shapes {want}, got {got}")
