"""Sampling against NumPy references of temperature / top-k / top-p, and empirical frequencies."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moonshot_jax.inference.sampling import (SamplingParams, apply_top_k, apply_top_p, filtered_logits,
                                             is_stop, sample)


def ref_distribution(logits, temperature, top_k, top_p, vocab_limit=0):
  """Independent NumPy reference: the renormalised distribution sampling should draw from."""
  x = np.asarray(logits, np.float64).copy()
  if vocab_limit:
    x[vocab_limit:] = -np.inf
  x = x / temperature
  if 0 < top_k < len(x):
    x[np.argsort(-x, kind="stable")[top_k:]] = -np.inf
  p = np.exp(x - x.max())
  p /= p.sum()
  if top_p < 1:
    order = np.argsort(-p, kind="stable")
    c = np.cumsum(p[order])
    n_keep = int(np.searchsorted(c, top_p) + 1)  # smallest prefix with mass >= top_p
    keep = np.zeros_like(p, bool)
    keep[order[:n_keep]] = True
    p = np.where(keep, p, 0)
    p /= p.sum()
  return p


def test_top_k_and_top_p_match_reference():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(5, 40)).astype(np.float32) * 2
  for k in (1, 3, 17):
    got = np.asarray(apply_top_k(jnp.asarray(logits), k))
    for b in range(5):
      kept = np.flatnonzero(np.isfinite(got[b]))
      np.testing.assert_array_equal(np.sort(kept), np.sort(np.argsort(-logits[b])[:k]))
      np.testing.assert_array_equal(got[b, kept], logits[b, kept])
  for p in (0.1, 0.5, 0.9):
    got = np.asarray(apply_top_p(jnp.asarray(logits), p))
    for b in range(5):
      want = ref_distribution(logits[b], 1.0, 0, p) > 0
      np.testing.assert_array_equal(np.isfinite(got[b]), want)


def test_filtered_distribution_and_empirical_frequencies():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(12,)).astype(np.float32) * 1.5
  params = SamplingParams(temperature=0.7, top_k=6, top_p=0.85, vocab_limit=10)
  want = ref_distribution(logits, 0.7, 6, 0.85, vocab_limit=10)
  got = np.asarray(jax.nn.softmax(filtered_logits(jnp.asarray(logits)[None], params)[0]))
  np.testing.assert_allclose(got, want, atol=1e-6)
  n = 40000
  draws = np.asarray(jax.jit(sample, static_argnames="params")(
      jnp.broadcast_to(jnp.asarray(logits), (n, 12)), jax.random.key(3), params=params))
  freq = np.bincount(draws, minlength=12) / n
  assert np.all(freq[want == 0] == 0), "sampled a filtered-out token"
  np.testing.assert_allclose(freq, want, atol=4 * np.sqrt(0.25 / n))  # 4 sigma


def test_greedy_and_temperature_extremes():
  rng = np.random.default_rng(2)
  logits = jnp.asarray(rng.normal(size=(4, 30)), jnp.float32)
  greedy = sample(logits, jax.random.key(0), SamplingParams())
  np.testing.assert_array_equal(greedy, np.argmax(np.asarray(logits), -1))
  limited = sample(logits, jax.random.key(0), SamplingParams(vocab_limit=5))
  np.testing.assert_array_equal(limited, np.argmax(np.asarray(logits)[:, :5], -1))
  cold = sample(logits, jax.random.key(0), SamplingParams(temperature=1e-4))
  np.testing.assert_array_equal(cold, greedy)
  a = sample(logits, jax.random.key(5), SamplingParams(temperature=1.0))
  b = sample(logits, jax.random.key(5), SamplingParams(temperature=1.0))
  np.testing.assert_array_equal(a, b)  # same key, same draw


def test_stop_and_validation():
  np.testing.assert_array_equal(is_stop(jnp.array([1, 2, 3]), (2, 3)), [False, True, True])
  assert not np.any(is_stop(jnp.array([1, 2]), ()))
  for bad in (dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5),
              dict(stop_tokens=(-1,)), dict(vocab_limit=-3)):
    with pytest.raises(ValueError, match=next(iter(bad))):
      SamplingParams(**bad)
  with pytest.raises(ValueError, match="logits_BV"):
    sample(jnp.zeros((3,)), jax.random.key(0), SamplingParams())
