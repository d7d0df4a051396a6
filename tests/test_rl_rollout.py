"""Multi-turn rollouts on the inference engine, against the test double env (tests/rl_doubles.py).

One small hybrid model (KDA + MLA/MoE, AttnRes) shared by the tests of this file (compiles dominate).
"""
import concurrent.futures as cf
import importlib.util
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moonshot_jax import experiment
from moonshot_jax.inference import engine
from moonshot_jax.model.transformer import Transformer
from moonshot_jax.rl import rollout as ro
from moonshot_jax.rl import source

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg():
  spec = importlib.util.spec_from_file_location("agent_sft", os.path.join(ROOT, "experiments", "agent_tiny_sft.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  cfg = mod.base("grpo")
  m = cfg.model
  m.n_layers, m.mla_layers, m.dense_layers, m.attn_res_block_size = 2, (2,), (1,), 1
  cfg.data.seq_len, cfg.data.batch_size = 128, 6
  cfg.rl.env_module, cfg.rl.group_size, cfg.rl.max_action_tokens, cfg.rl.max_turns = "tests.rl_doubles", 3, 8, 3
  return cfg


@pytest.fixture(scope="module")
def setup():
  cfg = _cfg()
  mcfg = experiment.model_config(cfg)
  v = nn.meta.unbox(Transformer(mcfg).init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32)))
  variables = {"params": v["params"], "moe_state": v.get("moe_state", {})}
  sampler = ro.Sampler(mcfg, int(cfg.data.seq_len) + 1, int(cfg.rl.max_action_tokens), 40)
  with cf.ThreadPoolExecutor(4) as pool:
    yield cfg, mcfg, variables, sampler, pool


def _full_logp(mcfg, variables, tokens):
  """Log-probs of every next token by one full prefill of the whole sequence."""
  logits, _ = engine.prefill(variables, mcfg, np.asarray([tokens], np.int32), max_len=129)  # one compile
  lp = jax.nn.log_softmax(np.asarray(logits[0], np.float64), -1)
  return np.asarray([lp[t - 1, tokens[t]] for t in range(1, len(tokens))])


def test_multiturn_logps_equal_full_prefill_and_env_tokens_are_masked(setup):
  """Every sampled token's log-prob, taken after observations were fed by the decode loop,
  equals the full-sequence prefill's: the KDA state / MLA latents continued exactly."""
  cfg, mcfg, variables, sampler, pool = setup
  tok = sampler.tok
  rows = [r for g in range(4) for r in source.start_group(cfg, "kv", 10 + g, g, tok)]  # 12 rows: 4 inert pads
  info = ro.run_rollouts(sampler, variables, rows, jax.random.key(0), pool)
  assert all(r.done for r in rows) and info["obs_tokens"] > 0
  multi = [r for r in rows if r.turns >= 2]
  assert multi, "no rollout reached a second turn"
  for r in multi[:3]:
    ref = _full_logp(mcfg, variables, r.tokens)
    pol = np.asarray(r.policy[1:], bool)
    np.testing.assert_allclose(np.asarray(r.logp[1:])[pol], ref[pol], atol=2e-4)
    # environment tokens: never flagged as policy, and the batch gives them no loss weight
    obs_at = [i for i in range(len(r.tokens) - 1) if r.tokens[i:i + 2] == tok.encode(ro.OBS_PREFIX)]
    assert obs_at and not any(r.policy[i] for i in obs_at)
  b = source.pack_rows(multi, len(multi), int(cfg.data.seq_len), [1.0] * len(multi))
  for i, r in enumerate(multi):
    L = len(r.tokens) - 1
    np.testing.assert_array_equal(b["loss_mask"][i, :L], r.policy[1:])
    assert not b["advantages"][i][b["loss_mask"][i] == 0].any()


def test_forked_group_sees_identical_initial_observations(setup):
  cfg, _, _, sampler, _ = setup
  rows = source.start_group(cfg, "kv_long", 7, 0, sampler.tok)
  assert len(rows) == cfg.rl.group_size
  assert all(r.tokens == rows[0].tokens for r in rows)
  first = [r.env.step(r.env.oracle_action()).observation for r in rows]
  assert len(set(first)) == 1 and first[0] != "none"
  assert len({id(r.env) for r in rows}) == len(rows)  # independent children


def test_crashing_tool_and_malformed_call_do_not_stop_the_batch(setup):
  cfg, _, variables, sampler, pool = setup
  tok = sampler.tok
  rows = source.start_group(cfg, "kv", 3, 0, tok) + source.start_group(cfg, "kv", 4, 1, tok)
  rows[0].env.crash_on_step = True  # this rollout's tool raises instead of returning
  ro.run_rollouts(sampler, variables, rows, jax.random.key(1), pool)
  assert all(r.done for r in rows)
  assert rows[0].errors == ["env_exception"] and rows[0].reward == 0.0
  assert any("malformed" in r.errors for r in rows[1:])  # an untrained policy's calls are malformed
  b = source.pack_rows(rows, len(rows), int(cfg.data.seq_len), [0.5] * len(rows))
  assert b["loss_mask"].sum() > 0


class _SlowEnv:
  """Delays every step of the wrapped env: its row waits while the others decode."""

  def __init__(self, env, delay_s):
    self.env, self.delay_s = env, delay_s

  def step(self, action):
    time.sleep(self.delay_s)
    return self.env.step(action)

  def close(self):
    self.env.close()


def test_rows_carried_across_decode_calls_match_one_call_per_turn(setup):
  """Greedy rollouts are the same whether the decode loop returns to the host after every step while
  env steps run (half the rows' envs are slow: the other rows' actions and observations then span
  many calls, their partial state carried) or only once every busy row has ended its action.
  Each call's returned row state is recorded: the first run must hand rows back to the host in the
  middle of an action (SAMPLE with tokens already sampled) and in the middle of an observation (FEED
  with tokens already fed), i.e. really carry them; the second run never does."""
  cfg, _, variables, sampler, pool = setup
  tok = sampler.tok

  def roll(frac, poll):
    rows = [source.start_group(cfg, "kv_long", g, g, tok)[0] for g in range(4)]
    for i, r in enumerate(rows):
      r.env = _SlowEnv(r.env, 0.2 * (i % 2))
    carried = {"action": 0, "observation": 0}

    def advance(*args, **kw):
      out = ro.Sampler.advance(sampler, *args, **kw)
      mode, obs_ptr, _, _, _, n = out[0]
      carried["action"] += int(np.sum((mode == ro.SAMPLE) & (n > 0)))
      carried["observation"] += int(np.sum((mode == ro.FEED) & (obs_ptr > 0)))
      return out

    sampler.advance = advance
    try:
      info = ro.run_rollouts(sampler, variables, rows, jax.random.key(2), pool, greedy=True, stop_fraction=frac,
                             poll_steps=poll)
    finally:
      del sampler.advance
    return [(r.tokens, r.policy, r.reward, r.logp) for r in rows], info, carried

  often, info, carried = roll(1e-6, 1)
  assert info["obs_tokens"] > 0 and info["turns"] >= 2
  assert carried["action"] > 0 and carried["observation"] > 0, carried
  rare, info_rare, carried_rare = roll(1.0, 1 << 30)
  assert carried_rare == {"action": 0, "observation": 0}
  assert [x[:3] for x in often] == [x[:3] for x in rare]
  np.testing.assert_allclose(np.concatenate([x[3] for x in often]), np.concatenate([x[3] for x in rare]),
                             atol=1e-6)


def test_engine_extend_equals_prefill_of_the_whole_sequence(setup):
  """engine.extend appends a different number of tokens per row (0 = row untouched) to a prefilled
  cache; the logits equal one prefill of prompt + appended tokens, and decoding continues from it."""
  _, mcfg, variables, _, _ = setup
  rng = np.random.default_rng(0)
  prompt = rng.integers(3, 256, (3, 9)).astype(np.int32)
  more = rng.integers(3, 256, (3, 6)).astype(np.int32)
  n = np.asarray([6, 2, 0], np.int32)
  _, cache = engine.prefill(variables, mcfg, prompt, max_len=129, all_logits=False)
  logits, cache = engine.extend(variables, mcfg, cache, more, n)
  np.testing.assert_array_equal(np.asarray(cache.lengths), 9 + n)
  for b in range(3):
    full = np.concatenate([prompt[b], more[b, :n[b]]])[None]
    ref, _ = engine.prefill(variables, mcfg, full, max_len=129)
    if n[b]:
      np.testing.assert_allclose(np.asarray(logits[b, :n[b]]), np.asarray(ref[0, 9:]), atol=2e-4)
  nxt = np.asarray([7, 8, 9], np.int32)
  step, _ = engine.decode_step(variables, mcfg, cache, nxt)
  for b in range(3):
    full = np.concatenate([prompt[b], more[b, :n[b]], nxt[b:b + 1]])[None]
    ref, _ = engine.prefill(variables, mcfg, full, max_len=129)
    np.testing.assert_allclose(np.asarray(step[b]), np.asarray(ref[0, -1]), atol=2e-4)


def test_bucket_rows():
  assert [ro.bucket_rows(k, 48) for k in (1, 2, 3, 5, 16, 17, 33, 48)] == [1, 2, 4, 8, 16, 32, 48, 48]
  assert ro.bucket_rows(5, 5) == 5
  with pytest.raises(ValueError, match="n_busy"):
    ro.bucket_rows(0, 8)


def test_batched_sampling_equals_one_row_at_a_time_with_the_same_keys(setup):
  """Sampled (T=1) rollouts: 12 rows in one batch (padded to 16; the decode loop computes only the
  busy rows, in shrinking buckets, while half the envs are slow) give each row the same tokens,
  log-probs and rewards as that row rolled out alone with its key: a row's draws depend on its key and
  token positions only, and the compacted rows' cache / logits / state are gathered and written back
  to the right rows."""
  cfg, _, variables, sampler, pool = setup
  tok = sampler.tok
  keys = jax.random.split(jax.random.key(5), 12)

  def fresh():
    rows = [r for g in range(4) for r in source.start_group(cfg, "kv_long", 20 + g, g, tok)]
    for i, r in enumerate(rows):
      r.env = _SlowEnv(r.env, 0.03 * (i % 2))
    return rows

  rows = fresh()
  info = ro.run_rollouts(sampler, variables, rows, keys, pool)
  assert info["row_steps"] < 16 * info["decode_steps"]  # idle rows were left out of some calls
  assert info["obs_tokens"] > 0 and info["turns"] >= 2
  assert len({tuple(r.tokens) for r in rows[:3]}) > 1  # one task, three keys: the draws differ
  alone = fresh()
  for i, r in enumerate(alone):
    ro.run_rollouts(sampler, variables, [r], keys[i:i + 1], pool)
  for a, b in zip(rows, alone):
    assert (a.tokens, a.policy, a.reward, a.errors) == (b.tokens, b.policy, b.reward, b.errors)
    np.testing.assert_allclose(a.logp, b.logp, atol=1e-5)


def _compiled():
  return {f: getattr(m, f)._cache_size() for m, f in ((ro, "_advance"), (ro, "_take"), (ro, "_put"),
                                                      (engine, "_prefill_impl"))}


def test_fixed_rows_compile_once_for_rounds_of_any_size(setup):
  """A sampler with fixed rows (the training run's: DAPO's extra rounds have however many groups were dropped)
  compiles in its first call every shape a later call of another size needs: a first call of one group (its
  decode loop sees at most 3 busy rows) warms all row buckets of the 8-row batch, so a second call of two
  groups (6 busy rows: the 8-row bucket) and a third of one compile nothing. What they sample equals each
  row rolled out alone with its key (the default sampler: a batch of one)."""
  cfg, mcfg, variables, sampler, pool = setup
  tok = sampler.tok
  fixed = ro.Sampler(mcfg, sampler.max_len, sampler.max_action_tokens, sampler.max_obs_chars, rows=8, prefill_rows=2)
  keys = jax.random.split(jax.random.key(9), 6)
  ro.run_rollouts(fixed, variables, source.start_group(cfg, "kv_long", 40, 0, tok), keys[:3], pool)
  before = _compiled()
  rows = [r for g in range(2) for r in source.start_group(cfg, "kv_long", 41 + g, g, tok)]
  info = ro.run_rollouts(fixed, variables, rows, keys, pool)
  ro.run_rollouts(fixed, variables, source.start_group(cfg, "kv", 43, 0, tok), keys[:3], pool)
  assert _compiled() == before
  assert info["turns"] >= 2 and info["obs_tokens"] > 0
  alone = [r for g in range(2) for r in source.start_group(cfg, "kv_long", 41 + g, g, tok)]
  for i, r in enumerate(alone):
    ro.run_rollouts(sampler, variables, [r], keys[i:i + 1], pool)
  for a, b in zip(rows, alone):
    assert (a.tokens, a.policy, a.reward, a.errors) == (b.tokens, b.policy, b.reward, b.errors)
    np.testing.assert_allclose(a.logp, b.logp, atol=1e-5)


def test_sample_is_categorical_of_the_row_key_at_its_position():
  """The decode loop's sampler draws what jax.random.categorical draws with fold_in(row key, position),
  and its greedy pick is jnp.argmax (first index on ties); log-prob and entropy are the row's."""
  logits = np.array(jax.random.normal(jax.random.key(3), (6, 512)) * 3, np.float32)
  logits[5, [7, 300]] = 50.0  # a tie: argmax takes the first
  keys, pos = jax.random.split(jax.random.key(4), 6), jnp.asarray([0, 1, 2, 40, 40, 9], jnp.int32)
  tok, lp, ent = jax.jit(ro._sample, static_argnums=(4,))(logits, keys, pos, 0.7, False)
  logp = jax.nn.log_softmax(logits / 0.7)
  want = [int(jax.random.categorical(jax.random.fold_in(keys[i], pos[i]), logp[i])) for i in range(6)]
  assert tok.tolist() == want and len(set(want)) > 3
  np.testing.assert_allclose(lp, logp[np.arange(6), want], atol=2e-6)
  np.testing.assert_allclose(ent, -(np.exp(logp) * logp).sum(-1), atol=2e-5)
  greedy, _, _ = jax.jit(ro._sample, static_argnums=(4,))(logits, keys, pos, 1.0, True)
  assert greedy.tolist() == np.argmax(logits, -1).tolist() and greedy[5] == 7


def test_sample_with_non_threefry_keys_draws_from_their_own_implementation():
  """Keys of another PRNG implementation (rbg) are not fed to rl/threefry.py's hash: the draw is
  jax.random.categorical's with those keys (vmapped over rows, as rbg draws differ under vmap)."""
  logits = np.array(jax.random.normal(jax.random.key(3), (6, 512)) * 3, np.float32)
  keys, pos = jax.random.split(jax.random.key(5, impl="rbg"), 6), jnp.asarray([0, 1, 2, 40, 40, 9], jnp.int32)
  tok, _, _ = jax.jit(ro._sample, static_argnums=(4,))(logits, keys, pos, 0.7, False)
  logp = jax.nn.log_softmax(logits / 0.7)
  want = jax.vmap(lambda k, p, l: jax.random.categorical(jax.random.fold_in(k, p), l))(keys, pos, logp).tolist()
  assert tok.tolist() == want and len(set(want)) > 3


def test_threefry_noise_equals_jax_random_bit_for_bit():
  """rl/threefry.py's fold_in and Gumbel noise are jax.random's (default threefry keys), bit for bit."""
  from moonshot_jax.rl import threefry
  keys = jax.random.split(jax.random.key(11), 8)
  pos = jnp.asarray([0, 1, 2, 3, 40, 127, 160, 2**31 - 1], jnp.int32)
  want_keys = jax.vmap(jax.random.fold_in)(keys, pos)
  got_keys = jax.jit(threefry.fold_in)(jax.random.key_data(keys), pos)
  np.testing.assert_array_equal(got_keys, jax.random.key_data(want_keys))
  for partitionable in (False, True):  # the tests run with False (conftest), training with jax's default
    with jax.threefry_partitionable(partitionable):
      for V in (512, 7):
        want = jax.vmap(lambda k: jax.random.gumbel(k, (V,)))(want_keys)
        got = jax.jit(threefry.gumbel, static_argnums=1)(got_keys, V)
        np.testing.assert_array_equal(got, want, err_msg=f"partitionable={partitionable} V={V}")


def test_advance_writes_an_unsorted_working_set_back_to_its_own_rows(setup):
  """run_rollouts builds a decode call's working set as busy rows first, then idle fill rows, so its
  row indices are often unsorted (fill rows below busy ones). After calls over idx [3, 1], [1, 0] and
  [3, 2] (first row busy, second an idle fill row), every row's cache (lengths, KDA state, conv window,
  MLA latents) and logits equal that row advanced alone through the same calls: `_take` / `_put` gather
  the working set and write each row back to its own index."""
  _, mcfg, variables, sampler, _ = setup
  tok = sampler.tok
  prompts = [[tok.bos_id] + tok.encode(f"find {c}{c}") for c in "abcd"]  # distinct, same length
  keys = ro._row_keys(jax.random.key(7), 4)
  N, L = sampler.max_action_tokens, sampler.max_obs_tokens
  calls = [([3, 1], 3), ([1, 0], 2), ([3, 2], 3)]  # (idx, steps): idx[0] samples, idx[1] rides along idle

  def run(cache, logits, idx, steps, rows_of):
    b = len(idx)
    zi = np.zeros(b, np.int32)
    mode = np.asarray([ro.SAMPLE] + [ro.IDLE] * (b - 1), np.int32)
    state = (mode, zi, np.zeros((b, N), np.int32), np.zeros((b, N), np.float32), np.zeros((b, N), np.float32), zi)
    out, k, cache, logits = sampler.advance(variables, cache, logits, np.asarray(idx), keys[rows_of], state,
                                            np.zeros((b, L), np.int32), zi, 99, steps, False)
    assert k == steps
    return out[2][0, :steps].tolist(), cache, logits

  logits, cache = sampler.prefill(variables, prompts)
  sampled = {r: [] for r in range(4)}
  for idx, steps in calls:
    toks, cache, logits = run(cache, logits, idx, steps, idx)
    sampled[idx[0]] += toks
  lengths = np.asarray(cache.lengths)
  np.testing.assert_array_equal(lengths, len(prompts[0]) + np.asarray([0, 2, 0, 6]))
  for r in range(4):
    lg1, c1 = sampler.prefill(variables, [prompts[r]])
    alone = []
    for idx, steps in calls:
      if idx[0] == r:
        toks, c1, lg1 = run(c1, lg1, [0], steps, [r])
        alone += toks
    assert sampled[r] == alone, r
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(c1)):
      np.testing.assert_allclose(np.asarray(a)[r], np.asarray(b)[0], atol=1e-5, err_msg=f"row {r}")
    np.testing.assert_allclose(np.asarray(logits)[r], np.asarray(lg1)[0], atol=1e-5, err_msg=f"row {r}")


def test_prefill_computes_identical_rows_once(setup, monkeypatch):
  """Sampler.prefill of rows with repeats (a GRPO group's shared prompt) runs the model on the distinct rows
  only and gives every row the cache and logits its own prefill gives."""
  _, _, variables, sampler, _ = setup
  a, b, c = [1, 5, 7, 9, 10], [1, 6, 2], [1, 5, 7, 9, 11]
  rows = [a, b, a, c, b, a, c, a, b, a]  # 10 rows, 3 distinct, in mixed order
  ran = []
  real = sampler._prefill
  monkeypatch.setattr(sampler, "_prefill", lambda v, seqs: ran.append([list(s) for s in seqs]) or real(v, seqs))
  logits, cache = sampler.prefill(variables, rows)
  assert ran == [[a, b, c]], ran
  assert np.asarray(logits).shape[0] == len(rows) and np.asarray(cache.lengths).tolist() == [len(r) for r in rows]
  for i, r in enumerate(rows):
    lg1, c1 = real(variables, [r])
    np.testing.assert_allclose(np.asarray(logits)[i], np.asarray(lg1)[0], atol=1e-5, err_msg=f"row {i}")
    for x, y in zip(jax.tree.leaves(cache), jax.tree.leaves(c1)):
      np.testing.assert_allclose(np.asarray(x)[i], np.asarray(y)[0], atol=1e-5, err_msg=f"row {i}")
