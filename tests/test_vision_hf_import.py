"""load_hf_vision on hub-layout directories written here: K2.5 (vs transformers' features) and K3.

The hub's interleaved RoPE rows are made with transformers' own PermuteForRope(inverse=True), so the
importer's de-interleave is checked against transformers' conversion, not against itself.
"""
from __future__ import annotations

import json
import os

import flax.linen as nn
import jax
import numpy as np
import pytest

from moonshot_jax.vision import encode_images, init_vision, k3_vision
from moonshot_jax.vision.hf_import import load_hf_vision

GRID = np.array([[1, 4, 6], [1, 2, 2]])


def _interleave(w, heads):
  import torch
  from transformers.core_model_loading import PermuteForRope
  cfg = type("C", (), {"num_attention_heads": heads})()
  return PermuteForRope(inverse=True)._permute_for_rope(torch.from_numpy(np.ascontiguousarray(w)), cfg).numpy()


def _write(directory, vision_config, text_hidden, tensors):
  from safetensors.numpy import save_file
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump({"vision_config": vision_config, "text_config": {"hidden_size": text_hidden}}, f)
  half = len(tensors) // 2
  names = sorted(tensors)
  for i, part in enumerate((names[:half], names[half:])):  # two shards, as on the hub
    save_file({n: np.ascontiguousarray(tensors[n], np.float32) for n in part},
              os.path.join(directory, f"model-{i:05d}-of-00002.safetensors"))


def test_k25_hub_layout_reproduces_transformers(tmp_path):
  from tests.vision_oracle import hf_forward, hf_tower, tiny_k25
  cfg = tiny_k25()
  model, proj = hf_tower(cfg, seed=3)
  sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  ps = {k: v.detach().numpy() for k, v in proj.state_dict().items()}
  vt, H = "vision_tower.", cfg.num_heads
  t = {vt + "patch_embed.proj.weight": sd["patch_embed.proj.weight"],
       vt + "patch_embed.proj.bias": sd["patch_embed.proj.bias"],
       vt + "patch_embed.pos_emb.weight": sd["patch_embed.pos_emb.position_embeddings"],
       vt + "encoder.final_layernorm.weight": sd["final_layernorm.weight"],
       vt + "encoder.final_layernorm.bias": sd["final_layernorm.bias"]}
  for new, old in (("pre_norm", "pre_norm"), ("proj.0", "in_proj"), ("proj.2", "out_proj")):
    for p in ("weight", "bias"):
      t[f"mm_projector.{new}.{p}"] = ps[f"{old}.{p}"]
  for i in range(cfg.n_layers):
    b, o = f"{vt}encoder.blocks.{i}.", f"layers.{i}."
    for p in ("weight", "bias"):
      q, k, v = (sd[f"{o}attn.{n}_proj.{p}"] for n in "qkv")
      t[b + f"wqkv.{p}"] = np.concatenate([_interleave(q, H), _interleave(k, H), v])
      for new, old in (("norm0", "norm1"), ("norm1", "norm2"), ("wo", "attn.proj"), ("mlp.fc0", "mlp.fc1"),
                       ("mlp.fc1", "mlp.fc2")):
        t[b + f"{new}.{p}"] = sd[f"{o}{old}.{p}"]
  t["language_model.model.embed_tokens.weight"] = np.zeros((4, 48), np.float32)  # ignored
  vision_config = dict(patch_size=14, init_pos_emb_height=8, init_pos_emb_width=8, init_pos_emb_time=4,
                       vt_num_attention_heads=H, vt_num_hidden_layers=cfg.n_layers, vt_hidden_size=cfg.width,
                       vt_intermediate_size=cfg.mlp_dim, merge_kernel_size=[2, 2], projector_ln_eps=1e-5)
  _write(tmp_path, vision_config, cfg.out_dim, t)

  vcfg, variables = load_hf_vision(str(tmp_path))
  assert (vcfg.norm, vcfg.use_bias, vcfg.interpolation, vcfg.projector_norm) == ("layernorm", True, "bicubic", "pre")
  pixels = np.random.RandomState(4).uniform(-1, 1, (28, 3, 14, 14)).astype(np.float32)
  _, tokens_hf = hf_forward(model, proj, pixels, GRID)
  ours = np.asarray(encode_images(variables, vcfg.replace(attn_block_size=16), pixels, GRID))
  assert np.max(np.abs(ours - tokens_hf)) / np.max(np.abs(tokens_hf)) <= 1e-4


def test_k3_hub_layout_round_trip_and_errors(tmp_path):
  pytest.importorskip("transformers")
  cfg = k3_vision(out_dim=40, width=48, num_heads=3, head_dim=24, mlp_dim=64, n_layers=2, pos_emb_height=6,
                  pos_emb_width=6)
  leaves, tree = jax.tree_util.tree_flatten(nn.meta.unbox(init_vision(cfg, jax.random.PRNGKey(0))))
  keys = jax.random.split(jax.random.PRNGKey(5), len(leaves))
  variables = jax.tree_util.tree_unflatten(tree, [np.asarray(1.0 * (x.ndim == 1) + 0.1 * jax.random.normal(k, x.shape))
                                                  for k, x in zip(keys, leaves)])
  enc, proj = variables["params"]["encoder"], variables["params"]["projector"]
  vt, W, H, A = "vision_tower.", cfg.width, cfg.num_heads, cfg.num_heads * cfg.head_dim
  t = {vt + "patch_embed.proj.weight": enc["patch_embed"]["kernel"].T.reshape(W, 3, 14, 14),
       vt + "patch_embed.pos_emb.weight": enc["pos_emb"],
       vt + "encoder.final_layernorm.weight": enc["final_norm"]["scale"],
       "mm_projector.proj.0.weight": proj["in_proj"]["kernel"].T,
       "mm_projector.proj.2.weight": proj["out_proj"]["kernel"].T,
       "mm_projector.post_norm.weight": proj["post_norm"]["scale"]}
  for i in range(cfg.n_layers):
    b, e = f"{vt}encoder.blocks.{i}.", enc[f"block_{i}"]
    qkv = e["wqkv"]["kernel"].transpose(1, 2, 3, 0).reshape(3, A, W)
    t[b + "wqkv.weight"] = np.concatenate([_interleave(qkv[0], H), _interleave(qkv[1], H), qkv[2]])
    t[b + "wo.weight"] = e["wo"]["kernel"].reshape(A, W).T
    t[b + "norm0.weight"], t[b + "norm1.weight"] = e["norm1"]["scale"], e["norm2"]["scale"]
    t[b + "mlp.fc0.weight"], t[b + "mlp.fc1.weight"] = e["fc1"]["kernel"].T, e["fc2"]["kernel"].T
  vision_config = dict(init_pos_emb_height=6, init_pos_emb_width=6, init_pos_emb_time=4, vt_num_attention_heads=H,
                       vt_num_hidden_layers=2, vt_hidden_size=W, vt_intermediate_size=64, qkv_hidden_size=A,
                       merge_kernel_size=[2, 2], pos_emb_interpolation_mode="bilinear", text_hidden_size=40)
  _write(tmp_path, vision_config, 40, t)
  vcfg, loaded = load_hf_vision(str(tmp_path))
  assert vcfg == cfg
  pixels = np.random.RandomState(6).uniform(-1, 1, (28, 3, 14, 14)).astype(np.float32)
  np.testing.assert_allclose(encode_images(loaded, vcfg, pixels, GRID), encode_images(variables, cfg, pixels, GRID),
                             rtol=1e-5, atol=1e-5)

  t[vt + "encoder.blocks.1.wo.weight"] = t[vt + "encoder.blocks.1.wo.weight"][:, :-1]
  _write(tmp_path, vision_config, 40, t)
  with pytest.raises(ValueError, match=r"blocks.1.wo.weight has shape \(48, 71\)"):
    load_hf_vision(str(tmp_path))
