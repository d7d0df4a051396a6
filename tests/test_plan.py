"""launch/plan.py and moonshot_jax/flops.py."""
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moonshot_jax import flops, params
from moonshot_jax.config import ModelConfig
from moonshot_jax.layers import attn_res
from moonshot_jax.model import Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_plan(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
  # one CPU device in launch/plan.py itself; XLA:CPU -O0 as tests/conftest.py (its --aot worker keeps it)
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_backend_optimization_level=0")
  return subprocess.run([sys.executable, "-m", "launch.plan", *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout)


def _check_report(proc, cfg: ModelConfig):
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(proc.stdout.strip().splitlines()[-1])  # the LAST line is the JSON object
  expected = params.summary(cfg)
  assert report["total_params"] == expected["total_params"]
  assert report["active_params"] == expected["active_params"]
  assert set(report["components"]) == set(params.COMPONENTS)
  assert report["total_params"] == sum(v["total"] for v in report["components"].values())
  assert report["flops"]["train_per_token"] == pytest.approx(3 * report["flops"]["forward_per_token"])
  assert report["layer_plan"][-1]["end"] == cfg.n_layers
  return report


def _model_config(name: str) -> ModelConfig:
  import importlib.util

  from moonshot_jax import experiment
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "experiments", f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return experiment.model_config(mod.get_config())


def test_plan_json_tiny():
  proc = _run_plan("--config=experiments/tiny.py", "--json", "--seq_len=64")
  report = _check_report(proc, _model_config("tiny"))
  assert report["flops"]["seq_len"] == 64
  assert "routed_experts" in proc.stdout and "FLOPs per token" in proc.stdout
  # serving / fine-tuning weights and the chips of each default kind that hold them (90% of HBM)
  sv, total = report["serving"], report["total_params"]
  routed = report["components"]["routed_experts"]["total"]
  assert sv["bytes"]["bf16"] == 2 * total
  assert sv["bytes"]["mxfp4"] == 2 * (total - routed) + routed * 4.25 / 8  # E2M1 + one E8M0 per 32
  assert sv["fine_tune_bytes"] == 8 * total + sv["optimizer_bytes"]
  hbm = {"H200": 141e9, "v5p": 95e9, "v6e": 32e9}
  assert sv["chips"] == {w: {k: math.ceil(b / (0.9 * c)) for k, c in hbm.items()}
                         for w, b in (("serve_mxfp4", sv["bytes"]["mxfp4"]), ("serve_bf16", sv["bytes"]["bf16"]),
                                      ("fine_tune", sv["fine_tune_bytes"]))}


@pytest.mark.slow
def test_plan_json_k3_in_seconds():
  proc = _run_plan("--config=experiments/k3.py", "--json", timeout=120)
  report = _check_report(proc, _model_config("k3"))
  assert report["total_params"] > 2e12


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------
def test_flops_match_xla_cost_analysis_for_mla_dense_model():
  """XLA's own FLOP count of the compiled forward (unrolled: XLA counts a scan body once) against
  the analytic count; XLA's dense attention path computes the full T x T square, so the causal
  attention term is rescaled to T keys per query for the comparison."""
  cfg = ModelConfig(vocab_size=1024, d_model=128, n_layers=2, mla_layers=(1, 2), dense_layers=(1, 2),
                    dense_ff_dim=512, mla_num_heads=4, kv_lora_rank=32, q_lora_rank=48, attn_res=False,
                    scan_layers=False)
  T = 64
  tokens = jax.ShapeDtypeStruct((2, T), jnp.int32)
  model = Transformer(cfg)
  variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
  xla = jax.jit(model.apply).lower(variables, tokens).compile().cost_analysis()
  xla = xla[0] if isinstance(xla, (list, tuple)) else xla
  f = flops.forward_flops_per_token(cfg, T)
  analytic = sum(f.values()) + f["mla_attn"] * (T / ((T + 1) / 2) - 1)
  assert abs(xla["flops"] / (2 * T) / analytic - 1) < 0.05, (xla["flops"] / (2 * T), analytic)


def test_matmul_flops_are_twice_the_active_matmul_params():
  cfg = ModelConfig(n_layers=4, mla_layers=(2, 4), dense_layers=(1,), q_lora_rank=16, moe_latent_dim=16,
                    attn_res=False)
  counts = params.tree_param_counts(params.abstract_params(cfg)["params"])
  f = flops.forward_flops_per_token(cfg, 64)
  k_over_e = cfg.num_experts_per_tok / cfg.num_experts
  assert f["routed_experts"] == pytest.approx(2 * counts["routed_experts"] * k_over_e)
  for c in ("dense_ffn", "router", "shared_experts", "head"):
    assert f[c] == pytest.approx(2 * counts[c]), c
  # latent: down + up are matmuls, the latent norm scale is not
  assert f["latent"] == pytest.approx(2 * (counts["latent"] - 3 * cfg.moe_latent_dim))
  # more experts at the same top-k cost nothing per token
  f2 = flops.forward_flops_per_token(cfg.replace(num_experts=64), 64)
  assert f2["routed_experts"] == f["routed_experts"]


def test_attn_res_source_count_matches_the_state():
  cfg = ModelConfig(n_layers=5, attn_res_block_size=2, d_model=4)
  state = attn_res.AttnResState.init(jnp.ones((1, 1, 4)), cfg)
  sources = 0
  for layer in range(cfg.n_layers):
    for block_end in (False, bool(attn_res.is_block_end(layer, cfg))):
      sources += int(state.mask.sum()) + int(state.partial_valid)
      state = attn_res.add_output(state, jnp.ones((1, 1, 4)), cfg, block_end)
  sources += int(state.mask.sum()) + int(state.partial_valid)
  assert flops.forward_flops_per_token(cfg, 8)["attn_res"] == 6 * cfg.d_model * sources


def test_kda_and_mla_attention_scaling():
  C, K = 64, 128
  per_tok = [flops.kda_chunk_flops_per_token(T, C, K, K) for T in (64, 1024, 65536)]
  assert np.allclose(per_tok, per_tok[0])  # linear in T
  assert flops.kda_chunk_flops_per_token(65, C, K, K) == pytest.approx(per_tok[0] * 128 / 65)  # padding
  # the state terms dominate and match the paper's 6d² per token; C terms stay within 2x of it
  paper = flops.kda_paper_flops(1024, C, K) / 1024
  assert 1.0 < per_tok[0] / paper < 2.0
  cfg = ModelConfig(n_layers=1, mla_layers=(1,), dense_layers=(1,), attn_res=False)
  a1, a2 = (flops.forward_flops_per_token(cfg, T)["mla_attn"] for T in (1023, 2047))
  assert a2 / a1 == pytest.approx(2048 / 1024)  # causal context (T + 1) / 2
  with pytest.raises(ValueError, match="seq_len"):
    flops.forward_flops_per_token(cfg, 0)
