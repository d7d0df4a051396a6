import pytest

from moonshot_jax.config import ConfigError, ModelConfig


def test_defaults_validate():
  ModelConfig().validate()


def test_unknown_key_named():
  with pytest.raises(ConfigError, match="kda_num_haeds"):
    ModelConfig.from_dict({"kda_num_haeds": 4})


@pytest.mark.parametrize("kw,key", [
    (dict(num_experts=4, num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(kda_num_heads=3, kda_num_v_heads=4), "kda_num_v_heads"),
    (dict(kda_chunk_size=48), "kda_chunk_size"),
    (dict(mla_layers=(9,)), "mla_layers"),
    (dict(expert_activation="gelu"), "expert_activation"),
])
def test_bad_values_named(kw, key):
  with pytest.raises(ConfigError, match=key):
    ModelConfig.from_dict(kw)


def test_layer_kinds():
  cfg = ModelConfig(n_layers=4, mla_layers=(4,), dense_layers=(1,))
  assert cfg.layer_kinds == (("kda", "dense"), ("kda", "moe"), ("kda", "moe"), ("mla", "moe"))
