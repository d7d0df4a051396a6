"""HF import: a small synthetic Kimi-Linear checkpoint (config.json + sharded safetensors in the HF
layout) -> our model, whose logits must equal an independent NumPy forward written directly against
the HF tensor names and PyTorch layouts (input_layernorm / post_attention_layernorm residual blocks)."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

safetensors_numpy = pytest.importorskip("safetensors.numpy")

from moonshot_jax.inference import engine, hf_import  # noqa: E402
from moonshot_jax.model.transformer import Transformer  # noqa: E402

HF_CONFIG = dict(
    model_type="kimi_linear", vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
    intermediate_size=48, rms_norm_eps=1e-5, tie_word_embeddings=False, q_lora_rank=None, kv_lora_rank=16,
    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, mla_use_nope=True, num_experts=4,
    num_experts_per_token=2, moe_intermediate_size=12, num_shared_experts=1, routed_scaling_factor=2.5,
    moe_renormalize=True, first_k_dense_replace=1, moe_layer_freq=1, moe_router_activation_func="sigmoid",
    use_grouped_topk=True, num_expert_group=1, topk_group=1, hidden_act="silu", max_position_embeddings=256,
    linear_attn_config=dict(kda_layers=[1, 2, 3], full_attn_layers=[4], num_heads=2, head_dim=16,
                            short_conv_kernel_size=4))


def synthetic_checkpoint(rng) -> dict[str, np.ndarray]:
  c, lin = HF_CONFIG, HF_CONFIG["linear_attn_config"]
  D, V = c["hidden_size"], c["vocab_size"]
  H, K, W = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
  Hm, N, R = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"]
  Vm, L = c["v_head_dim"], c["kv_lora_rank"]
  E, F = c["num_experts"], c["moe_intermediate_size"]
  w = lambda *s, scale=0.2: (scale * rng.normal(size=s)).astype(np.float32)
  ones = lambda n: (1 + 0.1 * rng.normal(size=n)).astype(np.float32)
  t = {"model.embed_tokens.weight": w(V, D, scale=1.0), "model.norm.weight": ones(D), "lm_head.weight": w(V, D)}
  for i in range(c["num_hidden_layers"]):
    p = f"model.layers.{i}"
    t[f"{p}.input_layernorm.weight"], t[f"{p}.post_attention_layernorm.weight"] = ones(D), ones(D)
    a = f"{p}.self_attn"
    if i + 1 in lin["kda_layers"]:
      for n in "qkv":
        t[f"{a}.{n}_proj.weight"] = w(H * K, D)
        t[f"{a}.{n}_conv1d.weight"] = w(H * K, 1, W, scale=0.5)
      t[f"{a}.f_a_proj.weight"], t[f"{a}.f_b_proj.weight"] = w(K, D), w(H * K, K)
      t[f"{a}.A_log"] = np.log(rng.uniform(1, 16, size=(1, 1, H, 1))).astype(np.float32)
      t[f"{a}.dt_bias"] = w(H * K, scale=1.0)
      t[f"{a}.b_proj.weight"] = w(H, D)
      t[f"{a}.g_a_proj.weight"], t[f"{a}.g_b_proj.weight"] = w(K, D), w(H * K, K)
      t[f"{a}.g_b_proj.bias"] = w(H * K)
      t[f"{a}.o_norm.weight"] = ones(K)
      t[f"{a}.o_proj.weight"] = w(D, H * K)
    else:
      t[f"{a}.q_proj.weight"] = w(Hm * (N + R), D)
      t[f"{a}.kv_a_proj_with_mqa.weight"] = w(L + R, D)
      t[f"{a}.kv_a_layernorm.weight"] = ones(L)
      t[f"{a}.kv_b_proj.weight"] = w(Hm * (N + Vm), L)
      t[f"{a}.o_proj.weight"] = w(D, Hm * Vm)
    if i < c["first_k_dense_replace"]:
      for n, s in (("gate_proj", (c["intermediate_size"], D)), ("up_proj", (c["intermediate_size"], D)),
                   ("down_proj", (D, c["intermediate_size"]))):
        t[f"{p}.mlp.{n}.weight"] = w(*s)
    else:
      m = f"{p}.block_sparse_moe"
      t[f"{m}.gate.weight"] = w(E, D, scale=1.0)
      t[f"{m}.gate.e_score_correction_bias"] = w(E, scale=0.3)
      for j in range(E):
        t[f"{m}.experts.{j}.w1.weight"], t[f"{m}.experts.{j}.w3.weight"] = w(F, D), w(F, D)
        t[f"{m}.experts.{j}.w2.weight"] = w(D, F)
      for n, s in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F))):
        t[f"{m}.shared_experts.{n}.weight"] = w(*s)
  return t


# ---- independent NumPy forward on the HF tensors (fp64) ----------------------------------------
def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _silu(x):
  return x / (1 + np.exp(-x))


def _sigmoid(x):
  return 1 / (1 + np.exp(-x))


def _kda_ref(x, t, a, c):
  lin = c["linear_attn_config"]
  H, K, W = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
  T = x.shape[0]
  lin_ = lambda name: x @ t[f"{a}.{name}.weight"].T

  def conv(z, name):  # torch Conv1d(groups=C, padding=W-1) then keep the first T outputs: causal
    w = t[f"{a}.{name}.weight"][:, 0, :]  # [C, W]
    zp = np.concatenate([np.zeros((W - 1, z.shape[1])), z])
    return _silu(np.stack([(zp[s:s + W] * w.T).sum(0) for s in range(T)]))

  l2 = lambda z: z / np.sqrt((z * z).sum(-1, keepdims=True) + 1e-6)
  q = l2(conv(lin_("q_proj"), "q_conv1d").reshape(T, H, K))
  k = l2(conv(lin_("k_proj"), "k_conv1d").reshape(T, H, K))
  v = conv(lin_("v_proj"), "v_conv1d").reshape(T, H, K)
  f = (x @ t[f"{a}.f_a_proj.weight"].T) @ t[f"{a}.f_b_proj.weight"].T + t[f"{a}.dt_bias"]
  g = (-np.exp(t[f"{a}.A_log"].reshape(H))[:, None] * np.log1p(np.exp(f.reshape(T, H, K))))
  beta = _sigmoid(lin_("b_proj"))
  S = np.zeros((H, K, K))
  o = np.zeros((T, H, K))
  for s in range(T):
    for h in range(H):
      Sh = np.exp(g[s, h])[:, None] * S[h]
      Sh = Sh + beta[s, h] * np.outer(k[s, h], v[s, h] - Sh.T @ k[s, h])
      S[h] = Sh
      o[s, h] = Sh.T @ q[s, h] / np.sqrt(K)
  gate = ((x @ t[f"{a}.g_a_proj.weight"].T) @ t[f"{a}.g_b_proj.weight"].T + t[f"{a}.g_b_proj.bias"]).reshape(T, H, K)
  o = _rms(o, t[f"{a}.o_norm.weight"], c["rms_norm_eps"]) * _sigmoid(gate)
  return o.reshape(T, -1) @ t[f"{a}.o_proj.weight"].T


def _mla_ref(x, t, a, c):
  T = x.shape[0]
  H, N, R, V, L = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"],
                   c["kv_lora_rank"])
  q = (x @ t[f"{a}.q_proj.weight"].T).reshape(T, H, N + R)
  kva = x @ t[f"{a}.kv_a_proj_with_mqa.weight"].T
  ckv, k_pe = _rms(kva[:, :L], t[f"{a}.kv_a_layernorm.weight"], c["rms_norm_eps"]), kva[:, L:]
  kv = (ckv @ t[f"{a}.kv_b_proj.weight"].T).reshape(T, H, N + V)
  k = np.concatenate([kv[..., :N], np.broadcast_to(k_pe[:, None], (T, H, R))], -1)
  s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(N + R)
  s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("hqk,khv->qhv", p, kv[..., N:]).reshape(T, -1) @ t[f"{a}.o_proj.weight"].T


def _mlp_ref(x, t, p):
  return (_silu(x @ t[f"{p}.gate_proj.weight"].T) * (x @ t[f"{p}.up_proj.weight"].T)) @ t[f"{p}.down_proj.weight"].T


def _moe_ref(x, t, m, c):
  scores = _sigmoid(x @ t[f"{m}.gate.weight"].T)
  biased = scores + t[f"{m}.gate.e_score_correction_bias"]
  out = np.zeros_like(x)
  for s in range(x.shape[0]):
    idx = np.argsort(-biased[s], kind="stable")[:c["num_experts_per_token"]]
    wts = scores[s, idx] / scores[s, idx].sum() * c["routed_scaling_factor"]
    for j, wj in zip(idx, wts):
      e = f"{m}.experts.{j}"
      out[s] += wj * ((_silu(x[s] @ t[f"{e}.w1.weight"].T) * (x[s] @ t[f"{e}.w3.weight"].T)) @ t[f"{e}.w2.weight"].T)
  return out + _mlp_ref(x, t, f"{m}.shared_experts")


def hf_reference_logits(tokens, t64, c):
  eps = c["rms_norm_eps"]
  x = t64["model.embed_tokens.weight"][tokens]
  for i in range(c["num_hidden_layers"]):
    p = f"model.layers.{i}"
    h = _rms(x, t64[f"{p}.input_layernorm.weight"], eps)
    if i + 1 in c["linear_attn_config"]["kda_layers"]:
      x = x + _kda_ref(h, t64, f"{p}.self_attn", c)
    else:
      x = x + _mla_ref(h, t64, f"{p}.self_attn", c)
    h = _rms(x, t64[f"{p}.post_attention_layernorm.weight"], eps)
    dense = i < c["first_k_dense_replace"]
    x = x + (_mlp_ref(h, t64, f"{p}.mlp") if dense else _moe_ref(h, t64, f"{p}.block_sparse_moe", c))
  return _rms(x, t64["model.norm.weight"], eps) @ t64["lm_head.weight"].T


# ---- tests ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  rng = np.random.default_rng(0)
  tensors = synthetic_checkpoint(rng)
  d = tmp_path_factory.mktemp("kimi_linear_tiny")
  (d / "config.json").write_text(json.dumps(HF_CONFIG))
  names = sorted(tensors)  # two shards, as large checkpoints are
  half = len(names) // 2
  safetensors_numpy.save_file({k: tensors[k] for k in names[:half]}, str(d / "model-00001-of-00002.safetensors"))
  safetensors_numpy.save_file({k: tensors[k] for k in names[half:]}, str(d / "model-00002-of-00002.safetensors"))
  return d, tensors


def test_config_mapping(checkpoint):
  cfg = hf_import.config_from_hf(HF_CONFIG)
  assert cfg.layer_kinds == (("kda", "dense"), ("kda", "moe"), ("kda", "moe"), ("mla", "moe"))
  assert (cfg.kda_num_heads, cfg.kda_head_dim, cfg.shared_ff_dim) == (2, 16, 12)
  assert not cfg.attn_res and not cfg.mla_output_gate and not cfg.mla_use_rope
  with pytest.raises(ValueError, match="mla_use_nope"):
    hf_import.config_from_hf(dict(HF_CONFIG, mla_use_nope=False))
  with pytest.raises(ValueError, match="num_expert_group"):
    hf_import.config_from_hf(dict(HF_CONFIG, num_expert_group=4))


def test_imported_model_matches_hf_reference(checkpoint):
  d, tensors = checkpoint
  cfg, variables = hf_import.load_hf_checkpoint(d)
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(1, 12)).astype(np.int32)
  ref = hf_reference_logits(tokens[0], {k: v.astype(np.float64) for k, v in tensors.items()}, HF_CONFIG)
  ours, _ = jax.jit(Transformer(cfg).apply)(variables, jnp.asarray(tokens))
  ours = np.asarray(ours[0], np.float64)
  assert np.max(np.abs(ours - ref)) / np.max(np.abs(ref)) < 1e-4


@pytest.mark.slow
def test_engine_on_imported_weights_matches_hf_reference(checkpoint):
  d, tensors = checkpoint
  cfg, variables = hf_import.load_hf_checkpoint(d)
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(1, 12)).astype(np.int32)
  ref = hf_reference_logits(tokens[0], {k: v.astype(np.float64) for k, v in tensors.items()}, HF_CONFIG)
  logits, cache = engine.prefill(variables, cfg, tokens[:, :11], max_len=16, all_logits=False)
  step, _ = engine.decode_step(variables, cfg, cache, tokens[:, 11])
  for got, want in ((logits[0], ref[10]), (step[0], ref[11])):
    assert np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want)) < 1e-4


def test_bad_checkpoints_are_rejected(checkpoint):
  _, tensors = checkpoint
  cfg = hf_import.config_from_hf(HF_CONFIG)
  missing = dict(tensors)
  del missing["model.layers.3.self_attn.kv_b_proj.weight"]
  with pytest.raises(ValueError, match="kv_b_proj"):
    hf_import.convert(missing, cfg)
  extra = dict(tensors, **{"model.layers.0.self_attn.surprise.weight": np.zeros((2, 2), np.float32)})
  with pytest.raises(ValueError, match="surprise"):
    hf_import.convert(extra, cfg)
  bad = dict(tensors, **{"model.norm.weight": np.zeros((7,), np.float32)})
  with pytest.raises(ValueError, match="model.norm.weight"):
    hf_import.convert(bad, cfg)
  # skipped: rotary buffers and an MTP layer past num_hidden_layers
  ok = dict(tensors, **{"model.layers.0.self_attn.rotary_emb.inv_freq": np.zeros((2,), np.float32),
                        "model.layers.4.mtp.weight": np.zeros((2,), np.float32)})
  hf_import.convert(ok, cfg)
  # bf16 params, with the fp32-by-design leaves (gates, norms, router) kept fp32
  v16 = hf_import.convert(tensors, cfg.replace(param_dtype="bfloat16"))
  kda = v16["params"]["layer_0"]["mixer"]["kda"]
  assert kda["q_proj"].dtype == jnp.bfloat16 and kda["A_log"].dtype == np.float32
