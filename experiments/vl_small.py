"""python -m launch.train --config=experiments/vl_small.py --workdir=/tmp/vl_small

Joint training from scratch at small size: small.py's hybrid LM (d_model 256, 8 layers: KDA + MLA +
LatentMoE with 32 experts, BPE 8000 + the image placeholder id) and a 6-layer MoonViT-V2-style
encoder (width 256, 4 heads x 64, MLP 1024, 16x16 position grid), on the generated image-text
corpus of vision/data.py plus Fashion-MNIST photos read from the Debian package's local files
(vision/fashion.py) (patch budget 4096 per batch of 16 x 256 tokens). Prints the loss per
log step and, every eval, eval_loss / eval_text_loss / eval_caption_loss and held-out QA exact match
with and without the images (qa_exact_match*, qa_blank_exact_match*); checkpoints every 250 steps.
launch/bench_vision.py measures this encoder's fwd+bwd at these shapes.
"""
from moonshot_jax import experiment
from moonshot_jax.vision.config import k3_vision, vl_section


def get_config(arg=None):
  del arg
  cfg = experiment.base_config()
  cfg.model = experiment.model_section("small")  # small.py's LM, unchanged

  cfg.vision = experiment.vision_section(k3_vision(
      out_dim=256, width=256, num_heads=4, head_dim=64, mlp_dim=1024, n_layers=6, pos_emb_height=16,
      pos_emb_width=16, attn_block_size=128, max_patches=4096, max_patches_per_side=64, patch_norm=True,
      init_std=0.0625, pos_init_std=1.0))  # from scratch: see vl_tiny.py (1/sqrt(256)); never trained
  # + real images: 20,000 Fashion-MNIST photos (apt-get install dataset-fashion-mnist; a missing file
  # is an error that names it), 200 held-out ones from the test file (qa_exact_match/fashion)
  cfg.vl = vl_section(image_token_id=8100, patch_budget=4096, train_scenes=80000, fashion_train=20000,
                      fashion_eval=200)

  cfg.data.tokenizer = "bpe"
  cfg.data.tokenizer_vocab_size = 8000  # ids 8000.. stay free for the image placeholder
  cfg.data.seq_len = 256
  cfg.data.batch_size = 16
  cfg.optimizer.lr = 2e-3
  cfg.optimizer.vision_lr_scale = 0.1  # as vl_tiny: at the LM's lr the tower collapses each image to one token
  cfg.optimizer.warmup_steps = 100
  cfg.train.steps = 5000
  cfg.train.log_every = 25
  cfg.train.eval_every = 500
  cfg.checkpoint.every_steps = 250
  cfg.logging.progress_bar = False
  return experiment.finalize(cfg)
