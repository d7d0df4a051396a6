"""launch/import_checkpoint: a tiny K3 hub checkpoint -> an orbax train state that the training
loop's restore and launch.generate's loader accept as is; resume after an interrupted import;
export back to the hub layout and re-import, bit for bit; a used workdir is refused."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest

pytest.importorskip("safetensors")

from moonshot_jax.inference import hub_checkpoint as import_checkpoint  # noqa: E402
from moonshot_jax import experiment  # noqa: E402
from moonshot_jax.config import ConfigError  # noqa: E402
from moonshot_jax.inference import hf_k3, hub_stream  # noqa: E402
from moonshot_jax.inference.load import load_latest  # noqa: E402
from moonshot_jax.train.checkpoint import Checkpointer  # noqa: E402
from moonshot_jax.train.loop import build  # noqa: E402
from tests.test_hf_k3 import TEXT, TOP, VISION, synthetic_k3, write_checkpoint  # noqa: E402


def _cfg(**model):
  cfg = experiment.base_config()
  for k, v in dict(hf_k3.architecture(TEXT), **model).items():
    cfg.model[k] = v
  cfg.data.tokenizer = "byte"
  cfg.train.steps, cfg.optimizer.warmup_steps = 2, 1
  cfg.mesh.expert = 2  # experts sharded over 2 of the 8 test devices: the import places them so
  return experiment.finalize(cfg)


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory):
  tensors = synthetic_k3(np.random.default_rng(0))
  return write_checkpoint(tmp_path_factory.mktemp("k3_hub"), tensors)


def test_import_restore_export_round_trip(hub_dir, tmp_path):
  """Imported with codec lz4 (params / moe_state): restores equal to the model read straight from the
  hub; the arrays' zarr metadata says lz4. The optimizer state (tx.init's zeros) is written as array
  metadata without a chunk, listed in the step's meta, and made by the restore."""
  cfg = _cfg()
  work = tmp_path / "run"
  out = import_checkpoint.run_import(cfg, hub_dir, work, progress=False, codec="lz4")
  assert out["skipped"] == {"vision": 2, "mtp": 1} and out["codec"] == "lz4"
  rec = json.loads((work / "hf_import.json").read_text())
  assert rec["vision_config"] == VISION and rec["experts_mxfp4"] and rec["codec"]["params, moe_state"] == "lz4"
  codecs = Checkpointer(work / "checkpoints", async_save=False).array_codecs(0)
  assert {c for k, c in codecs.items() if k.startswith(("params.", "moe_state."))} == {"blosc-lz4"}
  from tests.test_checkpoint import _chunk_keys
  chunks = _chunk_keys(work / "checkpoints" / "0")
  opt = {k for k in chunks if k.startswith("opt_state.")}
  # one chunk per optimizer array (orbax's save-time check wants one), the params written whole
  assert opt and all(chunks[k] == 1 for k in opt)
  assert all(chunks[k] > 0 for k in chunks if k.startswith("params."))
  assert not (work / "import_cache").exists() and not (work / "import_progress").exists()
  # what the training loop restores (same abstract state, same shardings), values as imported
  trainer = build(cfg)
  ckpt = Checkpointer(work / "checkpoints", async_save=False)
  step, state, data_state, meta = ckpt.restore_latest(trainer.setup.abstract)
  ckpt.close()
  assert step == 0 and data_state == {} and int(state.step) == 0
  listed = meta["constant_leaves"]
  assert {k.replace("/", ".") for k in listed} == opt, (sorted(listed)[:3], sorted(opt)[:3])
  direct = hub_stream.load_variables(hub_stream.HubDir(hub_dir), trainer.model_cfg, progress=False)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(direct["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert all(float(np.abs(np.asarray(x)).max()) == 0 for x in jax.tree.leaves(state.opt_state)
             if np.asarray(x).dtype.kind == "f")
  # launch.generate's loader: params + moe_state only; with experts_mxfp4 packed leaf by leaf as
  # restored, equal to packing the restored experts afterwards
  loaded = load_latest(cfg, work, with_tokenizer=False)
  assert loaded.step == 0 and set(loaded.variables) == {"params", "moe_state"}
  from moonshot_jax.inference import mxfp4_experts
  want, rep = mxfp4_experts.quantize_experts(loaded.variables, loaded.cfg)
  packed = load_latest(cfg, work, with_tokenizer=False, experts_mxfp4=True)
  assert packed.mxfp4_report == rep and rep["max_requant_error"] == 0.0
  boxes = lambda t: jax.tree.leaves(t, is_leaf=lambda x: isinstance(x, mxfp4_experts.MXFP4Experts))
  for a, b in zip(boxes(packed.variables), boxes(want)):
    assert type(a) is type(b)
    for x, y in ((a.packed, b.packed), (a.scales, b.scales)) if isinstance(a, mxfp4_experts.MXFP4Experts) else ((a, b),):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # export, re-import into a fresh run: identical params
  exp = import_checkpoint.run_export(cfg, work, tmp_path / "hub_out", max_shard_bytes=60_000, progress=False)
  assert exp["files"] > 1 and exp["step"] == 0
  work2 = tmp_path / "run2"
  import_checkpoint.run_import(cfg, tmp_path / "hub_out", work2, progress=False)
  again = load_latest(cfg, work2, with_tokenizer=False)
  for a, b in zip(jax.tree.leaves(again.variables), jax.tree.leaves(loaded.variables)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="already holds steps"):
    import_checkpoint.run_import(cfg, hub_dir, work, progress=False)


def test_lazy_optimizer_state_is_the_init_or_an_error_naming_the_leaf():
  """The streamed import's optimizer state: tx.init's constants, built leaf by leaf without the
  parameters (equal to tx.init on real ones); a state that depends on the parameters is refused."""
  import jax.numpy as jnp
  import optax
  from moonshot_jax.train.checkpoint import LazyLeaf
  sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  params = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones((4,))}
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), params)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, b1=0.9))
  abstract_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                jax.eval_shape(tx.init, params))
  lazy = import_checkpoint.lazy_initial_state(tx.init, abstract, abstract_state)
  leaves = jax.tree.leaves(lazy)
  assert leaves and all(isinstance(x, LazyLeaf) for x in leaves)
  for got, want in zip(leaves, jax.tree.leaves(tx.init(params))):
    x = got.build()
    assert x.dtype == want.dtype and x.sharding == sh
    np.testing.assert_array_equal(np.asarray(x), np.asarray(want))
  ema = lambda p: {"ema": jax.tree.map(lambda x: 0.5 * x, p), "count": jnp.zeros((), jnp.int32)}
  ema_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), jax.eval_shape(ema, params))
  with pytest.raises(ValueError, match=r"\['ema'\]\['b'\] depends on the parameters"):
    import_checkpoint.lazy_initial_state(ema, abstract, ema_state)


def test_config_mismatch_and_resume(hub_dir, tmp_path):
  with pytest.raises(ConfigError, match="expert_ff_dim: checkpoint 32"):
    import_checkpoint.run_import(_cfg(expert_ff_dim=64), hub_dir, tmp_path / "bad", progress=False)
  # an import interrupted after some slices were read resumes from the cache without re-reading them
  cfg = _cfg()
  work = tmp_path / "resume"
  hub = hub_stream.HubDir(hub_dir)
  trainer = build(cfg)
  sh = {"params": trainer.setup.shardings.params, "moe_state": trainer.setup.shardings.moe_state}
  calls = {"n": 0}
  orig = hub.read

  def failing(name):
    calls["n"] += 1
    if calls["n"] > 40:
      raise KeyboardInterrupt("simulated interruption")
    return orig(name)

  hub.read = failing
  with pytest.raises(KeyboardInterrupt):
    hub_stream.load_variables(hub, trainer.model_cfg, sh, cache_dir=work / "import_cache", progress=False)
  cached = len(list((work / "import_cache").glob("*.npy")))
  assert cached > 0 and not list((work / "import_cache").glob("*.tmp.npy"))
  hub.read, before = orig, hub.bytes_read
  got = hub_stream.load_variables(hub, trainer.model_cfg, sh, cache_dir=work / "import_cache", progress=False)
  full = hub_stream.load_variables(hub_stream.HubDir(hub_dir), trainer.model_cfg, progress=False)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(full)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert hub.bytes_read - before < hub_stream.validate(hub, trainer.model_cfg)["bytes"]  # cached slices not re-read


def test_interrupted_import_resumes_without_rereading(hub_dir, tmp_path, monkeypatch):
  """run_import killed part way (after orbax has started writing the step) leaves no step behind
  and no second copy of what it read (only a record of the leaves it wrote); the rerun into the same
  workdir keeps those leaves, reading fewer hub tensors, and holds the same state as an
  uninterrupted import."""
  cfg = _cfg()
  orig, calls = hub_stream.HubDir.read, {"n": 0, "limit": None}

  def counting(self, name):
    calls["n"] += 1
    if calls["limit"] is not None and calls["n"] > calls["limit"]:
      raise KeyboardInterrupt("simulated interruption")
    return orig(self, name)

  monkeypatch.setattr(hub_stream.HubDir, "read", counting)
  hub_bytes = import_checkpoint.run_import(cfg, hub_dir, tmp_path / "clean", progress=False)["bytes"]
  full_reads = calls["n"]
  calls.update(n=0, limit=full_reads // 2)
  work = tmp_path / "run"
  with pytest.raises(KeyboardInterrupt):
    import_checkpoint.run_import(cfg, hub_dir, work, progress=False)
  assert not Checkpointer(work / "checkpoints", async_save=False).steps()
  outside = sum(p.stat().st_size for p in work.rglob("*") if p.is_file() and "checkpoints" not in p.relative_to(work).parts)
  assert outside < 0.05 * hub_bytes, f"{outside} bytes kept outside the checkpoint for resuming"
  assert len((work / "import_progress" / "0.jsonl").read_text().splitlines()) > 1  # key + written leaves
  calls.update(n=0, limit=None)
  import_checkpoint.run_import(cfg, hub_dir, work, progress=False)
  assert 0 < calls["n"] < full_reads  # the slices cached before the interruption are not read again
  a = load_latest(cfg, work, with_tokenizer=False).variables
  b = load_latest(cfg, tmp_path / "clean", with_tokenizer=False).variables
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_hub_reads_leave_no_mapping_behind(hub_dir):
  """HubDir.read hands out a plain array and keeps no memory map of the shard: a mapping's touched
  pages would count towards the import's RSS on top of the array, up to a whole shard."""
  hub = hub_stream.HubDir(hub_dir)
  name = max(hub.tensors, key=lambda n: np.prod(hub.tensors[n][1]))
  x = hub.read(name)
  shard = str((hub.dir / hub.tensors[name][0]).resolve())
  maps = open("/proc/self/maps").read()
  hub.close()
  assert x.shape == hub.tensors[name][1] and x.flags.owndata
  assert shard not in maps, f"{shard} is mapped after read"


@pytest.mark.slow  # compiles the tiny K3 train step (~30 s; measured in the ckpt log)
def test_training_continues_from_an_import(tmp_path):
  """launch.train's loop (`loop.train`, what `python -m launch.train` runs) in an imported workdir:
  it restores step 0 as imported -- the first step sees exactly the hub's weights (read straight from
  the hub here) and the zero optimizer state the restore made --, trains two steps and saves an
  ordinary step 2 (every leaf written, no constant leaves) whose weights moved from the hub's.
  The hub's vocabulary is widened to 260 rows: the byte tokenizer has 259 ids."""
  from moonshot_jax.train import loop
  tensors = synthetic_k3(np.random.default_rng(2))
  rng, V = np.random.default_rng(3), 260
  for name, scale in (("language_model.model.embed_tokens.weight", 1.0), ("language_model.lm_head.weight", 0.2)):
    tensors[name] = (scale * rng.normal(size=(V, TEXT["hidden_size"]))).astype(tensors[name].dtype)
  text = dict(TEXT, vocab_size=V)
  hub = write_checkpoint(tmp_path / "hub", tensors, config=dict(TOP, text_config=text))
  cfg = experiment.base_config()
  for k, v in hf_k3.architecture(text).items():
    cfg.model[k] = v
  cfg.data.tokenizer = "byte"
  cfg.train.steps, cfg.optimizer.warmup_steps, cfg.checkpoint.every_steps = 2, 1, 2
  cfg.logging.progress_bar = False
  cfg.mesh.expert = 2
  cfg = experiment.finalize(cfg)
  work = tmp_path / "run"
  import_checkpoint.run_import(cfg, hub, work, progress=False)
  direct = hub_stream.load_variables(hub_stream.HubDir(hub), build(cfg).model_cfg, progress=False)
  seen = {}

  def before_step(step, state):
    if step == 1:  # what the loop restored, before any update
      seen["params"] = [np.asarray(x) for x in jax.tree.leaves(state.params)]
      seen["opt"] = [np.asarray(x) for x in jax.tree.leaves(state.opt_state)]
      seen["moe_state"] = [np.asarray(x) for x in jax.tree.leaves(state.moe_state)]
    return state

  summary = loop.train(cfg, work, hooks=loop.Hooks(before_step=before_step))
  assert summary["start_step"] == 0 and summary["final_step"] == 2 and np.isfinite(summary["final_loss"])
  assert len(seen["params"]) == len(jax.tree.leaves(direct["params"]))
  for a, b in zip(seen["params"], jax.tree.leaves(direct["params"])):
    np.testing.assert_array_equal(a, np.asarray(b))
  for a, b in zip(seen["moe_state"], jax.tree.leaves(direct["moe_state"])):
    np.testing.assert_array_equal(a, np.asarray(b))
  assert seen["opt"] and all(not np.any(x) for x in seen["opt"] if x.dtype.kind == "f")
  ckpt = Checkpointer(work / "checkpoints", async_save=False)
  step, state, _, meta = ckpt.restore_latest(build(cfg).setup.abstract)
  ckpt.close()
  assert step == 2 and int(state.step) == 2 and "constant_leaves" not in meta
  moved = [float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())
           for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(direct["params"]))]
  assert max(moved) > 0 and all(np.isfinite(moved))


def test_finite_check_on_the_bits():
  """hub_stream._all_finite (run on every bf16 / f16 hub tensor as it is read): inf, -inf and NaN
  anywhere, including past the first chunk, are caught; the largest finite values and -0 are not."""
  import ml_dtypes
  for dtype, big in ((ml_dtypes.bfloat16, 3.3895314e38), (np.float16, 65504.0)):
    ok = np.array([0.0, -0.0, big, -big, 1e-3], dtype)
    assert hub_stream._all_finite(ok, chunk=2)
    for bad in (np.inf, -np.inf, np.nan):
      x = np.zeros(7, dtype)
      x[5] = bad
      assert not hub_stream._all_finite(x, chunk=2), (dtype, bad)


def _find_once(files, data: bytes):
  """(file, offset) of the one place in `files` holding `data`."""
  hits = [(f, f.read_bytes().find(data)) for f in files]
  hits = [(f, o) for f, o in hits if o >= 0]
  assert len(hits) == 1, f"{len(hits)} data files hold the bytes"
  return hits[0]


@pytest.mark.slow  # an import and three restores: 28 s under load (ckpt log, session 18)
def test_expert_fingerprints_from_the_packed_bytes_still_catch_damage(hub_dir, tmp_path):
  """The MXFP4 experts' fingerprint is summed from the packed bytes and scales
  (mxfp4.dequantize_np_t), not from the decoded values: it equals sum |x| of each restored expert
  leaf, and a restore still refuses one expert value changed on disk, or one expert's bytes swapped
  with another leaf's (codec none: the chunks are the raw values), as CorruptCheckpoint naming the
  fingerprint."""
  from moonshot_jax.train.checkpoint import CorruptCheckpoint
  cfg = _cfg()
  work = tmp_path / "run"
  import_checkpoint.run_import(cfg, hub_dir, work, progress=False, codec="none")
  abstract = build(cfg).setup.abstract
  ckpt = Checkpointer(work / "checkpoints", async_save=False)
  state, _, meta = ckpt.restore(0, abstract)
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  experts = {jax.tree_util.keystr(k): (i, np.asarray(x)) for i, (k, x) in enumerate(flat)
             if jax.tree_util.keystr(k).endswith(("['moe']['w_gate']", "['moe']['w_up']", "['moe']['w_down']"))}
  assert len(experts) >= 3 and all(x.ndim >= 3 for _, x in experts.values())
  for name, (i, x) in experts.items():  # fp32 sum on the restore, float64 here: 1e-9 says exact
    np.testing.assert_allclose(meta["fingerprint"][i], np.abs(x.astype(np.float64)).sum(), rtol=1e-9, err_msg=name)
  files = list((work / "checkpoints" / "0").glob("state/**/d/*"))
  gate = next(x for n, (_, x) in experts.items() if n.endswith("['w_gate']"))
  up = next(x for n, (_, x) in experts.items() if n.endswith("['w_up']") and x.shape == gate.shape)
  g = gate.reshape((-1,) + gate.shape[-2:])[0]  # the first expert's [in, out] matrix
  u = up.reshape((-1,) + up.shape[-2:])[0]
  (f, o), (f2, o2) = _find_once(files, g.tobytes()), _find_once(files, u.tobytes())
  clean = {p: p.read_bytes() for p in {f, f2}}

  def damaged(edit):
    for p, b in clean.items():
      p.write_bytes(b)
    edit()
    with pytest.raises(CorruptCheckpoint, match="fingerprint"):
      ckpt.restore(0, abstract)

  def changed():  # its largest value times 2^10
    k = int(np.argmax(np.abs(g.astype(np.float64))))
    b = bytearray(f.read_bytes())
    b[o + k * g.itemsize:o + (k + 1) * g.itemsize] = (g.reshape(-1)[k:k + 1].astype(np.float32) * 1024).astype(g.dtype).tobytes()
    f.write_bytes(bytes(b))

  def swapped():  # the first expert's gate and up matrices trade places
    for p, off, data in ((f, o, u.tobytes()), (f2, o2, g.tobytes())):
      b = bytearray(p.read_bytes())
      b[off:off + len(data)] = data
      p.write_bytes(bytes(b))

  damaged(changed)
  damaged(swapped)
  ckpt.close()
