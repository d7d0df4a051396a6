import pytest

from moonshot_jax import experiment
from moonshot_jax.config import ConfigError


def _cfg():
  return experiment.finalize(experiment.base_config())


def test_locked_rejects_typo():
  cfg = _cfg()
  with pytest.raises(AttributeError, match="stepz"):
    cfg.train.stepz = 3


def test_mesh_resolution():
  cfg = _cfg()
  assert experiment.mesh_shape(cfg, 8) == dict(pipeline=1, data=8, expert=1, tensor=1)
  cfg.mesh.expert = 4
  assert experiment.mesh_shape(cfg, 8)["data"] == 2


@pytest.mark.parametrize("section,key,value,match", [
    ("mesh", "data", 3, "mesh"),
    ("mesh", "expert", 3, "mesh.expert"),
    ("mesh", "tensor", 4, "mesh.tensor"),
    ("train", "microbatches", 3, "train.microbatches"),
    ("optimizer", "name", "sgdd", "optimizer.name"),
    ("optimizer", "router_lr_scale", 0.0, "optimizer.router_lr_scale"),
    ("data", "seq_len", 10_000, "data.seq_len"),
])
def test_bad_values_named(section, key, value, match):
  cfg = _cfg()
  cfg[section][key] = value
  with pytest.raises(ConfigError, match=match):
    experiment.validate(cfg, num_devices=8)


def test_bad_model_value_named():
  cfg = _cfg()
  cfg.model.num_experts_per_tok = 99
  with pytest.raises(ConfigError, match="model.num_experts_per_tok"):
    experiment.validate(cfg)
