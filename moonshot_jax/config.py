"""Model hyperparameters: one frozen dataclass shared by every layer.

Experiment files (experiments/*.py) hold an ml_collections `model` section whose keys are exactly
these field names; `ModelConfig.from_dict` rejects unknown keys and `validate()` rejects
inconsistent values, naming the key, before anything is traced or compiled.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

_ACTIVATIONS = ("swiglu", "situ")
_BALANCING = ("quantile", "sign", "none")
_STORED_UPDATES = ("shift", "histogram")  # balance_stored_update
_JITTER_DECAYS = ("linear", "step")  # balance_jitter_decay
_ROUTER_NORMS = ("batch", "none")
_REMAT = ("none", "full", "dots", "dots_no_batch", "save_attn_out")
_KDA_IMPLS = (None, "xla", "pallas_gpu", "pallas_tpu")
_MOE_IMPLS = ("auto", "ragged_dot", "blocked")
# Keys that were renamed: from_dict names the replacement instead of only listing the valid keys.
_RENAMED = {"kda_gate_low_rank": "kda_output_gate_full_rank (the forget gate is always low-rank; "
                                 "Kimi Linear: False, K3: True)"}


class ConfigError(ValueError):
  """A bad configuration value; the message names the offending key."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  # ---- vocabulary and width -----------------------------------------------------------------
  vocab_size: int = 512
  d_model: int = 64
  n_layers: int = 4
  tie_embeddings: bool = False
  norm_eps: float = 1e-6
  init_std: float = 0.02
  # ---- layer pattern (1-indexed layer numbers, as Kimi Linear's `full_attn_layers`) ----------
  mla_layers: tuple[int, ...] = (3,)  # every other layer is a KDA layer
  dense_layers: tuple[int, ...] = (1,)  # dense FFN here, MoE everywhere else
  # ---- Kimi Delta Attention -----------------------------------------------------------------
  kda_num_heads: int = 2  # H (q/k heads)
  kda_num_v_heads: int = 2  # HV, a multiple of H
  kda_head_dim: int = 16  # K
  kda_v_head_dim: int = 16  # V
  kda_conv_size: int = 4
  # Output gate sigmoid(g_out(x)): low-rank d→V→HV·V with bias (Kimi Linear: g_a_proj / g_b_proj) or
  # full rank d→HV·V, no bias (K3: g_proj, HF `linear_attn_config.use_full_rank_gate`). The forget
  # gate is low-rank d→K→HV·K (f_a_proj / f_b_proj) in both.
  kda_output_gate_full_rank: bool = False
  kda_gate_lower_bound: float | None = None  # e.g. -5.0 enables the safe sigmoid gate
  kda_chunk_size: int = 64
  kda_implementation: str | None = None  # None = best for the backend
  # ---- Gated MLA ----------------------------------------------------------------------------
  mla_num_heads: int = 2
  q_lora_rank: int = 0  # 0 = no low-rank query
  kv_lora_rank: int = 32
  qk_nope_head_dim: int = 16
  qk_rope_head_dim: int = 8
  v_head_dim: int = 16
  mla_use_rope: bool = False  # K3 / Kimi Linear: NoPE (rope dims kept, never rotated)
  rope_theta: float = 10000.0
  mla_output_gate: bool = True
  # ---- FFN / Stable LatentMoE ----------------------------------------------------------------
  dense_ff_dim: int = 128
  dense_activation: str = "swiglu"  # the dense FFN layers' gated activation (K3: "situ", as its experts)
  num_experts: int = 8
  num_experts_per_tok: int = 2
  expert_ff_dim: int = 32
  moe_latent_dim: int = 0  # 0 = experts act on the full hidden (no latent projections)
  moe_latent_norm: bool = True  # RMSNorm on the latent expert sum before latent_up (False: ablation, #23)
  # > 0: the routed experts start identical (one expert's init copied to all) and train as ONE for the first
  # this-many train steps (the train step's forward uses their mean, so each receives the mean gradient and
  # they stay equal); from that step on each trains on its own tokens (a dense warm start of the experts,
  # as sparse upcycling). Routing and balancing are unchanged throughout. 0 = independent experts.
  # small, seed 0 (#23, session 21): 60 -> eval at 200 5.1862 vs 5.2334 without (the collapsing issue-time
  # config: 5.1880), load goals met (worst 1.19, 1.14 at 200); experiments/small.py uses 60.
  moe_expert_tie_steps: int = 0
  shared_ff_dim: int = 64  # all shared experts fused into one MLP of this width; 0 = none
  num_shared_experts: int = 1  # informational; shared_ff_dim is the fused width
  routed_scaling_factor: float = 1.0
  expert_activation: str = "swiglu"  # "swiglu" | "situ"
  moe_implementation: str = "auto"  # "auto" | "ragged_dot" | "blocked" (layers/moe.py)
  situ_beta: float = 4.0
  situ_beta_linear: float = 25.0
  balancing: str = "quantile"  # "quantile" | "sign" | "none"
  # Sign mode: gamma of b += gamma*sign(mean-load) (DeepSeek-V3 uses 1e-3). Quantile mode: step eta in
  # (0, 1] towards the k/E quantile; ~0.3 settles a skewed router in ~25 updates, 1e-3 barely moves it.
  balance_rate: float = 0.3
  aux_loss_coef: float = 0.0  # sequence-wise balance loss
  # Train step only: also shift the selection bias by this batch's own quantile step (rate 1) before
  # top-k (balancing.in_batch_shift); eval / decode use the stored bias. Needs balancing="quantile".
  balance_in_batch: bool = False
  # rate-1 quantile steps of that in-batch shift (the steps interact through each token's threshold):
  # small at step 200, 2 steps left one layer at 1.34x the mean load (#23, session 13)
  balance_in_batch_iters: int = 4
  # A tolerance band for that in-batch shift, in multiples of the mean load: in each in-batch step only the
  # experts outside [min_load, max_load] x mean take their step (to the mean), the rest route as the stored
  # bias (+ jitter) puts them (balancing.in_batch_shift). 1 / 1 = exact balance (the default path, unchanged).
  # From train step balance_in_batch_band_from on (0 = from the start; exact balance before it).
  # small, seed 0, band 0.5-1.2 from step 100 vs the default from the same step-100 state (#23, session 20):
  # eval at 200 5.2304 vs 5.2334 (-0.003, inside the late-phase spread), train load 1.21-1.32 vs 1.07-1.16: opt-in.
  balance_in_batch_max_load: float = 1.0
  balance_in_batch_min_load: float = 1.0
  balance_in_batch_band_from: int = 0
  # How the STORED bias (eval / decode routing, and the next in-batch start) learns with balance_in_batch:
  # "histogram": one quantile step of the stored bias's own histogram (the only update without
  # balance_in_batch); "shift": b <- b + balance_rate * (the batch's converged in-batch shift), an EMA of
  # the bias training routed with. small, seed 0 (#23, session 14): "shift" at rate 1 kept training load
  # <= 1.33 (histogram 0.3: 1.51) but eval at step 200 was 5.240 vs 5.2075, so it is opt-in.
  balance_stored_update: str = "histogram"
  # Train step with balance_in_batch only: std of a fixed pseudo-random offset per (token slot, expert)
  # added to the selection scores, so the in-batch quantile can split copies of one token id whose router
  # inputs are (nearly) the same (they otherwise move between experts together). 0 = off; experiments/small.py
  # uses 0.03 (#23, WORKSPACE_NOTES session 17: tighter training load on small's seeds 0-2, at lr 4e-3 and
  # with Muon, and the K3-shaped router E 896 / top-16 stays <= 1.3, where it reached 1.86 without it;
  # eval at step 200 better on seeds 0-1, worse on seed 2: the 3-seed mean +0.018).
  balance_jitter: float = 0.0
  # > 0: that jitter's std decays linearly to 0 at this train step (0 = constant); the train step passes its
  # step through moe.batch_routing(step=). small, 100 steps (#23, session 18): eval at 200 on seeds 0 / 2
  # 5.2001 / 5.2001 (constant 0.03: 5.2039 / 5.2483; none: 5.2075 / 5.1661); load goals met, but once the
  # jitter is gone the load loosens (worst 1.62 / 1.73, constant: 1.26 / 1.34; seed 2 ends at 1.29): opt-in.
  balance_jitter_steps: int = 0
  # With balance_jitter_steps > 0: the std the jitter ends at (in [0, balance_jitter]) and how it gets there:
  # "linear" falls linearly from balance_jitter to it at that step; "step" keeps balance_jitter before that
  # step and switches to it there (the full jitter through the collapse window, less selection noise after).
  # small, 0.03 -> 0.01 at step 100, "step" (#23, session 19): eval at 200 on seeds 0 / 1 / 2 5.1982 / 5.1847 /
  # 5.2481 (constant: 5.2039 / 5.1869 / 5.2483), lr 4e-3 5.2307 (5.2321), Muon 4.9811 (4.9920); load at 200
  # 1.14 / 1.09 / 1.16 / Muon 1.06 but 1.305 at lr 4e-3 (constant 1.11; goal <= 1.3); floor 0: 5.2018 and
  # 1.44 at 200 (seed 0). Opt-in.
  balance_jitter_floor: float = 0.0
  balance_jitter_decay: str = "linear"
  # Router input (issue #23). "batch": route on (x - mean) / sqrt(var + eps) per feature, with the mean
  # and variance of the batch's valid tokens in the train step (stop-gradient) and running estimates
  # ("moe_state"/"input_mean", "input_var") in eval and decode. It removes the shared direction all
  # tokens' MoE inputs take during warm-up, which otherwise collapses routing onto k experts.
  # "none": the raw input (the old behaviour; hub checkpoints, which carry no such statistics).
  router_norm: str = "batch"
  router_stats_rate: float = 0.1  # EMA rate of the running mean / variance (first steps: cumulative mean)
  # ---- AttnRes --------------------------------------------------------------------------------
  attn_res: bool = True
  attn_res_block_size: int = 2  # decoder layers per block
  # ---- numerics, memory, loss ---------------------------------------------------------------
  dtype: str = "float32"  # compute dtype ("bfloat16" for training at scale)
  param_dtype: str = "float32"
  remat_policy: str = "none"
  scan_layers: bool = True
  z_loss_coef: float = 0.0
  loss_chunk_size: int = 1024  # positions per chunk of the training loss's logits (0 = all at once)
  max_seq_len: int = 256

  # ------------------------------------------------------------------------------------------
  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    for key in unknown:
      if key in _RENAMED:
        raise ConfigError(f"model.{key}: no longer exists; use {_RENAMED[key]}")
    if unknown:
      raise ConfigError(f"model: unknown key(s) {unknown}; valid keys are {sorted(names)}")
    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()}
    cfg = cls(**kw)
    cfg.validate()
    return cfg

  def replace(self, **kw) -> "ModelConfig":
    cfg = dataclasses.replace(self, **kw)
    cfg.validate()
    return cfg

  # Layer kinds -------------------------------------------------------------------------------
  def is_mla(self, layer: int) -> bool:
    """`layer` is 0-indexed."""
    return (layer + 1) in self.mla_layers

  def is_dense(self, layer: int) -> bool:
    return (layer + 1) in self.dense_layers

  @property
  def layer_kinds(self) -> tuple[tuple[str, str], ...]:
    """(mixer, ffn) per 0-indexed layer: mixer in {"kda","mla"}, ffn in {"dense","moe"}."""
    return tuple(("mla" if self.is_mla(i) else "kda", "dense" if self.is_dense(i) else "moe")
                 for i in range(self.n_layers))

  @property
  def num_attn_res_sites(self) -> int:
    return 2 * self.n_layers + 1

  def validate(self) -> None:
    def need(cond, key, msg):
      if not cond:
        raise ConfigError(f"model.{key}: {msg} (got {getattr(self, key)!r})")

    for key in ("vocab_size", "d_model", "n_layers", "kda_num_heads", "kda_num_v_heads",
                "kda_head_dim", "kda_v_head_dim", "kda_conv_size", "mla_num_heads", "kv_lora_rank",
                "qk_nope_head_dim", "v_head_dim", "dense_ff_dim", "num_experts",
                "num_experts_per_tok", "expert_ff_dim", "attn_res_block_size", "max_seq_len"):
      need(isinstance(getattr(self, key), int) and getattr(self, key) > 0, key, "must be a positive int")
    need(self.qk_rope_head_dim >= 0 and self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim",
         "must be a non-negative even int")
    need(self.q_lora_rank >= 0, "q_lora_rank", "must be >= 0 (0 disables the low-rank query)")
    need(self.moe_latent_dim >= 0, "moe_latent_dim", "must be >= 0")
    need(isinstance(self.moe_latent_norm, bool), "moe_latent_norm", "must be a bool")
    need(isinstance(self.moe_expert_tie_steps, int) and not isinstance(self.moe_expert_tie_steps, bool)
         and self.moe_expert_tie_steps >= 0, "moe_expert_tie_steps", "must be an int >= 0 (0 = independent experts)")
    need(self.shared_ff_dim >= 0, "shared_ff_dim", "must be >= 0")
    need(self.kda_num_v_heads % self.kda_num_heads == 0, "kda_num_v_heads",
         f"must be a multiple of kda_num_heads={self.kda_num_heads}")
    need(self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
         f"top-k cannot exceed num_experts={self.num_experts}")
    need(self.kda_chunk_size in (16, 32, 64, 128), "kda_chunk_size", "must be one of 16, 32, 64, 128")
    need(self.kda_implementation in _KDA_IMPLS, "kda_implementation", f"must be one of {_KDA_IMPLS}")
    need(self.kda_gate_lower_bound is None or -5.0 <= self.kda_gate_lower_bound < 0, "kda_gate_lower_bound",
         "must be None or in [-5, 0)")
    need(self.expert_activation in _ACTIVATIONS, "expert_activation", f"must be one of {_ACTIVATIONS}")
    need(self.dense_activation in _ACTIVATIONS, "dense_activation", f"must be one of {_ACTIVATIONS}")
    need(self.moe_implementation in _MOE_IMPLS, "moe_implementation", f"must be one of {_MOE_IMPLS}")
    need(self.balancing in _BALANCING, "balancing", f"must be one of {_BALANCING}")
    need(not self.balance_in_batch or self.balancing == "quantile", "balance_in_batch",
         "needs balancing='quantile'")
    need(isinstance(self.balance_in_batch_iters, int) and 1 <= self.balance_in_batch_iters <= 16,
         "balance_in_batch_iters", "must be an int in [1, 16]")
    num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    e_over_k = self.num_experts / self.num_experts_per_tok
    need(num(self.balance_in_batch_max_load) and 1 <= self.balance_in_batch_max_load < e_over_k,
         "balance_in_batch_max_load", f"must be a number in [1, num_experts / num_experts_per_tok = {e_over_k:g})")
    need(num(self.balance_in_batch_min_load) and 0 <= self.balance_in_batch_min_load <= 1,
         "balance_in_batch_min_load", "must be a number in [0, 1]")
    need(isinstance(self.balance_in_batch_band_from, int) and not isinstance(self.balance_in_batch_band_from, bool)
         and self.balance_in_batch_band_from >= 0, "balance_in_batch_band_from", "must be an int >= 0")
    for key, off in (("balance_in_batch_max_load", 1.0), ("balance_in_batch_min_load", 1.0)):
      need(getattr(self, key) == off or self.balance_in_batch, key, "bands the in-batch shift: needs "
           "balance_in_batch=True")
    need(self.balance_in_batch_band_from == 0 or self.balance_in_batch_max_load != 1.0
         or self.balance_in_batch_min_load != 1.0, "balance_in_batch_band_from",
         "starts a band, but balance_in_batch_max_load = min_load = 1 (no band)")
    need(self.balance_stored_update in _STORED_UPDATES, "balance_stored_update",
         f"must be one of {_STORED_UPDATES}")
    need(isinstance(self.balance_jitter, (int, float)) and 0 <= self.balance_jitter < 0.5, "balance_jitter",
         "must be in [0, 0.5) (sigmoid score units)")
    need(self.balance_jitter == 0 or self.balance_in_batch, "balance_jitter", "needs balance_in_batch=True")
    need(isinstance(self.balance_jitter_steps, int) and not isinstance(self.balance_jitter_steps, bool)
         and self.balance_jitter_steps >= 0, "balance_jitter_steps", "must be an int >= 0 (0 = constant jitter)")
    need(self.balance_jitter_steps == 0 or self.balance_jitter > 0, "balance_jitter_steps",
         "decays balance_jitter, which is 0")
    need(isinstance(self.balance_jitter_floor, (int, float)) and not isinstance(self.balance_jitter_floor, bool)
         and 0 <= self.balance_jitter_floor <= self.balance_jitter, "balance_jitter_floor",
         f"must be in [0, balance_jitter={self.balance_jitter}]")
    need(self.balance_jitter_decay in _JITTER_DECAYS, "balance_jitter_decay", f"must be one of {_JITTER_DECAYS}")
    for key, off in (("balance_jitter_floor", 0.0), ("balance_jitter_decay", "linear")):
      need(getattr(self, key) == off or self.balance_jitter_steps > 0, key,
           "shapes the jitter's decay: needs balance_jitter_steps > 0")
    need(self.router_norm in _ROUTER_NORMS, "router_norm", f"must be one of {_ROUTER_NORMS}")
    need(isinstance(self.router_stats_rate, (int, float)) and 0 < self.router_stats_rate <= 1,
         "router_stats_rate", "must be in (0, 1]")
    need(self.loss_chunk_size >= 0, "loss_chunk_size", "must be >= 0 (0 = the whole sequence at once)")
    need(self.remat_policy in _REMAT, "remat_policy", f"must be one of {_REMAT}")
    need(self.dtype in ("float32", "bfloat16", "float16"), "dtype", "must be float32, bfloat16 or float16")
    need(self.param_dtype in ("float32", "bfloat16"), "param_dtype", "must be float32 or bfloat16")
    for key in ("mla_layers", "dense_layers"):
      v = getattr(self, key)
      need(isinstance(v, tuple) and all(isinstance(i, int) and 1 <= i <= self.n_layers for i in v), key,
           f"must be a tuple of 1-indexed layer numbers in [1, {self.n_layers}]")
      need(len(set(v)) == len(v), key, "has duplicate layer numbers")
