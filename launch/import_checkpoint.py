"""python -m launch.import_checkpoint --hf_dir=/ckpt/Kimi-K3 --config=experiments/k3.py --workdir=runs/k3_ft
       python -m launch.import_checkpoint --config=experiments/k3.py --workdir=runs/k3_ft --export=/out/k3 \
           [--export_format=mxfp4|bf16] [--max_shard_gb=5]

Import: checks config.json's text_config against the experiment's model (every differing field is
named), validates every tensor of the hub checkpoint from the headers (missing / unknown / misshapen
/ mistyped tensors are named; vision and multi-token-prediction tensors are skipped by name and
listed), then builds the train state directly in the run's shardings -- each device's slice read
memory-mapped from its safetensors shard, so each host reads only what its devices hold -- with
zero optimizer state, and saves it as step 0 of WORKDIR/checkpoints. `launch.train` with the same
--config and --workdir fine-tunes from it (or RL: the same train state), `launch.generate` samples
from it. An interrupted import resumes: finished slices are kept under WORKDIR/import_cache until
the checkpoint is saved. A workdir that already holds checkpoints is refused (nothing is overwritten).
WORKDIR/hf_import.json records what was read and skipped, and the vision_config for the vision tower.

Export (--export=DIR): the newest checkpoint of WORKDIR back to the hub layout (config.json with a
K3 text_config, the vision_config recorded at import, sharded safetensors + index), routed experts
in MXFP4 (default, the released format) or bf16, other matrices bf16, vectors fp32. DIR must not exist.
Prints one JSON line at the end: what was done, bytes, seconds.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
_HF_DIR = flags.DEFINE_string("hf_dir", None, "hub checkpoint directory (config.json + *.safetensors)")
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (the checkpoint goes to WORKDIR/checkpoints)")
_EXPORT = flags.DEFINE_string("export", None, "export the newest checkpoint of WORKDIR to this new directory")
_FORMAT = flags.DEFINE_enum("export_format", "mxfp4", ["mxfp4", "bf16"], "routed experts' format on export")
_SHARD_GB = flags.DEFINE_float("max_shard_gb", 5.0, "largest safetensors shard written on export (GB)")
_SEED = flags.DEFINE_integer("seed", 0, "seed of the train state's RNG")


def run_import(cfg, hf_dir, workdir, *, seed: int = 0, progress: bool = True, devices=None) -> dict:
  import jax
  import jax.numpy as jnp

  from moonshot_jax import experiment
  from moonshot_jax.inference import hf_k3, hub_stream
  from moonshot_jax.train import state as state_lib
  from moonshot_jax.train.checkpoint import Checkpointer
  from moonshot_jax.train.loop import build

  t0 = time.time()
  model_cfg = experiment.validate(cfg)
  hub = hub_stream.HubDir(hf_dir)
  if not hf_k3.is_k3_config(hub.config):
    raise ValueError(f"{hf_dir}/config.json is not a kimi_k3 config (model_type {hub.config.get('model_type')!r}); "
                     "Kimi-Linear checkpoints load with moonshot_jax.inference.hf_import")
  text, vision = hf_k3.split_config(hub.config)
  hf_k3.check_against(model_cfg, hf_k3.architecture(text), source="--config")
  workdir = Path(workdir).absolute()
  ckpt = Checkpointer(workdir / "checkpoints", async_save=False)
  try:
    if ckpt.steps():
      raise ValueError(f"{workdir / 'checkpoints'} already holds steps {ckpt.steps()}; import into a new workdir")
    report = hub_stream.validate(hub, model_cfg)
    trainer = build(cfg, devices)
    setup = trainer.setup
    shardings = {"params": setup.shardings.params, "moe_state": setup.shardings.moe_state}
    cache = workdir / "import_cache"
    variables = hub_stream.load_variables(hub, model_cfg, shardings, report, cache_dir=cache, progress=progress)
    t_read = time.time() - t0

    def make_state(params, moe_state):
      key = jax.random.split(jax.random.key(jnp.uint32(seed)))[1]
      return state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=setup.tx.init(params),
                                  moe_state=moe_state, rng=jax.random.key_data(key).astype(jnp.uint32),
                                  bad_steps=jnp.zeros((), jnp.int32))

    state = jax.jit(make_state, out_shardings=setup.shardings, donate_argnums=(0, 1))(
        variables["params"], variables["moe_state"])
    del variables
    record = {"imported_from": str(Path(hf_dir).absolute()), "experts_mxfp4": report["experts_mxfp4"],
              "skipped": report["skipped"], "vision_config": vision, "hub_bytes": report["bytes"]}
    ckpt.save(0, state, data_state={}, extra={"hf_import": {k: record[k] for k in ("imported_from", "hub_bytes")}})
    ckpt.wait()
  finally:
    ckpt.close()
    hub.close()
  if jax.process_index() == 0:
    (workdir / "hf_import.json").write_text(json.dumps(record, indent=1))
  shutil.rmtree(cache, ignore_errors=True)
  return {"import": str(workdir / "checkpoints" / "0"), "bytes": report["bytes"], "read_s": round(t_read, 2),
          "total_s": round(time.time() - t0, 2), "skipped": {k: len(v) for k, v in report["skipped"].items()}}


def run_export(cfg, workdir, out_dir, *, experts_mxfp4: bool = True, max_shard_bytes: int = 5 << 30,
               progress: bool = True, devices=None) -> dict:
  from moonshot_jax.inference import hub_stream
  from moonshot_jax.inference.load import load_latest

  t0 = time.time()
  loaded = load_latest(cfg, workdir, devices=devices, with_tokenizer=False)
  rec = Path(workdir) / "hf_import.json"
  vision = json.loads(rec.read_text()).get("vision_config") if rec.is_file() else None
  info = hub_stream.write_hub(loaded.variables, loaded.cfg, out_dir, experts_mxfp4=experts_mxfp4,
                              max_shard_bytes=max_shard_bytes, vision_config=vision, progress=progress)
  return {"export": str(out_dir), "step": loaded.step, **info, "total_s": round(time.time() - t0, 2)}


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if _CONFIG.value is None or not _WORKDIR.value:
    raise app.UsageError("--config and --workdir are required")
  if bool(_HF_DIR.value) == bool(_EXPORT.value):
    raise app.UsageError("give exactly one of --hf_dir (import) or --export (export)")
  if _HF_DIR.value:
    out = run_import(_CONFIG.value, _HF_DIR.value, _WORKDIR.value, seed=_SEED.value)
  else:
    out = run_export(_CONFIG.value, _WORKDIR.value, _EXPORT.value, experts_mxfp4=_FORMAT.value == "mxfp4",
                     max_shard_bytes=int(_SHARD_GB.value * 2 ** 30))
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  app.run(main)
