"""Import a Kimi-Linear-style Hugging Face checkpoint (config.json + *.safetensors) into our tree.

Layout read (moonshotai/Kimi-Linear-48B-A3B, `KimiLinearForCausalLM`; PyTorch Linear weights are
[out, in], so every matrix is transposed into our [in, ...out] kernels):
  model.embed_tokens.weight [V, D]                    -> embedding
  model.layers.{i}.input_layernorm.weight             -> layer i mixer/norm/scale
  model.layers.{i}.post_attention_layernorm.weight    -> layer i ffn/norm/scale
  KDA  self_attn.{q,k,v}_proj.weight [H·K, D]         -> mixer/kda/{q,k,v}_proj [D, H, K]
       self_attn.{q,k,v}_conv1d.weight [H·K, 1, W]    -> mixer/kda/{q,k,v}_conv [W, H, K] (tap W-1 = current token)
       self_attn.f_a_proj / f_b_proj                  -> f_a [D, K], f_b [K, HV, K]   (low-rank gate)
       self_attn.A_log [1, 1, HV, 1], dt_bias [HV·K]  -> A_log [HV], dt_bias [HV·K]
       self_attn.b_proj [HV, D]                       -> b_proj [D, HV]
       self_attn.g_a_proj / g_b_proj (+ .bias)        -> g_a [D, V], g_b [V, HV, V], g_bias [HV, V] (0 if absent)
       self_attn.o_norm.weight [V], o_proj [D, HV·V]  -> o_norm [V], o_proj [HV, V, D]
  MLA  self_attn.q_proj [H·(N+R), D]                  -> mixer/mla/wq [D, H, N+R]
       (or q_a_proj, q_a_layernorm, q_b_proj          -> wq_a, q_norm/scale, wq_b)
       self_attn.kv_a_proj_with_mqa [L+R, D]          -> wkv_a [D, L] | wk_rope [D, R]
       self_attn.kv_a_layernorm.weight [L]            -> kv_norm/scale
       self_attn.kv_b_proj [H·(N+V), L]               -> w_uk [L, H, N], w_uv [L, H, V]
       self_attn.o_proj [D, H·V]                      -> wo [H, V, D]
  dense mlp.{gate,up,down}_proj                       -> ffn/dense/{wi_gate, wi_up, wo}
  MoE  block_sparse_moe.gate.weight [E, D]            -> ffn/moe/router [D, E]
       block_sparse_moe.gate.e_score_correction_bias  -> moe_state ffn/moe/bias
       block_sparse_moe.experts.{j}.w1 / w3 / w2      -> w_gate / w_up [E, D, F], w_down [E, F, D]
       block_sparse_moe.shared_experts.{gate,up,down}_proj -> ffn/moe/shared/{wi_gate, wi_up, wo}
  model.norm.weight -> final_norm/scale;  lm_head.weight [V, D] -> lm_head [D, V] (unless tied)
Skipped: rotary_emb buffers and multi-token-prediction layers (index >= num_hidden_layers).

The model this maps onto (`config_from_hf`): no AttnRes (plain pre-norm residuals, as Kimi Linear),
NoPE MLA without output gate, SwiGLU experts, sigmoid router with renormalised top-k times
routed_scaling_factor, no latent MoE. Features Kimi Linear does not use (RoPE MLA, grouped top-k,
softmax routing, un-normalised top-k) are rejected with a ValueError naming the config key.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np

from moonshot_jax.config import ModelConfig
from moonshot_jax.model.transformer import Transformer, stack_layers

_SKIP = (re.compile(r"rotary_emb\."),)


def config_from_hf(hf: Mapping[str, Any], **overrides) -> ModelConfig:
  """ModelConfig for a Kimi-Linear `config.json` dict; `overrides` (e.g. dtype) win."""
  def get(key, default=None, required=True):
    if key not in hf and required and default is None:
      raise ValueError(f"config.json: missing key {key!r}")
    return hf.get(key, default)

  lin = get("linear_attn_config")
  n = int(get("num_hidden_layers"))
  full = tuple(int(i) for i in lin["full_attn_layers"])
  kda = tuple(int(i) for i in lin.get("kda_layers", [i for i in range(1, n + 1) if i not in full]))
  if sorted(full + kda) != list(range(1, n + 1)):
    raise ValueError(f"config.json: linear_attn_config kda_layers {kda} and full_attn_layers {full} must "
                     f"partition layers 1..{n}")
  if not hf.get("mla_use_nope", False):
    raise ValueError("config.json: mla_use_nope=false (RoPE MLA) is not supported by this importer")
  if hf.get("moe_router_activation_func", "sigmoid") != "sigmoid":
    raise ValueError("config.json: moe_router_activation_func must be 'sigmoid'")
  if int(hf.get("num_expert_group", 1) or 1) > 1 and hf.get("use_grouped_topk", True):
    raise ValueError("config.json: grouped top-k routing (num_expert_group > 1) is not supported")
  if not hf.get("moe_renormalize", True):
    raise ValueError("config.json: moe_renormalize=false is not supported (top-k weights are renormalised)")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError("config.json: hidden_act must be 'silu' (SwiGLU)")
  first_dense, freq = int(hf.get("first_k_dense_replace", 0)), int(hf.get("moe_layer_freq", 1))
  has_moe = hf.get("num_experts") is not None
  dense = tuple(i + 1 for i in range(n) if not (has_moe and i >= first_dense and i % freq == 0))
  n_shared = int(hf.get("num_shared_experts") or 0)
  heads, head_dim = int(lin["num_heads"]), int(lin["head_dim"])
  kw = dict(
      vocab_size=int(get("vocab_size")), d_model=int(get("hidden_size")), n_layers=n,
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      init_std=float(hf.get("initializer_range", 0.02)), mla_layers=full, dense_layers=dense,
      kda_num_heads=heads, kda_num_v_heads=heads, kda_head_dim=head_dim, kda_v_head_dim=head_dim,
      kda_conv_size=int(lin.get("short_conv_kernel_size", 4)), kda_output_gate_full_rank=False,
      mla_num_heads=int(get("num_attention_heads")), q_lora_rank=int(hf.get("q_lora_rank") or 0),
      kv_lora_rank=int(get("kv_lora_rank")), qk_nope_head_dim=int(get("qk_nope_head_dim")),
      qk_rope_head_dim=int(get("qk_rope_head_dim")), v_head_dim=int(get("v_head_dim")), mla_use_rope=False,
      mla_output_gate=False, dense_ff_dim=int(get("intermediate_size")),
      num_experts=int(hf.get("num_experts") or 1), num_experts_per_tok=int(hf.get("num_experts_per_token") or 1),
      expert_ff_dim=int(hf.get("moe_intermediate_size") or 1), moe_latent_dim=0,
      shared_ff_dim=n_shared * int(hf.get("moe_intermediate_size") or 0), num_shared_experts=max(n_shared, 1),
      routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)), expert_activation="swiglu",
      attn_res=False, max_seq_len=int(hf.get("max_position_embeddings", 4096)),
      router_norm="none")  # the checkpoint's router reads the raw input and has no input statistics
  kw.update(overrides)
  cfg = ModelConfig(**kw)
  cfg.validate()
  return cfg


class _Tensors:
  """Name -> array access that records which names were used (leftovers are an error)."""

  def __init__(self, tensors: Mapping[str, Any]):
    self._t, self.used = tensors, set()

  def __call__(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    if name not in self._t:
      raise ValueError(f"checkpoint: missing tensor {name!r}")
    x = np.asarray(self._t[name])
    if shape is not None and tuple(x.shape) != tuple(shape):
      raise ValueError(f"checkpoint: {name!r} has shape {tuple(x.shape)}, expected {tuple(shape)}")
    self.used.add(name)
    return x.astype(np.float32)

  def has(self, name: str) -> bool:
    return name in self._t

  def unused(self) -> list[str]:
    return sorted(set(self._t) - self.used)


def _kda(t: _Tensors, p: str, cfg: ModelConfig) -> dict:
  D, H, HV, K, V, W = (cfg.d_model, cfg.kda_num_heads, cfg.kda_num_v_heads, cfg.kda_head_dim,
                       cfg.kda_v_head_dim, cfg.kda_conv_size)
  conv = lambda name, heads, dim: t(f"{p}.{name}.weight", (heads * dim, 1, W))[:, 0, :].T.reshape(W, heads, dim)
  g_bias = (t(f"{p}.g_b_proj.bias", (HV * V,)).reshape(HV, V) if t.has(f"{p}.g_b_proj.bias")
            else np.zeros((HV, V), np.float32))
  return {
      "q_proj": t(f"{p}.q_proj.weight", (H * K, D)).T.reshape(D, H, K),
      "k_proj": t(f"{p}.k_proj.weight", (H * K, D)).T.reshape(D, H, K),
      "v_proj": t(f"{p}.v_proj.weight", (HV * V, D)).T.reshape(D, HV, V),
      "q_conv": conv("q_conv1d", H, K), "k_conv": conv("k_conv1d", H, K), "v_conv": conv("v_conv1d", HV, V),
      "f_a": t(f"{p}.f_a_proj.weight", (K, D)).T,
      "f_b": t(f"{p}.f_b_proj.weight", (HV * K, K)).T.reshape(K, HV, K),
      "A_log": t(f"{p}.A_log").reshape(HV),
      "dt_bias": t(f"{p}.dt_bias", (HV * K,)),
      "b_proj": t(f"{p}.b_proj.weight", (HV, D)).T,
      "g_a": t(f"{p}.g_a_proj.weight", (V, D)).T,
      "g_b": t(f"{p}.g_b_proj.weight", (HV * V, V)).T.reshape(V, HV, V),
      "g_bias": g_bias,
      "o_norm": t(f"{p}.o_norm.weight", (V,)),
      "o_proj": t(f"{p}.o_proj.weight", (D, HV * V)).T.reshape(HV, V, D),
  }


def _mla(t: _Tensors, p: str, cfg: ModelConfig) -> dict:
  D, H, N, R, V, L = (cfg.d_model, cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                      cfg.v_head_dim, cfg.kv_lora_rank)
  out = {}
  if cfg.q_lora_rank > 0:
    Q = cfg.q_lora_rank
    out["wq_a"] = t(f"{p}.q_a_proj.weight", (Q, D)).T
    out["q_norm"] = {"scale": t(f"{p}.q_a_layernorm.weight", (Q,))}
    out["wq_b"] = t(f"{p}.q_b_proj.weight", (H * (N + R), Q)).T.reshape(Q, H, N + R)
  else:
    out["wq"] = t(f"{p}.q_proj.weight", (H * (N + R), D)).T.reshape(D, H, N + R)
  kva = t(f"{p}.kv_a_proj_with_mqa.weight", (L + R, D))
  out["wkv_a"] = kva[:L].T
  if R > 0:
    out["wk_rope"] = kva[L:].T
  out["kv_norm"] = {"scale": t(f"{p}.kv_a_layernorm.weight", (L,))}
  kvb = t(f"{p}.kv_b_proj.weight", (H * (N + V), L)).reshape(H, N + V, L)
  out["w_uk"] = kvb[:, :N].transpose(2, 0, 1)
  out["w_uv"] = kvb[:, N:].transpose(2, 0, 1)
  out["wo"] = t(f"{p}.o_proj.weight", (D, H * V)).T.reshape(H, V, D)
  return out


def _mlp(t: _Tensors, p: str, d: int, f: int) -> dict:
  return {"wi_gate": t(f"{p}.gate_proj.weight", (f, d)).T, "wi_up": t(f"{p}.up_proj.weight", (f, d)).T,
          "wo": t(f"{p}.down_proj.weight", (d, f)).T}


def _moe(t: _Tensors, p: str, cfg: ModelConfig) -> tuple[dict, dict]:
  D, E, F = cfg.d_model, cfg.num_experts, cfg.expert_ff_dim
  ex = lambda w, shape: np.stack([t(f"{p}.experts.{j}.{w}.weight", shape).T for j in range(E)])
  params = {"router": t(f"{p}.gate.weight", (E, D)).T, "w_gate": ex("w1", (F, D)), "w_up": ex("w3", (F, D)),
            "w_down": ex("w2", (D, F))}
  if cfg.shared_ff_dim > 0:
    params["shared"] = _mlp(t, f"{p}.shared_experts", D, cfg.shared_ff_dim)
  bias_name = f"{p}.gate.e_score_correction_bias"
  bias = t(bias_name, (E,)) if t.has(bias_name) else np.zeros((E,), np.float32)
  return params, {"bias": bias}


def convert(tensors: Mapping[str, Any], cfg: ModelConfig) -> dict:
  """HF tensors (name -> array, PyTorch layout) -> our variables {"params", "moe_state"} (numpy fp32,
  cast to cfg.param_dtype). Raises ValueError on a missing, misshapen or unused tensor."""
  t = _Tensors({k: v for k, v in tensors.items()
                if not any(s.search(k) for s in _SKIP) and not _is_mtp(k, cfg)})
  per_layer = []
  for i, (mixer, ffn) in enumerate(cfg.layer_kinds):
    p = f"model.layers.{i}"
    m = {"norm": {"scale": t(f"{p}.input_layernorm.weight", (cfg.d_model,))}}
    m[mixer] = _kda(t, f"{p}.self_attn", cfg) if mixer == "kda" else _mla(t, f"{p}.self_attn", cfg)
    f = {"norm": {"scale": t(f"{p}.post_attention_layernorm.weight", (cfg.d_model,))}}
    layer = {"params": {"mixer": m, "ffn": f}}
    if ffn == "dense":
      f["dense"] = _mlp(t, f"{p}.mlp", cfg.d_model, cfg.dense_ff_dim)
    else:
      f["moe"], state = _moe(t, f"{p}.block_sparse_moe", cfg)
      layer["moe_state"] = {"ffn": {"moe": state}}
    per_layer.append(layer)
  rest = {"params": {"embedding": t("model.embed_tokens.weight", (cfg.vocab_size, cfg.d_model)),
                     "final_norm": {"scale": t("model.norm.weight", (cfg.d_model,))}}, "moe_state": {}}
  if not cfg.tie_embeddings:
    rest["params"]["lm_head"] = t("lm_head.weight", (cfg.vocab_size, cfg.d_model)).T
  if t.unused():
    raise ValueError(f"checkpoint: {len(t.unused())} tensors have no place in the model, e.g. {t.unused()[:5]}")
  variables = stack_layers(per_layer, rest, cfg)
  variables = {"params": variables["params"], "moe_state": variables.get("moe_state", {})}
  want = _model_tree(cfg)
  _check_against_model(variables, want)
  # A_log / dt_bias / norm scales / the router stay fp32 whatever param_dtype (as the layers create them)
  return jax.tree.map(lambda x, w: np.asarray(x, w.dtype), variables, want)


def _is_mtp(name: str, cfg: ModelConfig) -> bool:
  m = re.match(r"model\.layers\.(\d+)\.", name)
  return bool(m) and int(m.group(1)) >= cfg.n_layers


def _model_tree(cfg: ModelConfig) -> dict:
  """Abstract {"params", "moe_state"} of `Transformer(cfg).init` (shapes and dtypes)."""
  import flax.linen as nn
  want = nn.meta.unbox(jax.eval_shape(
      lambda: Transformer(cfg).init(jax.random.key(0), jax.numpy.zeros((1, 2), jax.numpy.int32))))
  return {"params": want["params"], "moe_state": want.get("moe_state", {})}


def _check_against_model(variables: dict, want: dict) -> None:
  """Same tree and shapes as the model's init (so apply can never silently misplace a weight)."""
  got_s = jax.tree_util.tree_flatten_with_path(jax.tree.map(lambda x: str(tuple(x.shape)), variables))[0]
  want_s = jax.tree_util.tree_flatten_with_path(jax.tree.map(lambda x: str(tuple(x.shape)), want))[0]
  got_d = {jax.tree_util.keystr(k): v for k, v in got_s}
  want_d = {jax.tree_util.keystr(k): v for k, v in want_s}
  if got_d != want_d:
    missing = sorted(set(want_d) - set(got_d))[:5]
    extra = sorted(set(got_d) - set(want_d))[:5]
    wrong = [k for k in set(got_d) & set(want_d) if got_d[k] != want_d[k]][:5]
    raise ValueError(f"converted tree does not match the model: missing {missing}, extra {extra}, "
                     f"wrong shapes {[(k, got_d[k], want_d[k]) for k in wrong]}")


def read_safetensors(directory: str | Path) -> dict[str, np.ndarray]:
  """Every tensor of the *.safetensors files in `directory` (numpy, bf16 via ml_dtypes)."""
  from safetensors.numpy import load_file  # optional dependency: pip install safetensors
  files = sorted(Path(directory).glob("*.safetensors"))
  if not files:
    raise ValueError(f"directory: no *.safetensors files in {directory}")
  out: dict[str, np.ndarray] = {}
  for f in files:
    part = load_file(str(f))
    dup = set(part) & set(out)
    if dup:
      raise ValueError(f"checkpoint: tensors {sorted(dup)[:3]} appear in more than one file ({f.name})")
    out.update(part)
  return out


def load_hf_checkpoint(directory: str | Path, **config_overrides) -> tuple[ModelConfig, dict]:
  """(cfg, variables) from a Kimi-Linear-style checkpoint directory (config.json + safetensors)."""
  directory = Path(directory)
  cfg_path = directory / "config.json"
  if not cfg_path.is_file():
    raise ValueError(f"directory: {cfg_path} not found")
  cfg = config_from_hf(json.loads(cfg_path.read_text()), **config_overrides)
  return cfg, convert(read_safetensors(directory), cfg)
