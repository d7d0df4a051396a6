"""rl/source.py's task mix: rl.train_mix (a curriculum of family@difficulty entries) feeds the training
runs, held-out evaluation stays on rl.families at rl.difficulty. Pure Python (the test double envs)."""
import importlib.util
import os
import types

import numpy as np
import pytest

from moonshot_jax import experiment

from moonshot_jax.config import ConfigError
from moonshot_jax.rl import source
from moonshot_jax.train.tokenizer import ByteTokenizer

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
