"""GRPO math (moonshot_jax/rl/grpo.py) against hand-computed numbers; masking carries no gradient."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moonshot_jax.rl import grpo


def test_group_advantages_hand_computed():
  r = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]  # two groups of 3
  # group 1: mean 1/3, std sqrt(2)/3 -> (2/3) / (sqrt(2)/3) = sqrt(2), (-1/3)/(sqrt(2)/3) = -1/sqrt(2)
  want = [np.sqrt(2), -1 / np.sqrt(2), -1 / np.sqrt(2), 0.0, 0.0, 0.0]
  np.testing.assert_allclose(grpo.group_advantages(r, 3, "std"), want, rtol=1e-5)
  np.testing.assert_allclose(grpo.group_advantages(r, 3, "none"), [2 / 3, -1 / 3, -1 / 3, 0, 0, 0], rtol=1e-6)
  with pytest.raises(ValueError, match="group_size=4"):
    grpo.group_advantages(r, 4)
  with pytest.raises(ValueError, match="adv_norm"):
    grpo.group_advantages(r, 3, "mean")


def _stats(logp):
  """Head stats whose target log-prob is `logp` (lse 0)."""
  return {"lse": jnp.zeros_like(logp), "target_logit": logp, "correct": jnp.zeros(logp.shape, bool)}


def test_policy_loss_hand_computed():
  cfg = grpo.GRPOConfig(clip_low=0.2, clip_high=0.3, kl_coef=0.5)
  old = jnp.log(jnp.asarray([[0.5, 0.5, 0.5, 0.5]]))
  # ratios 1.6 (A>0: clipped at 1.3), 0.6 (A<0: clipped at 0.8), 1.1 (inside), masked
  logp = jnp.log(jnp.asarray([[0.8, 0.3, 0.55, 0.9]]))
  adv = jnp.asarray([[1.0, -2.0, 0.5, 3.0]])
  mask = jnp.asarray([[1, 1, 1, 0]])
  ref = jnp.log(jnp.asarray([[0.4, 0.3, 0.5, 0.1]]))
  mb = {"loss_mask": mask, "old_logp": old, "ref_logp": ref, "advantages": adv}
  obj, m, _, n = grpo.rl_objective(cfg)(_stats(logp), mb, None, {})
  pg = [-1.3 * 1.0, -(0.8 * -2.0), -(1.1 * 0.5)]  # min(r A, clip(r) A) per token
  p, q = np.asarray([0.8, 0.3, 0.55]), np.asarray([0.4, 0.3, 0.5])  # policy, reference
  kl = q / p - np.log(q / p) - 1
  assert float(n) == 3
  np.testing.assert_allclose(float(m["pg_loss"]), np.mean(pg), rtol=1e-5)
  np.testing.assert_allclose(float(m["kl"]), np.mean(kl), rtol=1e-5)
  np.testing.assert_allclose(float(obj), np.mean(pg) + 0.5 * np.mean(kl), rtol=1e-5)
  np.testing.assert_allclose(float(m["clip_fraction"]), 2 / 3, rtol=1e-6)
  np.testing.assert_allclose(float(m["logp_mismatch"]), np.mean(np.abs(np.log([1.6, 0.6, 1.1]))), rtol=1e-5)


def test_masked_tokens_carry_no_gradient():
  """Gradients w.r.t. the policy's log-probs are zero on environment / padding tokens, whatever
  (even overflowing) old log-probs or advantages sit there; unmasked ones get the PPO gradient."""
  cfg = grpo.GRPOConfig(kl_coef=0.1)
  logp = jnp.log(jnp.asarray([[0.5, 0.4, 0.3, 0.2]]))
  mask = jnp.asarray([[1, 0, 1, 0]])
  mb = {"loss_mask": mask, "old_logp": jnp.asarray([[np.log(0.5), -200.0, np.log(0.3), -1e4]]),
        "ref_logp": jnp.asarray([[np.log(0.5), 50.0, np.log(0.3), 0.0]]),
        "advantages": jnp.asarray([[1.0, 1e6, -1.0, 7.0]])}
  g = jax.grad(lambda lp: grpo.rl_objective(cfg)(_stats(lp), mb, None, {})[0])(logp)
  g = np.asarray(g)
  assert np.isfinite(g).all()
  assert g[0, 1] == 0.0 and g[0, 3] == 0.0
  # ratio 1 on the policy tokens: d/dlogp of -A * ratio / n = -A / 2 (kl term has zero gradient at ref = logp)
  np.testing.assert_allclose(g[0, [0, 2]], [-0.5, 0.5], rtol=1e-5)


def test_update_schedule_covers_every_row_once_per_epoch():
  from moonshot_jax.rl import source
  order = source.update_schedule(10, 16, 8, 3, np.random.default_rng(0))
  assert len(order) == 6 and all(len(mb) == 8 for mb in order)
  for e in range(3):  # each epoch: rows 0..9 once, 6 empty slots
    flat = sorted(i for mb in order[2 * e:2 * e + 2] for i in mb)
    assert flat == [-1] * 6 + list(range(10))
  assert order[0:2] != order[2:4]  # reshuffled between epochs
  one = source.update_schedule(5, 8, 8, 2, np.random.default_rng(0))
  assert one[0] == [0, 1, 2, 3, 4, -1, -1, -1] and sorted(one[1]) == sorted(one[0]) and one[1] != one[0]
  with pytest.raises(ValueError, match="n_rows"):
    source.update_schedule(9, 8, 8, 1, np.random.default_rng(0))
