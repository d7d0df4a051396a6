"""Kimi K2.5 / K3 vision towers from a Hugging Face checkpoint directory (hub layout).

  config.json: `vision_config` (vt_hidden_size, vt_num_attention_heads, vt_intermediate_size,
      vt_num_hidden_layers, qkv_hidden_size (K3), init_pos_emb_{height,width,time}, merge_kernel_size,
      pos_emb_interpolation_mode, projector_ln_eps, text_hidden_size) and `text_config.hidden_size`.
  safetensors: vision_tower.patch_embed.{proj, pos_emb}, vision_tower.encoder.blocks.{i}.{norm0, norm1,
      wqkv, wo, mlp.fc0, mlp.fc1}, vision_tower.encoder.final_layernorm,
      mm_projector.{pre_norm (K2.5), proj.0, proj.2, post_norm (K3)}.

The hub's fused wqkv keeps each head's q and k rows as interleaved RoPE pairs (row 2i, 2i+1 rotate
together); the encoder rotates halves (row i with row i + D/2), so those rows are de-interleaved here,
as transformers does on load. Which norm (LayerNorm has a bias), whether there are biases and which
projector norm come from the tensors present; the config must agree with the tensor shapes.
"""
from __future__ import annotations

import glob
import json
import os

import numpy as np

from moonshot_jax.vision.config import VisionConfig

_PREFIXES = ("vision_tower.", "mm_projector.")


def vision_config_from_hf(config: dict, tensors: dict[str, np.ndarray]) -> VisionConfig:
  """VisionConfig of a hub config.json dict and the checkpoint's vision tensors."""
  if "vision_config" not in config:
    raise ValueError("config.json: no 'vision_config' section (not a vision checkpoint)")
  vc = config["vision_config"]
  text = config.get("text_config") or {}

  def get(*names, default=None):
    for n in names:
      if n in vc:
        return vc[n]
    if default is None:
      raise ValueError(f"config.json: vision_config has none of {names}")
    return default

  width = int(get("vt_hidden_size", "hidden_size"))
  heads = int(get("vt_num_attention_heads", "num_attention_heads"))
  qkv = int(get("qkv_hidden_size", default=width))
  out_dim = int(vc.get("text_hidden_size") or text.get("hidden_size") or 0)
  if not out_dim:
    raise ValueError("config.json: neither vision_config.text_hidden_size nor text_config.hidden_size")
  layernorm = "vision_tower.encoder.blocks.0.norm0.bias" in tensors
  bias = "vision_tower.encoder.blocks.0.wqkv.bias" in tensors
  post = "mm_projector.post_norm.weight" in tensors
  cfg = VisionConfig(
      patch_size=int(get("patch_size", default=14)), width=width, num_heads=heads,
      head_dim=qkv // heads, mlp_dim=int(get("vt_intermediate_size", "intermediate_size")),
      n_layers=int(get("vt_num_hidden_layers", "num_hidden_layers")),
      pos_emb_height=int(get("init_pos_emb_height", "pos_emb_height", default=64)),
      pos_emb_width=int(get("init_pos_emb_width", "pos_emb_width", default=64)),
      pos_emb_time=int(get("init_pos_emb_time", "pos_emb_time", default=4)),
      merge_kernel=tuple(int(k) for k in get("merge_kernel_size", default=[2, 2])),
      norm="layernorm" if layernorm else "rmsnorm", use_bias=bias,
      norm_eps=float(get("projector_ln_eps", default=1e-5)),
      interpolation=str(get("pos_emb_interpolation_mode", default="bicubic")),
      projector_norm="post" if post else "pre", out_dim=out_dim,
      max_patches=16384 if layernorm else 65536)
  cfg.validate()
  return cfg


def _t(tensors, name, shape):
  if name not in tensors:
    raise ValueError(f"checkpoint: missing tensor {name!r}")
  x = np.asarray(tensors[name], np.float32)
  if x.shape != tuple(shape):
    raise ValueError(f"checkpoint: {name} has shape {x.shape}, expected {tuple(shape)} from config.json")
  return x


def deinterleave_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
  """Rows [heads * D, ...] from per-head (pair, 2) order to (2, pair): rotate-half layout."""
  d = w.shape[0] // heads
  return w.reshape(heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def variables_from_hub(cfg: VisionConfig, tensors: dict[str, np.ndarray]) -> dict:
  """Flax variables of VisionTower(cfg) from hub-layout tensors (torch [out, in] linears)."""
  W, H, Dh, F = cfg.width, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
  A = H * Dh
  vt = "vision_tower."

  def norm(prefix, d):
    out = {"scale": _t(tensors, prefix + ".weight", (d,))}
    if cfg.norm == "layernorm" or prefix.endswith("pre_norm"):
      out["bias"] = _t(tensors, prefix + ".bias", (d,))
    return out

  def linear(prefix, d_out, d_in):
    out = {"kernel": _t(tensors, prefix + ".weight", (d_out, d_in)).T}
    if cfg.use_bias:
      out["bias"] = _t(tensors, prefix + ".bias", (d_out,))
    return out

  pe = {"kernel": _t(tensors, vt + "patch_embed.proj.weight",
                     (W, cfg.in_channels, cfg.patch_size, cfg.patch_size)).reshape(W, -1).T}
  if cfg.use_bias:
    pe["bias"] = _t(tensors, vt + "patch_embed.proj.bias", (W,))
  enc = {"patch_embed": pe,
         "pos_emb": _t(tensors, vt + "patch_embed.pos_emb.weight",
                       (cfg.pos_emb_height, cfg.pos_emb_width, W)),
         "final_norm": norm(vt + "encoder.final_layernorm", W)}
  for i in range(cfg.n_layers):
    b = f"{vt}encoder.blocks.{i}."
    wqkv = _t(tensors, b + "wqkv.weight", (3 * A, W)).reshape(3, A, W)
    wqkv = np.stack([deinterleave_rope_rows(wqkv[0], H), deinterleave_rope_rows(wqkv[1], H), wqkv[2]])
    qkv = {"kernel": wqkv.reshape(3, H, Dh, W).transpose(3, 0, 1, 2)}
    if cfg.use_bias:
      bq = _t(tensors, b + "wqkv.bias", (3 * A,)).reshape(3, A)
      bq = np.stack([deinterleave_rope_rows(bq[0], H), deinterleave_rope_rows(bq[1], H), bq[2]])
      qkv["bias"] = bq.reshape(3, H, Dh)
    wo = linear(b + "wo", W, A)
    wo["kernel"] = wo["kernel"].reshape(H, Dh, W)
    enc[f"block_{i}"] = {"norm1": norm(b + "norm0", W), "norm2": norm(b + "norm1", W), "wqkv": qkv,
                         "wo": wo, "fc1": linear(b + "mlp.fc0", F, W), "fc2": linear(b + "mlp.fc1", W, F)}
  proj = {"in_proj": linear("mm_projector.proj.0", cfg.merged_dim, cfg.merged_dim),
          "out_proj": linear("mm_projector.proj.2", cfg.out_dim, cfg.merged_dim)}
  if cfg.projector_norm == "pre":
    proj["pre_norm"] = norm("mm_projector.pre_norm", W)
  else:
    proj["post_norm"] = {"scale": _t(tensors, "mm_projector.post_norm.weight", (cfg.out_dim,))}
  used = _expected_names(cfg)
  extra = sorted(set(tensors) - used)
  if extra:
    raise ValueError(f"checkpoint: unexpected vision tensor(s) {extra[:5]} for the config read")
  return {"params": {"encoder": enc, "projector": proj}}


def _expected_names(cfg: VisionConfig) -> set[str]:
  vt = "vision_tower."
  ln = cfg.norm == "layernorm"
  names = {vt + "patch_embed.proj.weight", vt + "patch_embed.pos_emb.weight",
           vt + "encoder.final_layernorm.weight", "mm_projector.proj.0.weight", "mm_projector.proj.2.weight"}
  if ln:
    names.add(vt + "encoder.final_layernorm.bias")
  if cfg.use_bias:
    names |= {vt + "patch_embed.proj.bias", "mm_projector.proj.0.bias", "mm_projector.proj.2.bias"}
  names |= ({"mm_projector.pre_norm.weight", "mm_projector.pre_norm.bias"} if cfg.projector_norm == "pre"
            else {"mm_projector.post_norm.weight"})
  for i in range(cfg.n_layers):
    b = f"{vt}encoder.blocks.{i}."
    for m in ("norm0", "norm1"):
      names.add(b + m + ".weight")
      if ln:
        names.add(b + m + ".bias")
    for m in ("wqkv", "wo", "mlp.fc0", "mlp.fc1"):
      names.add(b + m + ".weight")
      if cfg.use_bias:
        names.add(b + m + ".bias")
  return names


def read_vision_tensors(directory: str) -> dict[str, np.ndarray]:
  """Every vision_tower.* / mm_projector.* tensor of the directory's safetensors files."""
  from safetensors import safe_open  # noqa: PLC0415 (an optional dependency of the importer)
  files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
  if not files:
    raise ValueError(f"{directory}: no *.safetensors files")
  out = {}
  for f in files:
    with safe_open(f, framework="np") as st:
      for name in st.keys():
        if name.startswith(_PREFIXES):
          out[name] = st.get_tensor(name)
  if not out:
    raise ValueError(f"{directory}: no vision_tower.* / mm_projector.* tensors in {len(files)} file(s)")
  return out


def load_hf_vision(directory: str) -> tuple[VisionConfig, dict]:
  """(vision_cfg, variables) of a K2.5 or K3 checkpoint directory in the hub layout."""
  path = os.path.join(directory, "config.json")
  if not os.path.exists(path):
    raise ValueError(f"{directory}: no config.json")
  with open(path) as f:
    config = json.load(f)
  tensors = read_vision_tensors(directory)
  cfg = vision_config_from_hf(config, tensors)
  return cfg, variables_from_hub(cfg, tensors)
