"""python -m launch.plan --config=experiments/k3.py

Prints the parameter breakdown (≈2.78T total, ≈104B active per token; see moonshot_jax/params.py
for the convention) and FLOPs per token of Kimi K3: hidden 7168, 93 layers — MLA at 4, 8, ..., 92 and 93
(24 MLA + 69 KDA), dense FFN at layer 1 (ff 33792) — Gated MLA with 96 heads (q_lora 1536,
kv_lora 512, nope 128 / rope 64 / v 128, NoPE); KDA with a low-rank forget gate, a full-rank
output gate and the safe gate (lower bound -5); Stable LatentMoE with
896 experts top-16 (ff 3072, SiTU-GLU) in a 3584-wide latent space, 2 shared experts fused into one
MLP of ff 6144, routed scaling 1.0, quantile balancing; Block AttnRes with blocks of 12 layers;
vocab 163840; 1M context. bf16 compute, fp32 master weights, full remat, scanned layers. The
MoonViT-V2 vision tower (section `vision`): its parameters and forward FLOPs per image size.

KDA heads are not published for K3. We use 96 heads x 128 (K = V = 128): (a) Kimi Linear gives KDA
exactly as many heads (32) as MLA, and K3's MLA has 96; (b) 96 divides over tensor = 1, 2, 3, 4, 6,
8, ... like the MLA heads, so one tensor axis serves both mixers; (c) with 96 heads the totals land
on the published ≈2.8T / ≈104B (64 heads would give ≈94B active).
"""
from moonshot_jax import experiment
from moonshot_jax.vision.config import k3_vision


def get_config(arg=None):
  del arg
  cfg = experiment.base_config()
  m = cfg.model
  m.vocab_size = 163840
  m.d_model = 7168
  m.n_layers = 93
  m.mla_layers = tuple(range(4, 93, 4)) + (93,)
  m.dense_layers = (1,)
  m.kda_num_heads, m.kda_num_v_heads, m.kda_head_dim, m.kda_v_head_dim = 96, 96, 128, 128
  m.kda_output_gate_full_rank = True  # g_proj; the forget gate stays low-rank (f_a_proj / f_b_proj)
  m.kda_gate_lower_bound = -5.0  # linear_attn_config.gate_lower_bound of the released checkpoint
  m.norm_eps = 1e-5  # rms_norm_eps of the released checkpoint
  m.mla_num_heads, m.kv_lora_rank, m.q_lora_rank = 96, 512, 1536
  m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = 128, 64, 128
  m.mla_use_rope = False
  m.dense_ff_dim = 33792
  m.dense_activation = "situ"  # hidden_act "situ": the dense layer's MLP is SiTU-GLU too
  m.num_experts, m.num_experts_per_tok, m.expert_ff_dim = 896, 16, 3072
  m.moe_latent_dim = 3584
  m.shared_ff_dim, m.num_shared_experts = 6144, 2
  m.routed_scaling_factor = 1.0
  m.expert_activation = "situ"
  m.balancing, m.balance_rate = "quantile", 0.3  # eta of b <- centre(b + eta*q); 1e-3 would barely move it
  m.router_norm = "none"  # as the published model (hub import / export); "batch" fixes #23's collapse
  m.attn_res, m.attn_res_block_size = True, 12
  m.dtype, m.param_dtype = "bfloat16", "float32"
  m.remat_policy = "full"
  m.scan_layers = True
  m.max_seq_len = 1 << 20

  cfg.data.tokenizer = "bpe"
  cfg.data.seq_len = 8192
  cfg.data.batch_size = 4096
  cfg.optimizer.name = "muon"
  cfg.optimizer.schedule = "wsd"
  cfg.optimizer.lr = 2e-4
  cfg.optimizer.warmup_steps = 2000
  cfg.train.steps = 500_000
  cfg.train.log_every = 10
  cfg.train.eval_every = 1000
  cfg.checkpoint.every_steps = 500
  cfg.mesh.pipeline, cfg.mesh.data, cfg.mesh.expert, cfg.mesh.tensor = 16, -1, 64, 1
  # MoonViT-V2 (moonshot_jax/vision/config.py): 401,214,464 encoder + 46,144,512 merger parameters.
  cfg.vision = experiment.vision_section(k3_vision(out_dim=m.d_model, dtype="bfloat16"))
  return experiment.finalize(cfg)
