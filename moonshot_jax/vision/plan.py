"""Vision-tower sizes on paper: parameters per component and forward FLOPs per image.

Parameters are counted analytically here and pinned to `jax.eval_shape` of the real init by
tests/test_vision_plan.py. FLOPs count 2 per multiply-add of every matmul (patch embed, q/k/v, the
attention's q.k and p.v over the image's own patches, out, MLP, projector); norms, RoPE, softmax
and the position gather are left out (O(N * width), not O(N * width^2)).
"""
from __future__ import annotations

from moonshot_jax.vision.config import VisionConfig


def param_counts(cfg: VisionConfig) -> dict[str, int]:
  W, A, F, b = cfg.width, cfg.num_heads * cfg.head_dim, cfg.mlp_dim, int(cfg.use_bias)
  norm = W * (2 if cfg.norm == "layernorm" else 1)
  block = 2 * norm + W * 3 * A + b * 3 * A + A * W + b * W + W * F + b * F + F * W + b * W
  K = cfg.merged_dim
  proj = K * K + b * K + K * cfg.out_dim + b * cfg.out_dim
  proj += 2 * W if cfg.projector_norm == "pre" else cfg.out_dim
  return {"patch_embed": cfg.patch_dim * W + b * W + (norm if cfg.patch_norm else 0),
          "pos_emb": cfg.pos_emb_height * cfg.pos_emb_width * W,
          "blocks": cfg.n_layers * block, "final_norm": norm, "projector": proj}


def forward_flops(cfg: VisionConfig, t: int, h: int, w: int) -> dict[str, int]:
  """Forward FLOPs of one image / clip of t frames x h x w patches."""
  n = t * h * w
  W, A, F = cfg.width, cfg.num_heads * cfg.head_dim, cfg.mlp_dim
  m = h * w // cfg.merge_size
  return {"patch_embed": 2 * n * cfg.patch_dim * W,
          "attn_proj": cfg.n_layers * 2 * n * W * 4 * A,
          "attn_scores": cfg.n_layers * 2 * 2 * n * n * A,
          "mlp": cfg.n_layers * 2 * 2 * n * W * F,
          "projector": 2 * m * cfg.merged_dim * (cfg.merged_dim + cfg.out_dim)}


# Square images (in pixels) the plan reports: 448 .. K3's largest (3584 = 256 patches a side).
PLAN_SIDES_PX = (448, 896, 1792, 3584)
