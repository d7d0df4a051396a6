"""Checkpoints: an orbax CheckpointManager over WORKDIR/checkpoints, one step directory per save.

Items per step: "state" (the TrainState pytree: params, optimizer state, moe_state, step, RNG,
bad-step counter), "data" (the grain iterator's JSON state), "meta" (step, eval loss, a
per-leaf fingerprint of the state). Retention: the last `keep` steps plus the `keep_best` with
the lowest eval loss (orbax preservation policies). Saves are async: the device->host copy
happens inside `save`, the file writes in the background, so the caller may donate the state
right after.

Restore walks back from the newest step: a step that fails to load, or whose fingerprint does
not match what was saved, is reported and moved to WORKDIR/checkpoints_corrupt/ (never deleted)
and the previous one is tried. Half-written saves (killed mid-write) never become a step
directory: orbax writes into a temporary directory and renames it when complete. Restoring
takes the abstract target state with its shardings, so a checkpoint written under one mesh
loads resharded into another.

A state may hold `LazyLeaf`s (hub_checkpoint.run_import does): each is made only when orbax writes
it, one at a time. A leaf with `slabs` never exists whole: its slabs (one layer's / expert's
matrix, a constant fill) are written straight into its tensorstore array chunk by chunk, with a
bounded number of bytes in flight, so saving needs about one slab of host memory, not one leaf (nor a
device copy, a host copy and a transaction buffer of it, as orbax's own path holds). A leaf without
`slabs` is built whole and written by orbax, then dropped. Fingerprints are summed as leaves are
written; the "meta" item waits for them before it is written. A leaf with `fill` (the import's zero
optimizer state) writes its array metadata and one chunk (orbax's save check wants one); the meta lists it under "constant_leaves",
and restore builds exactly the listed leaves: any other leaf whose chunks are missing still fails
the restore (orbax refuses missing chunks), so a truncated step is caught as before.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from orbax.checkpoint._src.multihost import multihost
from orbax.checkpoint._src.serialization import jax_array_handlers, ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
from orbax.checkpoint.checkpoint_managers import preservation_policy as pp

from moonshot_jax.inference import hub_stream

log = logging.getLogger(__name__)

_FP_RTOL = 1e-4  # fingerprints are fp32 sums; a different mesh may reorder the reduction


def _abs_sum(x: jax.Array) -> jax.Array:
  return jnp.sum(jnp.abs(x.astype(jnp.float32)))


@jax.jit
def fingerprint(tree: Any) -> jax.Array:
  """[n_leaves] fp32: sum |x| per leaf (a cheap check that restored values are the saved ones)."""
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.zeros((0,), jnp.float32)
  return jnp.stack([_abs_sum(x) for x in leaves])


_leaf_fingerprint = jax.jit(_abs_sum)  # one leaf's entry of `fingerprint` (lazy leaves, partial restores)


Box = tuple[slice, ...]


@dataclasses.dataclass(frozen=True)
class LazyLeaf:
  """A state leaf made only when the checkpoint writes it (restoring gives back a plain jax.Array).

  `slabs(box)` (preferred): yields (sub_box, host array) pairs that tile `box` (global indices of one
  device's shard), each sub_box whole along every axis except `stack_axes`, where it may be one index
  (a layer, an expert): the leaf is written slab by slab and never built. A triple (sub_box, array,
  abs_sum) gives the slab's sum |x| when its maker knows it cheaper (MXFP4 experts: from the packed
  bytes); the fingerprint adds it instead of summing the slab (None: summed here). Otherwise `build()` returns
  the whole jax.Array of this shape, dtype and sharding. `written`: a resumed save finds this leaf
  already in the state's data (with this fingerprint) and writes only its metadata. `on_written(fp)`
  is told the leaf's fingerprint once its bytes are committed; `on_start(state_dir)` is called before
  the leaf is written; `on_error` when the save fails before this leaf."""
  shape: tuple[int, ...]
  dtype: Any
  sharding: Any
  build: Callable[[], jax.Array] | None = None
  on_error: Callable[[BaseException], None] | None = None
  slabs: Callable[[Box], Iterable[tuple[Box, np.ndarray]]] | None = None
  stack_axes: tuple[int, ...] = ()
  written: float | None = None
  on_written: Callable[[float], None] | None = None
  on_start: Callable[[Path], None] | None = None
  codec: str | None = None  # a slab leaf's chunk compressor (a key of CODECS); None: orbax's (zstd level 1)
  # Every element is `fill` (an optimizer's zero moments): the array's metadata and its first chunk are
  # written, nothing else; the step's meta lists the leaf ("constant_leaves") and `Checkpointer.restore` builds it.
  fill: float | int | None = None
  # Threads that make a slab leaf's chunks contiguous (transposes) and fingerprint them, several chunks at
  # once (the numpy copies and XLA calls release the GIL). 1: the writer's own thread, one chunk at a time.
  # 2 was not consistently faster on the 10 GB import under load (+6% / -28% wall, session 17): 1 unless asked.
  chunk_workers: int = 1


# Chunk compressors a slab leaf may be written with (zarr v2 "compressor"). The zarr metadata
# records it, so a restore reads any of them without being told. CPU s per GB written on the 2-core
# dev box (session 15, ratio in brackets): bf16 weights zstd 2.1 (1.28x), lz4 2.3 (1.13x), none 0.8;
# MXFP4 experts decoded to bf16 zstd 5.3 (2.9x), lz4 2.7 (1.44x), none 0.9.
CODECS: dict[str, dict | None] = {
    "zstd": {"id": "zstd", "level": 1},  # orbax's default
    "lz4": {"id": "blosc", "cname": "lz4", "clevel": 5, "shuffle": 1},
    "none": None,
}


_CHUNK_BYTES = 64 << 20  # chunk cap of slab-written leaves: what one write holds beyond its slab
# Chunks being made contiguous / fingerprinted plus chunks handed to tensorstore and not yet committed
# (its encoding and file writes run in its own threads).
_INFLIGHT_BYTES = 512 << 20
_LOOKAHEAD = True  # make a leaf's next slab (hub read, decode) in a worker thread while this one is written
_END = object()


def _one_ahead(items: Iterable) -> Iterable:
  """`items` in order, the next one made in a worker thread while the caller works on the current
  one: at most two alive (the caller drops its references before asking for the next). The reads
  and XLA calls that make a slab release the GIL, so this overlaps them with the chunk transposes
  and tensorstore's encoding on the other core."""
  it = iter(items)
  with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="slab") as ex:
    nxt = ex.submit(next, it, _END)
    while True:
      item = nxt.result()
      if item is _END:
        return
      nxt = ex.submit(next, it, _END)
      yield item
      del item


def _owned_boxes(sharding, shape) -> list[Box]:
  """Global index boxes this process writes: one per distinct shard, held by replica 0 (the first
  device in the sharding's order holding it), as orbax's replica_id == 0 rule."""
  seen, out = set(), []
  for dev, idx in sharding.devices_indices_map(tuple(shape)).items():
    idx = tuple(slice(*s.indices(n)[:2]) for s, n in zip(idx, shape))
    key = tuple((s.start, s.stop) for s in idx)
    if key in seen:
      continue
    seen.add(key)
    if dev.process_index == jax.process_index():
      out.append(idx)
  return out


def _chunk_boxes(box: Box, chunk: tuple[int, ...]) -> Iterable[Box]:
  """The chunk-grid boxes inside `box` (which is chunk-aligned)."""
  if any(s.start % c for s, c in zip(box, chunk)):
    raise AssertionError(f"slab {box} is not aligned to chunks {chunk}")
  ranges = [range(s.start, s.stop, c) for s, c in zip(box, chunk)]
  for starts in itertools.product(*ranges):
    yield tuple(slice(a, min(a + c, s.stop)) for a, c, s in zip(starts, chunk, box))


def _tiled_contiguous(x: np.ndarray) -> np.ndarray:
  """x as a C-contiguous array (a transposed view is copied by tiles: see hub_stream.copy_tiled)."""
  return x if x.flags.c_contiguous else hub_stream.copy_tiled(np.empty(x.shape, x.dtype), x)


@functools.partial(jax.jit, static_argnums=1)
def _permute_abs_sum(x: jax.Array, perm: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  return jnp.transpose(x, perm), _abs_sum(x)


# |x| as the bits of a float32: (unsigned view, sign-clearing mask, left shift into float32's bits).
# bfloat16 is float32's upper half, so the shift is exact.
_ABS_BITS = {np.dtype(jnp.bfloat16): (np.uint16, 0x7FFF, 16), np.dtype(np.float32): (np.uint32, 0x7FFFFFFF, 0)}


def _host_abs_sum(x: np.ndarray, chunk: int = 1 << 20) -> float:
  """`fingerprint`'s entry of a contiguous host array, on the host: per chunk the sign bits are
  cleared into a float32 buffer and summed (numpy's pairwise sum), chunks added in float64. One pass
  and no GIL held over a chunk, where XLA:CPU converts, takes |x| and sums in three (session 17: 1.5x
  less CPU on bf16). Other dtypes: the jitted sum."""
  bits = _ABS_BITS.get(x.dtype)
  flat = x.reshape(-1)
  if bits is None or not x.flags.c_contiguous:
    return float(_leaf_fingerprint(flat))
  u, mask, shift = bits
  flat, buf, total = flat.view(u), np.empty(min(chunk, flat.size), np.uint32), 0.0
  for i in range(0, flat.size, chunk):
    o = buf[:min(chunk, flat.size - i)]
    np.bitwise_and(flat[i:i + chunk], u(mask), out=o, casting="unsafe")
    if shift:
      np.left_shift(o, np.uint32(shift), out=o)
    total += float(np.add.reduce(o.view(np.float32)))
  return total


def _contiguous_abs_sum(x: np.ndarray) -> tuple[np.ndarray, float]:
  """(x as a C-contiguous array, sum |x| as `fingerprint` takes it). A permuted view of contiguous
  memory (a hub [out, in] matrix seen as our [in, out]) is summed on that memory and, for a matrix,
  copied by tiles (hub_stream.copy_tiled; with the host sum 0.7-1.0x the CPU of XLA's fused transpose +
  sum on a 176 MB bf16 matrix, session 17), else transposed by XLA in the same call that sums it (an
  expert slab [1, in, out]: XLA's was cheaper there); a view of no such memory is copied by tiles."""
  if not x.flags.c_contiguous:
    order = tuple(int(a) for a in np.argsort([-abs(st) for st in x.strides], kind="stable"))
    base = x.transpose(order)
    if base.flags.c_contiguous and all(st >= 0 for st in x.strides):
      if x.ndim == 2:
        return _tiled_contiguous(x), _host_abs_sum(base)
      y, v = _permute_abs_sum(base, tuple(int(a) for a in np.argsort(order)))
      return np.asarray(y), float(v)
    x = _tiled_contiguous(x)
  return x, _host_abs_sum(x)


class _LazyArrayHandler(jax_array_handlers.ArrayHandler):
  """Writes LazyLeafs one by one (orbax hands a handler all its values at once and would otherwise
  hold them all): slab leaves chunk by chunk straight into tensorstore, others built, written by
  orbax, waited for and dropped."""

  async def serialize(self, values, infos, args=None):
    args = args or [None] * len(values)
    try:
      for leaf, info, arg in zip(values, infos, args):
        await info.await_path_creation()
        if leaf.on_start is not None:
          leaf.on_start(Path(info.parent_dir.as_posix()))
        if leaf.slabs is not None or leaf.fill is not None:
          fp = await self._write_slabs(leaf, info, leaf.written is not None)
        else:
          x = leaf.build()
          if tuple(x.shape) != tuple(leaf.shape) or x.dtype != jnp.dtype(leaf.dtype):
            raise ValueError(f"checkpoint: lazy leaf {info.name} built {x.shape} {x.dtype}, "
                             f"declared {leaf.shape} {jnp.dtype(leaf.dtype)}")
          fp = float(_leaf_fingerprint(x))
          for f in await super().serialize([x], [info], None if arg is None else [arg]):
            await asyncio.to_thread(f.result)
          del x
        if leaf.on_written is not None:
          leaf.on_written(fp)
    except BaseException as e:  # whoever waits on the leaves (the meta item) must not wait forever
      for leaf in values:
        if leaf.on_error is not None:
          leaf.on_error(e)
      raise
    return []

  async def _write_slabs(self, leaf: LazyLeaf, info, metadata_only: bool) -> float:
    """Writes `leaf` from its slabs (or, metadata_only, only its metadata: a resumed save; or, for a
    `fill` leaf, its metadata and first chunk); returns its fingerprint (this process's share summed
    over all processes)."""
    dtype = np.dtype(jnp.dtype(leaf.dtype))
    boxes = _owned_boxes(leaf.sharding, leaf.shape)
    local = tuple(len(range(n)[s]) for n, s in zip(
        leaf.shape, next(iter(leaf.sharding.devices_indices_map(tuple(leaf.shape)).values()))))
    spec = ts_utils.build_array_write_spec(
        info=info, arg=ocp.SaveArgs(chunk_byte_size=_CHUNK_BYTES, shard_axes=tuple(leaf.stack_axes)),
        global_shape=tuple(leaf.shape), local_shape=local, dtype=dtype, use_ocdbt=info.is_ocdbt_checkpoint,
        process_index=ocdbt_utils.get_process_index_for_subdir(info.is_ocdbt_checkpoint),
        metadata_key=self._metadata_key)
    if leaf.codec is not None:
      spec = _with_codec(spec, leaf.codec, info.name)
    fp = leaf.written if metadata_only else 0.0
    if leaf.fill is not None:  # one chunk only: orbax's save-time check wants data in every array
      if multihost.is_primary_host(self._primary_host):
        t = await ts.open(ts.Spec(spec.json), create=True, open=True, context=info.ts_context)
        first = tuple(slice(0, min(c, n)) for c, n in zip(spec.metadata.chunk_shape, leaf.shape))
        await t[first].write(np.full(tuple(s.stop for s in first), leaf.fill, dtype))
      metadata_only, fp = True, _fill_fingerprint(leaf.fill, leaf.shape, dtype)
    elif not metadata_only:
      chunk = tuple(spec.metadata.chunk_shape)
      if multihost.is_primary_host(self._primary_host):
        await ts.open(ts.Spec(spec.json), create=True, open=True, context=info.ts_context)
      t = await ts.open(ts.Spec(spec.json), open=True, assume_metadata=True, context=info.ts_context)
      # In order: chunks being prepared (contiguous + fingerprint, a future of the chunk workers), then
      # chunks handed to tensorstore; `inflight` counts the bytes of both. A chunk is written in order
      # as soon as it is ready, so the slab it views is released once its last chunk is prepared.
      preparing: collections.deque = collections.deque()
      pending: collections.deque = collections.deque()
      inflight, filled = 0, {}
      workers = concurrent.futures.ThreadPoolExecutor(leaf.chunk_workers, thread_name_prefix="chunk") \
          if leaf.chunk_workers > 1 else None

      async def write_ready():  # hands the oldest prepared chunk to tensorstore
        nonlocal fp
        cb, ready, n = preparing.popleft()
        part, v = await asyncio.wrap_future(ready) if isinstance(ready, concurrent.futures.Future) else ready
        fp += v
        pending.append((t[cb].write(part, can_reference_source_data_indefinitely=True), n))

      async def make_room():  # keeps what is prepared or uncommitted within the budget (at least one chunk)
        nonlocal inflight
        while inflight > _INFLIGHT_BYTES and (preparing or pending):
          if pending:
            f, n = pending.popleft()
            await f
            inflight -= n
          else:
            await write_ready()

      try:
        for box in boxes:
          for slab in (_one_ahead if _LOOKAHEAD else iter)(leaf.slabs(box)):
            sub, x, known = slab if len(slab) == 3 else (*slab, None)
            want = tuple(s.stop - s.start for s in sub)
            if tuple(x.shape) != want or x.dtype != dtype:
              raise ValueError(f"checkpoint: lazy leaf {info.name} slab {sub} is {x.shape} {x.dtype}, "
                               f"expected {want} {dtype}")
            if known is not None:
              fp += float(known)
            for cb in _chunk_boxes(sub, chunk):
              part = np.asarray(x[tuple(slice(c.start - s.start, c.stop - s.start) for c, s in zip(cb, sub))])
              if part.size and all(st == 0 for st in part.strides):  # a broadcast constant
                key = (part.shape, part.reshape(-1)[:1].tobytes())  # one filled chunk serves them all
                if key not in filled:
                  filled[key] = np.array(part, order="C")  # (ascontiguousarray would make 0-d 1-d)
                ready = (filled[key], 0.0 if known is not None else float(abs(np.float64(part.reshape(-1)[0]))) * part.size)
              elif not part.size:
                ready = (part, 0.0)
              elif known is not None:  # only made contiguous: the slab's sum is in fp already
                ready = (_tiled_contiguous(part), 0.0)
              elif workers is not None:
                ready = workers.submit(_contiguous_abs_sum, part)
              else:
                ready = _contiguous_abs_sum(part)
              preparing.append((cb, ready, part.nbytes))
              inflight += part.nbytes
              while preparing and not isinstance(preparing[0][1], concurrent.futures.Future) \
                  or preparing and preparing[0][1].done():
                await write_ready()
              await make_room()
            slab = x = part = ready = None  # nothing of this slab is held while the next one is made
        while preparing:
          await write_ready()
        while pending:
          await pending.popleft()[0]
      finally:  # an interrupted save: let what was handed to tensorstore finish before unwinding
        for _, ready, _ in preparing:
          if isinstance(ready, concurrent.futures.Future):
            ready.cancel()
        if workers is not None:
          workers.shutdown(wait=True)
        for f, _ in pending:
          try:
            await f
          except Exception:  # the original error is the one to report
            pass
    if jax.process_count() > 1 and not metadata_only:  # (a fill leaf's fp is already global)
      from jax.experimental import multihost_utils
      fp = float(np.sum(multihost_utils.process_allgather(np.float64(fp))))
    if self._enable_write_sharding_file:
      await jax_array_handlers._async_serialize_shardings(shardings=[leaf.sharding], infos=[info],
                                                          primary_host=self._primary_host)
    if self._array_metadata_store is not None:
      await self._array_metadata_store.write(checkpoint_dir=info.parent_dir, array_metadatas=[spec.metadata],
                                             process_index=multihost.process_index())
    return fp


def _fill_fingerprint(fill, shape, dtype) -> float:
  """`fingerprint`'s entry of a leaf whose every element is `fill` (as stored: cast to `dtype`)."""
  return float(abs(np.asarray(fill, dtype).astype(np.float64))) * float(np.prod(shape, dtype=np.float64))


@functools.cache
def _fill_fn(shape, dtype, value, sharding):
  return jax.jit(lambda: jnp.full(shape, value, dtype), out_shardings=sharding)


def filled(shape, dtype, value, sharding) -> jax.Array:
  """A jax.Array of `shape` / `dtype` / `sharding` whose every element is `value` (a jitted fill:
  each device makes its own shard, nothing is copied from the host)."""
  return _fill_fn(tuple(shape), jnp.dtype(dtype), value, sharding)()


def _with_codec(spec, codec: str, name: str):
  """orbax's write spec with the chunk compressor `codec` (zarr v2 only) in both the zarr metadata
  and orbax's array metadata record."""
  if codec not in CODECS:
    raise ValueError(f"checkpoint: leaf {name}: unknown codec {codec!r} (one of {sorted(CODECS)})")
  tspec = spec.json
  base = tspec["base"] if tspec.get("driver") == "cast" else tspec
  if base.get("driver") != ts_utils.ZARR_VER2:
    raise ValueError(f"checkpoint: leaf {name}: a codec is only set on zarr v2 arrays (got {base.get('driver')})")
  c = base["metadata"]["compressor"] = CODECS[codec]
  spec._metadata = dataclasses.replace(  # what orbax logs as the array's compression
      spec.metadata, compression_algorithm="none" if c is None else c.get("cname", c["id"]),
      compression_level=None if c is None else c.get("level", c.get("clevel")))
  return spec


class _MetaHandler(ocp.JsonCheckpointHandler):
  """JSON whose "fingerprint" may be a Future (lazy leaves): written once it resolves."""

  async def async_save(self, directory, item=None, args=None):
    item = dict(args.item if args is not None else item)
    if isinstance(item.get("fingerprint"), concurrent.futures.Future):
      item["fingerprint"] = await asyncio.to_thread(item["fingerprint"].result)
    return await super().async_save(directory, args=ocp.args.JsonSave(item=item))


@ocp.args.register_with_handler(_MetaHandler, for_save=True)
@dataclasses.dataclass
class _MetaSave(ocp.args.JsonSave):
  pass


@ocp.args.register_with_handler(_MetaHandler, for_restore=True)
@dataclasses.dataclass
class _MetaRestore(ocp.args.JsonRestore):
  pass


def _fingerprints(state: Any) -> Any:
  """The fingerprint list of `state`, or a Future of it when it holds LazyLeafs (each one's
  on_written is wrapped to record its fingerprint; returns (future, state with wrapped leaves))."""
  leaves, treedef = jax.tree.flatten(state)
  lazy = [i for i, x in enumerate(leaves) if isinstance(x, LazyLeaf)]
  eager = [i for i, x in enumerate(leaves) if not isinstance(x, LazyLeaf)]
  fp = [None] * len(leaves)
  for i, v in zip(eager, np.asarray(jax.device_get(fingerprint([leaves[i] for i in eager])), np.float64).tolist()):
    fp[i] = v
  if not lazy:
    return fp, state
  done: concurrent.futures.Future = concurrent.futures.Future()
  left = set(lazy)

  def fail(e):
    if not done.done():
      done.set_exception(e)

  def wrap(i, leaf):
    def written(v):
      if leaf.on_written is not None:
        leaf.on_written(v)
      fp[i] = v
      left.discard(i)
      if not left:
        done.set_result(fp)

    def error(e):
      if leaf.on_error is not None:
        leaf.on_error(e)
      fail(e)
    return dataclasses.replace(leaf, on_written=written, on_error=error)

  for i in lazy:
    leaves[i] = wrap(i, leaves[i])
  return done, jax.tree.unflatten(treedef, leaves)


def _key_names(kpath) -> tuple[str, ...]:
  """A leaf's path as strings, the same for the live state and orbax's saved metadata tree
  (which holds namedtuples as dicts and tuples as lists)."""
  return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in kpath)


def leaf_specs(tree: Any) -> dict[tuple[str, ...], tuple[tuple[int, ...], str]]:
  return {_key_names(k): (tuple(v.shape), str(v.dtype)) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _with_constants(restored: Any, abstract: Any, constants: Mapping[str, Any]) -> Any:
  """`restored` with its constant leaves (PLACEHOLDER) made from `constants` as `abstract` says."""
  if not constants:
    return restored
  flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  got = jax.tree.leaves(restored, is_leaf=lambda x: x is ocp.PLACEHOLDER)
  return jax.tree_util.tree_unflatten(treedef, [
      filled(a.shape, a.dtype, constants["/".join(_key_names(k))], a.sharding) if x is ocp.PLACEHOLDER else x
      for (k, a), x in zip(flat, got)])


def _nested_dicts(items: Iterable[tuple[tuple[str, ...], Any]]) -> dict:
  """[(names, leaf)] -> the nested dicts holding exactly those leaves."""
  out: dict = {}
  for names, leaf in items:
    d = out
    for n in names[:-1]:
      d = d.setdefault(n, {})
    d[names[-1]] = leaf
  return out


class CorruptCheckpoint(RuntimeError):
  """A step that cannot be trusted; restore_latest moves it aside and tries the previous one."""


class CheckpointMismatch(ValueError):
  """A readable step whose state has other leaves / shapes than the target: the config changed.
  Never treated as corruption (nothing is moved): the caller must fix the config or workdir."""


def _type_handlers() -> Any:
  """orbax's standard handlers, except that a replicated jax.Array is written whole by one
  replica: "replica-parallel" saving slices it per device first, one tiny jit compile per
  (shape, device) -- hundreds of compiles on a first save, for no gain at these sizes."""
  th = ocp.type_handlers
  return th.create_type_handler_registry(
      (int, th.ScalarHandler()), (float, th.ScalarHandler()), (bytes, th.ScalarHandler()),
      (np.number, th.ScalarHandler()), (np.ndarray, th.NumpyHandler()),
      (jax.Array, th.ArrayHandler(use_replica_parallel=False)), (str, th.StringHandler()),
      (LazyLeaf, _LazyArrayHandler(use_replica_parallel=False)))


class Checkpointer:
  """Save / restore-latest-good of (state, data-iterator state, eval loss) for one run."""

  def __init__(self, directory: str | Path, *, keep: int = 3, keep_best: int = 1, async_save: bool = True):
    if keep < 1:
      raise ValueError(f"checkpoint.keep: must be >= 1 (got {keep})")
    if keep_best < 0:
      raise ValueError(f"checkpoint.keep_best: must be >= 0 (got {keep_best})")
    self.directory = Path(directory).absolute()
    self.corrupt_dir = self.directory.parent / (self.directory.name + "_corrupt")
    policies: list[pp.PreservationPolicy] = [pp.LatestN(n=keep)]
    if keep_best > 0:
      policies.append(pp.BestN(get_metric_fn=lambda m: m["eval_loss"], reverse=True, n=keep_best,
                               keep_checkpoints_without_metrics=False))
    options = ocp.CheckpointManagerOptions(
        preservation_policy=pp.AnyPreservationPolicy(policies), enable_async_checkpointing=async_save,
        create=True, cleanup_tmp_directories=False)
    handlers = {"state": ocp.PyTreeCheckpointHandler(type_handler_registry=_type_handlers()),
                "data": ocp.JsonCheckpointHandler(), "meta": _MetaHandler()}
    self._mgr = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

  # -- saving ----------------------------------------------------------------------------------
  def save(self, step: int, state: Any, data_state: Mapping[str, Any] | None = None,
           eval_loss: float | None = None, extra: Mapping[str, Any] | None = None) -> bool:
    fp, state = _fingerprints(state)
    meta = {"step": int(step), "eval_loss": eval_loss, "fingerprint": fp, "time": time.time()}
    constants = {"/".join(_key_names(k)): x.fill for k, x in jax.tree_util.tree_flatten_with_path(state)[0]
                 if isinstance(x, LazyLeaf) and x.fill is not None}
    if constants:  # one chunk written each: the restore builds them (and only them)
      meta["constant_leaves"] = constants
    meta.update(dict(extra or {}))
    metrics = None if eval_loss is None or not np.isfinite(eval_loss) else {"eval_loss": float(eval_loss)}
    return self._mgr.save(int(step), args=ocp.args.Composite(
        state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(dict(data_state or {})),
        meta=_MetaSave(meta)), metrics=metrics, force=True)

  def wait(self) -> None:
    self._mgr.wait_until_finished()

  def close(self) -> None:
    self._mgr.wait_until_finished()
    self._mgr.close()

  # -- restoring -------------------------------------------------------------------------------
  def steps(self) -> list[int]:
    self._mgr.reload()
    return sorted(self._mgr.all_steps())

  def array_codecs(self, step: int) -> dict[str, str]:
    """{array name: chunk compressor} of `step`'s state as its zarr metadata records it -- what a
    restore decodes ("zstd", "blosc-lz4", "none"; the import chooses per leaf, training saves zstd)."""
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{self.directory / str(step) / 'state'}"}).result()
    out = {}
    for key in kv.list().result():
      name = key.decode()
      if name.endswith("/.zarray"):
        c = json.loads(kv.read(key).result().value).get("compressor")
        out[name[:-len("/.zarray")]] = "none" if c is None else (
            f"blosc-{c['cname']}" if c["id"] == "blosc" else c["id"])
    return out

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict, dict]:
    """(state, data_state, meta) of `step`; raises CorruptCheckpoint when it cannot be trusted,
    CheckpointMismatch when it holds a differently shaped state."""
    saved, meta = self._metadata(step)
    want = leaf_specs(abstract_state)
    if saved != want:  # paths too: an optimizer chain of other shape is a config change, not corruption
      only_saved = ["/".join(k) + f" {saved[k]}" for k in saved if want.get(k) != saved[k]]
      only_want = ["/".join(k) + f" {want[k]}" for k in want if saved.get(k) != want[k]]
      raise CheckpointMismatch(
          f"checkpoint step {step} under {self.directory} holds {len(saved)} arrays that do not match "
          f"the {len(want)} of this config's train state (model / optimizer changed?): only in the "
          f"checkpoint {only_saved[:4]}, only in this config {only_want[:4]}. Use a new workdir or the "
          f"config that wrote it; nothing was modified.")
    item, constants = self._without_constants(step, meta, abstract_state, strict=True)
    try:
      out = self._mgr.restore(step, args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(item=item,
                                       restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state)),
          data=ocp.args.JsonRestore()))
      state, data_state = _with_constants(out["state"], abstract_state, constants), out["data"]
      want = np.asarray(meta["fingerprint"], np.float64)
      got = np.asarray(jax.device_get(fingerprint(state)), np.float64)
    except Exception as e:  # orbax / tensorstore raise many types for bad files
      msg = str(e) if len(str(e)) < 300 else str(e)[:300] + "..."
      raise CorruptCheckpoint(f"checkpoint step {step} under {self.directory} failed to load: "
                              f"{type(e).__name__}: {msg}") from e
    if want.shape != got.shape or not np.allclose(got, want, rtol=_FP_RTOL, atol=1e-6):
      bad = np.flatnonzero(~np.isclose(got, want, rtol=_FP_RTOL, atol=1e-6)) if want.shape == got.shape else []
      raise CorruptCheckpoint(f"checkpoint step {step} under {self.directory}: restored values do not "
                              f"match the saved fingerprint (leaves {list(bad)[:8]})")
    return state, data_state, meta

  def restore_subset(self, step: int, subset: Mapping[str, Any], abstract_state: Any, exact: bool = False) -> dict:
    """Some leaves of the state saved at `step`, restored alone (no other leaf is read): `subset`
    mirrors the state's fields as nested dicts of abstract arrays with their shardings, e.g.
    {"params": {...}, "moe_state": {...}} with any leaves left out. Each leaf is checked against the
    saved shape and dtype (CheckpointMismatch) and its saved fingerprint (CorruptCheckpoint).
    exact: `subset`'s top-level fields must hold all of the saved leaves under them, no more and no
    fewer (another model's params), else CheckpointMismatch naming the first leaves that differ.
    abstract_state may also be a function of the saved leaves ({path: (shape, dtype)}, as saved_leaves)
    returning it, for a layout that depends on what was saved (another run's optimizer leaf count): the
    step's metadata is then read once."""
    names = _key_names
    saved, meta = self._metadata(step)
    if callable(abstract_state):
      abstract_state = abstract_state(saved)
    index = {names(k): i for i, (k, _) in enumerate(jax.tree_util.tree_flatten_with_path(abstract_state)[0])}
    flat = jax.tree_util.tree_flatten_with_path(subset)[0]
    if exact:
      want = {names(k): (tuple(a.shape), str(jnp.dtype(a.dtype))) for k, a in flat}
      have = {k: v for k, v in saved.items() if k[0] in subset}
      diff = sorted("/".join(k) + f" checkpoint {have.get(k)} vs this config {want.get(k)}"
                    for k in set(have) | set(want) if have.get(k) != want.get(k))
      if diff:
        raise CheckpointMismatch(f"checkpoint step {step} under {self.directory}: {len(diff)} leaves of "
                                 f"{sorted(subset)} differ from this config's: {diff[:3]}")
    for k, a in flat:
      want = (tuple(a.shape), str(jnp.dtype(a.dtype)))
      if saved.get(names(k)) != want or names(k) not in index:
        raise CheckpointMismatch(f"checkpoint step {step} under {self.directory}: {'/'.join(names(k))} is "
                                 f"{saved.get(names(k))} there, this config wants {want}")
    _, constants = self._without_constants(step, meta, subset, strict=False)
    # a partial restore reads every leaf of its item, PLACEHOLDER or not: constants are left out of it
    item = _nested_dicts([(names(k), a) for k, a in flat if "/".join(names(k)) not in constants]) if constants else subset
    try:
      out = self._mgr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
          item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
          partial_restore=True)))["state"] if jax.tree.leaves(item) else {}
      if constants:
        out = jax.tree_util.tree_unflatten(jax.tree.structure(subset), [
            filled(a.shape, a.dtype, constants["/".join(names(k))], a.sharding) if "/".join(names(k)) in constants
            else functools.reduce(lambda d, n: d[n], names(k), out) for k, a in flat])
      got = jax.tree_util.tree_flatten_with_path(out)[0]
      fp = [float(_leaf_fingerprint(x)) for _, x in got]
    except Exception as e:
      raise CorruptCheckpoint(f"checkpoint step {step} under {self.directory} failed to load: "
                              f"{type(e).__name__}: {str(e)[:300]}") from e
    want_fp = np.asarray(meta["fingerprint"], np.float64)
    for (k, _), v in zip(got, fp):
      w = want_fp[index[names(k)]]
      if not np.isclose(v, w, rtol=_FP_RTOL, atol=1e-6):
        raise CorruptCheckpoint(f"checkpoint step {step} under {self.directory}: {'/'.join(names(k))} does not "
                                f"match its saved fingerprint ({v} vs {w})")
    return out

  def saved_leaves(self, step: int) -> dict[tuple[str, ...], tuple[tuple[int, ...], str]]:
    """{leaf path: (shape, dtype)} of the state saved at `step`, from its metadata (no array is read)."""
    return self._metadata(step)[0]

  def _metadata(self, step: int) -> tuple[dict, dict]:
    """(saved leaf specs, meta item) of `step`; CorruptCheckpoint when they cannot be read."""
    try:
      saved = leaf_specs(self._mgr.item_metadata(step)["state"])
      meta = self._mgr.restore(step, args=ocp.args.Composite(meta=_MetaRestore()))["meta"]
    except Exception as e:  # unreadable metadata: corrupt
      raise CorruptCheckpoint(f"checkpoint step {step} under {self.directory}: unreadable metadata "
                              f"({type(e).__name__}: {str(e)[:300]})") from e
    return saved, meta

  def _without_constants(self, step: int, meta: dict, tree: Any, strict: bool) -> tuple[Any, dict]:
    """(`tree` with orbax's PLACEHOLDER at the leaves that `step`'s meta lists as constants -- not
    read: they hold one chunk --, {path: value} of those in `tree`). strict: every listed leaf must
    be in `tree` (the whole state), else the step is corrupt. Any other leaf is read, so one whose
    chunks are missing fails the restore as before."""
    constants = meta.get("constant_leaves") or {}
    if not constants:
      return tree, {}
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    here = {"/".join(_key_names(k)) for k, _ in flat}
    if strict and not set(constants) <= here:
      raise CorruptCheckpoint(f"checkpoint step {step} under {self.directory}: its meta lists constant leaves "
                              f"{sorted(set(constants) - here)[:4]} that its state does not hold")
    item = [ocp.PLACEHOLDER if "/".join(_key_names(k)) in constants else a for k, a in flat]
    return jax.tree_util.tree_unflatten(treedef, item), {n: v for n, v in constants.items() if n in here}

  def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict, dict] | None:
    """Newest restorable (step, state, data_state, meta), or None when there is no checkpoint.
    Unrestorable newer steps are reported and moved aside."""
    for step in reversed(self.steps()):
      try:
        state, data_state, meta = self.restore(step, abstract_state)
        return step, state, data_state, meta
      except CorruptCheckpoint as e:
        dest = self._quarantine(step)
        log.error("%s -- moved to %s; falling back to the previous checkpoint", e, dest)
        print(f"[checkpoint] WARNING: {e}\n[checkpoint] moved to {dest}; trying the previous one", flush=True)
    return None

  def _quarantine(self, step: int) -> Path:
    src = self.directory / str(step)
    self.corrupt_dir.mkdir(parents=True, exist_ok=True)
    dest = self.corrupt_dir / f"{step}-{int(time.time() * 1000)}"
    shutil.move(str(src), str(dest))
    self._mgr.reload()
    return dest
