"""python -m launch.train --config=experiments/tiny.py --workdir=/tmp/tiny --config.train.steps=20

Prints one log line per step, the loss falling from about ln(512) = 6.2, and saves a checkpoint
every 5 steps in /tmp/tiny. Every component is on at toy size (~200K parameters): 3 layers =
KDA + dense FFN, KDA + LatentMoE, MLA + LatentMoE (8 experts, top-2, latent 32, 1 shared expert),
Block AttnRes (blocks of 2 layers), quantile balancing, byte-level tokens (vocab padded to 512).
Trains in seconds on CPU; CI uses it for end-to-end tests.
"""
from moonshot_jax import experiment


def get_config(arg=None):
  del arg
  cfg = experiment.base_config()
  m = cfg.model
  m.vocab_size = 512
  m.d_model = 64
  m.n_layers = 3
  m.mla_layers = (3,)
  m.dense_layers = (1,)
  m.kda_num_heads, m.kda_num_v_heads, m.kda_head_dim, m.kda_v_head_dim = 2, 2, 16, 16
  m.kda_chunk_size = 16
  m.mla_num_heads, m.kv_lora_rank, m.q_lora_rank = 2, 32, 0
  m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = 16, 8, 16
  m.dense_ff_dim = 128
  m.num_experts, m.num_experts_per_tok, m.expert_ff_dim = 8, 2, 32
  m.moe_latent_dim = 32
  m.shared_ff_dim, m.num_shared_experts = 64, 1
  m.balancing, m.balance_rate = "quantile", 0.1
  m.attn_res, m.attn_res_block_size = True, 2
  m.max_seq_len = 128

  cfg.data.tokenizer = "byte"
  cfg.data.seq_len = 64
  cfg.data.batch_size = 8
  cfg.data.eval_batches = 2
  cfg.optimizer.lr = 3e-3
  cfg.optimizer.warmup_steps = 5
  cfg.train.steps = 50
  cfg.train.log_every = 1
  cfg.train.eval_every = 10
  cfg.train.sample_tokens = 32
  cfg.checkpoint.every_steps = 5
  cfg.checkpoint.async_save = False
  cfg.logging.progress_bar = False
  return experiment.finalize(cfg)
