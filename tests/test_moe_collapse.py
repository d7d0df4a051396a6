"""Issue #23: LatentMoE expert collapse in warm-up. A tiny MoE trained with the real train step on
Zipf-distributed tokens learns the unigram distribution within a few steps, every token's MoE input
takes one shared direction, and a router on the raw input (router_norm="none", the old default)
sends all tokens to the same k experts (load max/mean -> E/k). The default (router_norm="batch")
must keep every layer balanced, with no dead expert, at every step.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest

from moonshot_jax.train import loop
from moonshot_jax.train import state as state_lib
from tests.test_train_loop import _config

STEPS, B, T = 10, 8, 64


def _zipf_batches(vocab: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  p = 1.0 / np.arange(1, vocab + 1)
  p /= p.sum()
  for _ in range(STEPS):
    tok = rng.choice(vocab, size=(B, T + 1), p=p).astype(np.int32)
    yield {"tokens": tok[:, :-1], "targets": tok[:, 1:], "segment_ids": np.ones((B, T), np.int32),
           "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
           "loss_mask": np.ones((B, T), np.int32)}


def _train_loads(**model_overrides) -> tuple[np.ndarray, dict]:
  """(load max/mean [STEPS, L_moe] of each step's global batch, the last step's metrics)."""
  cfg = _config({"train.steps": STEPS, "data.seq_len": T, "data.batch_size": B,
                 **{f"model.{k}": v for k, v in model_overrides.items()}})
  trainer = loop.build(cfg, devices=jax.devices()[:1])
  state = state_lib.create_train_state(trainer.setup, trainer.init_fn, 0)
  mom = []
  for batch in _zipf_batches(int(cfg.model.vocab_size) // 2):
    state, m = trainer.train_step(state, loop.to_global(batch, trainer.mesh))
    mom.append(np.asarray(m["load_max_over_mean"]))
  return np.stack(mom), jax.device_get(m)


def test_default_router_does_not_collapse():
  mom, last = _train_loads()
  assert mom.max() <= 2.0, f"load max/mean per step x layer:\n{mom}"  # old default: 4.0 = E/k
  assert np.all(last["dead_experts"] == 0), last["dead_experts"]
  assert np.all(last["router_input_cos"] < 0.2), last["router_input_cos"]  # the shared direction is gone


@pytest.mark.slow
def test_raw_router_collapses():
  """The regime above is a collapse regime: the old raw-input router ends at E/k in some layer."""
  mom, last = _train_loads(router_norm="none")
  assert mom[-3:].max() >= 3.5, f"load max/mean per step x layer:\n{mom}"  # E/k = 4 for tiny
  assert np.all(last["input_cos"] > 0.8), last["input_cos"]
