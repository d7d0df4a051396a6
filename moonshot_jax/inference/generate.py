"""Batched generation: bucketed prefill, then sample + `decode_step` per token, with streaming.

  generate(variables, cfg, prompts, *, max_new_tokens, sampling=SamplingParams(), seed=0,
           callback=None, max_len=None, mesh=None, strategy="zero1") -> Generation
    prompts: token-id lists (any lengths >= 1; right-padded into one batch internally).
    sampling: temperature (0 = greedy), top_k, top_p, stop_tokens, repetition_penalty,
      no_repeat_ngram_size (see sampling.py; the last two read each row's prompt + generated
      tokens from a [B, max_len] device buffer: static shapes, one compilation per max_len).
    callback(new_tokens_B: np.ndarray, emitted_B: np.ndarray[bool]) runs after every step, as soon
      as that step's tokens are on the host: emitted_B marks the rows whose token is part of the
      output (rows already stopped are still computed, for fixed shapes, but not emitted; a stop
      token itself is not emitted).
    max_len: cache rows per sequence (default: the bucketed longest prompt + max_new_tokens,
      rounded up to a multiple of 64 so nearby requests share a compilation).
  The PRNG key for step i is fold_in(key(seed), i): a run is reproducible from its seed.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moonshot_jax.config import ModelConfig
from moonshot_jax.inference import engine
from moonshot_jax.inference.sampling import SamplingParams, sample

Callback = Callable[[np.ndarray, np.ndarray], None]


@dataclasses.dataclass
class Generation:
  tokens: list[list[int]]  # generated ids per prompt (stop token excluded)
  stopped: list[bool]  # True: ended on a stop token; False: ran out of max_new_tokens
  prompt_lengths: list[int]


_sample = jax.jit(sample, static_argnames=("params",))


@functools.partial(jax.jit, donate_argnums=(0,))
def _append(history_BL, length_B, tok_B):
  """Writes each row's new token at its length (rows already stopped write too: shapes stay fixed)."""
  return history_BL.at[jnp.arange(history_BL.shape[0]), length_B].set(tok_B), length_B + 1


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def generate(variables, cfg: ModelConfig, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             sampling: SamplingParams = SamplingParams(), seed: int = 0, callback: Callback | None = None,
             max_len: int | None = None, mesh=None, strategy: str = "zero1", image_mask=None,
             vision_MD=None) -> Generation:
  """image_mask (one bool list / array per prompt, True at image placeholders) + vision_MD
  [n_vision_tokens, d_model]: prefill embeds the vision tokens there (engine.prefill)."""
  if isinstance(prompts, (str, bytes)) or not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("prompts: expected a non-empty list of non-empty token-id lists")
  if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
    raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
  if not isinstance(sampling, SamplingParams):
    raise ValueError(f"sampling: expected a SamplingParams, got {type(sampling).__name__}")
  lens = [len(p) for p in prompts]
  for p in prompts:
    bad = [t for t in p if not (0 <= int(t) < cfg.vocab_size)]
    if bad:
      raise ValueError(f"prompts: token ids must be in [0, vocab_size={cfg.vocab_size}), got {bad[:5]}")
  B, T = len(prompts), engine.bucket_length(max(lens))
  need = max(lens) + max_new_tokens
  max_len = max(_round_up(max(T, need), 64), T) if max_len is None else max_len
  if max_len < need or max_len < T:
    raise ValueError(f"max_len: {max_len} cache rows cannot hold the longest prompt ({max(lens)} tokens, "
                     f"bucketed to {T}) plus max_new_tokens={max_new_tokens}")
  tokens = np.zeros((B, T), np.int32)
  for b, p in enumerate(prompts):
    tokens[b, :len(p)] = p
  mask = None
  if image_mask is not None:
    mask = np.zeros((B, T), bool)
    for b, m in enumerate(image_mask):
      if len(m) != lens[b]:
        raise ValueError(f"image_mask[{b}]: {len(m)} entries for a prompt of {lens[b]} tokens")
      mask[b, :lens[b]] = np.asarray(m, bool)
  logits, cache = engine.prefill(variables, cfg, tokens, lengths=np.asarray(lens, np.int32), max_len=max_len,
                                 all_logits=False, mesh=mesh, strategy=strategy, image_mask=mask,
                                 vision_MD=vision_MD)
  root = jax.random.key(seed)
  history = None
  if sampling.uses_history:
    buf = np.zeros((B, max_len), np.int32)
    buf[:, :T] = tokens
    history = (buf, np.asarray(lens, np.int32))
    # replicated on the model's devices, so the sampler's jit sees one device set
    where = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) if mesh is not None else None
    history = tuple(jax.device_put(h, where) for h in history)
  out: list[list[int]] = [[] for _ in range(B)]
  done = np.zeros((B,), bool)
  stopped = np.zeros((B,), bool)
  for i in range(max_new_tokens):
    tok = _sample(logits, jax.random.fold_in(root, i), params=sampling,
                  **(dict(history_BL=history[0], length_B=history[1]) if history else {}))
    if history is not None:
      history = _append(*history, tok)
    if i + 1 < max_new_tokens:  # dispatch the next step before waiting on the host copy
      logits, cache = engine.decode_step(variables, cfg, cache, tok, mesh=mesh, strategy=strategy)
    tok_np = np.asarray(tok)
    stop_np = np.isin(tok_np, np.asarray(sampling.stop_tokens, np.int64))
    emitted = ~done & ~stop_np
    for b in np.flatnonzero(emitted):
      out[b].append(int(tok_np[b]))
    stopped |= ~done & stop_np
    done |= stop_np
    if callback is not None:
      callback(tok_np, emitted)
    if done.all():
      break
  return Generation(tokens=out, stopped=stopped.tolist(), prompt_lengths=lens)
