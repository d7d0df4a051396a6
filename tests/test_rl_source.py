"""rl/source.py: the task mix (rl.train_mix feeds the training runs, held-out evaluation stays on rl.families at
rl.difficulty), batches, rl.init_workdir / init_step (another run's checkpoint through the Checkpointer), and the
agent config's SFT data. Pure Python on the test double envs, except a tiny real checkpoint and one test on the
real sandboxes (skipped without namespaces)."""
import importlib.util
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moonshot_jax import experiment

from moonshot_jax.config import ConfigError
from moonshot_jax.rl import rollout as ro
from moonshot_jax.rl import source
from moonshot_jax.train.tokenizer import ByteTokenizer
from tests.agentenv_testutil import require_namespaces

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(**rl):
  spec = importlib.util.spec_from_file_location("agent_sft", os.path.join(ROOT, "experiments", "agent_tiny_sft.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  cfg = mod.base("grpo")
  cfg.rl.env_module, cfg.rl.families, cfg.rl.difficulty = "tests.rl_doubles", "kv,kv_long", 3
  cfg.rl.update(rl)
  return cfg


def test_train_mix_sets_training_tasks_and_difficulty_but_not_the_heldout_ones():
  cfg = _cfg(train_mix="kv@1, kv_long ,kv@2")
  source.validate(cfg)
  mix = source.train_tasks(cfg)
  assert mix == ("kv@1", "kv_long", "kv@2")
  assert [source.task(cfg, mix, i, 0) for i in range(4)] == [("kv@1", 0), ("kv_long", 1), ("kv@2", 2), ("kv@1", 3)]
  assert [source.make_env(cfg, e).difficulty for e in mix] == [1, 3, 2]  # no @: rl.difficulty
  assert [source.make_env(cfg, e).family for e in mix] == ["kv", "kv_long", "kv"]
  assert source.families(cfg) == ("kv", "kv_long")  # held-out evaluation's tasks are unchanged
  assert source.train_tasks(_cfg()) == ("kv", "kv_long")  # no train_mix: the families at rl.difficulty
  # an entry's difficulty reaches the env: the oracle episode of kv@1 is that of a difficulty-1 config
  tok = ByteTokenizer()
  a = source.oracle_rollout(cfg, "kv@1", 5, tok)
  b = source.oracle_rollout(_cfg(difficulty=1), "kv", 5, tok)
  c = source.oracle_rollout(cfg, "kv@2", 5, tok)
  assert a.tokens == b.tokens and a.reward == 1.0 and c.tokens != a.tokens
  # a group of forks and its checkpoint rebuild keep the entry's difficulty
  g = source.start_group(cfg, "kv@1", 5, 0, tok)
  assert {r.env.difficulty for r in g} == {1} and g[0].family == "kv@1"
  for r in g:
    r.env.close()


def test_a_group_is_the_reset_sandbox_and_its_forks_all_independent(monkeypatch):
  """start_group: the reset env is row 0 and rows 1..G-1 are its (lazy) forks. All start identical (prompt, first
  observation) on the one reset sandbox, reads (kv get) leave it shared, and a row's first write gives it a sandbox of
  its own first: nothing one row does (kv service memory, episode state) reaches another, the reset env included."""
  require_namespaces()
  cfg = _cfg()
  cfg.rl.env_module, cfg.rl.families = "moonshot_jax.agentenv.envs", "kv_query"
  cfg.rl.difficulty, cfg.rl.group_size, cfg.rl.max_turns = 2, 3, 8
  made, real_make_env = [], source.make_env

  def make_env(*args):
    made.append(real_make_env(*args))
    return made[-1]

  monkeypatch.setattr(source, "make_env", make_env)
  g = source.start_group(cfg, "kv_query", 9, 0, ByteTokenizer())
  try:
    assert len(made) == 1 and g[0].env is made[0], "the reset env is row 0 (not a fork of it closed at once)"
    assert len(g) == 3 and len({id(r.env) for r in g}) == 3
    shared = g[0].env.sb
    assert all(r.tokens == g[0].tokens for r in g)
    first = [r.env.step(r.env.oracle_action()).observation for r in g]
    assert len(set(first)) == 1 and "no such key" not in first[0], first
    assert all(r.env.sb is shared for r in g), "gets read the reset sandbox's service: no copy yet"
    assert g[0].env.step("kv set zz0 from-row-0").observation == "ok"
    assert g[2].env.step("kv set zz2 from-row-2").observation == "ok"
    ids = [r.env.sb.id for r in g]
    assert len(set(ids)) == 3 and ids[1] == shared.id, "the writers got copies; the last reader keeps the original"
    seen = [(r.env.step("kv get zz0").observation, r.env.step("kv get zz2").observation) for r in g]
    assert seen == [("from-row-0", "no such key"), ("no such key", "no such key"), ("no such key", "from-row-2")]
    assert [r.env.turn for r in g] == [4, 3, 4]
  finally:
    for r in g:
      r.env.close()
  assert shared.closed, "the shared sandbox closes with its last user"


def test_sft_batches_follow_the_train_mix():
  """The source's own task stream (SFT rows here; GRPO groups draw from the same `task` calls) is the mix."""
  cfg = _cfg(train_mix="kv@1,kv_long", algorithm="sft")
  cfg.data.seq_len, cfg.data.batch_size, cfg.rl.max_action_tokens, cfg.rl.group_size = 64, 4, 8, 2
  trainer = types.SimpleNamespace(model_cfg=experiment.model_config(cfg), mesh=None)
  src = source.AgentSource(cfg, "/nonexistent", trainer)
  try:
    batch = src.next_batch(None)
  finally:
    src.close()
  tok = ByteTokenizer()
  for i, entry in enumerate(["kv@1", "kv_long", "kv@1", "kv_long"]):
    want = source.oracle_rollout(cfg, entry, i, tok).tokens
    assert batch["tokens"][i, :len(want) - 1].tolist() == want[:-1], (i, entry)


@pytest.mark.parametrize("mix,match", [("kv@0", "kv@0"), ("kv@x", "kv@x"), ("@2", "@2")])
def test_train_mix_syntax_errors_name_the_entry(mix, match):
  with pytest.raises(ConfigError, match=f"rl.train_mix.*{match}"):
    source.validate(_cfg(train_mix=mix))


def test_train_mix_unknown_family_or_difficulty_names_the_entry():
  with pytest.raises(ConfigError, match="rl.train_mix: unknown family in 'kb@1'"):
    source.train_tasks(_cfg(train_mix="kv,kb@1"))
  real = _cfg(train_mix="file_edit@9")
  real.rl.env_module = "moonshot_jax.agentenv.envs"
  with pytest.raises(ConfigError, match=r"'file_edit@9': file_edit has difficulties 1..4"):
    source.train_tasks(real)


def test_rl_envs_recycle_sandboxes_unless_turned_off():
  real = _cfg()
  real.rl.env_module = "moonshot_jax.agentenv.envs"
  assert source.make_env(real, "python_fn").recycle is True  # the RL default (rl.sandbox_recycle)
  real.rl.sandbox_recycle = False
  assert source.make_env(real, "python_fn").recycle is False


def test_the_hub_pool_holds_every_grpo_presets_sandboxes_in_flight():
  """With a smaller pool part of every GRPO batch's sandboxes are new inits (rl.sandboxes_in_flight)."""
  from moonshot_jax.agentenv import _hub

  spec = importlib.util.spec_from_file_location("agent_grpo", os.path.join(ROOT, "experiments", "agent_tiny_grpo.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  peaks = {p: source.sandboxes_in_flight(mod.get_config(p or None)) for p in mod.PRESETS}
  assert peaks[""] == 8 * 8 * (2 + 2), peaks  # 8 groups of G=8, 2 rounds closing, 2 prefetched
  assert max(peaks.values()) <= _hub.RECYCLE_MAX, (peaks, _hub.RECYCLE_MAX)


def test_grpo_focus_preset_trains_on_its_mix_and_evaluates_on_all_four_families():
  spec = importlib.util.spec_from_file_location("agent_grpo", os.path.join(ROOT, "experiments", "agent_tiny_grpo.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  base, focus = mod.get_config(), mod.get_config("focus")
  assert source.train_tasks(focus) == ("file_lookup", "kv_query", "python_fn", "python_fn")
  assert focus.rl.group_size == 16 and base.rl.group_size == 8 and base.rl.train_mix == ""
  assert source.families(focus) == source.families(base) == source.train_tasks(base)  # same held-out tasks
  assert focus.rl.difficulty == base.rl.difficulty == 3
  with pytest.raises(ConfigError, match="'fokus'"):
    mod.get_config("fokus")


@pytest.mark.parametrize("rl,match", [(dict(temperature=0.0), "must be a number"),
                                      (dict(temperature=5.0), "must be a number"),
                                      (dict(temperature=1.5, turns_per_iteration=2), "turns_per_iteration=0")])
def test_rollout_temperature_out_of_range_or_with_partial_rollouts_names_the_key(rl, match):
  with pytest.raises(ConfigError, match=f"rl.temperature: .*{match}"):
    source.validate(_cfg(**rl))
  source.validate(_cfg(temperature=1.5))  # in range, whole episodes: accepted


def test_set_policy_logp_overwrites_only_policy_tokens_with_their_targets_logp():
  """Rollouts sampled at T != 1 get the T=1 log-probs of their own policy tokens (B rows per batch)."""
  from moonshot_jax.rl import rollout as ro
  rows = []
  for k, n in enumerate([7, 5, 9]):  # 3 rows, B=2: two batches, the second one padded
    toks = [10 * k + t for t in range(n)]
    pol = [0, 0, 1, 1, 0, 1, 1, 1, 1][:n]
    rows.append(ro.Rollout("kv", k, 0, toks, pol, [-9.0] * n))
  B, T = 2, 8  # row 2 (9 tokens) is cut at T + 1 = 9: all its tokens fit

  def logp_fn(batch):  # a distinct value per (row, position): -(its target token) / 100
    assert batch["tokens"].shape == (B, T)
    return -batch["targets"].astype(np.float32) / 100

  source.set_policy_logp(rows, B, T, logp_fn)
  for k, r in enumerate(rows):
    want = [-(10 * k + t) / 100 if r.policy[t] else -9.0 for t in range(len(r.tokens))]
    assert np.allclose(r.logp, want), (k, r.logp, want)


def test_init_step_picks_that_checkpoint_and_a_missing_one_names_the_steps(tmp_path):
  """rl.init_step / eval_agent --step: 0 = the newest step (numerically, not by name), N = step N."""
  for s in (300, 1000, 200):
    (tmp_path / "checkpoints" / str(s)).mkdir(parents=True)
  (tmp_path / "checkpoints" / "tmp_save").mkdir()
  ck = tmp_path / "checkpoints"
  assert source.checkpoint_step(ck) == 1000 and source.checkpoint_step(ck, 300) == 300
  with pytest.raises(ConfigError, match=r"rl.init_step: no checkpoint step 400 .*\[200, 300, 1000\]"):
    source.checkpoint_step(ck, 400)
  source.validate(_cfg(init_workdir=str(tmp_path), init_step=200))
  with pytest.raises(ConfigError, match="rl.init_step: no checkpoint step 250"):
    source.validate(_cfg(init_workdir=str(tmp_path), init_step=250))
  assert source.init_checkpoint(_cfg(init_workdir=str(tmp_path), init_step=300).rl) == (ck, 300)
  assert source.init_checkpoint(_cfg(init_workdir=str(tmp_path)).rl) == (ck, 1000)
  assert source.init_checkpoint(_cfg().rl) is None
  source.validate(_cfg(init_step=200))  # a preset may set it before the command line names the workdir ...
  with pytest.raises(ConfigError, match="rl.init_step: 200 needs rl.init_workdir"):
    source.init_checkpoint(_cfg(init_step=200).rl)  # ... but a run without one does not start
  with pytest.raises(ConfigError, match="rl.init_step: must be an int >= 0"):
    source.validate(_cfg(init_workdir=str(tmp_path), init_step=-1))


def test_grpo_early_preset_starts_from_sft_step_300_at_lr_3e_4_on_the_default_mix():
  spec = importlib.util.spec_from_file_location("agent_grpo", os.path.join(ROOT, "experiments", "agent_tiny_grpo.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  base, early = mod.get_config(), mod.get_config("early")
  assert (early.rl.init_step, early.optimizer.lr) == (300, 3e-4)
  assert (base.rl.init_step, base.optimizer.lr) == (0, 1e-4)
  assert source.train_tasks(early) == source.train_tasks(base) == source.families(early)  # same mix, same held-out
  assert early.rl.group_size == base.rl.group_size and early.train.steps == base.train.steps


def _train_state(seed, n_opt=3, w_shape=(4, 3)):
  """A small real TrainState: params, an optimizer state of n_opt leaves, a MoE bias."""
  from moonshot_jax.train.state import TrainState
  r = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(r.standard_normal(s).astype(np.float32))
  return TrainState(step=jnp.int32(seed), params={"w": f(*w_shape), "b": f(w_shape[1])},
                    opt_state=tuple(f(2) for _ in range(n_opt)), moe_state={"bias": f(5)},
                    rng=jnp.zeros((2,), jnp.uint32), bad_steps=jnp.int32(0))


def _abstract(state):
  dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), state)


def test_restore_params_checks_the_sft_checkpoint_through_the_checkpointer(tmp_path):
  """rl.init_workdir's params go through Checkpointer.restore_subset: another optimizer is fine, another
  model's shapes and damaged files are a ConfigError naming the step directory and the leaf."""
  import shutil
  from moonshot_jax.train.checkpoint import Checkpointer
  ck_dir = tmp_path / "sft" / "checkpoints"
  ck = Checkpointer(ck_dir, async_save=False)
  states = {100: _train_state(1), 200: _train_state(2)}
  for s, st in states.items():
    ck.save(s, st, data_state={})
  ck.close()
  grpo_like = _abstract(_train_state(0, n_opt=1))  # the RL run's optimizer state differs: only params are read
  reads = []
  real_metadata = Checkpointer._metadata

  def counted(self, step):
    reads.append(step)
    return real_metadata(self, step)
  for step, want in ((100, 100), (0, 200)):
    reads.clear()
    with pytest.MonkeyPatch.context() as mp:
      mp.setattr(Checkpointer, "_metadata", counted)
      got = source.restore_params(ck_dir, grpo_like, step)
    assert reads == [want], reads  # the step's metadata (its leaf list, the meta item) is read once
    for k in ("params", "moe_state"):
      for x, y in zip(jax.tree.leaves(got[k]), jax.tree.leaves(getattr(states[want], k))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  with pytest.raises(ConfigError, match=r"rl.init_workdir: checkpoint step 200 under .*params/w checkpoint "
                                        r"\(\(4, 3\), 'float32'\) vs this config \(\(4, 4\)"):
    source.restore_params(ck_dir, _abstract(_train_state(0, w_shape=(4, 4))), 200)
  # a model without the checkpoint's params/b: restore_subset's exact check names the leaf it lacks, while a plain
  # restore_subset reads such a partial subset
  no_b = grpo_like.replace(params={"w": grpo_like.params["w"]})
  with pytest.raises(ConfigError, match=r"step 200 under .*params/b checkpoint \(\(3,\), 'float32'\) vs this config None"):
    source.restore_params(ck_dir, no_b, 200)
  ck = Checkpointer(ck_dir, async_save=False)
  layout = _abstract(_train_state(0))
  part = ck.restore_subset(200, {"params": {"w": layout.params["w"]}}, layout)
  np.testing.assert_array_equal(np.asarray(part["params"]["w"]), np.asarray(states[200].params["w"]))
  ck.close()
  # step 100's state files replaced by step 200's (a mixed-up copy): values no longer match its fingerprints
  shutil.move(ck_dir / "100" / "state", tmp_path / "state100")
  shutil.copytree(ck_dir / "200" / "state", ck_dir / "100" / "state")
  with pytest.raises(ConfigError, match=r"rl.init_workdir: checkpoint step 100 under .*: (params|moe_state)/\w+ does not "
                                        r"match its saved fingerprint"):
    source.restore_params(ck_dir, grpo_like, 100)
  # bytes flipped in step 200's array chunks
  for f in (ck_dir / "200").glob("state/**/d/*"):
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0xFF
    f.write_bytes(bytes(b))
  with pytest.raises(ConfigError, match=r"rl.init_workdir: checkpoint step 200 under .*checkpoints"):
    source.restore_params(ck_dir, grpo_like, 200)
  assert sorted(p.name for p in ck_dir.iterdir()) == ["100", "200"]  # nothing moved aside or deleted


def test_agent_sft_oracle_fits_the_action_budget_and_python_fn_only_copies_numbers():
  """The default agent config's SFT data (the scripted solver's episodes on the real sandboxes): every action
  plus its "\\n" fits rl.max_action_tokens, every episode data.seq_len + 1, and python_fn's actions hold only
  numbers that its prompt holds (d3 writes the slope as f(1)-f(0): copied, not computed)."""
  import re
  from tests.agentenv_testutil import require_namespaces
  require_namespaces()
  cfg = experiment.experiment_module(os.path.join(ROOT, "experiments", "agent_tiny_sft.py")).get_config()
  tok = ByteTokenizer()
  for fam in source.families(cfg):
    for seed in (0, 1, 2, source.HELDOUT_SEED, source.HELDOUT_SEED + 1, source.HELDOUT_SEED + 2):
      r = source.oracle_rollout(cfg, fam, seed, tok)
      assert r.reward == 1.0 and len(r.tokens) <= cfg.data.seq_len + 1, (fam, seed, r.actions)
      for a in r.actions:
        assert len(ro.action_tokens(tok, a)) <= cfg.rl.max_action_tokens, (fam, seed, a)
      if fam == "python_fn":
        prompt = tok.decode([t for t in r.tokens[:r.policy.index(1)] if t < 256])
        assert set(re.findall(r"\d+", " ".join(r.actions))) <= set(re.findall(r"\d+", prompt)), (seed, prompt, r.actions)


def _agent_configs(preset: str):
  """(SFT config, GRPO config) of one preset of experiments/agent_tiny_{sft,grpo}.py."""
  sft = experiment.experiment_module(os.path.join(ROOT, "experiments", "agent_tiny_sft.py"))
  grpo = experiment.experiment_module(os.path.join(ROOT, "experiments", "agent_tiny_grpo.py"))
  return sft.get_config(preset), grpo.get_config(preset)


def _heldout(cfg):
  """What decides a config's held-out tasks and whether an episode fits: eval_agent's tasks for one --seed."""
  fams = source.families(cfg)
  return (cfg.rl.env_module, fams, cfg.rl.difficulty, cfg.rl.max_turns, cfg.data.seq_len, cfg.rl.max_action_tokens,
          cfg.rl.max_obs_chars, [source.task(cfg, fams, i, source.HELDOUT_SEED) for i in range(8)])


def test_d4_presets_share_the_heldout_tasks_and_the_sft_mix_covers_d4_partly():
  sft, grpo = _agent_configs("d4")
  fams = ("file_lookup", "file_edit", "kv_query", "python_fn")
  assert _heldout(sft) == _heldout(grpo) and source.families(sft) == fams and sft.rl.difficulty == 4
  assert source.train_tasks(grpo) == fams  # GRPO trains on d4 tasks (training seeds)
  mix = source.train_tasks(sft)
  for fam in fams:  # each family: d3 six times per round, d4 once (1 in 7 of its SFT demos)
    assert sorted(int(e.partition("@")[2]) for e in mix if e.partition("@")[0] == fam) == [3] * 6 + [4]
  assert (grpo.optimizer.lr, sft.data.seq_len, sft.rl.max_turns) == (3e-4, 192, 6)
  base_sft, base_grpo = _agent_configs("")  # the presets leave the default testbed as it was
  assert _heldout(base_sft) == _heldout(base_grpo) and (base_sft.rl.difficulty, base_sft.data.seq_len) == (3, 160)
  assert base_sft.rl.train_mix == "" and base_grpo.optimizer.lr == 1e-4
  sft_mod = experiment.experiment_module(os.path.join(ROOT, "experiments", "agent_tiny_sft.py"))
  with pytest.raises(ConfigError, match="agent_tiny_sft: unknown preset 'd5'"):
    sft_mod.get_config("d5")


def test_grpo_d4_early_preset_is_d4_from_the_step_300_checkpoint_the_sft_d4_run_keeps():
  sft, d4 = _agent_configs("d4")
  grpo_mod = experiment.experiment_module(os.path.join(ROOT, "experiments", "agent_tiny_grpo.py"))
  early = grpo_mod.get_config("d4_early")
  assert (early.rl.init_step, d4.rl.init_step) == (300, 0)
  a, b = early.to_dict(), d4.to_dict()
  a["rl"].pop("init_step"), b["rl"].pop("init_step")
  assert a == b  # otherwise the :d4 recipe: same model, tasks, lr, steps
  # the SFT :d4 run saves every checkpoint.every_steps and keeps the newest checkpoint.keep: step 300 must survive
  saved = list(range(sft.checkpoint.every_steps, sft.train.steps + 1, sft.checkpoint.every_steps))
  assert early.rl.init_step in saved[-sft.checkpoint.keep:], (saved, sft.checkpoint.keep)


def test_d4_oracle_episodes_fit_the_room_the_sampler_leaves():
  """The d4 testbed on the real sandboxes: the scripted solver solves each SFT mix entry and held-out d4 tasks of
  every family within rl.max_turns, and before each of its actions the sampler's room rule holds (rollout ends a
  row "context_full" unless prefix + rl.max_action_tokens <= data.seq_len + 1): a policy acting like the oracle
  can solve every held-out task."""
  from tests.agentenv_testutil import require_namespaces
  require_namespaces()
  sft, _ = _agent_configs("d4")
  tok = ByteTokenizer()
  cases = [(e, i) for i, e in enumerate(dict.fromkeys(source.train_tasks(sft)))]
  cases += [(f, source.HELDOUT_SEED + i) for f in source.families(sft) for i in range(2)]
  for entry, seed in cases:
    r = source.oracle_rollout(sft, entry, seed, tok)
    assert r.reward == 1.0, (entry, seed, r.actions)
    starts = [t for t in range(1, len(r.policy)) if r.policy[t] and not r.policy[t - 1]]
    assert len(starts) == len(r.actions) <= sft.rl.max_turns
    assert max(starts) + sft.rl.max_action_tokens <= sft.data.seq_len + 1, (entry, seed, max(starts))


def test_finished_groups_envs_close_in_the_pool_off_the_steps_path():
  """_collect hands the finished groups' envs to the pool (`_retire`): the step does not wait for their closes (a
  hub round trip each on real sandboxes), the rows drop them at once, and close() waits until every one is closed."""
  import threading
  import time

  from tests import rl_doubles

  gate = threading.Event()

  class SlowClose(rl_doubles.KVEnv):
    def close(self):
      gate.wait(2.0)  # a close that takes its time until the test lets it go
      super().close()

  cfg = _cfg(algorithm="sft")
  cfg.data.seq_len, cfg.data.batch_size, cfg.rl.max_action_tokens, cfg.rl.group_size = 64, 4, 8, 2
  trainer = types.SimpleNamespace(model_cfg=experiment.model_config(cfg), mesh=None)
  src = source.AgentSource(cfg, "/nonexistent", trainer)
  envs = [SlowClose("kv") for _ in range(4)]
  groups = [[ro.Rollout("kv", 0, g, [1], [0], [0.0], env=e) for e in envs[2 * g:2 * g + 2]] for g in range(2)]
  t0 = time.perf_counter()
  src._retire(groups)
  assert time.perf_counter() - t0 < 1.0, "the step waited for the closes"
  assert all(r.env is None for g in groups for r in g)
  assert not any(e.closed for e in envs)
  gate.set()
  src.close()  # waits for the pool
  assert all(e.closed for e in envs)
