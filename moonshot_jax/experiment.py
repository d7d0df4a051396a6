"""Experiment configs: the ml_collections schema every `experiments/*.py` file builds on.

An experiment file does

    from moonshot_jax import experiment
    def get_config(arg=None):
      cfg = experiment.base_config()
      cfg.model.d_model = ...
      return experiment.finalize(cfg)

`finalize` validates and locks the ConfigDict, so a misspelt key — in the file or in an absl
override such as `--config.train.stepz=5` — is an error, and inconsistent values fail before any
compile with a message naming the key. Launchers pass `parse_flags` to `app.run` so that a
misspelt override prints one `config error:` line and exits 2 (no traceback). `warnings(cfg)`
lists legitimate-but-surprising settings (a warm-up longer than the run) the loop prints once.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import sys
from typing import Sequence

import ml_collections

from moonshot_jax.config import ConfigError, ModelConfig

_OPTIMIZERS = ("adamw", "muon")
_SCHEDULES = ("cosine", "wsd", "constant")
_DISPATCH = ("dense", "ragged")
_STRATEGIES = ("zero1", "zero3")
_PIPE_SCHEDULES = ("gpipe", "circular")


def _model_defaults() -> ml_collections.ConfigDict:
  d = {}
  for f in dataclasses.fields(ModelConfig):
    v = f.default
    d[f.name] = v
  # None-valued fields need a declared type so overrides like --config.model.kda_gate_lower_bound=-5 parse.
  cd = ml_collections.ConfigDict(d)
  for name, typ in (("kda_gate_lower_bound", float), ("kda_implementation", str)):
    cd[name] = ml_collections.config_dict.placeholder(typ)
  return cd


def base_config() -> ml_collections.ConfigDict:
  cfg = ml_collections.ConfigDict()
  cfg.model = _model_defaults()
  cfg.data = ml_collections.ConfigDict(dict(
      corpus="sotu",  # "sotu" | "files"
      # corpus == "files": files, directories and globs, as a tuple/list or one comma-separated
      # string (`--config.data.paths=~/texts,/data/*.jsonl`); see corpus.py
      paths=ml_collections.config_dict.FieldReference((), field_type=object),
      jsonl_text_key="text",
      tokenizer="bpe",  # "bpe" (trained locally, cached in workdir) | "byte" | a path to a tokenizer file
      tokenizer_vocab_size=0,  # 0 = model.vocab_size
      seq_len=128,
      batch_size=8,  # global batch (rows of seq_len tokens)
      eval_fraction=0.05,  # held-out documents, fixed split
      eval_batches=4,
      shuffle_seed=0,
      num_workers=0,  # grain worker processes (0 = in-process)
      prefetch=2,
  ))
  cfg.optimizer = ml_collections.ConfigDict(dict(
      name="adamw",
      lr=3e-3,
      schedule="cosine",
      warmup_steps=10,
      decay_fraction=0.2,  # WSD: fraction of steps in the final decay
      min_lr_ratio=0.1,
      weight_decay=0.1,
      b1=0.9,
      b2=0.95,
      eps=1e-8,
      clip_norm=1.0,
      muon_beta=0.95,
      muon_lr_scale=1.0,  # Muon lr = lr * muon_lr_scale
      vision_lr_scale=1.0,  # the vision tower's (params["vision"]) lr = lr * vision_lr_scale
      # > 0: a ramp of that factor, linear from vision_lr_scale to vision_lr_scale_to over the updates
      # [vision_lr_ramp_begin, vision_lr_ramp_begin + vision_lr_ramp_steps], then held; 0 = constant factor
      vision_lr_scale_to=0.0,
      vision_lr_ramp_begin=0,
      vision_lr_ramp_steps=0,
      # > 0: the lr factor of the tower's per-patch maps (patch embedding + its norm, the merger's projector)
      # instead of vision_lr_scale (#19: they learn digit glyphs; the blocks' attention stays slow)
      vision_local_lr_scale=0.0,
      # MoE routers' lr = lr * router_lr_scale. #23, small at lr 4e-3: x0.5 kept the router's weights on the
      # lr-2e-3 path but not the load (2.24x at step 60): the router's inputs outran the balancing bias.
      router_lr_scale=1.0,
  ))
  cfg.train = ml_collections.ConfigDict(dict(
      steps=100,
      microbatches=1,  # gradient accumulation
      seed=0,
      log_every=10,
      eval_every=50,
      max_bad_steps=5,  # consecutive NaN/Inf steps before stopping
      sample_after=False,
      sample_prompt="The state of the union",
      sample_tokens=64,
  ))
  cfg.mesh = ml_collections.ConfigDict(dict(
      pipeline=1, data=-1, expert=1, tensor=1,  # -1 = all remaining devices
      strategy="zero1",
      ep_dispatch="dense",  # "dense" (capacity all_to_all, any backend) | "ragged" (GPU/TPU)
      capacity_factor=2.0,
      redundant_experts=0,
      pipeline_microbatches=0,  # 0 = 2 * pipeline stages
      pipeline_schedule="gpipe",
  ))
  cfg.checkpoint = ml_collections.ConfigDict(dict(
      every_steps=50,
      keep=3,
      keep_best=1,
      async_save=True,
  ))
  cfg.logging = ml_collections.ConfigDict(dict(
      tensorboard=True,
      progress_bar=True,
  ))
  return cfg


EXPERIMENTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments")


def experiment_module(path: str):
  """An experiment file as a module: a path, or a name in the checkout's experiments/ ("tiny").
  Experiment files build on each other through it (vl_tiny takes tiny's model, agent GRPO the SFT's base)."""
  if os.sep not in path and not path.endswith(".py"):
    path = os.path.join(EXPERIMENTS_DIR, path + ".py")
  spec = importlib.util.spec_from_file_location("experiment_" + os.path.splitext(os.path.basename(path))[0], path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def load_experiment(path: str):
  """`get_config()` of an experiment file (a path or a name, as `experiment_module`)."""
  return experiment_module(path).get_config()


def model_section(name: str) -> ml_collections.ConfigDict:
  """An unlocked copy of experiment `name`'s model section, to derive another experiment from."""
  section = load_experiment(name).model.copy_and_resolve_references()
  section.unlock()
  return section


def model_config(cfg: ml_collections.ConfigDict) -> ModelConfig:
  return ModelConfig.from_dict(cfg.model.to_dict())


def vision_config(cfg: ml_collections.ConfigDict):
  """The VisionConfig of a config's optional `vision` section (None for text-only experiments)."""
  if "vision" not in cfg:
    return None
  from moonshot_jax.vision.config import VisionConfig  # noqa: PLC0415
  vcfg = VisionConfig.from_dict(cfg.vision.to_dict())
  m = model_config(cfg)
  if vcfg.out_dim != m.d_model:
    raise ConfigError(f"vision.out_dim: must equal model.d_model={m.d_model} (got {vcfg.out_dim})")
  return vcfg


def vision_section(vcfg) -> ml_collections.ConfigDict:
  """A `vision` config section holding exactly the fields of `vcfg` (a VisionConfig)."""
  import dataclasses  # noqa: PLC0415
  return ml_collections.ConfigDict(dataclasses.asdict(vcfg))


def mesh_shape(cfg: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
  """Resolves the -1 entry of the mesh section against `num_devices`."""
  axes = ("pipeline", "data", "expert", "tensor")
  sizes = {a: int(cfg.mesh[a]) for a in axes}
  free = [a for a in axes if sizes[a] == -1]
  if len(free) > 1:
    raise ConfigError(f"mesh: only one axis may be -1, got {free}")
  for a in axes:
    if sizes[a] == 0 or sizes[a] < -1:
      raise ConfigError(f"mesh.{a}: must be a positive size or -1 (got {sizes[a]})")
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if free:
    if num_devices % fixed:
      raise ConfigError(f"mesh.{free[0]}: {num_devices} devices are not divisible by the other axes' "
                        f"product {fixed}")
    sizes[free[0]] = num_devices // fixed
  elif fixed != num_devices:
    raise ConfigError(f"mesh: product of axis sizes {sizes} is {fixed}, but there are {num_devices} devices")
  return sizes


def validate(cfg: ml_collections.ConfigDict, num_devices: int | None = None) -> ModelConfig:
  """Checks every section; returns the ModelConfig. Raises ConfigError naming the key."""
  m = model_config(cfg)

  def need(cond, key, msg):
    if not cond:
      section, name = key.split(".", 1)
      raise ConfigError(f"{key}: {msg} (got {cfg[section][name]!r})")

  vcfg = vision_config(cfg)
  if vcfg is not None and "vl" in cfg:  # a vision-language training run (vision/data.py)
    from moonshot_jax.vision.config import check_vl_config  # noqa: PLC0415
    check_vl_config(cfg, vcfg)
  d, o, t, c = cfg.data, cfg.optimizer, cfg.train, cfg.checkpoint
  need(d.corpus in ("sotu", "files"), "data.corpus", 'must be "sotu" or "files"')
  if d.corpus == "files":
    split_paths(d.paths)  # raises ConfigError on a bad type or an empty list
  need(d.seq_len > 0, "data.seq_len", "must be positive")
  need(d.seq_len <= m.max_seq_len, "data.seq_len", f"exceeds model.max_seq_len={m.max_seq_len}")
  need(d.batch_size > 0, "data.batch_size", "must be positive")
  need(0.0 < d.eval_fraction < 0.5, "data.eval_fraction", "must be in (0, 0.5)")
  need(0 <= d.tokenizer_vocab_size <= m.vocab_size, "data.tokenizer_vocab_size",
       f"must be in [0, model.vocab_size={m.vocab_size}]")
  need(o.name in _OPTIMIZERS, "optimizer.name", f"must be one of {_OPTIMIZERS}")
  need(o.schedule in _SCHEDULES, "optimizer.schedule", f"must be one of {_SCHEDULES}")
  need(o.lr > 0, "optimizer.lr", "must be positive")
  need(o.vision_lr_scale > 0, "optimizer.vision_lr_scale", "must be positive")
  need(o.vision_lr_scale_to >= 0, "optimizer.vision_lr_scale_to", "must be >= 0 (0 = no ramp)")
  need(o.vision_lr_ramp_begin >= 0, "optimizer.vision_lr_ramp_begin", "must be >= 0")
  need((o.vision_lr_scale_to > 0) == (o.vision_lr_ramp_steps > 0), "optimizer.vision_lr_ramp_steps",
       "must be >= 1 exactly when optimizer.vision_lr_scale_to > 0 (a ramp needs both)")
  need(o.vision_local_lr_scale >= 0, "optimizer.vision_local_lr_scale", "must be >= 0 (0 = as vision_lr_scale)")
  need(o.router_lr_scale > 0, "optimizer.router_lr_scale", "must be positive")
  need(o.warmup_steps >= 0, "optimizer.warmup_steps", "must be >= 0")  # >= train.steps: see warnings()
  need(0.0 < o.decay_fraction <= 1.0, "optimizer.decay_fraction", "must be in (0, 1]")
  need(o.clip_norm >= 0, "optimizer.clip_norm", "must be >= 0 (0 disables clipping)")
  need(t.steps >= 0, "train.steps", "must be >= 0")
  need(t.microbatches >= 1, "train.microbatches", "must be >= 1")
  need(d.batch_size % t.microbatches == 0, "train.microbatches",
       f"must divide data.batch_size={d.batch_size}")
  need(t.log_every >= 1, "train.log_every", "must be >= 1")
  need(t.max_bad_steps >= 1, "train.max_bad_steps", "must be >= 1")
  need(c.every_steps >= 1, "checkpoint.every_steps", "must be >= 1")
  need(c.keep >= 1, "checkpoint.keep", "must be >= 1")

  ms = cfg.mesh
  need(ms.strategy in _STRATEGIES, "mesh.strategy", f"must be one of {_STRATEGIES}")
  need(ms.ep_dispatch in _DISPATCH, "mesh.ep_dispatch", f"must be one of {_DISPATCH}")
  need(ms.pipeline_schedule in _PIPE_SCHEDULES, "mesh.pipeline_schedule", f"must be one of {_PIPE_SCHEDULES}")
  need(ms.capacity_factor > 0, "mesh.capacity_factor", "must be positive")
  if ms.expert > 0:
    need(m.num_experts % ms.expert == 0, "mesh.expert",
         f"model.num_experts={m.num_experts} is not divisible by the expert axis")
  if ms.tensor > 0:
    for key, val in (("kda_num_v_heads", m.kda_num_v_heads), ("mla_num_heads", m.mla_num_heads)):
      if val % ms.tensor:
        raise ConfigError(f"mesh.tensor: model.{key}={val} is not divisible by the tensor axis ({ms.tensor})")
  if ms.pipeline > 0:
    need(m.n_layers >= ms.pipeline, "mesh.pipeline", f"more stages than model.n_layers={m.n_layers}")
  if num_devices is not None:
    sizes = mesh_shape(cfg, num_devices)
    need(d.batch_size % (sizes["data"] * sizes["expert"]) == 0 or sizes["data"] * sizes["expert"] == 1,
         "data.batch_size", f"must be divisible by data*expert={sizes['data'] * sizes['expert']}")
  return m


def split_paths(paths) -> tuple[str, ...]:
  """data.paths as a tuple of entries: a string is split on commas (empty pieces dropped)."""
  if isinstance(paths, str):
    out = tuple(p.strip() for p in paths.split(",") if p.strip())
  elif isinstance(paths, (list, tuple)) and all(isinstance(p, str) for p in paths):
    out = tuple(p for p in paths if p.strip())
  else:
    raise ConfigError(f"data.paths: expected a tuple of paths or a comma-separated string (got {paths!r})")
  if not out:
    raise ConfigError('data.paths: corpus "files" needs at least one file, directory or glob (got '
                      f'{paths!r}; e.g. --config.data.paths=~/texts,/data/*.jsonl)')
  return out


def warnings(cfg: ml_collections.ConfigDict) -> list[str]:
  """Settings that are legal but change what the run does in a way a user may not expect."""
  out = []
  steps, warm = int(cfg.train.steps), int(cfg.optimizer.warmup_steps)
  if steps > 0 and warm >= steps:
    from moonshot_jax.train import optim  # local: optax import
    sched = optim.make_schedule(cfg.optimizer, steps)
    first, last = float(sched(0)), float(sched(steps - 1))
    out.append(f"optimizer.warmup_steps={warm} >= train.steps={steps}: the whole run is warm-up; the "
               f"learning rate rises linearly from {first:.3g} to {last:.3g} (peak optimizer.lr="
               f"{float(cfg.optimizer.lr):.3g} is {'reached at the last step' if warm == steps else 'never reached'}) "
               f"and the {cfg.optimizer.schedule} decay never starts")
  return out


_MISSING_KEY = re.compile(r"""['"]([^'"\\]+)['"]""")
_SUGGESTION = re.compile(r'Did you mean "([^"]+)" instead of')


def _innermost_message(e: BaseException) -> str:
  while e.args and isinstance(e.args[0], BaseException):
    e = e.args[0]
  return str(e.args[0]) if e.args else str(e)


def missing_key_error(e: BaseException, argv: Sequence[str]) -> str:
  """One line for a KeyError/AttributeError raised by ml_collections while applying a
  `--config.a.b=v` override naming no key: the flag (from argv), the key, the suggestion."""
  msg = _innermost_message(e)
  m = _MISSING_KEY.search(msg)
  key = m.group(1) if m else msg.splitlines()[0]
  flag = next((a.split("=", 1)[0] for a in argv[1:]
               if re.match(r"--\w+\.", a) and key in a.split("=", 1)[0].lstrip("-").split(".")[1:]), None)
  where = f"{flag.lstrip('-')}: " if flag else ""
  hint = _SUGGESTION.search(msg)
  return (f"{where}no such key {key!r}" + (f'; did you mean "{hint.group(1)}"?' if hint else
                                            " (the config is locked: keys cannot be added)"))


def parse_flags(argv: list[str]) -> list[str]:
  """`flags_parser` for `absl.app.run` in launchers with a `--config` file flag: as absl's own
  (bad flags print usage, exit 1), except an override naming no config key prints one
  `config error:` line (the flag, the key, ml_collections' suggestion) and exits 2."""
  from absl import app  # local: only launchers need absl here
  try:
    return app.parse_flags_with_usage(argv)
  except (KeyError, AttributeError) as e:
    print(f"config error: {missing_key_error(e, argv)}", file=sys.stderr, flush=True)
    raise SystemExit(2) from None


def finalize(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Validates (device-independent checks) and locks: new keys become errors."""
  validate(cfg)
  cfg.lock()
  return cfg
