"""Repetition penalty and no-repeat-ngram blocking (moonshot_jax/inference/sampling.py) on hand-made
logits, and against a plain-Python re-statement of both rules on random histories."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moonshot_jax.inference import sampling as S

# two rows of an 8-slot history buffer: row 0 holds 6 tokens, row 1 holds 3 (the rest is stale)
HIST = jnp.array([[5, 1, 2, 3, 1, 2, 7, 7],
                  [4, 4, 6, 1, 1, 1, 1, 1]], jnp.int32)
LEN = jnp.array([6, 3], jnp.int32)
LOGITS = jnp.array([[1.0, -1.0, 2.0, -2.0, 0.5, 3.0, 0.0, 4.0],
                    [1.0, -1.0, 2.0, -2.0, 0.5, 3.0, 0.0, 4.0]], jnp.float32)


def test_repetition_penalty_divides_positive_multiplies_negative():
  got = S.apply_repetition_penalty(LOGITS, HIST, LEN, 2.0)
  # row 0 saw {5, 1, 2, 3}; row 1 saw {4, 6} (its slots from 3 on are not history)
  np.testing.assert_array_equal(got[0], [1.0, -2.0, 1.0, -4.0, 0.5, 1.5, 0.0, 4.0])
  np.testing.assert_array_equal(got[1], [1.0, -1.0, 2.0, -2.0, 0.25, 3.0, 0.0, 4.0])
  np.testing.assert_array_equal(S.apply_repetition_penalty(LOGITS, HIST, LEN, 1.0), LOGITS)


@pytest.mark.parametrize("n,want0,want1", [
    (1, [1, 2, 3, 5], [4, 6]),  # every seen token
    (2, [3], []),  # row 0 ends in 2; "2 3" occurred. Row 1 ends in 6, never followed
    (3, [3], []),  # row 0 ends in "1 2"; "1 2 3" occurred
    (4, [], []),  # "3 1 2" never occurred before the end
])
def test_ngram_bans_hand_made(n, want0, want1):
  banned = np.asarray(S.banned_ngram_tokens(HIST, LEN, n, 8))
  assert np.flatnonzero(banned[0]).tolist() == want0
  assert np.flatnonzero(banned[1]).tolist() == want1


def test_greedy_picks_the_best_allowed_token():
  p = S.SamplingParams(no_repeat_ngram_size=2)
  hist = jnp.array([[3, 7, 3, 0]], jnp.int32)  # ends in 3; "3 7" occurred: 7 banned
  assert int(S.sample(LOGITS[:1], jax.random.key(0), p, hist, jnp.array([3]))[0]) == 5
  assert int(S.sample(LOGITS[:1], jax.random.key(0), S.SamplingParams(), hist, jnp.array([3]))[0]) == 7
  # penalty 2 on seen {3, 7}: 7 drops to 2.0 < 3.0 (token 5)
  p = S.SamplingParams(repetition_penalty=2.0)
  assert int(S.sample(LOGITS[:1], jax.random.key(0), p, hist, jnp.array([3]))[0]) == 5


def test_sampling_never_draws_a_banned_token_and_matches_the_penalised_softmax():
  p = S.SamplingParams(temperature=0.7, repetition_penalty=1.5, no_repeat_ngram_size=3)
  keys = jax.random.split(jax.random.key(1), 4000)
  draws = jax.vmap(lambda k: S.sample(LOGITS[:1], k, p, HIST[:1], LEN[:1])[0])(keys)
  counts = np.bincount(np.asarray(draws), minlength=8) / len(keys)
  assert counts[3] == 0  # "1 2 3" exists, history ends in "1 2"
  x = np.asarray(LOGITS[0], np.float64)
  seen = [1, 2, 3, 5]
  x[seen] = np.where(x[seen] > 0, x[seen] / 1.5, x[seen] * 1.5)
  x[3] = -np.inf
  want = np.exp(x / 0.7 - np.max(x / 0.7))
  np.testing.assert_allclose(counts, want / want.sum(), atol=0.025)


def test_a_row_whose_every_token_is_banned_keeps_its_logits():
  p = S.SamplingParams(no_repeat_ngram_size=1, vocab_limit=3)
  hist = jnp.array([[0, 1, 2]], jnp.int32)  # every allowed id seen
  got = S.penalized_logits(LOGITS[:1], p, hist, jnp.array([3]))
  np.testing.assert_array_equal(got[0, :3], LOGITS[0, :3])
  assert bool(jnp.all(got[0, 3:] == -jnp.inf))


def _reference(logits, hist, n, penalty):
  """Plain Python: CTRL's penalty over the history's tokens, then ban each follower of an earlier
  occurrence of the last n-1 tokens."""
  x = list(map(float, logits))
  for t in set(hist):
    x[t] = x[t] / penalty if x[t] > 0 else x[t] * penalty
  if n and len(hist) >= n:
    tail = hist[len(hist) - n + 1:]
    for j in range(len(hist) - n + 1):
      if hist[j:j + n - 1] == tail:
        x[hist[j + n - 1]] = -np.inf
  return x


@pytest.mark.parametrize("n", [1, 2, 3])
def test_against_plain_python_on_random_histories(n):
  rng = np.random.default_rng(n)
  b, L, V = 6, 20, 5  # small vocab: many repeated n-grams
  hist = rng.integers(0, V, (b, L)).astype(np.int32)
  lens = rng.integers(0, L + 1, b).astype(np.int32)
  logits = rng.normal(size=(b, V)).astype(np.float32)
  p = S.SamplingParams(repetition_penalty=1.7, no_repeat_ngram_size=n)
  got = np.asarray(jax.jit(S.penalized_logits, static_argnums=1)(jnp.asarray(logits), p, hist, lens))
  for i in range(b):
    want = _reference(logits[i], hist[i, :lens[i]].tolist(), n, 1.7)
    if all(w == -np.inf for w in want):  # the all-banned fallback: penalised, unbanned
      want = _reference(logits[i], hist[i, :lens[i]].tolist(), 0, 1.7)
    np.testing.assert_allclose(got[i], want, rtol=1e-6)


def test_bad_parameters_named():
  with pytest.raises(ValueError, match="repetition_penalty"):
    S.SamplingParams(repetition_penalty=0.0)
  with pytest.raises(ValueError, match="no_repeat_ngram_size"):
    S.SamplingParams(no_repeat_ngram_size=-2)
  with pytest.raises(ValueError, match="history_BL"):
    S.sample(LOGITS, jax.random.key(0), S.SamplingParams(repetition_penalty=1.2))
