"""python -m launch.train --config=experiments/vl_tiny.py --workdir=/tmp/vl_tiny

Trains a MoonViT-V2-style encoder (3 layers, width 128) and tiny's hybrid LM (KDA + MLA + LatentMoE,
d_model 64) together from scratch on the generated image-text corpus (vision/data.py: Pillow scenes
of shapes, colours, counts, positions and DejaVu digits at mixed sizes, captions and one question
per image, with SOTU text chunks mixed in), byte tokens. Every eval prints eval_loss,
eval_text_loss, eval_caption_loss and held-out QA exact match (overall and per question type), both
with the images and with every image blanked (qa_blank_*: near chance if the answers come from the
pixels). Measured (session 20, quiet 2-core box, the command alone): **28 min 43 s wall** for the whole command
(compile, 8 evals and 8 checkpoints included; ~0.17-0.20 s per step), held-out QA exact match **92.2%** at step 8000
(colour 100, position 100, count 97, shape 94.3, digit 73.7) vs 20.8% with every image blanked; text eval loss 1.253
(text-only control, 4000 steps: 1.310). It prints one JSON summary line at the end ({"workdir": ..., "final_step":
8000, "eval_loss": 0.2918, ...}); the per-type QA numbers are the step-8000 eval line of <workdir>/metrics.jsonl
(qa_exact_match, qa_exact_match/<type>, qa_blank_exact_match). The box's speed varies ~1.6x between windows
(sessions 17-19: 0.14-0.23 s per step), so the wall time can read a few minutes either side of 30 min.
Digit is what the schedule length buys: it keeps improving after step ~2500 while the schedule leaves it
some lr (a 9000-step schedule: 93.0% at 7000, 96.0 at 8000, 95.6 at 9000, in 30 min 24 s, session 18; a 7000-step
schedule: 89.4%, digit 63.2, session 17; 4000 steps: 80.8%, digit 33, sessions 14-16).
The tower's lr / 10 is what made position learnable (at the LM's lr: 42.8% at step 1000, 41.8%
at 2000, position at chance; at 0.3x, constant or ramped up after step 1000, or with only the patch embedding +
projector at the LM's lr, `--config.optimizer.vision_local_lr_scale=1.0` (session 16), or with
`--config.vision.qk_norm=True` at 0.3x (session 17), position falls back too; 8000 extra digit scenes,
`--config.vl.extra_digit_scenes=8000 --config.train.steps=4500`: 78.2%, digit 39.5: session 15).
See WORKSPACE_NOTES.md (sessions 12-20).
Checkpoints, exact resume, metrics.jsonl and TensorBoard as for text runs; then
    python -m launch.generate --config=experiments/vl_tiny.py --workdir=/tmp/vl_tiny --image=x.png \
        --prompt="Q: What colour is the shape? A:" --temperature=0
"""
from moonshot_jax import experiment
from moonshot_jax.vision.config import k3_vision, vl_section


def get_config(arg=None):
  del arg
  cfg = experiment.base_config()
  cfg.model = experiment.model_section("tiny")  # tiny.py's LM, unchanged

  cfg.vision = experiment.vision_section(k3_vision(
      out_dim=64, width=128, num_heads=4, head_dim=32, mlp_dim=256, n_layers=3, pos_emb_height=8,
      pos_emb_width=8, attn_block_size=64, max_patches=1024, max_patches_per_side=64, patch_norm=True,
      # init scales for training from scratch at width 128 (WORKSPACE_NOTES, session 13): fan-in weights
      # (1/sqrt(128)) and a unit-scale position grid beside the unit-scale patch features; K3's bounded
      # post-norm projector (K2.5's unbounded one grew to rms 65 with one vector per image)
      init_std=0.088, pos_init_std=1.0,
      # the packed attention's one-pass backward: bit for bit the split one's gradients, 1.3-1.6x cheaper attention
      # fwd+bwd per layer on the 2-core box (WORKSPACE_NOTES, session 20)
      attn_backward="fused"))
  # byte tokens use ids < 259; captions name every object's colour, shape and place: dense signal
  cfg.vl = vl_section(image_token_id=300, patch_budget=1280, caption_fraction=0.5)

  cfg.data.tokenizer = "byte"
  cfg.data.seq_len = 128
  cfg.data.batch_size = 16
  cfg.optimizer.lr = 3e-3
  # the tower learns at lr / 10: at the LM's lr it learns within ~1000 steps to broadcast each image's
  # mean to all its tokens (within-image token cosine 0.996 at step 2000) and position / shape never
  # reach the LM; at lr / 10 position is 96.5% at step 1000 (WORKSPACE_NOTES, session 14)
  cfg.optimizer.vision_lr_scale = 0.1
  cfg.optimizer.warmup_steps = 50
  cfg.train.steps = 8000  # 92.2% held-out QA in 28.7 min (session 20, quiet); 9000: 95.6%; 7000: 89.4%
  cfg.train.log_every = 25
  # every 1000 (was 500): an eval (500 QA, with and without images) + a save cost ~6.7 s each on session 18's quiet
  # box (18 of them ~120 s), and neither touches the training numerics (session 19: loss per step bit-identical)
  cfg.train.eval_every = 1000
  cfg.checkpoint.every_steps = 1000
  cfg.checkpoint.async_save = False
  cfg.logging.progress_bar = False
  return experiment.finalize(cfg)
