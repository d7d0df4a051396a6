"""The released Kimi K3 hub layout (moonshotai/Kimi-K3, `KimiK3ForConditionalGeneration`) <-> our tree.

Layout as read by the public ports (NeMo-AutoModel `components/models/kimi_k3/{config,model,
state_dict_adapter}.py`; notes: /work/notes/k3ckpt.md). config.json: model_type "kimi_k3",
`text_config` (model_type "kimi_linear" + K3 keys) and `vision_config` (MoonViT-V2, passed through
untouched for moonshot_jax.vision). Text tensors live under "language_model.", vision ones under
"vision_tower." / "mm_projector.". PyTorch Linear weights are [out, in]: our kernels are [in, ...out].

  P = language_model.model.layers.{i}
  P.self_attention_res_norm.weight [D] * P.self_attention_res_proj.weight [1, D] -> mixer/site/query
  P.mlp_res_norm.weight [D] * P.mlp_res_proj.weight [1, D]                       -> ffn/site/query
      (K3 scores a source v as sum(rmsnorm(v) * norm_w * proj_w): our pseudo-query is that product;
       export writes norm = 1, proj = query, which imports back to the same query bit for bit)
  P.input_layernorm / post_attention_layernorm.weight [D]          -> mixer|ffn/norm/scale
  KDA  self_attn.{q,k,v}_proj [H·K, D], {q,k,v}_conv1d [H·K, 1, W]  -> {q,k,v}_proj [D,H,K], _conv [W,H,K]
       f_a_proj [K, D], f_b_proj [H·K, K]                           -> f_a [D,K], f_b [K,H,K] (forget gate)
       g_proj [H·V, D]                                              -> g_proj [D,H,V] (full-rank output gate)
         (or Kimi Linear's g_a_proj / g_b_proj (+ bias) when use_full_rank_gate is false)
       A_log [H rounded up to 128, zero padded] (or [1,1,H,1]), dt_bias [H·K] -> A_log [H], dt_bias
       b_proj [H, D], o_norm.weight [V], o_proj [D, H·V]           -> b_proj [D,H], o_norm, o_proj [H,V,D]
  MLA  q_a_proj [Q, D], q_a_layernorm [Q], q_b_proj [H·(N+R), Q]    -> wq_a, q_norm/scale, wq_b [Q,H,N+R]
       kv_a_proj_with_mqa [L+R, D] -> wkv_a [D,L] | wk_rope [D,R];  kv_a_layernorm [L] -> kv_norm/scale
       kv_b_proj [H·(N+V), L] -> w_uk [L,H,N], w_uv [L,H,V];  o_proj [D, H·V] -> wo [H,V,D]
       g_proj [H·V, D] -> w_gate [D,H,V] (mla_use_output_gate)
  dense  mlp.{gate,up,down}_proj                                    -> ffn/dense/{wi_gate, wi_up, wo}
  MoE  block_sparse_moe.gate.weight [E, D] -> router [D,E]; .gate.e_score_correction_bias -> moe_state bias
       routed_expert_down_proj [l, D] / routed_expert_up_proj [D, l] -> latent_down [D,l] / latent_up [l,D]
       routed_expert_norm.weight [l] -> latent_norm/scale
       experts.{j}.w1 / w3 (gate / up) [F, l], w2 (down) [l, F], each as weight_packed [out, in/2] +
         weight_scale [out, in/32] (MXFP4, layers/mxfp4.py) or a plain .weight -> w_gate/w_up[j] [l,F], w_down[j]
       shared_experts.{gate,up,down}_proj -> ffn/moe/shared/{wi_gate, wi_up, wo}
  language_model.model.embed_tokens [V, D], .norm [D], .output_attn_res_{norm,proj} -> final_site/query,
  language_model.lm_head.weight [V, D] -> lm_head [D, V]
Multi-token-prediction layers (index >= num_hidden_layers) are skipped BY NAME and reported.

`Piece`s are the unit of both directions: one leaf of one layer (or of one expert), the hub tensors
it is made of, and the exact transforms each way. hub_stream.py streams them.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from moonshot_jax.config import ConfigError, ModelConfig

TEXT = "language_model."
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
_LAYER = re.compile(r"^language_model\.model\.layers\.(\d+)\.")

# text_config keys that are read (mapped or checked) ...
_READ = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "hidden_act", "initializer_range", "rms_norm_eps", "tie_word_embeddings",
    "max_position_embeddings", "moe_intermediate_size", "moe_renormalize", "moe_router_activation_func",
    "num_experts", "num_experts_per_token", "num_shared_experts", "routed_scaling_factor",
    "first_k_dense_replace", "moe_layer_freq", "use_grouped_topk", "num_expert_group", "topk_group",
    "topk_method", "routed_expert_hidden_size", "latent_moe_use_norm", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mla_use_nope", "mla_use_output_gate",
    "linear_attn_config", "attn_res_block_size", "activation_situ_beta", "activation_situ_linear_beta",
    "num_nextn_predict_layers", "quantization_config", "rope_scaling", "model_type",
}
# ... and the ones that carry no architecture (token ids, kernel / runtime switches, HF bookkeeping).
_IGNORED = {
    "head_dim", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "architectures", "rope_theta",
    "attention_dropout", "kda_mode", "kda_unpad_inputs", "kda_use_fused_gate", "kda_chunk_impl",
    "kda_use_qk_l2norm_in_kernel", "kda_disable_recompute", "kda_conv_backend", "kda_transpose_state_layout",
    "situ_backend", "attn_res_triton", "torch_dtype", "dtype", "transformers_version", "auto_map",
    "_name_or_path", "model_max_length", "_attn_implementation_autoset", "return_dict", "output_attentions",
    "output_hidden_states", "use_return_dict", "tie_encoder_decoder", "is_encoder_decoder",
}
_TOP_READ = {"text_config", "vision_config", "model_type"}
_TOP_IGNORED = {"architectures", "auto_map", "torch_dtype", "dtype", "transformers_version", "ignore_index",
                "media_placeholder_token_id", "pad_token_id", "bos_token_id", "eos_token_id", "hidden_size",
                "vocab_size", "max_position_embeddings", "quantization_config", "tie_word_embeddings",
                "_name_or_path", "use_cache"}
_LIN_KEYS = {"num_heads", "head_dim", "short_conv_kernel_size", "kda_layers", "full_attn_layers",
             "use_full_rank_gate", "gate_lower_bound"}


def is_k3_config(hf: Mapping[str, Any]) -> bool:
  return hf.get("model_type") == "kimi_k3" or "text_config" in hf


def split_config(hf: Mapping[str, Any]) -> tuple[dict, dict | None]:
  """(text_config, vision_config or None) of a K3 top-level config.json; unknown top keys are errors."""
  unknown = sorted(set(hf) - _TOP_READ - _TOP_IGNORED)
  if unknown:
    raise ConfigError(f"config.json: unknown top-level key(s) {unknown} for a kimi_k3 checkpoint")
  if "text_config" not in hf:
    raise ConfigError("config.json: a kimi_k3 checkpoint needs a text_config section")
  return dict(hf["text_config"]), (dict(hf["vision_config"]) if hf.get("vision_config") is not None else None)


def architecture(text: Mapping[str, Any]) -> dict[str, Any]:
  """ModelConfig fields fixed by a K3 `text_config` (the training knobs -- dtype, remat, balancing,
  ... -- are the experiment's). Unsupported values and unknown keys raise ConfigError naming the key."""
  unknown = sorted(set(text) - _READ - _IGNORED)
  if unknown:
    raise ConfigError(f"config.json text_config: unknown key(s) {unknown}")

  def get(key, default=None):
    if key not in text and default is None:
      raise ConfigError(f"config.json text_config: missing key {key!r}")
    return text.get(key, default)

  def need(cond, key, msg):
    if not cond:
      raise ConfigError(f"config.json text_config.{key}: {msg} (got {text.get(key)!r})")

  lin = dict(get("linear_attn_config"))
  bad = sorted(set(lin) - _LIN_KEYS)
  if bad:
    raise ConfigError(f"config.json text_config.linear_attn_config: unknown key(s) {bad}")
  n = int(get("num_hidden_layers"))
  full = tuple(int(i) for i in lin["full_attn_layers"])
  kda = tuple(int(i) for i in lin["kda_layers"])
  if sorted(full + kda) != list(range(1, n + 1)):
    raise ConfigError(f"config.json text_config.linear_attn_config: kda_layers {kda} and full_attn_layers "
                      f"{full} must partition layers 1..{n}")
  need(get("hidden_act") == "situ", "hidden_act", "K3 uses 'situ' (SiTU-GLU) everywhere")
  need(bool(get("mla_use_nope", True)), "mla_use_nope", "K3 MLA is NoPE (true)")
  need(text.get("rope_scaling") is None, "rope_scaling", "NoPE MLA has no rotary scaling")
  need(get("moe_router_activation_func", "sigmoid") == "sigmoid", "moe_router_activation_func", "must be sigmoid")
  need(bool(get("moe_renormalize", True)), "moe_renormalize", "top-k weights are renormalised (true)")
  need(int(text.get("num_expert_group") or 1) == 1, "num_expert_group", "grouped top-k is not supported")
  need(text.get("topk_method", "noaux_tc") == "noaux_tc", "topk_method", "must be noaux_tc (bias-only selection)")
  need(bool(get("latent_moe_use_norm", True)), "latent_moe_use_norm", "the latent MoE always has its norm")
  need(not text.get("tie_word_embeddings", False), "tie_word_embeddings", "K3 is untied")
  heads = int(get("num_attention_heads"))
  need(int(text.get("num_key_value_heads") or heads) == heads, "num_key_value_heads",
       f"MLA has one latent for all heads: must equal num_attention_heads={heads}")
  first_dense, freq = int(get("first_k_dense_replace", 0)), int(get("moe_layer_freq", 1))
  dense = tuple(i + 1 for i in range(n) if not (i >= first_dense and i % freq == 0))
  n_shared, moe_ff = int(get("num_shared_experts", 0) or 0), int(get("moe_intermediate_size"))
  block = text.get("attn_res_block_size")
  return dict(
      vocab_size=int(get("vocab_size")), d_model=int(get("hidden_size")), n_layers=n, tie_embeddings=False,
      norm_eps=float(get("rms_norm_eps")), init_std=float(text.get("initializer_range", 0.02)),
      mla_layers=full, dense_layers=dense,
      kda_num_heads=int(lin["num_heads"]), kda_num_v_heads=int(lin["num_heads"]),
      kda_head_dim=int(lin["head_dim"]), kda_v_head_dim=int(lin["head_dim"]),
      kda_conv_size=int(lin.get("short_conv_kernel_size", 4)),
      kda_output_gate_full_rank=bool(lin.get("use_full_rank_gate", False)),
      kda_gate_lower_bound=(None if lin.get("gate_lower_bound") is None else float(lin["gate_lower_bound"])),
      mla_num_heads=heads, q_lora_rank=int(text.get("q_lora_rank") or 0), kv_lora_rank=int(get("kv_lora_rank")),
      qk_nope_head_dim=int(get("qk_nope_head_dim")), qk_rope_head_dim=int(get("qk_rope_head_dim")),
      v_head_dim=int(get("v_head_dim")), mla_use_rope=False, mla_output_gate=bool(get("mla_use_output_gate", False)),
      dense_ff_dim=int(get("intermediate_size")), dense_activation="situ",
      num_experts=int(get("num_experts")), num_experts_per_tok=int(get("num_experts_per_token")),
      expert_ff_dim=moe_ff, moe_latent_dim=int(text.get("routed_expert_hidden_size") or 0),
      shared_ff_dim=n_shared * moe_ff, num_shared_experts=max(n_shared, 1),
      routed_scaling_factor=float(get("routed_scaling_factor", 1.0)), expert_activation="situ",
      situ_beta=float(get("activation_situ_beta", 4.0)),
      situ_beta_linear=float(get("activation_situ_linear_beta", 25.0)),
      attn_res=block is not None, attn_res_block_size=int(block or 1),
      max_seq_len=int(get("max_position_embeddings")),
      router_norm="none")  # K3's gate reads the raw hidden state; the format has no input statistics


def check_against(cfg: ModelConfig, arch: Mapping[str, Any], source: str = "the experiment config") -> None:
  """ConfigError listing every architecture field where `cfg` and the checkpoint disagree."""
  diff = [f"{k}: checkpoint {v!r}, {source} {getattr(cfg, k)!r}" for k, v in arch.items()
          if getattr(cfg, k) != v and not (k == "max_seq_len") and not (k == "attn_res_block_size" and not cfg.attn_res)]
  if diff:
    raise ConfigError("the checkpoint does not match the model config:\n  " + "\n  ".join(diff))


def text_config_for(cfg: ModelConfig, quantized: bool) -> dict[str, Any]:
  """A K3 text_config for `cfg` (export); `architecture` of it gives back cfg's architecture fields."""
  if cfg.router_norm != "none":
    raise ValueError(f"router_norm {cfg.router_norm!r}: K3's gate reads the raw hidden state; export needs "
                     "model.router_norm=none (the router-input statistics have no place in the format)")
  dense = set(cfg.dense_layers)
  first = next((i for i in range(cfg.n_layers) if (i + 1) not in dense), cfg.n_layers)
  if dense != set(range(1, first + 1)):
    raise ValueError(f"dense_layers {cfg.dense_layers}: K3's config expresses only the first k layers as dense")
  if cfg.shared_ff_dim % cfg.expert_ff_dim or cfg.expert_activation != "situ" or cfg.dense_activation != "situ":
    raise ValueError("export: K3's layout needs SiTU experts and dense FFN and shared_ff_dim = n * expert_ff_dim")
  if cfg.kda_num_heads != cfg.kda_num_v_heads or cfg.kda_head_dim != cfg.kda_v_head_dim:
    raise ValueError("export: K3's linear_attn_config has one head count and one head dim for q/k and v")
  t = dict(
      model_type="kimi_linear", vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
      intermediate_size=cfg.dense_ff_dim, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.mla_num_heads,
      num_key_value_heads=cfg.mla_num_heads, hidden_act="situ", initializer_range=cfg.init_std,
      rms_norm_eps=cfg.norm_eps, tie_word_embeddings=False, max_position_embeddings=cfg.max_seq_len,
      moe_intermediate_size=cfg.expert_ff_dim, moe_renormalize=True, moe_router_activation_func="sigmoid",
      num_experts=cfg.num_experts, num_experts_per_token=cfg.num_experts_per_tok,
      num_shared_experts=cfg.shared_ff_dim // cfg.expert_ff_dim, routed_scaling_factor=cfg.routed_scaling_factor,
      first_k_dense_replace=first, moe_layer_freq=1, num_expert_group=1, topk_group=1, topk_method="noaux_tc",
      routed_expert_hidden_size=cfg.moe_latent_dim or None, latent_moe_use_norm=True,
      q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
      qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, mla_use_nope=True,
      mla_use_output_gate=cfg.mla_output_gate,
      linear_attn_config=dict(num_heads=cfg.kda_num_heads, head_dim=cfg.kda_head_dim,
                              short_conv_kernel_size=cfg.kda_conv_size,
                              kda_layers=[i for i in range(1, cfg.n_layers + 1) if i not in cfg.mla_layers],
                              full_attn_layers=list(cfg.mla_layers),
                              use_full_rank_gate=cfg.kda_output_gate_full_rank,
                              gate_lower_bound=cfg.kda_gate_lower_bound),
      attn_res_block_size=cfg.attn_res_block_size if cfg.attn_res else None,
      activation_situ_beta=cfg.situ_beta, activation_situ_linear_beta=cfg.situ_beta_linear,
      num_nextn_predict_layers=0)
  if quantized:
    t["quantization_config"] = mxfp4_quantization_config()
  return t


def mxfp4_quantization_config() -> dict[str, Any]:
  """compressed-tensors style record of what is MXFP4: the routed experts' w1/w2/w3."""
  return {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
          "config_groups": {"group_0": {"targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"],
                                        "weights": {"num_bits": 4, "type": "float", "group_size": 32,
                                                    "strategy": "group", "symmetric": True,
                                                    "scale_dtype": "e8m0"}}}}


# ---------------------------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Piece:
  """One leaf of one layer (layer=None: a top-level leaf), or its slot `expert` of a routed-expert
  leaf [E, in, out]. `hub` lists its tensors with their hub shapes; `to_ours(arrays) -> ours`,
  `to_hub(ours) -> arrays` are exact inverses up to dtype (ours float32)."""
  collection: str  # "params" | "moe_state"
  path: tuple[str, ...]  # within the layer ({"mixer", "ffn"}...) or the top level
  layer: int | None
  expert: int | None
  hub: tuple[tuple[str, tuple[int, ...]], ...]
  shape: tuple[int, ...]  # ours (of this layer / expert)
  to_ours: Callable[[Sequence[np.ndarray]], np.ndarray]
  to_hub: Callable[[np.ndarray], list[np.ndarray]]
  mxfp4: bool = False  # hub tensors are (weight_packed, weight_scale)


def _lin(out_in_split, ours_shape):
  """PyTorch [out, in] <-> ours [in, *out_split] (transpose + reshape); `out_in_split` unused."""
  def fwd(a):
    return a[0].T.reshape(ours_shape)

  def back(x):
    return [np.ascontiguousarray(x.reshape(ours_shape[0], -1).T)]
  return fwd, back


def _lin_out_first(ours_shape):
  """PyTorch [out, in] <-> ours [*in_split, out] (o_proj-like: [H, V, D] from [D, H·V])."""
  def fwd(a):
    return a[0].T.reshape(ours_shape)

  def back(x):
    return [np.ascontiguousarray(x.reshape(-1, ours_shape[-1]).T)]
  return fwd, back


def _same(shape):
  return (lambda a: a[0].reshape(shape)), (lambda x: [np.asarray(x)])


def _query(d):
  """(res_norm [D], res_proj [1, D]) -> query = norm * proj in float32; back: (ones, query)."""
  def fwd(a):
    return a[0].astype(np.float32) * a[1].astype(np.float32).reshape(d)

  def back(x):
    return [np.ones((d,), np.float32), np.asarray(x, np.float32).reshape(1, d)]
  return fwd, back


def a_log_hub_size(heads: int) -> int:
  return ((heads + 127) // 128) * 128


def _piece(col, path, layer, hub, shape, fns, expert=None, mxfp4=False):
  return Piece(col, tuple(path), layer, expert, tuple((n, tuple(s)) for n, s in hub), tuple(shape),
               fns[0], fns[1], mxfp4)


def _lin_piece(path, layer, name, out_dim, in_dim, ours_shape, out_first=False):
  fns = _lin_out_first(ours_shape) if out_first else _lin(None, ours_shape)
  return _piece("params", path, layer, [(name, (out_dim, in_dim))], ours_shape, fns)


def _kda_pieces(cfg: ModelConfig, i: int, p: str) -> list[Piece]:
  D, H, K, W = cfg.d_model, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
  a = p + "self_attn."
  base = ("mixer", "kda")
  out = [_lin_piece(base + (f"{n}_proj",), i, f"{a}{n}_proj.weight", H * K, D, (D, H, K)) for n in "qkv"]
  for n in "qkv":
    fwd = lambda arr: arr[0][:, 0, :].T.reshape(W, H, K)
    back = lambda x: [np.ascontiguousarray(x.reshape(W, H * K).T[:, None, :])]
    out.append(_piece("params", base + (f"{n}_conv",), i, [(f"{a}{n}_conv1d.weight", (H * K, 1, W))], (W, H, K),
                      (fwd, back)))
  out.append(_lin_piece(base + ("f_a",), i, f"{a}f_a_proj.weight", K, D, (D, K)))
  out.append(_lin_piece(base + ("f_b",), i, f"{a}f_b_proj.weight", H * K, K, (K, H, K)))
  hub_a = a_log_hub_size(H)
  out.append(_piece("params", base + ("A_log",), i, [(f"{a}A_log", (hub_a,))], (H,),
                    (lambda arr: np.asarray(arr[0]).reshape(-1)[:H],
                     lambda x: [np.concatenate([np.asarray(x, np.float32), np.zeros(hub_a - H, np.float32)])])))
  out.append(_piece("params", base + ("dt_bias",), i, [(f"{a}dt_bias", (H * K,))], (H * K,), _same((H * K,))))
  out.append(_lin_piece(base + ("b_proj",), i, f"{a}b_proj.weight", H, D, (D, H)))
  if cfg.kda_output_gate_full_rank:
    out.append(_lin_piece(base + ("g_proj",), i, f"{a}g_proj.weight", H * K, D, (D, H, K)))
  else:
    out.append(_lin_piece(base + ("g_a",), i, f"{a}g_a_proj.weight", K, D, (D, K)))
    out.append(_lin_piece(base + ("g_b",), i, f"{a}g_b_proj.weight", H * K, K, (K, H, K)))
    out.append(_piece("params", base + ("g_bias",), i, [(f"{a}g_b_proj.bias", (H * K,))], (H, K), _same((H, K))))
  out.append(_piece("params", base + ("o_norm",), i, [(f"{a}o_norm.weight", (K,))], (K,), _same((K,))))
  out.append(_lin_piece(base + ("o_proj",), i, f"{a}o_proj.weight", D, H * K, (H, K, D), out_first=True))
  return out


def _mla_pieces(cfg: ModelConfig, i: int, p: str) -> list[Piece]:
  D, H, N, R, V, L, Q = (cfg.d_model, cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                         cfg.v_head_dim, cfg.kv_lora_rank, cfg.q_lora_rank)
  a = p + "self_attn."
  base = ("mixer", "mla")
  out = []
  if Q > 0:
    out.append(_lin_piece(base + ("wq_a",), i, f"{a}q_a_proj.weight", Q, D, (D, Q)))
    out.append(_piece("params", base + ("q_norm", "scale"), i, [(f"{a}q_a_layernorm.weight", (Q,))], (Q,), _same((Q,))))
    out.append(_lin_piece(base + ("wq_b",), i, f"{a}q_b_proj.weight", H * (N + R), Q, (Q, H, N + R)))
  else:
    out.append(_lin_piece(base + ("wq",), i, f"{a}q_proj.weight", H * (N + R), D, (D, H, N + R)))
  kva = [(f"{a}kv_a_proj_with_mqa.weight", (L + R, D))]
  if R > 0:  # one hub tensor, two leaves: each piece reads it and keeps its rows; export re-joins them
    out.append(_piece("params", base + ("wkv_a",), i, kva, (D, L), (lambda arr: arr[0][:L].T, None)))
    out.append(_piece("params", base + ("wk_rope",), i, kva, (D, R), (lambda arr: arr[0][L:].T, None)))
  else:
    out.append(_lin_piece(base + ("wkv_a",), i, kva[0][0], L, D, (D, L)))
  out.append(_piece("params", base + ("kv_norm", "scale"), i, [(f"{a}kv_a_layernorm.weight", (L,))], (L,), _same((L,))))
  kvb = [(f"{a}kv_b_proj.weight", (H * (N + V), L))]
  out.append(_piece("params", base + ("w_uk",), i, kvb, (L, H, N),
                    (lambda arr: arr[0].reshape(H, N + V, L)[:, :N].transpose(2, 0, 1), None)))
  out.append(_piece("params", base + ("w_uv",), i, kvb, (L, H, V),
                    (lambda arr: arr[0].reshape(H, N + V, L)[:, N:].transpose(2, 0, 1), None)))
  out.append(_lin_piece(base + ("wo",), i, f"{a}o_proj.weight", D, H * V, (H, V, D), out_first=True))
  if cfg.mla_output_gate:
    out.append(_lin_piece(base + ("w_gate",), i, f"{a}g_proj.weight", H * V, D, (D, H, V)))
  return out


def _mlp_pieces(base, i, p, d, f) -> list[Piece]:
  return [_lin_piece(base + ("wi_gate",), i, f"{p}gate_proj.weight", f, d, (d, f)),
          _lin_piece(base + ("wi_up",), i, f"{p}up_proj.weight", f, d, (d, f)),
          _lin_piece(base + ("wo",), i, f"{p}down_proj.weight", d, f, (f, d))]


def expert_tensor_names(prefix: str, mxfp4: bool) -> tuple[str, ...]:
  return (prefix + ".weight_packed", prefix + ".weight_scale") if mxfp4 else (prefix + ".weight",)


def _moe_pieces(cfg: ModelConfig, i: int, p: str, experts_mxfp4: bool) -> list[Piece]:
  from moonshot_jax.layers import mxfp4 as mx
  D, E, F, lat = cfg.d_model, cfg.num_experts, cfg.expert_ff_dim, cfg.moe_latent_dim
  width = lat if lat > 0 else D
  m = p + "block_sparse_moe."
  base = ("ffn", "moe")
  out = [_lin_piece(base + ("router",), i, f"{m}gate.weight", E, D, (D, E)),
         _piece("moe_state", base + ("bias",), i, [(f"{m}gate.e_score_correction_bias", (E,))], (E,), _same((E,)))]
  if lat > 0:
    out.append(_lin_piece(base + ("latent_down",), i, f"{m}routed_expert_down_proj.weight", lat, D, (D, lat)))
    out.append(_lin_piece(base + ("latent_up",), i, f"{m}routed_expert_up_proj.weight", D, lat, (lat, D)))
    out.append(_piece("params", base + ("latent_norm", "scale"), i, [(f"{m}routed_expert_norm.weight", (lat,))],
                      (lat,), _same((lat,))))
  for leaf, w, (o, n) in (("w_gate", "w1", (F, width)), ("w_up", "w3", (F, width)), ("w_down", "w2", (width, F))):
    for j in range(E):
      names = expert_tensor_names(f"{m}experts.{j}.{w}", experts_mxfp4)
      if experts_mxfp4:
        hub = [(names[0], (o, n // 2)), (names[1], (o, n // mx.BLOCK))]
        # dtype: hub_stream.piece_value decodes straight to the leaf's dtype (no float32 detour) and
        # asks for sum |W| too (with_abs_sum: (ours, sum), taken from the packed bytes: its fingerprint)
        def fwd(arr, dtype=np.float32, name=names[0], with_abs_sum=False):
          ours, abs_sum = mx.dequantize_np_t(arr[0], arr[1], dtype, name)
          return (ours, abs_sum) if with_abs_sum else ours
        back = lambda x, name=names[0]: list(mx.quantize(np.asarray(x).T, name))
      else:
        hub = [(names[0], (o, n))]
        fwd, back = (lambda arr: arr[0].T), (lambda x: [np.ascontiguousarray(np.asarray(x).T)])
      out.append(_piece("params", base + (leaf,), i, hub, (n, o), (fwd, back), expert=j, mxfp4=experts_mxfp4))
  if cfg.shared_ff_dim > 0:
    out += _mlp_pieces(base + ("shared",), i, m + "shared_experts.", D, cfg.shared_ff_dim)
  return out


def pieces(cfg: ModelConfig, experts_mxfp4: bool = True) -> list[Piece]:
  """Every piece of the model `cfg` in the K3 hub layout (experts as MXFP4 pairs or plain weights)."""
  D = cfg.d_model
  out: list[Piece] = []
  for i, (mixer, ffn) in enumerate(cfg.layer_kinds):
    p = f"{TEXT}model.layers.{i}."
    if cfg.attn_res:
      out.append(_piece("params", ("mixer", "site", "query"), i,
                        [(p + "self_attention_res_norm.weight", (D,)), (p + "self_attention_res_proj.weight", (1, D))],
                        (D,), _query(D)))
      out.append(_piece("params", ("ffn", "site", "query"), i,
                        [(p + "mlp_res_norm.weight", (D,)), (p + "mlp_res_proj.weight", (1, D))], (D,), _query(D)))
    out.append(_piece("params", ("mixer", "norm", "scale"), i, [(p + "input_layernorm.weight", (D,))], (D,), _same((D,))))
    out.append(_piece("params", ("ffn", "norm", "scale"), i, [(p + "post_attention_layernorm.weight", (D,))], (D,),
                      _same((D,))))
    out += _kda_pieces(cfg, i, p) if mixer == "kda" else _mla_pieces(cfg, i, p)
    if ffn == "dense":
      out += _mlp_pieces(("ffn", "dense"), i, p + "mlp.", D, cfg.dense_ff_dim)
    else:
      out += _moe_pieces(cfg, i, p, experts_mxfp4)
  t = TEXT + "model."
  out.append(_piece("params", ("embedding",), None, [(t + "embed_tokens.weight", (cfg.vocab_size, D))],
                    (cfg.vocab_size, D), _same((cfg.vocab_size, D))))
  out.append(_piece("params", ("final_norm", "scale"), None, [(t + "norm.weight", (D,))], (D,), _same((D,))))
  if cfg.attn_res:
    out.append(_piece("params", ("final_site", "query"), None,
                      [(t + "output_attn_res_norm.weight", (D,)), (t + "output_attn_res_proj.weight", (1, D))],
                      (D,), _query(D)))
  out.append(_lin_piece(("lm_head",), None, TEXT + "lm_head.weight", cfg.vocab_size, D, (D, cfg.vocab_size)))
  return out


def joint_to_hub(group: Sequence[Piece], values: Sequence[np.ndarray]) -> list[np.ndarray]:
  """Hub tensors of pieces that share one hub tensor (MLA kv_a / kv_b), from their values."""
  names = [pc.path[-1] for pc in group]
  vals = dict(zip(names, values))
  if names[:1] == ["wkv_a"]:
    return [np.ascontiguousarray(np.concatenate([vals["wkv_a"].T, vals["wk_rope"].T], axis=0))]
  if names[:1] == ["w_uk"]:
    uk, uv = vals["w_uk"].transpose(1, 2, 0), vals["w_uv"].transpose(1, 2, 0)  # [H, N, L], [H, V, L]
    return [np.ascontiguousarray(np.concatenate([uk, uv], axis=1).reshape(-1, uk.shape[-1]))]
  raise AssertionError(f"no joint export for {names}")


def classify_extra(name: str, cfg: ModelConfig) -> str | None:
  """"vision" / "mtp" for tensors that are skipped by name, None for an unknown tensor."""
  if name.startswith(VISION_PREFIXES):
    return "vision"
  m = _LAYER.match(name)
  if m and int(m.group(1)) >= cfg.n_layers:
    return "mtp"
  return None


def hub_bytes(shape, dtype) -> int:
  return int(math.prod(shape)) * np.dtype(dtype).itemsize
