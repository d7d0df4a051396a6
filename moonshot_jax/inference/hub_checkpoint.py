"""Library half of `launch/import_checkpoint.py`: hub checkpoint <-> the run's orbax train state.

Kept out of the launcher so that tests and notebooks can call it without defining absl flags.

The import streams: every leaf of the train state is a `checkpoint.LazyLeaf`, read from the hub
(params, moe_state) or made from tx.init's constants (optimizer state) only when orbax writes it,
and dropped once written, so host memory holds about one leaf, not the model.
"""
from __future__ import annotations

import functools
import json
import shutil
import time
from pathlib import Path
from typing import Any


def run_import(cfg, hf_dir, workdir, *, seed: int = 0, progress: bool = True, devices=None) -> dict:
  import jax
  import jax.numpy as jnp

  from moonshot_jax import experiment
  from moonshot_jax.inference import hf_k3, hub_stream
  from moonshot_jax.train import state as state_lib
  from moonshot_jax.train.checkpoint import Checkpointer, LazyLeaf
  from moonshot_jax.train.loop import build

  t0 = time.time()
  bar = None
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
    bar = hub_stream.progress_bar(report, progress)
    treedef, builders = hub_stream.leaf_builders(hub, model_cfg, shardings, report, cache_dir=cache, bar=bar)
    variables = jax.tree_util.tree_unflatten(treedef, [LazyLeaf(b.shape, b.dtype, b.sharding, b.build)
                                                       for b in builders])
    key = jax.random.split(jax.random.key(jnp.uint32(seed)))[1]
    sh = setup.shardings
    state = state_lib.TrainState(
        step=jax.device_put(jnp.zeros((), jnp.int32), sh.step), params=variables["params"],
        opt_state=lazy_initial_state(setup.tx.init, setup.abstract.params, setup.abstract.opt_state),
        moe_state=variables["moe_state"], rng=jax.device_put(jax.random.key_data(key).astype(jnp.uint32), sh.rng),
        bad_steps=jax.device_put(jnp.zeros((), jnp.int32), sh.bad_steps))
    record = {"imported_from": str(Path(hf_dir).absolute()), "experts_mxfp4": report["experts_mxfp4"],
              "skipped": report["skipped"], "vision_config": vision, "hub_bytes": report["bytes"]}
    ckpt.save(0, state, data_state={}, extra={"hf_import": {k: record[k] for k in ("imported_from", "hub_bytes")}})
    ckpt.wait()
    t_read = time.time() - t0
  finally:
    if bar is not None:
      bar.close()
    ckpt.close()
    hub.close()
  if jax.process_index() == 0:
    (workdir / "hf_import.json").write_text(json.dumps(record, indent=1))
  shutil.rmtree(cache, ignore_errors=True)
  return {"import": str(workdir / "checkpoints" / "0"), "bytes": report["bytes"], "read_write_s": round(t_read, 2),
          "total_s": round(time.time() - t0, 2), "skipped": {k: len(v) for k, v in report["skipped"].items()}}


def lazy_initial_state(init_fn, abstract_params: Any, abstract_state: Any) -> Any:
  """`init_fn(params)` (an optimizer's init) as a tree of LazyLeafs shaped and sharded like
  `abstract_state`, without the parameters' values: every leaf must be a constant of the init
  (optax's moments and step counters are); one that depends on the parameters is a ValueError naming
  it. A broadcast constant is made by a jitted fill; any other constant leaf by jitting init_fn on
  zero parameters for that leaf alone (XLA drops the unused zeros)."""
  import jax
  import jax.numpy as jnp
  from jax.extend import core as jcore

  from moonshot_jax.train.checkpoint import LazyLeaf
  jaxpr = jax.make_jaxpr(init_fn)(abstract_params).jaxpr
  is_var = lambda v: not isinstance(v, jcore.Literal)
  depends, producer = set(jaxpr.invars), {}
  for eqn in jaxpr.eqns:  # forward: which values depend on the parameters
    dep = any(is_var(v) and v in depends for v in eqn.invars)
    for o in eqn.outvars:
      producer[o] = eqn
      if dep:
        depends.add(o)
  flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
  if len(flat) != len(jaxpr.outvars):
    raise ValueError(f"optimizer state: {len(jaxpr.outvars)} leaves from init, {len(flat)} in the abstract state")

  def constant(v):
    if not is_var(v):
      return v.val
    eqn = producer.get(v)
    if eqn is not None and eqn.primitive.name == "broadcast_in_dim" and not is_var(eqn.invars[0]):
      return eqn.invars[0].val
    return None

  zeros = lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract_params)
  out = []
  for i, ((path, a), v) in enumerate(zip(flat, jaxpr.outvars)):
    if is_var(v) and v in depends:
      raise ValueError(f"import: optimizer state leaf {jax.tree_util.keystr(path)} depends on the parameters' "
                       f"values; an imported checkpoint starts the optimizer from constants only")
    c = constant(v)
    if c is not None:
      build = functools.partial(_filled, a.shape, jnp.dtype(a.dtype), c.item() if hasattr(c, "item") else c,
                                a.sharding)
    else:
      build = lambda i=i, s=a.sharding: jax.jit(lambda: jax.tree.leaves(init_fn(zeros()))[i], out_shardings=s)()
    out.append(LazyLeaf(tuple(a.shape), a.dtype, a.sharding, build))
  return jax.tree_util.tree_unflatten(treedef, out)


@functools.cache
def _fill_fn(shape, dtype, value, sharding):
  import jax
  import jax.numpy as jnp
  return jax.jit(lambda: jnp.full(shape, value, dtype), out_shardings=sharding)


def _filled(shape, dtype, value, sharding):
  return _fill_fn(tuple(shape), dtype, value, sharding)()


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
