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
