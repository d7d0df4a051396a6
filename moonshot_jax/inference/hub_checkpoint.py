"""Library half of `launch/import_checkpoint.py`: hub checkpoint <-> the run's orbax train state.

Kept out of the launcher so that tests and notebooks can call it without defining absl flags.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path


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
