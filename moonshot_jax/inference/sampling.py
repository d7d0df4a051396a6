"""Next-token sampling from logits: greedy, temperature, top-k, top-p (nucleus), stop tokens.

Order of operations (as in most LM toolkits): logits / temperature -> keep the top-k -> keep the
smallest set of tokens whose probability mass reaches top_p -> sample from the renormalised rest.
temperature == 0 is greedy (argmax; ties go to the lowest id), whatever top_k / top_p say.

Everything is jit-friendly: `SamplingParams` is hashable and static (top-k needs a static k), the
PRNG key is traced. All math is fp32 on [B, V] logits.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp

_NEG = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  temperature: float = 0.0  # 0 = greedy
  top_k: int = 0  # 0 = off
  top_p: float = 1.0  # 1 = off
  stop_tokens: tuple[int, ...] = ()  # generation of a row ends after emitting one of these
  vocab_limit: int = 0  # > 0: only ids < vocab_limit are ever produced (a tokenizer smaller than the
  #                       model's padded vocab); 0 = all ids

  def __post_init__(self):
    if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
      raise ValueError(f"temperature: expected a float >= 0 (0 = greedy), got {self.temperature!r}")
    if not (isinstance(self.top_k, int) and self.top_k >= 0):
      raise ValueError(f"top_k: expected an int >= 0 (0 = off), got {self.top_k!r}")
    if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
      raise ValueError(f"top_p: expected a float in (0, 1] (1 = off), got {self.top_p!r}")
    stops = tuple(self.stop_tokens)
    if not all(isinstance(t, int) and t >= 0 for t in stops):
      raise ValueError(f"stop_tokens: expected non-negative token ids, got {self.stop_tokens!r}")
    object.__setattr__(self, "stop_tokens", stops)
    if not (isinstance(self.vocab_limit, int) and self.vocab_limit >= 0):
      raise ValueError(f"vocab_limit: expected an int >= 0 (0 = off), got {self.vocab_limit!r}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def _check_logits(logits_BV: jax.Array) -> None:
  if logits_BV.ndim != 2 or not jnp.issubdtype(logits_BV.dtype, jnp.floating):
    raise ValueError(f"logits_BV: expected a floating [B, V] array, got {logits_BV.dtype}{logits_BV.shape}")


def apply_top_k(logits_BV: jax.Array, k: int) -> jax.Array:
  """Sets every logit below the k-th largest of its row to -inf (ties at the threshold are kept)."""
  _check_logits(logits_BV)
  if k <= 0 or k >= logits_BV.shape[-1]:
    return logits_BV
  kth_B1 = jax.lax.top_k(logits_BV, k)[0][:, -1:]
  return jnp.where(logits_BV < kth_B1, _NEG, logits_BV)


def apply_top_p(logits_BV: jax.Array, p: float) -> jax.Array:
  """Keeps the smallest highest-probability prefix whose mass reaches p (always >= 1 token)."""
  _check_logits(logits_BV)
  if p >= 1.0:
    return logits_BV
  order_BV = jnp.argsort(-logits_BV, axis=-1, stable=True)
  sorted_BV = jnp.take_along_axis(logits_BV, order_BV, axis=-1)
  probs_BV = jax.nn.softmax(sorted_BV.astype(jnp.float32), axis=-1)
  mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # mass of strictly better tokens
  keep_sorted_BV = mass_before_BV < p  # token i is needed iff the better ones fall short of p
  keep_BV = jnp.zeros_like(keep_sorted_BV).at[jnp.arange(logits_BV.shape[0])[:, None], order_BV].set(
      keep_sorted_BV)
  return jnp.where(keep_BV, logits_BV, _NEG)


def _limit_vocab(x_BV: jax.Array, limit: int) -> jax.Array:
  if limit <= 0 or limit >= x_BV.shape[-1]:
    return x_BV
  return jnp.where(jnp.arange(x_BV.shape[-1])[None, :] < limit, x_BV, _NEG)


def filtered_logits(logits_BV: jax.Array, params: SamplingParams) -> jax.Array:
  """fp32 logits of the distribution `sample` draws from (vocab limit, temperature, top-k, top-p)."""
  _check_logits(logits_BV)
  x = _limit_vocab(logits_BV.astype(jnp.float32), params.vocab_limit)
  if params.greedy:
    return x
  x = apply_top_k(x / params.temperature, params.top_k)
  return apply_top_p(x, params.top_p)


def sample(logits_BV: jax.Array, key: jax.Array, params: SamplingParams) -> jax.Array:
  """[B] int32 next tokens."""
  _check_logits(logits_BV)
  if params.greedy:
    return jnp.argmax(_limit_vocab(logits_BV, params.vocab_limit), axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, filtered_logits(logits_BV, params), axis=-1).astype(jnp.int32)


def is_stop(tokens_B: jax.Array, stop_tokens: Sequence[int]) -> jax.Array:
  """[B] bool: the token is one of `stop_tokens`."""
  if not stop_tokens:
    return jnp.zeros(tokens_B.shape, bool)
  return jnp.isin(tokens_B, jnp.asarray(tuple(stop_tokens), tokens_B.dtype))
