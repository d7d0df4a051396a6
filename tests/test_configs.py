"""experiments/*.py: load, validate, locked, documented; parameter totals of the big configs."""
import functools
import importlib.util
import os
import re
import time

import pytest
from absl import flags
from ml_collections import config_flags

from moonshot_jax import experiment, params
from moonshot_jax.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ("tiny", "small", "kimi_linear_48b", "k3", "vl_tiny", "vl_small", "agent_tiny_sft", "agent_tiny_grpo")


def _path(name: str) -> str:
  return os.path.join(ROOT, "experiments", f"{name}.py")


def _module(name: str):
  spec = importlib.util.spec_from_file_location(f"experiments_{name}", _path(name))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@functools.lru_cache(maxsize=None)
def _summary(name: str):
  m = experiment.model_config(_module(name).get_config())
  t0 = time.time()
  s = params.summary(m)
  return m, s, time.time() - t0


@pytest.mark.parametrize("name", NAMES)
def test_loads_validates_and_is_locked(name):
  cfg = _module(name).get_config()
  m = experiment.validate(cfg)
  assert m.n_layers == len(m.layer_kinds)
  with pytest.raises(AttributeError):
    cfg.train.stepz = 3  # locked: a typo is an error, not a new key
  with pytest.raises(AttributeError):
    cfg.model.d_modle = 3
  cfg.train.steps = 7  # existing keys stay overridable
  assert cfg.train.steps == 7


@pytest.mark.parametrize("name", ["tiny", "k3"])
def test_command_line_typo_override_is_an_error(name):
  def parse(override):
    argv = ["prog", f"--config={_path(name)}", override]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True, sys_argv=argv)
    fv(argv)
    return fv.config

  assert parse("--config.train.steps=3").train.steps == 3
  with pytest.raises(Exception, match="stepz"):
    parse("--config.train.stepz=3")


@pytest.mark.parametrize("name", NAMES)
def test_docstring_starts_with_the_command(name):
  doc = _module(name).__doc__
  assert doc, f"experiments/{name}.py has no docstring"
  first = doc.strip().splitlines()[0]
  assert re.match(r"^python3? (-m launch\.\w+ |launch/\w+\.py)", first), first
  launcher = re.search(r"launch[./](\w+)", first).group(1)
  if launcher != "quickstart":  # quickstart trains experiments/small.py itself
    assert f"--config=experiments/{name}.py" in first
  assert "print" in doc.lower()  # says what the command should print


def test_bad_override_fails_validation_naming_the_key():
  cfg = _module("tiny").get_config()
  cfg.model.mla_layers = (5,)
  with pytest.raises(ConfigError, match="model.mla_layers"):
    experiment.validate(cfg)
  cfg = _module("vl_tiny").get_config()
  cfg.optimizer.vision_lr_scale_to = 0.3  # a ramp target without a ramp length
  with pytest.raises(ConfigError, match="optimizer.vision_lr_ramp_steps"):
    experiment.validate(cfg)
  cfg.optimizer.vision_lr_ramp_steps = 500
  experiment.validate(cfg)
  cfg.optimizer.vision_local_lr_scale = -1.0
  with pytest.raises(ConfigError, match="optimizer.vision_local_lr_scale"):
    experiment.validate(cfg)


def test_sizes_of_the_demo_configs():
  _, tiny, _ = _summary("tiny")
  assert 1e5 <= tiny["total_params"] <= 1e6  # "a few hundred K"
  m, small, _ = _summary("small")
  assert 30e6 <= small["total_params"] <= 60e6
  tiny_m = experiment.model_config(_module("tiny").get_config())
  kinds = tiny_m.layer_kinds
  assert sorted(k for k, _ in kinds) == ["kda", "kda", "mla"] and [f for _, f in kinds].count("dense") == 1
  assert tiny_m.attn_res and tiny_m.moe_latent_dim > 0 and (tiny_m.num_experts, tiny_m.num_experts_per_tok) == (8, 2)
  assert m.vocab_size == 8192 and _module("small").get_config().data.seq_len == 256


@pytest.mark.parametrize("name", NAMES)
def test_tree_counts_equal_closed_forms(name):
  """The eval_shape tree and the independent formulas agree exactly, per component."""
  m, s, _ = _summary(name)
  formula = params.formula_param_counts(m)
  assert {c: v["total"] for c, v in s["components"].items()} == formula


def test_k3_totals_match_published():
  m, s, seconds = _summary("k3")
  assert seconds < 60, f"eval_shape of k3 init took {seconds:.1f}s"
  assert abs(s["total_params"] / 2.8e12 - 1) < 0.02, s["total_params"]
  assert abs(s["active_params"] / 104e9 - 1) < 0.02, s["active_params"]
  assert m.n_layers == 93 and sum(k == "mla" for k, _ in m.layer_kinds) == 24
  assert m.mla_layers[-2:] == (92, 93)


def test_kimi_linear_totals_match_published():
  """The published config counted exactly is 49.19B total / 3.17B active (embedding table excluded):
  the model's name "48B-A3B" rounds both (2.5% and 6%), so these bands are wider than K3's."""
  m, s, _ = _summary("kimi_linear_48b")
  assert abs(s["total_params"] / 48e9 - 1) < 0.03, s["total_params"]
  assert abs(s["active_params"] / 3e9 - 1) < 0.07, s["active_params"]
  assert m.mla_layers == (4, 8, 12, 16, 20, 24, 27) and m.n_layers == 27


def test_published_values_field_by_field():
  """The architecture values issue #3 pins, one by one (the totals alone could hide a swap)."""
  k3 = experiment.model_config(_module("k3").get_config())
  assert (k3.d_model, k3.n_layers, k3.vocab_size) == (7168, 93, 163840)
  assert k3.mla_layers == tuple(range(4, 93, 4)) + (93,) and k3.dense_layers == (1,)
  assert k3.kda_output_gate_full_rank and k3.kda_gate_lower_bound == -5.0  # HF: g_proj, gate_lower_bound
  assert (k3.dense_activation, k3.norm_eps) == ("situ", 1e-5)
  assert (k3.mla_num_heads, k3.q_lora_rank, k3.kv_lora_rank) == (96, 1536, 512)
  assert (k3.qk_nope_head_dim, k3.qk_rope_head_dim, k3.v_head_dim) == (128, 64, 128)
  assert not k3.mla_use_rope and k3.mla_output_gate  # NoPE, gated
  assert (k3.num_experts, k3.num_experts_per_tok, k3.moe_latent_dim, k3.expert_ff_dim) == (896, 16, 3584, 3072)
  assert (k3.expert_activation, k3.situ_beta, k3.situ_beta_linear) == ("situ", 4.0, 25.0)
  assert (k3.shared_ff_dim, k3.routed_scaling_factor, k3.balancing) == (6144, 1.0, "quantile")
  assert (k3.dense_ff_dim, k3.attn_res, k3.attn_res_block_size) == (33792, True, 12)
  assert k3.num_attn_res_sites == 187 and k3.max_seq_len == 2 ** 20

  kl = experiment.model_config(_module("kimi_linear_48b").get_config())
  assert (kl.d_model, kl.n_layers, kl.vocab_size) == (2304, 27, 163840)
  assert (kl.kda_num_heads, kl.kda_head_dim, kl.kda_output_gate_full_rank) == (32, 128, False)
  assert (kl.mla_num_heads, kl.q_lora_rank, kl.kv_lora_rank) == (32, 0, 512)
  assert (kl.qk_nope_head_dim, kl.qk_rope_head_dim, kl.v_head_dim, kl.mla_use_rope) == (128, 64, 128, False)
  assert (kl.num_experts, kl.num_experts_per_tok, kl.expert_ff_dim, kl.moe_latent_dim) == (256, 8, 1024, 0)
  assert (kl.routed_scaling_factor, kl.dense_ff_dim, kl.dense_layers) == (2.446, 9216, (1,))
