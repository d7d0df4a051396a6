"""plan_tpu's helpers that need no compile: the proxy mesh / slice choice and the parser of XLA:TPU's
buffer-assignment report (the compiles themselves are in test_tpu_aot_kda.py, slow + tpu_aot)."""
from __future__ import annotations

import pytest

from moonshot_jax.parallel import plan_tpu

# shape of libtpu 0.0.42.1's *memory-usage-report.txt: the temporaries' heap first, then one table per argument
REPORT = """Memory Space: default (color=0)
Total bytes: 177338464000 (165.16GiB)
  cumulative_size;       size;       offset; used_by_n_values; shapes_list
  ------------------------------------------------------------
   13.78GiB(  5%);   13.78GiB;            0;              155; bf16[1,1792,7168], f32[8,7,1,8192,7168], 2\u00d7f32[1,2,3584,7168]
   27.56GiB(  9%);   13.78GiB;  14797504512;                5; 5\u00d7f32[9,7,1,8192,7168]
   28.40GiB( 10%);  840.00MiB;            0;                2; 2\u00d7f32[1,5,3584,96,128]
  The rest 6517 values are less than 5% of the total size and not shown.

  cumulative_size;       size;       offset; used_by_n_values; shapes_list
  ------------------------------------------------------------
    2.19GiB(100%);    2.19GiB;            0;                2; 2\u00d7f32[163840,3584]

Memory Space: vmem (color=1)
Total bytes: 50266112 (47.94MiB)
  cumulative_size;       size;       offset; used_by_n_values; shapes_list
  ------------------------------------------------------------
   40.00MiB( 80%);   40.00MiB;            0;                1; f32[1024,10240]
"""


def test_largest_allocations_reads_the_temporaries_table_only(tmp_path):
  (tmp_path / "module_0026.jit_step.after_optimizations-memory-usage-report.txt").write_text(REPORT, "utf-8")
  (tmp_path / "module_0002.jit_seed.after_optimizations-memory-usage-report.txt").write_text("x", "utf-8")
  got = plan_tpu.largest_allocations(str(tmp_path), n=10)
  assert [round(a["bytes"] / 2**30, 2) for a in got] == [13.78, 13.78, 0.82]
  # values ordered by their own size, the count prefix kept
  assert got[0]["values"] == ["f32[8,7,1,8192,7168]", "2xf32[1,2,3584,7168]", "bf16[1,1792,7168]"]
  assert got[1]["values"] == ["5xf32[9,7,1,8192,7168]"]
  assert plan_tpu.largest_allocations(str(tmp_path), n=1) == got[:1]
  assert plan_tpu.largest_allocations(str(tmp_path / "none")) == []


def test_proxy_mesh_takes_the_real_data_size_and_its_slice():
  assert plan_tpu.tpu_proxy_mesh(dict(pipeline=16, data=8, expert=64, tensor=1)) == dict(
      pipeline=2, data=8, expert=4, tensor=1)
  assert plan_tpu.tpu_proxy_mesh(dict(pipeline=16, data=32, expert=64, tensor=1))["data"] == 8
  assert plan_tpu.tpu_proxy_mesh(dict(pipeline=2, data=2, expert=4, tensor=1))["data"] == 2
  assert plan_tpu.parse_target("tpu:v5p", 64) == "v5p:4x4x4"
  assert plan_tpu.parse_target("tpu:v6e", 16) == "v6e:4x4"
  assert plan_tpu.parse_target("tpu:v6e:8x8", 16) == "v6e:8x8"
  with pytest.raises(ValueError, match="unknown generation 'v9'"):
    plan_tpu.parse_target("tpu:v9")
  with pytest.raises(ValueError, match="expected tpu:<generation>"):
    plan_tpu.parse_target("gpu:h100")


def test_aot_cache_is_keyed_by_the_flags_and_reused(tmp_path, monkeypatch):
  """--aot_cache: a stored result is returned without compiling (marked `cached`), a different flag
  set misses, flag order and the --aot_cache flag itself do not change the key."""
  argv = ["--config=experiments/k3.py", "--mesh=pipeline=16,data=8,expert=64", "--target=tpu:v5p"]
  path = plan_tpu.cache_file(str(tmp_path), argv)
  assert path == plan_tpu.cache_file(str(tmp_path), argv[::-1] + [f"--aot_cache={tmp_path}"])
  other = plan_tpu.cache_file(str(tmp_path), argv + ["--config.data.seq_len=2048"])
  assert other != path
  (tmp_path / path.rsplit("/", 1)[1]).write_text('{"memory": {"peak_bytes": 1}}')
  monkeypatch.setattr(plan_tpu.pmem, "run_plan_worker", lambda *a, **k: pytest.fail("compiled despite the cache"))
  got = plan_tpu.run_worker(argv, cache_dir=str(tmp_path))
  assert got["memory"] == {"peak_bytes": 1} and got["cached"] == path
  with pytest.raises(pytest.fail.Exception):
    plan_tpu.run_worker(argv + ["--config.data.seq_len=2048"], cache_dir=str(tmp_path))


@pytest.fixture(scope="module")
def libtpu():
  from moonshot_jax.parallel import tpu_aot
  reason = tpu_aot.unavailable_reason()
  if reason:
    pytest.skip(reason)


@pytest.mark.tpu_aot
@pytest.mark.slow  # one XLA:TPU compile of a 4-layer decode step (~1-4 min of wall time on the dev box)
def test_decode_step_compiles_for_tpu_with_mxfp4_experts(libtpu):
  """plan_tpu_decode's proxy on the K3-layout tiny model: the decode step with MXFP4 experts and a
  2048-token cache compiles for a 16-chip v5p slice; XLA's arguments cover the estimate (weights
  per chip + the replicated cache) -- up to 2.5x here: the tiny model's 16-64-wide arrays fill
  (8, 128) tiles partly (K3's proxy: +0.0%, WORKSPACE_NOTES) -- and the cache is donated."""
  import jax
  import numpy as np

  from moonshot_jax.inference import engine
  from moonshot_jax.parallel import plan_tpu_decode as ptd, tpu_aot
  from tests.test_hf_k3 import model_cfg

  cfg = ptd.proxy_model(model_cfg(), serve_expert=4, mxfp4=True)  # 1 expert per chip x 16 chips
  assert cfg.n_layers == 4 and cfg.num_experts == 16 and cfg.layer_kinds[-1][0] == "mla"
  devices = tpu_aot.devices(plan_tpu.parse_target("tpu:v5p"))
  mesh = jax.sharding.Mesh(np.array(devices).reshape(1, 1, 16, 1), ("pipeline", "data", "expert", "tensor"))
  variables, cache, token = ptd._abstract_inputs(cfg, mesh, 2048, True)
  with engine._context(mesh, "zero1"):
    compiled = engine._decode_impl.lower(variables, cache, token, cfg=cfg, mesh=mesh,
                                         strategy="zero1").compile(tpu_aot.PLANNING_COMPILE_OPTIONS)
  m = tpu_aot.memory_stats(compiled)
  est = ptd._tree_bytes_per_chip(variables, mesh) + ptd._tree_bytes_per_chip(cache, mesh)
  assert est <= m["argument_size_in_bytes"] <= 2.5 * est + 2**20, (m, est)
  assert m["alias_size_in_bytes"] >= ptd._tree_bytes_per_chip(cache, mesh) * 0.99
  in_dtypes = {str(a._aval.dtype) for a in jax.tree.leaves(compiled.args_info)}
  assert "uint8" in in_dtypes, in_dtypes  # the experts entered as MXFP4 bytes
