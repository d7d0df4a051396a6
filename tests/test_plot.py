"""launch/plot.py: loss, MFU and the per-MoE-layer expert-load heatmaps and router panels."""
import json

import pytest

from launch.plot import _layer_series, plot


def test_plot_writes_moe_heatmaps_and_router_panels(tmp_path):
  rows = []
  for step in range(1, 6):
    rows.append({"step": step, "loss": 5.0 - 0.1 * step, "mfu": 0.01, "tokens_per_s": 100.0,
                 "moe/load_max_over_mean": [1.0 + step, 1.5], "moe/dead_experts": [step, 0],
                 "moe/router_logit_std": [0.3, 0.2], "moe/router_logit_offset": [0.0, 0.1],
                 "moe/input_cos": [0.5, 0.9], "moe/router_input_cos": [0.0, 0.1],
                 "moe/stored_load_max_over_mean": [1.2, 2.5], "moe/router_weight_norm": [1.8, 1.9],
                 "moe/router_grad_norm": [1e-2, 1e-3 * step], "moe/bias_range": [0.1, 0.2 * step],
                 "moe/bias_update_rms": [0.01, 0.02], "moe/sigmoid_saturation": [0.0, 0.01 * step]})
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  names = sorted(p.name for p in plot(tmp_path))
  assert names == ["expert_load.png", "loss.png", "mfu.png", "moe_router.png"]
  assert all((tmp_path / "plots" / n).stat().st_size > 1000 for n in names)
  steps, mat = _layer_series(rows, "load_max_over_mean")
  assert steps == [1, 2, 3, 4, 5] and mat.shape == (5, 2) and mat[2, 0] == 4.0
  from launch.plot import ROUTER_PANELS
  assert all(_layer_series(rows, k)[0] for k in ROUTER_PANELS)  # every router panel has its series here


def test_plot_without_metrics_names_the_file(tmp_path):
  with pytest.raises(ValueError, match="metrics.jsonl"):
    plot(tmp_path)
