"""Next-token sampling from logits: greedy, temperature, top-k, top-p (nucleus), stop tokens, and
the two anti-repetition controls: repetition penalty and no-repeat-ngram blocking.

Order of operations (as in most LM toolkits): vocab limit -> repetition penalty -> n-gram ban ->
(greedy: argmax) logits / temperature -> keep the top-k -> keep the smallest set of tokens whose
probability mass reaches top_p -> sample from the renormalised rest. temperature == 0 is greedy
(argmax; ties go to the lowest id), whatever top_k / top_p say.

The anti-repetition controls read the row's history (prompt + generated so far) from a fixed-size
token buffer history_BL with valid lengths length_B, so the decode loop keeps static shapes:
  repetition_penalty r (CTRL, Keskar et al. 2019): the logit of every token already in the history
    is divided by r if positive and multiplied by r if negative (r > 1 discourages repeats).
  no_repeat_ngram_size n: a token that would complete an n-gram already in the history is banned
    (logit -inf); n = 1 bans every token seen. If it would ban every allowed token the row keeps its
    unbanned logits (a token must come out).

Everything is jit-friendly: `SamplingParams` is hashable and static (top-k needs a static k), the
PRNG key and the history are traced. All math is fp32 on [B, V] logits.
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
  repetition_penalty: float = 1.0  # 1 = off; > 1 discourages tokens already in the history
  no_repeat_ngram_size: int = 0  # 0 = off; n: never complete an n-gram already in the history

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
    if not (isinstance(self.repetition_penalty, (int, float)) and self.repetition_penalty > 0):
      raise ValueError(f"repetition_penalty: expected a float > 0 (1 = off), got {self.repetition_penalty!r}")
    if not (isinstance(self.no_repeat_ngram_size, int) and self.no_repeat_ngram_size >= 0):
      raise ValueError(f"no_repeat_ngram_size: expected an int >= 0 (0 = off), got {self.no_repeat_ngram_size!r}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  @property
  def uses_history(self) -> bool:
    """Whether sampling reads the token history (the caller must pass history_BL / length_B)."""
    return self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0


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


def _scatter_ids(ids_BN: jax.Array, vocab: int) -> jax.Array:
  """[B, V] bool: True at the ids of each row (ids outside [0, V) are ignored)."""
  b = ids_BN.shape[0]
  return jnp.zeros((b, vocab), bool).at[jnp.arange(b)[:, None], ids_BN].set(True, mode="drop")


def _check_history(history_BL: jax.Array, length_B: jax.Array, batch: int) -> None:
  if history_BL.ndim != 2 or history_BL.shape[0] != batch or length_B.shape != (batch,):
    raise ValueError(f"history_BL / length_B: expected [B={batch}, L] and [B], got {history_BL.shape} "
                     f"and {length_B.shape}")


def seen_tokens(history_BL: jax.Array, length_B: jax.Array, vocab: int) -> jax.Array:
  """[B, V] bool: the token occurs in history_BL[b, :length_B[b]]."""
  valid_BL = jnp.arange(history_BL.shape[1])[None, :] < length_B[:, None]
  return _scatter_ids(jnp.where(valid_BL, history_BL, vocab), vocab)


def apply_repetition_penalty(logits_BV: jax.Array, history_BL: jax.Array, length_B: jax.Array,
                             penalty: float) -> jax.Array:
  """CTRL's penalty: seen tokens' logits / penalty where positive, * penalty where negative."""
  _check_logits(logits_BV)
  _check_history(history_BL, length_B, logits_BV.shape[0])
  if penalty == 1.0:
    return logits_BV
  seen_BV = seen_tokens(history_BL, length_B, logits_BV.shape[1])
  scaled_BV = jnp.where(logits_BV > 0, logits_BV / penalty, logits_BV * penalty)
  return jnp.where(seen_BV, scaled_BV, logits_BV)


def banned_ngram_tokens(history_BL: jax.Array, length_B: jax.Array, n: int, vocab: int) -> jax.Array:
  """[B, V] bool: tokens t such that (last n-1 history tokens, t) is an n-gram of the history.
  Static shapes: every start j of history_BL is compared with the row's last n-1 tokens, [B, L, n-1]."""
  if n <= 0:
    return jnp.zeros((history_BL.shape[0], vocab), bool)
  if n == 1:
    return seen_tokens(history_BL, length_B, vocab)
  L = history_BL.shape[1]
  at = lambda idx: jnp.take_along_axis(history_BL, jnp.clip(idx, 0, L - 1), axis=1)
  prefix_Bm = at(length_B[:, None] - (n - 1) + jnp.arange(n - 1)[None, :])  # the row's last n-1
  starts_L = jnp.arange(L)
  window_BLm = history_BL[:, jnp.clip(starts_L[:, None] + jnp.arange(n - 1)[None, :], 0, L - 1)]
  match_BL = jnp.all(window_BLm == prefix_Bm[:, None, :], axis=-1)
  whole_BL = starts_L[None, :] + n <= length_B[:, None]  # the n-gram at j lies inside the history
  follower_BL = history_BL[:, jnp.clip(starts_L + n - 1, 0, L - 1)]
  return _scatter_ids(jnp.where(match_BL & whole_BL, follower_BL, vocab), vocab)


def penalized_logits(logits_BV: jax.Array, params: SamplingParams, history_BL: jax.Array | None = None,
                     length_B: jax.Array | None = None) -> jax.Array:
  """fp32 logits after the vocab limit, the repetition penalty and the n-gram ban (no temperature)."""
  _check_logits(logits_BV)
  x = _limit_vocab(logits_BV.astype(jnp.float32), params.vocab_limit)
  if not params.uses_history:
    return x
  if history_BL is None or length_B is None:
    raise ValueError("history_BL / length_B: repetition_penalty / no_repeat_ngram_size need the token "
                     "history (prompt + generated so far)")
  length_B = jnp.asarray(length_B, jnp.int32)
  x = apply_repetition_penalty(x, history_BL, length_B, params.repetition_penalty)
  if params.no_repeat_ngram_size > 0:
    banned_BV = banned_ngram_tokens(history_BL, length_B, params.no_repeat_ngram_size, x.shape[1])
    blocked_BV = jnp.where(banned_BV, _NEG, x)
    stuck_B1 = jnp.all(blocked_BV == _NEG, axis=-1, keepdims=True) & jnp.any(x > _NEG, axis=-1, keepdims=True)
    x = jnp.where(stuck_B1, x, blocked_BV)
  return x


def filtered_logits(logits_BV: jax.Array, params: SamplingParams, history_BL: jax.Array | None = None,
                    length_B: jax.Array | None = None) -> jax.Array:
  """fp32 logits of the distribution `sample` draws from (penalties, temperature, top-k, top-p)."""
  x = penalized_logits(logits_BV, params, history_BL, length_B)
  if params.greedy:
    return x
  x = apply_top_k(x / params.temperature, params.top_k)
  return apply_top_p(x, params.top_p)


def sample(logits_BV: jax.Array, key: jax.Array, params: SamplingParams, history_BL: jax.Array | None = None,
           length_B: jax.Array | None = None) -> jax.Array:
  """[B] int32 next tokens. history_BL / length_B: each row's tokens so far (needed only when
  params.uses_history; entries at and past length_B[b] are ignored)."""
  _check_logits(logits_BV)
  if params.greedy:
    return jnp.argmax(penalized_logits(logits_BV, params, history_BL, length_B), axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, filtered_logits(logits_BV, params, history_BL, length_B),
                                axis=-1).astype(jnp.int32)


def is_stop(tokens_B: jax.Array, stop_tokens: Sequence[int]) -> jax.Array:
  """[B] bool: the token is one of `stop_tokens`."""
  if not stop_tokens:
    return jnp.zeros(tokens_B.shape, bool)
  return jnp.isin(tokens_B, jnp.asarray(tuple(stop_tokens), tokens_B.dtype))
