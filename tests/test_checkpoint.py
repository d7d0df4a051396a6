"""Checkpointer (moonshot_jax/train/checkpoint.py): retention, resharding restore, corrupt fallback."""
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from moonshot_jax.train.checkpoint import Checkpointer, CorruptCheckpoint


def _mesh(**sizes):
  from moonshot_jax.parallel.mesh import make_mesh
  return make_mesh(sizes)


def _state(mesh, seed):
  """A TrainState-shaped tree: sharded matrices, a replicated vector, int scalars, uint32 key data."""
  r = np.random.default_rng(seed)
  put = lambda x, spec: jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))
  return {"params": {"w": put(r.standard_normal((16, 8)).astype(np.float32), P("data", None)),
                     "b": put(r.standard_normal((8,)).astype(np.float32), P())},
          "moe_state": {"bias": put(r.standard_normal((4,)).astype(np.float32), P())},
          "step": put(np.int32(seed), P()), "rng": put(r.integers(0, 2 ** 32, (2,), dtype=np.uint32), P())}


def _abstract(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _target(mesh, like):
  sh = {"params": {"w": NamedSharding(mesh, P("tensor", "data")), "b": NamedSharding(mesh, P("tensor"))},
        "moe_state": {"bias": NamedSharding(mesh, P())}, "step": NamedSharding(mesh, P()),
        "rng": NamedSharding(mesh, P())}
  return _abstract(like, sh), sh


def _equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _corrupt_arrays(step_dir: Path) -> int:
  n = 0
  for f in step_dir.glob("state/**/d/*"):
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0xFF
    f.write_bytes(bytes(b))
    n += 1
  return n


@pytest.fixture
def frozen_heap():
  """For tests that gc.collect() per leaf / slab to count what is alive: the objects that exist before
  the test go to gc's permanent generation, so a collect walks only what the test made. In a CI worker
  that ran the compile-heavy files first, one full collect took seconds (48 s for 16 slabs, session 22)."""
  import gc
  gc.freeze()
  yield
  gc.unfreeze()


@pytest.fixture
def saved(tmp_path):
  """Five async saves on a data=8 mesh: eval losses None, 3, None, 5, 6; keep 2 + best 1."""
  mesh = _mesh(data=8)
  ck = Checkpointer(tmp_path / "checkpoints", keep=2, keep_best=1, async_save=True)
  states = {}
  for s, ev in zip(range(1, 6), (None, 3.0, None, 5.0, 6.0)):
    states[s] = _state(mesh, s)
    ck.save(s, states[s], {"pos": s, "epoch": 0}, eval_loss=ev)
  ck.close()
  return tmp_path, states


def test_retention_and_resharded_restore(saved):
  tmp_path, states = saved
  ck = Checkpointer(tmp_path / "checkpoints", keep=2, keep_best=1)
  assert ck.steps() == [2, 4, 5]  # last 2, plus the best eval loss (step 2)
  other = _mesh(data=2, tensor=4)  # a different mesh: restore reshards
  abstract, sh = _target(other, states[5])
  step, state, data_state, meta = ck.restore_latest(abstract)
  assert step == 5 and data_state == {"pos": 5, "epoch": 0} and meta["eval_loss"] == 6.0
  _equal(state, states[5])
  for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(sh)):
    assert x.sharding == s
  best, _, _ = ck.restore(2, abstract)
  _equal(best, states[2])
  ck.close()


def test_corrupt_latest_falls_back_and_is_kept(saved, capsys):
  tmp_path, states = saved
  assert _corrupt_arrays(tmp_path / "checkpoints" / "5") > 0
  ck = Checkpointer(tmp_path / "checkpoints", keep=2, keep_best=1)
  abstract, _ = _target(_mesh(data=8), states[5])
  step, state, data_state, _ = ck.restore_latest(abstract)
  assert step == 4 and data_state["pos"] == 4
  _equal(state, states[4])
  assert "checkpoint step 5" in capsys.readouterr().out
  moved = list((tmp_path / "checkpoints_corrupt").iterdir())
  assert len(moved) == 1 and moved[0].name.startswith("5-") and any(moved[0].rglob("*"))  # not deleted
  assert ck.steps() == [2, 4]
  ck.save(5, states[5], {"pos": 5})  # the step number is free again for the resumed run
  ck.wait()
  _equal(ck.restore(5, abstract)[0], states[5])
  ck.close()


def test_fingerprint_mismatch_is_corrupt(saved):
  tmp_path, states = saved
  meta_file = tmp_path / "checkpoints" / "5" / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  meta["fingerprint"][0] *= 1.5  # as if the arrays on disk were not the ones saved
  meta_file.write_text(json.dumps(meta))
  ck = Checkpointer(tmp_path / "checkpoints", keep=2, keep_best=1)
  abstract, _ = _target(_mesh(data=8), states[5])
  with pytest.raises(CorruptCheckpoint, match="fingerprint"):
    ck.restore(5, abstract)
  assert ck.restore_latest(abstract)[0] == 4
  ck.close()


def test_half_written_save_is_ignored(saved):
  tmp_path, states = saved
  tmp = tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp-1234"  # a save killed mid-write
  (tmp / "state").mkdir(parents=True)
  (tmp / "state" / "junk").write_bytes(os.urandom(64))
  ck = Checkpointer(tmp_path / "checkpoints", keep=2, keep_best=1)
  abstract, _ = _target(_mesh(data=8), states[5])
  assert ck.steps() == [2, 4, 5]
  assert ck.restore_latest(abstract)[0] == 5
  assert tmp.exists()  # left alone
  ck.close()


def test_async_save_survives_donation(tmp_path):
  """save() copies to host before returning: donating the state right after cannot change it."""
  mesh = _mesh(data=8)
  st = _state(mesh, 7)
  want = jax.device_get(st)
  shardings = jax.tree.map(lambda x: x.sharding, st)
  ck = Checkpointer(tmp_path / "ck", keep=1, keep_best=0, async_save=True)
  ck.save(7, st, {})
  clobber = jax.jit(lambda t: jax.tree.map(lambda x: x * 0 + 1, t), donate_argnums=0)
  jax.block_until_ready(clobber(st))
  ck.wait()
  abstract = _abstract(want, shardings)
  _equal(ck.restore(7, abstract)[0], want)
  ck.close()


def test_bad_arguments():
  with pytest.raises(ValueError, match="checkpoint.keep"):
    Checkpointer("/tmp/unused_ck_dir_for_test", keep=0)


def test_changed_config_is_a_mismatch_not_corruption(saved):
  """A restore target with other shapes (the config changed) is an error; nothing is moved."""
  from moonshot_jax.train.checkpoint import CheckpointMismatch
  tmp_path, states = saved
  mesh = _mesh(data=8)
  other = dict(states[5], params={"w": jnp.zeros((16, 4)), "b": states[5]["params"]["b"]})
  abstract, _ = _target(mesh, other)
  ck = Checkpointer(tmp_path / "checkpoints", keep=2, keep_best=1)
  with pytest.raises(CheckpointMismatch, match="step 5"):
    ck.restore_latest(abstract)
  assert ck.steps() == [2, 4, 5] and not (tmp_path / "checkpoints_corrupt").exists()
  ck.close()


def test_same_shapes_in_another_tree_is_a_mismatch_not_corruption(saved):
  """Every array the same shape and dtype but under other paths (an optimizer chain that gained or lost
  a stage nests its state one level deeper): a config change, named, with every step left in place --
  as corruption it would move each step aside and the run would start again from step 0."""
  from moonshot_jax.train.checkpoint import CheckpointMismatch
  tmp_path, states = saved
  mesh = _mesh(data=8)
  abstract, _ = _target(mesh, states[5])
  nested = dict(abstract, params={"0": abstract["params"]})
  ck = Checkpointer(tmp_path / "checkpoints", keep=2, keep_best=1)
  with pytest.raises(CheckpointMismatch, match=r"only in this config \[.params/0/"):
    ck.restore_latest(nested)
  assert ck.steps() == [2, 4, 5] and not (tmp_path / "checkpoints_corrupt").exists()
  _equal(ck.restore_latest(abstract)[1], states[5])
  ck.close()


def test_lazy_leaves_are_built_one_at_a_time_and_restore(tmp_path, frozen_heap):
  """LazyLeafs (the streamed import): each is built only when written and released before the next
  is built (at most one alive), the meta fingerprint covers them, and the step restores as usual,
  whole or as a subset (restore_subset reads only the leaves asked for)."""
  import gc
  import weakref

  from moonshot_jax.train.checkpoint import LazyLeaf
  mesh = _mesh(data=4, tensor=2)
  full = _state(mesh, 3)
  full["params"]["v"] = jax.device_put(jnp.arange(64, dtype=jnp.float32).reshape(8, 8),
                                       NamedSharding(mesh, P("data", None)))
  alive, most = [], [0]

  def lazy(x):
    def build():
      gc.collect()
      alive[:] = [r for r in alive if r() is not None]
      y = x + 0  # a new array each call (the leaf's only owner is the writer)
      alive.append(weakref.ref(y))
      most[0] = max(most[0], len(alive))
      return y
    return LazyLeaf(x.shape, x.dtype, x.sharding, build)

  state = dict(full, params={k: lazy(v) for k, v in full["params"].items()})
  ck = Checkpointer(tmp_path / "ck", async_save=False)
  ck.save(0, state, data_state={})
  ck.wait()
  assert most[0] == 1, f"{most[0]} lazy leaves alive at once"
  shardings = jax.tree.map(lambda x: x.sharding, full)
  got, _, meta = ck.restore(0, _abstract(full, shardings))
  assert all(isinstance(v, float) for v in meta["fingerprint"])
  jax.tree.map(np.testing.assert_array_equal, got, full)
  sub = ck.restore_subset(0, {"params": {"v": _abstract(full, shardings)["params"]["v"]}}, _abstract(full, shardings))
  assert list(sub) == ["params"] and list(sub["params"]) == ["v"]
  np.testing.assert_array_equal(sub["params"]["v"], full["params"]["v"])
  ck.close()


def test_a_failing_lazy_leaf_fails_the_save_without_a_step(tmp_path):
  """A lazy leaf that builds the wrong shape fails the save (in a bounded time) with an error naming
  what it built, and leaves no step."""
  import threading

  from moonshot_jax.train.checkpoint import LazyLeaf
  mesh = _mesh(data=8)
  full = _state(mesh, 4)
  w = full["params"]["w"]
  bad = LazyLeaf((16, 4), w.dtype, w.sharding, lambda: w)
  ck = Checkpointer(tmp_path / "ck", async_save=False)
  err = []

  def save():
    try:
      ck.save(0, dict(full, params=dict(full["params"], w=bad)), data_state={})
      ck.wait()
    except Exception as e:  # noqa: BLE001 -- the test inspects it
      err.append(e)

  t = threading.Thread(target=save, daemon=True)
  t.start()
  t.join(120)
  assert not t.is_alive(), "the save hung"
  assert err and "built (16, 8)" in str(err[0]) + str(getattr(err[0], "__cause__", ""))
  assert ck.steps() == []


def test_slab_leaves_are_written_slab_by_slab_never_built(tmp_path, monkeypatch, frozen_heap):
  """A LazyLeaf with `slabs` (the import's path) is never built whole: each distinct shard this
  process holds is asked for once (replicas skipped), one stacked index at a time, made one ahead in
  the writer's worker thread, at most two slabs alive with the in-flight budget at its minimum; a
  broadcast constant fills a leaf; the step restores equal, with its fingerprints checked."""
  import gc
  import threading
  import weakref

  from moonshot_jax.train import checkpoint as ck_lib
  from moonshot_jax.train.checkpoint import LazyLeaf
  monkeypatch.setattr(ck_lib, "_INFLIGHT_BYTES", 1)  # wait for each chunk before the next slab
  mesh = _mesh(data=2, tensor=2, expert=2)  # P("data", "tensor"): 4 shards, each held by 2 devices
  full = _state(mesh, 5)
  sh = NamedSharding(mesh, P("data", "tensor"))
  stack = np.random.default_rng(0).standard_normal((8, 6, 8)).astype(np.float32)  # 4 slabs per shard
  asked, alive, most, threads = [], [], [0], set()

  def never():
    raise AssertionError("a slab leaf was built whole")

  def slabs(box):
    asked.append(tuple((s.start, s.stop) for s in box))
    for i in range(box[0].start, box[0].stop):
      threads.add(threading.current_thread().name.split("_")[0])
      gc.collect()
      alive[:] = [r for r in alive if r() is not None]
      y = stack[i:i + 1, box[1], box[2]].copy()
      alive.append(weakref.ref(y))
      most[0] = max(most[0], len(alive))
      yield (slice(i, i + 1), box[1], box[2]), y
      del y

  zeros = np.zeros((), np.float32)
  state = dict(full, params=dict(full["params"], s=LazyLeaf((8, 6, 8), jnp.float32, sh, never, slabs=slabs,
                                                              stack_axes=(0,)),
                                 z=LazyLeaf((6, 8), jnp.float32, sh, never,
                                            slabs=lambda box: [(box, np.broadcast_to(zeros + 2.5, (3, 4)))])))
  ck = Checkpointer(tmp_path / "ck", async_save=False)
  ck.save(0, state, data_state={})
  ck.wait()
  assert sorted(asked) == [((0, 4), (0, 3), (0, 8)), ((0, 4), (3, 6), (0, 8)), ((4, 8), (0, 3), (0, 8)),
                           ((4, 8), (3, 6), (0, 8))], asked  # tensor splits axis 1: 4 distinct shards
  assert most[0] <= 2, f"{most[0]} slabs alive at once"
  assert threads == {"slab"}, threads  # made by the look-ahead worker, not the writer's own thread
  want = dict(full, params=dict(full["params"], s=jax.device_put(stack, sh),
                                z=jax.device_put(np.full((6, 8), 2.5, np.float32), sh)))
  shardings = jax.tree.map(lambda x: x.sharding, want)
  got, _, _ = ck.restore(0, _abstract(want, shardings))  # raises CorruptCheckpoint on a fingerprint mismatch
  jax.tree.map(np.testing.assert_array_equal, got, want)
  ck.close()


def test_slab_codecs_are_recorded_and_restore(tmp_path):
  """A slab leaf's `codec` is the compressor its zarr metadata records (what restore decodes; the
  default stays orbax's zstd), each restores equal with its fingerprint checked. An unknown codec
  is an error naming the leaf."""
  from moonshot_jax.train.checkpoint import LazyLeaf
  mesh = _mesh(data=2, tensor=2, expert=2)
  full = _state(mesh, 6)
  sh = NamedSharding(mesh, P("data", "tensor"))
  r = np.random.default_rng(3)
  vals = {k: r.standard_normal((4, 6)).astype(np.float32) for k in "abcd"}

  def leaf(k, codec=None):
    def slabs(box):
      yield box, vals[k][box]
    return LazyLeaf((4, 6), jnp.float32, sh, None, slabs=slabs, codec=codec)

  want = dict(full, params=dict(full["params"], **{k: jax.device_put(v, sh) for k, v in vals.items()}))
  abstract = _abstract(want, jax.tree.map(lambda x: x.sharding, want))
  ck = Checkpointer(tmp_path / "ck", async_save=False)
  ck.save(0, dict(full, params=dict(full["params"], a=leaf("a", "lz4"), b=leaf("b", "none"), c=leaf("c"),
                                    d=leaf("d", "zstd"))), data_state={})
  ck.wait()
  codecs = ck.array_codecs(0)
  assert {k: codecs[f"params.{k}"] for k in "abcd"} == {"a": "blosc-lz4", "b": "none", "c": "zstd", "d": "zstd"}
  assert codecs["params.w"] == "zstd"  # a plain jax.Array: orbax's own path, untouched
  got, _, _ = ck.restore(0, abstract)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  with pytest.raises(Exception) as e:
    ck.save(2, dict(full, params=dict(full["params"], a=leaf("a", "lzma"))), data_state={})
    ck.wait()
  assert "leaf params.a: unknown codec 'lzma'" in str(e.value) + str(e.value.__cause__), e.value
  ck.close()


def test_slab_writer_drops_each_slab_before_asking_for_the_next(tmp_path, monkeypatch, frozen_heap):
  """Without the look-ahead the slabs are made on the writer's own thread: the writer must let go of
  slab i (and its chunks: the in-flight budget is at its minimum) before it asks for slab i+1, so
  exactly one slab is alive at a time."""
  import gc
  import weakref

  from moonshot_jax.train import checkpoint as ck_lib
  from moonshot_jax.train.checkpoint import LazyLeaf
  monkeypatch.setattr(ck_lib, "_INFLIGHT_BYTES", 1)
  monkeypatch.setattr(ck_lib, "_LOOKAHEAD", False)
  mesh = _mesh(data=8)
  full = _state(mesh, 7)
  stack = np.random.default_rng(1).standard_normal((6, 4, 8)).astype(np.float32)
  alive, most = [], [0]

  def slabs(box):
    for i in range(box[0].start, box[0].stop):
      gc.collect()
      alive[:] = [r for r in alive if r() is not None]
      y = stack[i:i + 1].copy()
      alive.append(weakref.ref(y))
      most[0] = max(most[0], len(alive))
      yield (slice(i, i + 1), box[1], box[2]), y
      del y

  rep = NamedSharding(mesh, P())
  state = dict(full, params=dict(full["params"], s=LazyLeaf((6, 4, 8), jnp.float32, rep, None, slabs=slabs,
                                                              stack_axes=(0,))))
  ck = Checkpointer(tmp_path / "ck", async_save=False)
  ck.save(0, state, data_state={})
  ck.wait()
  assert most[0] == 1, f"{most[0]} slabs alive at once"
  want = dict(full, params=dict(full["params"], s=jax.device_put(stack, rep)))
  got, _, _ = ck.restore(0, _abstract(want, jax.tree.map(lambda x: x.sharding, want)))
  jax.tree.map(np.testing.assert_array_equal, got, want)
  ck.close()


def _with_constants(tmp_path, monkeypatch):
  """Step 0 holds two constant (`fill`) leaves -- an optimizer's zero moments and a counter, as the
  import writes them -- beside ordinary ones; returns (directory, the state they stand for, shardings).
  Chunks of 32 bytes: the moments span 8 chunks, of which a fill leaf writes one."""
  from moonshot_jax.train import checkpoint as ck_lib
  from moonshot_jax.train.checkpoint import LazyLeaf
  monkeypatch.setattr(ck_lib, "_CHUNK_BYTES", 32)
  mesh = _mesh(data=8)
  full = _state(mesh, 8)
  sh, rep = NamedSharding(mesh, P("data", None)), NamedSharding(mesh, P())
  state = dict(full, opt={"mu": LazyLeaf((16, 8), jnp.bfloat16, sh, fill=0.0),
                          "count": LazyLeaf((), jnp.int32, rep, fill=3)})
  want = dict(full, opt={"mu": jax.device_put(jnp.zeros((16, 8), jnp.bfloat16), sh),
                         "count": jax.device_put(jnp.int32(3), rep)})
  ck = Checkpointer(tmp_path / "ck", async_save=False)
  ck.save(0, state, data_state={"pos": 0})
  ck.close()
  return tmp_path / "ck", want, jax.tree.map(lambda x: x.sharding, want)


def _chunk_keys(step_dir: Path) -> dict[str, int]:
  """{array: number of chunk keys} in a step's OCDBT state database."""
  import tensorstore as ts
  kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{step_dir / 'state'}"}).result()
  out: dict[str, int] = {}
  for k in kv.list().result():
    name, _, last = k.decode().rpartition("/")
    out[name] = out.get(name, 0) + (not last.startswith("."))
  return out


def test_constant_leaves_are_metadata_only_and_built_at_restore(tmp_path, monkeypatch):
  """A `fill` LazyLeaf writes its array metadata and no chunk; the step's meta lists it; restore
  and restore_subset build it (values, dtype, sharding), fingerprints checked. A later save of real
  arrays is an ordinary step again."""
  d, want, shardings = _with_constants(tmp_path, monkeypatch)
  chunks = _chunk_keys(d / "0")
  assert chunks["opt.mu"] == 1 and chunks["opt.count"] == 1 and chunks["params.w"] > 1, chunks
  ck = Checkpointer(d, async_save=False)
  state, data_state, meta = ck.restore(0, _abstract(want, shardings))
  assert meta["constant_leaves"] == {"opt/mu": 0.0, "opt/count": 3} and data_state == {"pos": 0}
  jax.tree.map(np.testing.assert_array_equal, state, want)
  for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(shardings)):
    assert x.sharding == s
  assert state["opt"]["mu"].dtype == jnp.bfloat16
  sub = ck.restore_subset(0, {"opt": {"count": _abstract(want, shardings)["opt"]["count"]},
                              "params": {"b": _abstract(want, shardings)["params"]["b"]}}, _abstract(want, shardings))
  assert int(sub["opt"]["count"]) == 3
  np.testing.assert_array_equal(sub["params"]["b"], want["params"]["b"])
  ck.save(1, state, data_state={"pos": 1})  # what training saves next: every leaf written
  ck.wait()
  _, _, meta1 = ck.restore(1, _abstract(want, shardings))
  assert "constant_leaves" not in meta1 and _chunk_keys(d / "1")["opt.mu"] > 1
  ck.close()


@pytest.mark.parametrize("damage", ["unmarked", "unknown_leaf", "other_value", "truncated"])
def test_constant_leaves_do_not_hide_a_damaged_step(tmp_path, monkeypatch, damage):
  """Only the leaves the meta lists are built: without that mark a chunk-less array is a corrupt
  step (as a truncated one is); a mark naming a leaf the state lacks, or a value other than the
  saved one (fingerprint), is corrupt; a truncated data file is still caught. Each time the restore
  falls back to the previous good step."""
  d, want, shardings = _with_constants(tmp_path, monkeypatch)
  ck = Checkpointer(d, async_save=False)
  ck.save(1, want, data_state={"pos": 1})  # a good later step to damage; step 0 is the fallback
  ck.close()
  meta_file = d / "1" / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  if damage == "truncated":
    files = list((d / "1").glob("state/**/d/*"))
    assert files
    for f in files:
      f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
  else:  # step 1's arrays are all written: make its meta say what an import's would
    meta["constant_leaves"] = {"unmarked": {}, "unknown_leaf": {"opt/mu": 0.0, "opt/nu": 0.0},
                               "other_value": {"opt/mu": 0.0, "opt/count": 4}}[damage]
    meta_file.write_text(json.dumps(meta))
    if damage == "unmarked":  # step 0 (chunk-less constants) without its mark: move it to step 1
      import shutil
      shutil.rmtree(d / "1")
      shutil.copytree(d / "0", d / "1")
      meta = json.loads((d / "1" / "meta" / "metadata").read_text())
      del meta["constant_leaves"]
      (d / "1" / "meta" / "metadata").write_text(json.dumps(dict(meta, step=1)))
  ck = Checkpointer(d, async_save=False)
  match = {"unmarked": "failed to load", "unknown_leaf": r"constant leaves \['opt/nu'\]",
           "other_value": "fingerprint", "truncated": "unreadable metadata|failed to load"}[damage]
  with pytest.raises(CorruptCheckpoint, match=match):
    ck.restore(1, _abstract(want, shardings))
  step, state, _, _ = ck.restore_latest(_abstract(want, shardings))
  assert step == 0
  jax.tree.map(np.testing.assert_array_equal, state, want)
  ck.close()


def test_host_fingerprint_and_tiled_copies_are_exact():
  """The writer's host-side pieces: `_host_abs_sum` is `fingerprint`'s entry (bf16 / f32, signs and
  chunk edges included; other dtypes fall back to the jitted sum); `_contiguous_abs_sum` gives the
  bytes of the view, contiguous, for a transposed matrix, a permuted 3-D view and a sliced transpose."""
  import ml_dtypes

  from moonshot_jax.train import checkpoint as ck_lib
  rng = np.random.default_rng(0)
  for dtype in (ml_dtypes.bfloat16, np.float32, np.float16):
    a = (rng.standard_normal((300, 517)) * 3).astype(dtype)
    want = float(ck_lib._leaf_fingerprint(a.reshape(-1)))
    assert abs(ck_lib._host_abs_sum(a, chunk=1000) - want) <= 1e-5 * want, dtype
    for x in (a, a.T, a[:, 3:200].T, a.reshape(300, 11, 47).transpose(2, 0, 1)):
      y, v = ck_lib._contiguous_abs_sum(x)
      assert y.flags.c_contiguous and y.dtype == x.dtype and y.shape == x.shape
      assert np.ascontiguousarray(x).view(np.uint8).tobytes() == y.view(np.uint8).tobytes()
      w = float(ck_lib._leaf_fingerprint(np.ascontiguousarray(x).reshape(-1)))
      assert abs(v - w) <= 1e-5 * w, (dtype, x.shape)


def test_chunks_are_prepared_by_two_worker_threads_and_written_in_order(tmp_path, monkeypatch):
  """A slab leaf with chunk_workers=2 and room in the in-flight budget: two of its chunks are made
  contiguous and fingerprinted at once, on the writer's chunk threads (not its own); the step restores equal."""
  import threading
  import time as time_lib

  from moonshot_jax.train import checkpoint as ck_lib
  from moonshot_jax.train.checkpoint import LazyLeaf
  monkeypatch.setattr(ck_lib, "_CHUNK_BYTES", 128)  # [1, 8, 8] float32 slabs: 2 chunks each
  orig, lock, now, most, names = ck_lib._contiguous_abs_sum, threading.Lock(), [0], [0], set()

  def slow(x):
    with lock:
      now[0] += 1
      most[0] = max(most[0], now[0])
      names.add(threading.current_thread().name.split("_")[0])
    time_lib.sleep(0.05)  # long enough for a second chunk to be handed out meanwhile
    with lock:
      now[0] -= 1
    return orig(x)

  monkeypatch.setattr(ck_lib, "_contiguous_abs_sum", slow)
  mesh = _mesh(data=8)
  full = _state(mesh, 3)
  stack = np.random.default_rng(2).standard_normal((4, 8, 8)).astype(np.float32)
  rep = NamedSharding(mesh, P())
  stack_t = np.ascontiguousarray(stack.transpose(0, 2, 1))
  slabs = lambda box: (((slice(i, i + 1), box[1], box[2]), stack_t[i:i + 1].transpose(0, 2, 1))
                       for i in range(box[0].start, box[0].stop))  # transposed views: made contiguous
  state = dict(full, params=dict(full["params"], s=LazyLeaf((4, 8, 8), jnp.float32, rep, None, slabs=slabs,
                                                              stack_axes=(0,), chunk_workers=2)))
  ck = Checkpointer(tmp_path / "ck", async_save=False)
  ck.save(0, state, data_state={})
  ck.wait()
  assert names == {"chunk"} and most[0] == 2, (names, most)
  want = dict(full, params=dict(full["params"], s=jax.device_put(stack, rep)))
  got, _, _ = ck.restore(0, _abstract(want, jax.tree.map(lambda x: x.sharding, want)))
  jax.tree.map(np.testing.assert_array_equal, got, want)
  ck.close()
