"""MoonViT hyperparameters: one frozen dataclass for both generations of Kimi's vision tower.

  K2.5 (MoonViT, public as HF transformers' `models/kimi_k25`): LayerNorm and biases everywhere,
      bicubic resampling of the learned position grid, width 1152 / 16 heads / MLP 4304, projector
      LayerNorm(width) per patch -> concat 2x2 -> Linear -> GELU -> Linear.
  K3 (MoonViT-V2): RMSNorm, no biases, bilinear resampling, width 1024 / 12 heads x 128 (attention
      wider than the residual stream) / MLP 4096, projector concat 2x2 -> Linear -> GELU -> Linear ->
      RMSNorm(d_model).

Both: 14x14 patches, a learned 64x64 position grid resized to each image's patch grid, a fixed sin/cos
time table for clips of 2..pos_emb_time frames, 2-D RoPE on q and k, attention within each image or
clip only, tanh-GELU MLP, a final norm, then the merger (mean over frames, each 2x2 neighbourhood
concatenated).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from moonshot_jax.config import ConfigError

NORMS = ("layernorm", "rmsnorm")
INTERPOLATIONS = ("bicubic", "bilinear")
PROJECTOR_NORMS = ("pre", "post")  # K2.5: LayerNorm(width) before the concat; K3: RMSNorm(d_model) after
ATTN_BACKWARDS = ("split", "fused")  # packed attention backward passes (vision/attention.py)


@dataclasses.dataclass(frozen=True)
class VisionConfig:
  patch_size: int = 14
  in_channels: int = 3
  width: int = 64  # residual stream of the encoder
  num_heads: int = 2
  head_dim: int = 32  # num_heads * head_dim may differ from width (K3: 12 x 128 over 1024)
  mlp_dim: int = 128
  n_layers: int = 2
  pos_emb_height: int = 8  # learned position grid (square: HF resamples with one side length)
  pos_emb_width: int = 8
  pos_emb_time: int = 4  # clips of up to this many frames
  merge_kernel: tuple[int, int] = (2, 2)
  norm: str = "rmsnorm"
  norm_eps: float = 1e-5
  use_bias: bool = False
  interpolation: str = "bilinear"
  rope_theta: float = 10000.0
  # Not in K2.5 / K3: a norm on the patch embedding before the position grid is added. Training from
  # scratch, the patch projection grows until the position grid and the blocks' updates vanish next to
  # it (measured: notes of session 12); this keeps the residual stream at unit scale.
  patch_norm: bool = False
  projector_norm: str = "post"
  # Not in K2.5 / K3 (off: their layouts stay exact): RMSNorm over head_dim (scale [head_dim], shared by
  # the heads) on q and k before RoPE, so attention logits stay bounded. Training from scratch with the
  # tower at the LM's lr, block 0's attention collapses to one key per query (entropy 0.04 of uniform,
  # vs 0.33 at lr / 10) and its branches grow to ~12x the residual. Measured (session 17): at lr x0.3 it keeps
  # block 0's attention broad, but the branches still outgrow the stream and position still falls to chance.
  qk_norm: bool = False
  # Init scales (K2.5 / K3 publish no init; the defaults are the usual 0.02 / 1). From scratch at toy
  # width, a position grid at 0.02 next to unit-scale patch features leaves every background patch of
  # an image identical, so the LM attends uniformly over an image's tokens, every token gets the same
  # gradient and the tokens collapse onto one direction (measured: notes of sessions 12-13).
  # pos_init_std ~ 1 gives each patch a distinct position from step 0.
  pos_init_std: float = 0.02
  # initial scale of the K3 projector's output RMSNorm: the RMS of the vision tokens the LM reads
  # (its text embeddings start at model.init_std)
  proj_norm_init: float = 1.0
  out_dim: int = 64  # the LM's d_model
  # Processor limits (per image, in patches, before merging).
  max_patches: int = 16384
  max_patches_per_side: int = 512
  # Packed attention: rows per block of the flash-style path (never builds [N, N]).
  attn_block_size: int = 256
  # Its backward (vision/attention.py): "split" = a dq pass and a dk / dv pass, each recomputing every
  # block pair's probabilities; "fused" = one pass, probabilities once per pair, the same gradients bit for bit.
  attn_backward: str = "split"
  dtype: str = "float32"
  param_dtype: str = "float32"
  init_std: float = 0.02

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "VisionConfig":
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
      raise ConfigError(f"vision: unknown key(s) {unknown}; valid keys are {sorted(names)}")
    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()}
    cfg = cls(**kw)
    cfg.validate()
    return cfg

  def replace(self, **kw) -> "VisionConfig":
    cfg = dataclasses.replace(self, **kw)
    cfg.validate()
    return cfg

  @property
  def patch_dim(self) -> int:
    return self.in_channels * self.patch_size * self.patch_size

  @property
  def merge_size(self) -> int:
    return self.merge_kernel[0] * self.merge_kernel[1]

  @property
  def merged_dim(self) -> int:
    return self.width * self.merge_size

  def validate(self) -> None:
    def need(cond, key, msg):
      if not cond:
        raise ConfigError(f"vision.{key}: {msg} (got {getattr(self, key)!r})")

    for key in ("patch_size", "in_channels", "width", "num_heads", "head_dim", "mlp_dim", "n_layers",
                "pos_emb_height", "pos_emb_width", "pos_emb_time", "out_dim", "max_patches",
                "max_patches_per_side", "attn_block_size"):
      need(isinstance(getattr(self, key), int) and getattr(self, key) > 0, key, "must be a positive int")
    need(self.head_dim % 4 == 0, "head_dim", "must be a multiple of 4 (2-D RoPE: two axes of pairs)")
    need(self.width % 2 == 0, "width", "must be even (the sin/cos time table)")
    need(self.pos_emb_height == self.pos_emb_width, "pos_emb_width",
         f"must equal pos_emb_height={self.pos_emb_height} (the grid is resampled as a square)")
    need(isinstance(self.merge_kernel, tuple) and len(self.merge_kernel) == 2
         and all(isinstance(k, int) and k > 0 for k in self.merge_kernel), "merge_kernel",
         "must be a pair of positive ints")
    need(self.norm in NORMS, "norm", f"must be one of {NORMS}")
    need(self.attn_backward in ATTN_BACKWARDS, "attn_backward", f"must be one of {ATTN_BACKWARDS}")
    need(self.interpolation in INTERPOLATIONS, "interpolation", f"must be one of {INTERPOLATIONS}")
    need(self.projector_norm in PROJECTOR_NORMS, "projector_norm", f"must be one of {PROJECTOR_NORMS}")
    need(self.norm_eps > 0, "norm_eps", "must be > 0")
    for key in ("use_bias", "patch_norm", "qk_norm"):
      need(isinstance(getattr(self, key), bool), key, "must be true or false")
    for key in ("init_std", "pos_init_std", "proj_norm_init"):
      need(isinstance(getattr(self, key), (int, float)) and getattr(self, key) > 0, key, "must be > 0")
    need(self.dtype in ("float32", "bfloat16", "float16"), "dtype", "must be float32, bfloat16 or float16")
    need(self.param_dtype in ("float32", "bfloat16"), "param_dtype", "must be float32 or bfloat16")


def k25_vision(out_dim: int = 7168, **kw) -> VisionConfig:
  """Kimi K2.5's MoonViT (transformers' Kimi_K25VisionConfig defaults) with its projector."""
  base = dict(width=1152, num_heads=16, head_dim=72, mlp_dim=4304, n_layers=27, pos_emb_height=64,
              pos_emb_width=64, pos_emb_time=4, norm="layernorm", use_bias=True,
              interpolation="bicubic", projector_norm="pre", out_dim=out_dim, max_patches=16384,
              max_patches_per_side=512)
  return VisionConfig(**{**base, **kw}).replace()


def k3_vision(out_dim: int = 7168, **kw) -> VisionConfig:
  """K3's MoonViT-V2 (401,214,464 encoder + 46,144,512 merger parameters at out_dim=7168); its
  processor allows 65,536 patches per image (in_patch_limit), 512 per side."""
  base = dict(width=1024, num_heads=12, head_dim=128, mlp_dim=4096, n_layers=27, pos_emb_height=64,
              pos_emb_width=64, pos_emb_time=4, norm="rmsnorm", use_bias=False,
              interpolation="bilinear", projector_norm="post", out_dim=out_dim, max_patches=65536,
              max_patches_per_side=512)
  return VisionConfig(**{**base, **kw}).replace()


def vl_section(**overrides):
  """The `vl` section of a vision-language experiment: the generated corpus and its packing
  (vision/data.py); `overrides` replace defaults, never add keys."""
  import ml_collections  # noqa: PLC0415
  base = dict(
      image_token_id=300,  # placeholder id: above the tokenizer's ids, below model.vocab_size
      patch_budget=1280,  # patches per batch (static); merged tokens per batch = patch_budget / merge_size
      scene_seed=0,
      train_scenes=40000,
      extra_digit_scenes=0,  # train scenes added to the uniform ones, all with a digit (question or caption)
      caption_fraction=0.25,  # of image documents; the rest carry one question each
      text_fraction=0.1,  # of all documents: chunks of the text corpus (data.corpus)
      eval_qa=500,
      eval_captions=100,
      eval_text=40,
      # control run: the same text documents in the same batches and steps, image documents dropped
      # (the text-only baseline of the joint run's eval_text_loss)
      text_only=False,
      # real images (vision/fashion.py): Fashion-MNIST photos read from local IDX files (Debian package
      # dataset-fashion-mnist), as captions and "What clothing item is this?" questions; 0 = none
      fashion_dir="/usr/share/datasets/fashion-mnist",
      fashion_train=0,
      fashion_eval=0,  # held-out photos (from the test file): half questions, half captions
      fashion_scale=2,  # nearest-neighbour upscale: 28 px -> 56 px = 4x4 patches, 4 merged tokens
  )
  unknown = sorted(set(overrides) - set(base))
  if unknown:
    raise ConfigError(f"vl: unknown key(s) {unknown}; valid keys are {sorted(base)}")
  return ml_collections.ConfigDict({**base, **overrides})


def check_vl_config(cfg: Any, vcfg: VisionConfig, tok_vocab: int | None = None) -> None:
  """The `vl` section of a vision-language experiment (vision/data.py reads it), naming the key."""
  vl, m = cfg.vl, cfg.model

  def need(ok, key, msg):
    if not ok:
      raise ConfigError(f"vl.{key}: {msg} (got {vl[key]!r})")
  need(int(vl.patch_budget) > 0 and int(vl.patch_budget) % vcfg.merge_size == 0, "patch_budget",
       f"must be a positive multiple of the merge size {vcfg.merge_size}")
  need(0 <= int(vl.image_token_id) < int(m.vocab_size), "image_token_id",
       f"must be in [0, model.vocab_size={m.vocab_size})")
  if tok_vocab is not None:
    need(int(vl.image_token_id) >= tok_vocab, "image_token_id",
         f"must not be a text id: the tokenizer uses [0, {tok_vocab})")
  need(0 <= float(vl.text_fraction) < 1, "text_fraction", "must be in [0, 1)")
  need(0 <= float(vl.caption_fraction) <= 1, "caption_fraction", "must be in [0, 1]")
  need(int(vl.fashion_scale) >= 1, "fashion_scale", "must be >= 1")
  for key in ("train_scenes", "extra_digit_scenes", "eval_qa", "eval_captions", "eval_text", "fashion_train",
              "fashion_eval"):
    need(int(vl[key]) >= 0, key, "must be >= 0")
  need(int(vl.train_scenes) > 0, "train_scenes", "must be positive")
  if int(cfg.train.microbatches) != 1:
    raise ConfigError(f"train.microbatches: vision batches are not split into microbatches (got "
                      f"{cfg.train.microbatches}, need 1)")
  if int(cfg.mesh.pipeline) != 1:
    raise ConfigError(f"mesh.pipeline: the vision-language model runs without pipeline stages "
                      f"(got {cfg.mesh.pipeline})")
