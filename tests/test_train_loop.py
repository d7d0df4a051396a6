"""End-to-end training on experiments/tiny.py: loss falls, checkpoints, metrics, exact resume after
kill -9, corrupt-checkpoint fallback, NaN guard, gradient accumulation, config errors.

Training runs in subprocesses (this file is also their driver: `python tests/test_train_loop.py
MODE WORKDIR OVERRIDES_JSON`) sharing one persistent compilation cache, so the train step compiles
once for the whole module; they use XLA:CPU's -O0 backend (same flags for every run, so bitwise
comparisons stay valid) because compile time dominates at this model size.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8
BASE = {"train.steps": STEPS, "train.log_every": 1, "train.eval_every": 4, "checkpoint.every_steps": 4,
        "logging.tensorboard": False, "logging.progress_bar": False}


# ---------------------------------------------------------------------------------------------
# Driver (runs in the subprocess)
# ---------------------------------------------------------------------------------------------
def _config(overrides: dict):
  import importlib.util
  spec = importlib.util.spec_from_file_location("tiny", ROOT / "experiments" / "tiny.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  cfg = mod.get_config()
  for key, value in overrides.items():  # through the locked ConfigDict: typos fail loudly
    section, name = key.split(".")
    cfg[section][name] = value
  return cfg


def _host(tree):
  import jax
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def _same(a, b) -> bool:
  return len(a) == len(b) and all(np.array_equal(x, y, equal_nan=True) for x, y in zip(a, b))


def _driver(mode: str, workdir: str, overrides: dict) -> None:
  import jax
  import jax.numpy as jnp
  jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
  jax.config.update("jax_compilation_cache_dir", os.environ["MOONSHOT_TEST_JAX_CACHE"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  from moonshot_jax.train import loop

  cfg = _config(overrides)
  out: dict = {}
  hooks = loop.Hooks()
  if mode == "pause":  # stop responding after step `pause_after` and wait to be killed
    pause = int(os.environ["MOONSHOT_TEST_PAUSE_AFTER"])

    def after(step, m):
      if step == pause:
        Path(workdir, "PAUSED").write_text(str(step))
        time.sleep(3600)
    hooks.after_step = after
  elif mode == "nan":  # poison one parameter at `poison_at`; record the state around the bad steps
    poison_at = int(os.environ["MOONSHOT_TEST_POISON_AT"])
    seen = {}

    def before(step, state):
      if step == poison_at:
        p = dict(state.params)
        p["final_norm"] = {"scale": state.params["final_norm"]["scale"].at[0].set(jnp.nan)}
        state = state.replace(params=p)
        seen["poisoned"] = _host((state.params, state.opt_state, state.moe_state))
      elif step > poison_at:
        out[f"unchanged_before_{step}"] = _same(seen["poisoned"],
                                                _host((state.params, state.opt_state, state.moe_state)))
      return state
    hooks.before_step = before
  elif mode == "nan_update":  # corrupt Adam's second moment: finite grads, non-finite update
    poison_at = int(os.environ["MOONSHOT_TEST_POISON_AT"])

    def before(step, state):
      if step == poison_at:
        from moonshot_jax.train.optim import path_str
        hits = []

        def corrupt(path, x):
          if path_str(path).endswith("/nu/final_norm/scale"):
            hits.append(path_str(path))
            return -jnp.ones_like(x)
          return x
        state = state.replace(opt_state=jax.tree_util.tree_map_with_path(corrupt, state.opt_state))
        assert len(hits) == 1, hits
      return state
    hooks.before_step = before
  elif mode == "gradacc":
    out.update(_grad_accumulation(cfg))
    Path(workdir, "result.json").write_text(json.dumps(out))
    return
  summary = loop.train(cfg, workdir, hooks=hooks)
  if mode == "nan":
    st = summary["state"]
    out["unchanged_final"] = _same(seen["poisoned"], _host((st.params, st.opt_state, st.moe_state)))
    out["bad_steps"] = int(st.bad_steps)
  out.update({k: summary.get(k) for k in ("start_step", "final_step", "final_loss", "eval_loss",
                                          "last_checkpoint", "stopped", "sample")})
  Path(workdir, "result.json").write_text(json.dumps(out))


def _grad_accumulation(cfg) -> dict:
  """Gradients of one [8, 64] batch in 1 vs 4 microbatches, rows with different token counts."""
  import jax
  from moonshot_jax.train import loop, state as state_lib, step as step_lib

  tr = loop.build(cfg)
  st = state_lib.create_train_state(tr.setup, tr.init_fn, 0)
  b, t = int(cfg.data.batch_size), int(cfg.data.seq_len)
  r = np.random.default_rng(3)
  tok = r.integers(3, 259, (b, t + 1), dtype=np.int32)
  seg = np.ones((b, t), np.int32)
  for row in range(b):  # row r: its last 6*r positions are padding
    if row:
      seg[row, t - 6 * row:] = 0
  batch = dict(tokens=tok[:, :-1], targets=tok[:, 1:], segment_ids=seg,
               positions=np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
               loss_mask=(seg > 0).astype(np.int32) * (r.random((b, t)) < 0.9))
  gb = loop.to_global(batch, tr.mesh)
  res = {}
  for m in (1, 4):
    fn = jax.jit(lambda p, s, bb, m=m: step_lib.loss_and_grads(tr.model.apply, tr.model_cfg, p, s, bb, m, tr.mesh))
    res[m] = jax.device_get(fn(st.params, st.moe_state, gb))
  from grad_testutil import assert_grads_close
  g1 = jax.tree.leaves(res[1][0])
  # per leaf against its own norm; the first AttnRes site (layer 0's mixer) has a single source,
  # the embedding, so its query's gradient is exactly 0 in math
  try:
    assert_grads_close(res[4][0], res[1][0], zero=("layer_0/mixer/site/query",))
    mismatch = None
  except AssertionError as e:
    mismatch = str(e)
  # the naive alternative (mean of per-microbatch mean losses) must be distinguishable
  n_m = [float(batch["loss_mask"][i::4].sum()) for i in range(4)]
  return {"grad_mismatch": mismatch, "loss1": float(res[1][1]["loss"]), "loss4": float(res[4][1]["loss"]),
          "counts_equal": bool(np.array_equal(res[1][2]["counts"], res[4][2]["counts"])),
          "hist_equal": bool(np.array_equal(res[1][2]["hist"], res[4][2]["hist"])),
          "tokens_per_microbatch": n_m, "grad_norm1": float(np.sqrt(sum(np.sum(a * a) for a in g1)))}


# ---------------------------------------------------------------------------------------------
# Tests (the pytest side)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
  return tmp_path_factory.mktemp("jax_cache")


def _env(cache: Path, **extra) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", MOONSHOT_TEST_JAX_CACHE=str(cache),
             XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
             PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.update({k: str(v) for k, v in extra.items()})
  return env


def _cmd(mode: str, workdir: Path, overrides: dict) -> list[str]:
  return [sys.executable, str(Path(__file__).resolve()), mode, str(workdir), json.dumps(dict(BASE, **overrides))]


def _run(mode: str, workdir: Path, cache: Path, overrides: dict | None = None, **env) -> dict:
  p = subprocess.run(_cmd(mode, workdir, overrides or {}), env=_env(cache, **env), cwd=ROOT,
                     capture_output=True, text=True, timeout=600)
  (workdir / f"{mode}.log").write_text(p.stdout + p.stderr)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
  result = json.loads((workdir / "result.json").read_text())
  result["stdout"] = p.stdout
  return result


def _metrics(workdir: Path) -> list[dict]:
  from moonshot_jax.train.metrics import read_metrics
  return read_metrics(workdir)


def _losses(rows: list[dict]) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in rows}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, jax_cache):
  """One uninterrupted 8-step run (checkpoints at 4 and 8, eval at 4 and 8)."""
  wd = tmp_path_factory.mktemp("reference")
  return wd, _run("train", wd, jax_cache, {"train.sample_after": True, "train.sample_tokens": 12})


def test_end_to_end_tiny(reference):
  wd, res = reference
  rows = _metrics(wd)
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  loss = _losses(rows)
  assert loss[1] == pytest.approx(np.log(512), abs=0.1)  # ~uniform over tiny's 512 logits at init
  assert loss[STEPS] < loss[1] - 0.8, loss  # it learns
  assert res["stopped"] is None and res["final_step"] == STEPS and res["last_checkpoint"] == STEPS
  assert sorted(int(p.name) for p in (wd / "checkpoints").iterdir() if p.name.isdigit()) == [4, 8]
  ev = [r for r in rows if "eval_loss" in r]
  assert [r["step"] for r in ev] == [4, 8] and ev[1]["eval_loss"] < ev[0]["eval_loss"]
  last = rows[-1]
  for key in ("grad_norm", "lr", "tokens_per_s", "step_time_s", "mfu"):
    assert np.isfinite(last[key]) and last[key] > 0, key
  assert len(last["moe/load_max_over_mean"]) == 2  # tiny has two MoE layers
  assert res["sample"].startswith("The state of the union") and len(res["sample"]) > len("The state of the union")
  # max/mean load lies in [1, E/k] (a token picks k distinct experts), and the entropy of the load
  # distribution is bounded by its min-entropy log(E/max_over_mean) and by log E: ties both metrics
  # to real routing counts (a wrong mean, a count of padding, nats vs bits all break one)
  E, k = 8, 2
  for m, h in zip(last["moe/load_max_over_mean"], last["moe/load_entropy"]):
    assert 1.0 < m <= E / k and np.log(E / m) - 1e-5 <= h <= np.log(E) + 1e-5, (m, h)
  # tiny routes the training batch with the stored bias alone (no balance_in_batch): the load read
  # off the quantile histogram must be the counted one; the bias moves every step. Up to one copy at the
  # boundary: a token whose k-th biased score equals, or rounds to, the (k+1)-th has d >= 0 for an expert that
  # top-k picked, and the histogram (d < 0 = selected) drops it. The 2-core CI box, 2026-12-07, step 4:
  # 1.243402 vs 1.242188 = 1024/1023, one of B*T*k copies. A debug probe changed the compiled program and hid
  # it, so whether it was an exact tie or two fusions rounding s + b apart is not known. Moving the
  # histogram's middle edge by one bin shifts it by 8-20% (checked).
  copies = 8 * 64 * k  # tiny's data.batch_size x data.seq_len x top-k
  for r in rows:
    np.testing.assert_allclose(r["moe/stored_load_max_over_mean"], r["moe/load_max_over_mean"], rtol=1.5 / copies)
    assert all(0.0 <= v <= 1.0 for v in r["moe/sigmoid_saturation"])
    assert all(v > 0 for v in r["moe/router_weight_norm"] + r["moe/router_grad_norm"] + r["moe/bias_update_rms"])


def test_resume_after_kill_is_bitwise_identical(reference, tmp_path, jax_cache):
  """kill -9 mid-run (async checkpoints every 2 steps), rerun the same command: the resumed run
  logs exactly the reference losses, and metrics.jsonl holds each step once."""
  ref_wd, _ = reference
  wd = tmp_path / "killed"
  wd.mkdir()
  over = {"checkpoint.every_steps": 2, "checkpoint.async_save": True}
  log = open(tmp_path / "killed.log", "w")
  proc = subprocess.Popen(_cmd("pause", wd, over), env=_env(jax_cache, MOONSHOT_TEST_PAUSE_AFTER=7), cwd=ROOT,
                          stdout=log, stderr=subprocess.STDOUT)
  try:
    deadline = time.time() + 600
    while not (wd / "PAUSED").exists():
      assert proc.poll() is None, "training subprocess exited before pausing"
      assert time.time() < deadline
      time.sleep(0.5)
  finally:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    log.close()
  assert max(r["step"] for r in _metrics(wd)) == 7
  res = _run("train", wd, jax_cache, over)
  assert res["start_step"] in (4, 6)  # 6 unless its async write was still in flight
  rows = _metrics(wd)
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  assert _losses(rows) == _losses(_metrics(ref_wd))  # bit for bit (floats compared exactly)
  ref_eval = {r["step"]: r["eval_loss"] for r in _metrics(ref_wd) if "eval_loss" in r}
  assert {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r} == ref_eval


def _corrupt(step_dir: Path) -> None:
  for f in step_dir.glob("state/**/d/*"):
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0xFF
    f.write_bytes(bytes(b))


def test_corrupt_latest_checkpoint_falls_back(reference, tmp_path, jax_cache):
  import shutil
  ref_wd, _ = reference
  wd = tmp_path / "corrupt"
  shutil.copytree(ref_wd, wd)
  (wd / "result.json").unlink()
  _corrupt(wd / "checkpoints" / "8")
  res = _run("train", wd, jax_cache)
  assert "checkpoint step 8" in res["stdout"] and "trying the previous one" in res["stdout"]
  assert res["start_step"] == 4 and res["final_step"] == STEPS
  assert any((wd / "checkpoints_corrupt").iterdir())  # reported and kept, not deleted
  assert _losses(_metrics(wd)) == _losses(_metrics(ref_wd))


def test_nan_guard_skips_and_stops(tmp_path, jax_cache):
  """A NaN parameter at step 3: steps 3 and 4 are not applied (state unchanged), logged with the
  poisoned leaf's name, and after max_bad_steps=2 the run stops, leaving checkpoint 2 newest."""
  wd = tmp_path / "nan"
  wd.mkdir()
  res = _run("nan", wd, jax_cache, {"checkpoint.every_steps": 2, "train.max_bad_steps": 2},
             MOONSHOT_TEST_POISON_AT=3)
  assert res["unchanged_before_4"] and res["unchanged_final"]
  assert res["bad_steps"] == 2 and res["final_step"] == 4 and "non-finite" in res["stopped"]
  rows = {r["step"]: r for r in _metrics(wd)}
  assert sorted(rows) == [1, 2, 3, 4]
  for s in (3, 4):
    assert rows[s]["bad_step"] and "final_norm/scale" in rows[s]["nonfinite_params"]
    assert "final_norm/scale" in rows[s]["nonfinite_grads"] and len(rows[s]["nonfinite_grads"]) > 1
  assert "bad_step" not in rows[2]
  assert sorted(int(p.name) for p in (wd / "checkpoints").iterdir() if p.name.isdigit()) == [2]
  assert res["last_checkpoint"] == 2


def test_update_that_makes_params_nonfinite_stops_at_once(tmp_path, jax_cache):
  """Finite gradients but a corrupt optimizer state (Adam nu < 0 for final_norm/scale): the update
  is applied (the guard decides on loss and gradients), its params are non-finite, so the run stops
  at that step without saving it and checkpoint 2 stays the newest."""
  wd = tmp_path / "nan_update"
  wd.mkdir()
  res = _run("nan_update", wd, jax_cache, {"checkpoint.every_steps": 2, "train.max_bad_steps": 5},
             MOONSHOT_TEST_POISON_AT=4)
  assert res["final_step"] == 4 and "after the update of step 4" in res["stopped"]
  row = {r["step"]: r for r in _metrics(wd)}[4]
  assert row["bad_step"] and row["update_applied"] and row["nonfinite_grads"] == []
  assert row["nonfinite_params"] == ["final_norm/scale"]
  assert sorted(int(p.name) for p in (wd / "checkpoints").iterdir() if p.name.isdigit()) == [2]
  assert res["last_checkpoint"] == 2


def test_grad_accumulation_equals_big_batch(tmp_path, jax_cache):
  # one MLA + MoE layer (with AttnRes): accumulation is per-row math, KDA adds only compile time
  # router_norm "none": with "batch" each microbatch routes on its own statistics (as BatchNorm),
  # so only the raw-input router makes accumulation exactly the big batch
  res = _run("gradacc", tmp_path, jax_cache, {"model.n_layers": 1, "model.mla_layers": (1,),
                                               "model.dense_layers": (), "model.router_norm": "none"})
  assert len(set(res["tokens_per_microbatch"])) > 1  # unequal microbatches: weighting matters
  assert res["grad_mismatch"] is None, res["grad_mismatch"]
  assert res["loss1"] == pytest.approx(res["loss4"], rel=1e-6)
  assert res["counts_equal"] and res["hist_equal"]
  assert res["grad_norm1"] > 0


# ---- cheap, in-process -------------------------------------------------------------------------
@pytest.mark.parametrize("key,value,match", [
    ("train.microbatches", 3, "train.microbatches"),
    ("optimizer.name", "sgd", "optimizer.name"),
    ("mesh.expert", 3, "mesh.expert"),
    ("mesh.data", 3, "mesh"),
    ("optimizer.warmup_steps", -1, "optimizer.warmup_steps"),  # >= train.steps is legal (a warning)
    ("mesh.pipeline", 4, "mesh.pipeline"),  # more stages than tiny's 3 layers
])
def test_bad_config_rejected_with_key(key, value, match):
  from moonshot_jax.config import ConfigError
  from moonshot_jax.train import loop
  cfg = _config(dict(BASE, **{key: value}))
  with pytest.raises(ConfigError, match=match.replace(".", r"\.")):
    loop.build(cfg)


def test_metrics_truncated_on_resume(tmp_path):
  from moonshot_jax.train.metrics import MetricsWriter, read_metrics
  w = MetricsWriter(tmp_path, tensorboard=False)
  for s in range(1, 6):
    w.write(s, {"loss": 1.0 / s, "eval_loss": float("nan") if s == 2 else 0.5})
  w.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 6, "lo')  # a line torn by kill -9
  w = MetricsWriter(tmp_path, resume_step=3, tensorboard=False)
  w.write(4, {"loss": 0.2})
  w.close()
  rows = read_metrics(tmp_path)
  assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["loss"] == 0.2
  assert rows[1]["eval_loss"] == "nan"  # strict-JSON readers still parse the line


def test_microbatch_split_keeps_rows_on_their_device():
  """Batch [16, 3] over data=2 x expert=4 (2 rows per device), 2 microbatches: microbatch m takes
  row m of every device's pair, so the compiled split moves no data between devices and each
  device's shard of every microbatch holds rows it already had. The control (a contiguous split)
  does move rows: the HLO check can see resharding."""
  import jax
  from moonshot_jax.parallel.mesh import make_mesh
  from moonshot_jax.train.step import batch_sharding, split_microbatches
  x = np.arange(16 * 3).reshape(16, 3)
  mb = split_microbatches({"x": x}, 4)["x"]
  assert mb.shape == (4, 4, 3)
  for m in range(4):
    np.testing.assert_array_equal(mb[m], x[m::4])
  with pytest.raises(ValueError, match="train.microbatches"):
    split_microbatches({"x": x}, 3)

  mesh = make_mesh(dict(data=2, expert=4))
  xs = jax.device_put(x, batch_sharding(mesh))
  collectives = ("all-to-all", "all-gather", "collective-permute", "all-reduce")

  def moves(f):
    text = jax.jit(f).lower(xs).compile().as_text()
    return sum(text.count(op) for op in collectives)

  split = lambda a: split_microbatches({"x": a}, 2, mesh)["x"]
  assert moves(split) == 0
  control = lambda a: jax.lax.with_sharding_constraint(a.reshape(2, 8, 3), jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(None, ("data", "expert"))))
  assert moves(control) > 0
  out = jax.jit(split)(xs)
  held = {s.device: set(map(tuple, np.asarray(s.data))) for s in xs.addressable_shards}
  for shard in out.addressable_shards:
    rows = set(map(tuple, np.asarray(shard.data).reshape(-1, 3)))
    assert rows and rows <= held[shard.device], shard.device


def test_moe_state_update_maps_scanned_layers():
  """Each layer's bias is updated from its own row of the stacked stats (sign balancing, so the
  expected update is b + rate * sign(mean - counts) per layer)."""
  import jax
  from moonshot_jax.config import ModelConfig
  from moonshot_jax.model.transformer import Transformer, layer_plan
  from moonshot_jax.train.step import update_moe_state
  cfg = ModelConfig(n_layers=5, mla_layers=(), dense_layers=(1,), balancing="sign", balance_rate=0.5,
                    num_experts=4, num_experts_per_tok=1, d_model=16, kda_head_dim=8, kda_v_head_dim=8,
                    expert_ff_dim=8, shared_ff_dim=0, dense_ff_dim=16, max_seq_len=16)
  assert any(s.scanned for s in layer_plan(cfg))
  tok = jax.numpy.zeros((1, 16), jax.numpy.int32)
  shapes = jax.eval_shape(Transformer(cfg).init, jax.random.key(0), tok)
  moe_state = jax.tree.map(lambda s: np.zeros(s.shape, np.float32), nn_unbox(shapes["moe_state"]))
  r = np.random.default_rng(0)
  counts = r.permutation(16).reshape(4, 4).astype(np.float32)  # [4 MoE layers, 4 experts]
  new = update_moe_state(moe_state, {"counts": counts, "hist": np.zeros((4, 4, 8), np.float32)}, cfg)
  want = 0.5 * np.sign(counts.mean(-1, keepdims=True) - counts)  # layers 1..4 in order
  got = []
  for seg in layer_plan(cfg):
    if seg.name not in new:  # a dense layer has no MoE state
      continue
    tree = new[seg.name]
    if seg.scanned:
      got.extend(np.asarray(tree["layer_0"]["ffn"]["moe"]["bias"]))
    else:
      got.append(np.asarray(tree["ffn"]["moe"]["bias"]))
  np.testing.assert_allclose(np.stack(got), want)


def test_router_dynamics_per_layer_in_layer_order():
  """Router weight / gradient norms and the bias trajectory per MoE layer, in aux's layer order,
  through scanned segments, against numpy on per-layer trees stacked by `stack_layers`."""
  import jax
  from moonshot_jax.config import ModelConfig
  from moonshot_jax.model.transformer import Transformer, layer_plan, stack_layers, unstack_layers
  from moonshot_jax.train.step import router_dynamics
  cfg = ModelConfig(n_layers=6, mla_layers=(4,), dense_layers=(1,), num_experts=4, num_experts_per_tok=1,
                    d_model=16, kda_head_dim=8, kda_v_head_dim=8, expert_ff_dim=8, shared_ff_dim=0,
                    dense_ff_dim=16, max_seq_len=16, mla_num_heads=2, kv_lora_rank=8, qk_nope_head_dim=8,
                    qk_rope_head_dim=4, v_head_dim=8)
  assert any(s.scanned for s in layer_plan(cfg)) and any(not s.scanned for s in layer_plan(cfg))
  tok = jax.numpy.zeros((1, 16), jax.numpy.int32)
  shapes = nn_unbox(jax.eval_shape(Transformer(cfg).init, jax.random.key(0), tok))
  per_layer, rest = unstack_layers(shapes, cfg)
  r = np.random.default_rng(3)
  fill = lambda t: jax.tree.map(lambda s: r.standard_normal(s.shape).astype(np.float32), t)
  per_layer = [fill(v) for v in per_layer]
  moe = [i for i, v in enumerate(per_layer) if "moe_state" in v]
  assert moe == [1, 2, 3, 4, 5]  # layer 0 is the dense one (dense_layers are 1-based)
  variables = stack_layers(per_layer, fill(rest), cfg)
  grads = jax.tree.map(lambda a: 2.0 * a + 1.0, variables["params"])
  new_state = jax.tree.map(lambda a: a * 3.0, variables["moe_state"])
  out = router_dynamics(variables["params"], grads, variables["moe_state"], new_state, cfg)
  w = np.stack([per_layer[i]["params"]["ffn"]["moe"]["router"] for i in moe])
  b = np.stack([per_layer[i]["moe_state"]["ffn"]["moe"]["bias"] for i in moe])
  np.testing.assert_allclose(out["router_weight_norm"], np.linalg.norm(w.reshape(5, -1), axis=-1), rtol=1e-5)
  np.testing.assert_allclose(out["router_grad_norm"], np.linalg.norm((2 * w + 1).reshape(5, -1), axis=-1),
                             rtol=1e-5)
  np.testing.assert_allclose(out["bias_range"], 3 * (b.max(-1) - b.min(-1)), rtol=1e-5)
  np.testing.assert_allclose(out["bias_std"], 3 * b.std(-1), rtol=1e-5)
  np.testing.assert_allclose(out["bias_update_rms"], 2 * np.sqrt((b * b).mean(-1)), rtol=1e-5)
  assert router_dynamics({"other": {}}, {"other": {}}, {}, {}, cfg) == {}  # not the Transformer layout


def nn_unbox(tree):
  import flax.linen as nn
  return nn.meta.unbox(tree)


if __name__ == "__main__":
  _driver(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
