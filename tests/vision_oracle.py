"""Test-only oracle: transformers' Kimi K2.5 vision tower + projector on torch CPU, tiny and random.

torchvision imports only through tests/torchvision_shim.py (installed by conftest.py).
"""
from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers.models.kimi_k25 import modeling_kimi_k25 as hf  # noqa: E402

from moonshot_jax.vision.config import VisionConfig  # noqa: E402


def tiny_k25(**kw) -> VisionConfig:
  base = dict(width=64, num_heads=2, head_dim=32, mlp_dim=96, n_layers=2, pos_emb_height=8,
              pos_emb_width=8, pos_emb_time=4, norm="layernorm", use_bias=True, interpolation="bicubic",
              projector_norm="pre", out_dim=48, attn_block_size=16)
  return VisionConfig(**{**base, **kw}).replace()


def hf_tower(cfg: VisionConfig, seed: int = 0):
  """(vision model, projection) in eval mode with every parameter random (norms included)."""
  vc = hf.Kimi_K25VisionConfig(
      patch_size=cfg.patch_size, pos_emb_height=cfg.pos_emb_height, pos_emb_width=cfg.pos_emb_width,
      pos_emb_time=cfg.pos_emb_time, num_attention_heads=cfg.num_heads, num_hidden_layers=cfg.n_layers,
      hidden_size=cfg.width, intermediate_size=cfg.mlp_dim, merge_kernel_size=list(cfg.merge_kernel),
      rope_parameters={"rope_type": "axial", "rope_theta": cfg.rope_theta})
  vc._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = hf.Kimi_K25VisionModel(vc).eval()
  pc = types.SimpleNamespace(vision_config=vc, projection_hidden_size=cfg.width,
                             projection_layer_norm_eps=cfg.norm_eps,
                             text_config=types.SimpleNamespace(hidden_size=cfg.out_dim))
  proj = hf.Kimi_K25MultimodalProjection(pc).eval()
  with torch.no_grad():
    for m in (model, proj):
      for name, p in m.named_parameters():
        scale = 0.5 if "position" in name else (0.2 if p.ndim == 1 else 0.08)
        base = 1.0 if ("norm" in name and name.endswith("weight")) else 0.0
        p.copy_(base + scale * torch.randn_like(p))
  return model, proj


def variables_from_transformers(cfg: VisionConfig, model, proj) -> dict:
  """Our variable tree from transformers' module names (already in the rotate-half layout)."""
  sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
  ps = {k: v.detach().numpy().astype(np.float32) for k, v in proj.state_dict().items()}
  W, H, Dh = cfg.width, cfg.num_heads, cfg.head_dim

  def ln(d, p):
    return {"scale": d[p + ".weight"], "bias": d[p + ".bias"]}

  def lin(d, p):
    return {"kernel": d[p + ".weight"].T, "bias": d[p + ".bias"]}

  enc = {"patch_embed": {"kernel": sd["patch_embed.proj.weight"].reshape(W, -1).T,
                         "bias": sd["patch_embed.proj.bias"]},
         "pos_emb": sd["patch_embed.pos_emb.position_embeddings"],
         "final_norm": ln(sd, "final_layernorm")}
  for i in range(cfg.n_layers):
    b = f"layers.{i}."
    qkv_w = np.stack([sd[b + f"attn.{n}_proj.weight"] for n in "qkv"])  # [3, A, W]
    qkv_b = np.stack([sd[b + f"attn.{n}_proj.bias"] for n in "qkv"])
    wo = lin(sd, b + "attn.proj")
    enc[f"block_{i}"] = {
        "norm1": ln(sd, b + "norm1"), "norm2": ln(sd, b + "norm2"),
        "wqkv": {"kernel": qkv_w.reshape(3, H, Dh, W).transpose(3, 0, 1, 2), "bias": qkv_b.reshape(3, H, Dh)},
        "wo": {"kernel": wo["kernel"].reshape(H, Dh, W), "bias": wo["bias"]},
        "fc1": lin(sd, b + "mlp.fc1"), "fc2": lin(sd, b + "mlp.fc2")}
  projector = {"pre_norm": ln(ps, "pre_norm"), "in_proj": lin(ps, "in_proj"), "out_proj": lin(ps, "out_proj")}
  return {"params": {"encoder": enc, "projector": projector}}


def hf_forward(model, proj, pixel_values: np.ndarray, grid_thw: np.ndarray):
  """(features [N, width], projected tokens [M, out_dim]) from transformers."""
  with torch.no_grad():
    out = model(torch.from_numpy(pixel_values), grid_thw=torch.from_numpy(grid_thw).long())
    tokens = proj(out.pooler_output)
  return out.last_hidden_state.numpy(), tokens.reshape(tokens.shape[0], -1).numpy()


def hf_image_processor(**kw):
  """transformers' Kimi_K25ImageProcessor (torchvision imports through tests/torchvision_shim.py)."""
  from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor  # noqa: PLC0415
  return Kimi_K25ImageProcessor(**kw)
