"""Library half of `launch/import_checkpoint.py`: hub checkpoint <-> the run's orbax train state.

Kept out of the launcher so that tests and notebooks can call it without defining absl flags.

The import streams: every leaf of the train state is a `checkpoint.LazyLeaf`, read from the hub
(params, moe_state) only when orbax writes it, one layer's / expert's slab at a time, so host memory
holds about one hub tensor, not a leaf. The optimizer state is tx.init's constants: written as array
metadata and one chunk each (`LazyLeaf.fill`) and made by the restore.

Resume (`_Resume`) is per leaf and costs no second copy of the data: each leaf written into the
step's temporary directory is recorded with its fingerprint; a rerun keeps what those leaves wrote
and writes only the rest.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np


# Chunk compressor of the hub leaves (checkpoint.CODECS): see launch/import_checkpoint.py --codec.
DEFAULT_CODEC = "zstd"


def run_import(cfg, hf_dir, workdir, *, seed: int = 0, progress: bool = True, devices=None,
               codec: str = DEFAULT_CODEC, chunk_workers: int = 1) -> dict:
  import jax
  import jax.numpy as jnp

  from moonshot_jax import experiment
  from moonshot_jax.inference import hf_k3, hub_stream
  from moonshot_jax.train import state as state_lib
  from moonshot_jax.train.checkpoint import CODECS, Checkpointer, LazyLeaf
  from moonshot_jax.train.loop import build

  if codec not in CODECS:
    raise ValueError(f"import: unknown codec {codec!r} (one of {sorted(CODECS)})")
  if chunk_workers < 1:
    raise ValueError(f"import: chunk_workers must be >= 1 (got {chunk_workers})")
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
    bar = hub_stream.progress_bar(report, progress)
    treedef, builders = hub_stream.leaf_builders(hub, model_cfg, shardings, report, bar=bar)
    variables = jax.tree_util.tree_unflatten(treedef, [
        LazyLeaf(b.shape, b.dtype, b.sharding, b.build, slabs=b.slabs, stack_axes=b.stack_axes, codec=codec,
                 chunk_workers=chunk_workers)
        for b in builders])
    key = jax.random.split(jax.random.key(jnp.uint32(seed)))[1]
    sh = setup.shardings
    small = lambda x, s: LazyLeaf(tuple(x.shape), x.dtype, s, lambda: jax.device_put(x, s))
    state = state_lib.TrainState(
        step=small(jnp.zeros((), jnp.int32), sh.step), params=variables["params"],
        opt_state=lazy_initial_state(setup.tx.init, setup.abstract.params, setup.abstract.opt_state),
        moe_state=variables["moe_state"], rng=small(jax.random.key_data(key).astype(jnp.uint32), sh.rng),
        bad_steps=small(jnp.zeros((), jnp.int32), sh.bad_steps))
    resume = _Resume(workdir, _import_key(hub, state))
    state = resume.attach(state)
    record = {"imported_from": str(Path(hf_dir).absolute()), "experts_mxfp4": report["experts_mxfp4"],
              "skipped": report["skipped"], "vision_config": vision, "hub_bytes": report["bytes"],
              "codec": {"params, moe_state": codec},
              "opt_state": "constants: metadata and one chunk, filled by the restore"}
    ckpt.save(0, state, data_state={}, extra={"hf_import": {k: record[k] for k in ("imported_from", "hub_bytes", "codec")}})
    ckpt.wait()
    t_read = time.time() - t0
  finally:
    if bar is not None:
      bar.close()
    ckpt.close()
    hub.close()
  if jax.process_index() == 0:
    (workdir / "hf_import.json").write_text(json.dumps(record, indent=1))
  resume.clear()
  return {"import": str(workdir / "checkpoints" / "0"), "bytes": report["bytes"], "read_write_s": round(t_read, 2),
          "codec": codec,
          "total_s": round(time.time() - t0, 2), "skipped": {k: len(v) for k, v in report["skipped"].items()}}


def _import_key(hub, state) -> str:
  """What a recorded partial import must match to be resumed: the hub's files, the state's leaves
  (path, shape, dtype, sharding) and the process layout."""
  import jax
  leaves = [(jax.tree_util.keystr(k), tuple(x.shape), str(x.dtype), str(x.sharding))
            for k, x in jax.tree_util.tree_flatten_with_path(state)[0]]
  files = sorted((f, n, int((hub.dir / f).stat().st_mtime)) for f, n in hub.file_bytes.items())
  blob = json.dumps([str(hub.dir.absolute()), files, leaves, jax.process_count(), jax.process_index()])
  return hashlib.sha1(blob.encode()).hexdigest()


class _Resume:
  """Per-leaf resume of an interrupted import, without a second copy of the data.

  Every slab-written leaf committed into step 0's temporary state directory is appended (with its
  fingerprint) to WORKDIR/import_progress/<process>.jsonl, after the directory itself. An interrupted
  save leaves that directory behind, and orbax deletes it when step 0 is saved again; so a rerun with
  the same key first moves this process's OCDBT database out of it (into import_progress/), then, when
  the first leaf is about to be written, into the new state directory, where the recorded leaves are
  already complete: only their metadata is written. A leaf that was half written is written again (same chunk keys)."""

  def __init__(self, workdir: Path, key: str):
    import jax
    from orbax.checkpoint._src.serialization import ocdbt_process_spec
    self.name = f"{ocdbt_process_spec.PROCESS_PREFIX}{jax.process_index()}"
    self.dir = workdir / "import_progress"
    self.file = self.dir / f"{jax.process_index()}.jsonl"
    self.held = self.dir / self.name
    self.started = False
    lines = [json.loads(x) for x in self.file.read_text().splitlines() if x.strip()] if self.file.is_file() else []
    dirs = [Path(x["dir"]) / self.name for x in lines if "dir" in x]  # where the last run wrote
    left = dirs[-1] if dirs else None
    self.done: dict[str, float] = {}
    if lines and lines[0] == {"key": key} and (left is not None and left.is_dir() or self.held.is_dir()):
      if left is not None and left.is_dir():  # the interrupted run's data; a held copy (if any) is older
        shutil.rmtree(self.held, ignore_errors=True)
        os.replace(left, self.held)
      self.done = {x["leaf"]: x["fp"] for x in lines[1:] if "leaf" in x}
    else:
      shutil.rmtree(self.dir, ignore_errors=True)
    self.dir.mkdir(parents=True, exist_ok=True)
    self.file.write_text("".join(json.dumps(x) + "\n" for x in
                                 [{"key": key}] + [{"leaf": k, "fp": v} for k, v in self.done.items()]))

  def attach(self, state):
    import dataclasses

    import jax
    from moonshot_jax.train.checkpoint import LazyLeaf
    flat, treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, LazyLeaf))
    if jax.process_count() > 1:  # skip only what every process finished: the rest is written (and
      from jax.experimental import multihost_utils  # its fingerprint gathered) by all of them together
      names = [jax.tree_util.keystr(k) for k, x in flat if x.slabs is not None]
      everywhere = np.asarray(multihost_utils.process_allgather(
          np.asarray([n in self.done for n in names], np.int32))).reshape(-1, len(names)).min(0)
      self.done = {n: self.done[n] for n, ok in zip(names, everywhere) if ok}
    out = []
    for path, leaf in flat:
      name = jax.tree_util.keystr(path)
      if leaf.slabs is not None:
        leaf = dataclasses.replace(leaf, written=self.done.get(name), on_written=functools.partial(self._record, name))
      out.append(dataclasses.replace(leaf, on_start=self._move_in))
    return jax.tree_util.tree_unflatten(treedef, out)

  def _move_in(self, state_dir: Path) -> None:
    if self.started:
      return
    self.started = True
    if self.held.is_dir():
      os.replace(self.held, state_dir / self.name)
    self._append({"dir": str(state_dir)})  # orbax's temporary item directory: where to look next time

  def _record(self, name: str, fp: float) -> None:
    self._append({"leaf": name, "fp": fp})

  def _append(self, entry) -> None:
    with open(self.file, "a") as f:
      f.write(json.dumps(entry) + "\n")
      f.flush()
      os.fsync(f.fileno())

  def clear(self) -> None:
    shutil.rmtree(self.dir, ignore_errors=True)


def lazy_initial_state(init_fn, abstract_params: Any, abstract_state: Any) -> Any:
  """`init_fn(params)` (an optimizer's init) as a tree of LazyLeafs shaped and sharded like
  `abstract_state`, without the parameters' values: every leaf must be a constant of the init
  (optax's moments and step counters are); one that depends on the parameters is a ValueError naming
  it. A broadcast constant is a `fill` leaf (the checkpoint holds its metadata and first chunk; the
  restore makes it by a jitted fill); any other constant leaf is built by jitting init_fn on zero
  parameters for that leaf alone (XLA drops the unused zeros) and written."""
  import jax
  import jax.numpy as jnp
  from jax.extend import core as jcore

  from moonshot_jax.train.checkpoint import LazyLeaf, filled
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
    if c is not None:  # written as metadata + one chunk: the restore fills it
      c = c.item() if hasattr(c, "item") else c
      out.append(LazyLeaf(tuple(a.shape), a.dtype, a.sharding,
                          functools.partial(filled, a.shape, jnp.dtype(a.dtype), c, a.sharding), fill=c))
    else:
      build = lambda i=i, s=a.sharding: jax.jit(lambda: jax.tree.leaves(init_fn(zeros()))[i], out_shardings=s)()
      out.append(LazyLeaf(tuple(a.shape), a.dtype, a.sharding, build))
  return jax.tree_util.tree_unflatten(treedef, out)


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
