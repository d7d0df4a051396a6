"""python -m launch.plan --config=experiments/kimi_linear_48b.py

Prints the parameter breakdown and FLOPs per token: ≈49.2B total and ≈3.17B active per token
(the published config counted exactly; the name "48B-A3B" rounds: 2.5% and 6% off).
Kimi Linear 48B-A3B (Kimi Team, "Kimi Linear", 2025; HF moonshotai/Kimi-Linear-48B-A3B-Base):
hidden 2304, 27 layers, MLA at 4, 8, 12, 16, 20, 24, 27 (3:1 KDA:MLA), 32 KDA heads x 128 with a
low-rank gate, MLA 32 heads (kv_lora 512, no q_lora, nope 128 / rope 64 / v 128, NoPE), 256
experts top-8 (ff 1024) + 1 shared, routed scaling 2.446, dense layer 1 (ff 9216), vocab 163840,
no AttnRes and no latent MoE (those are K3's). Too big to train here; bf16, remat and scan are on.
"""
from moonshot_jax import experiment


def get_config(arg=None):
  del arg
  cfg = experiment.base_config()
  m = cfg.model
  m.vocab_size = 163840
  m.d_model = 2304
  m.n_layers = 27
  m.mla_layers = (4, 8, 12, 16, 20, 24, 27)
  m.dense_layers = (1,)
  m.kda_num_heads, m.kda_num_v_heads, m.kda_head_dim, m.kda_v_head_dim = 32, 32, 128, 128
  m.kda_output_gate_full_rank = False  # low-rank g_a_proj / g_b_proj with bias
  m.mla_num_heads, m.kv_lora_rank, m.q_lora_rank = 32, 512, 0
  m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = 128, 64, 128
  m.mla_use_rope = False
  m.dense_ff_dim = 9216
  m.num_experts, m.num_experts_per_tok, m.expert_ff_dim = 256, 8, 1024
  m.moe_latent_dim = 0
  m.shared_ff_dim, m.num_shared_experts = 1024, 1
  m.routed_scaling_factor = 2.446
  m.expert_activation = "swiglu"
  m.balancing, m.balance_rate = "sign", 1e-3
  m.router_norm = "none"  # as the published model (hub import / export); "batch" fixes #23's collapse
  m.attn_res = False
  m.dtype, m.param_dtype = "bfloat16", "float32"
  m.remat_policy = "full"
  m.scan_layers = True
  m.max_seq_len = 1 << 20

  cfg.data.tokenizer = "bpe"
  cfg.data.seq_len = 4096
  cfg.data.batch_size = 1024
  cfg.optimizer.name = "muon"
  cfg.optimizer.schedule = "wsd"
  cfg.optimizer.lr = 2e-4
  cfg.optimizer.warmup_steps = 500
  cfg.train.steps = 100_000
  cfg.train.log_every = 10
  cfg.train.eval_every = 1000
  cfg.checkpoint.every_steps = 1000
  cfg.mesh.pipeline, cfg.mesh.data, cfg.mesh.expert, cfg.mesh.tensor = 1, -1, 8, 1
  return experiment.finalize(cfg)
