"""Gated MLPs: the activation math shared by the dense FFN, the shared experts and the routed experts.

Activations (h_gate, h_up are the two input projections of a gated MLP):
  swiglu:   silu(g) * u
  situ:     SiTU-GLU, soft-capped so every activation is bounded whatever the input:
            beta*tanh(g/beta)*sigmoid(g) * beta_l*tanh(u/beta_l),  |.| < beta * beta_l
            (cfg.situ_beta = 4, cfg.situ_beta_linear = 25 in K3). Near 0 it is ~ silu(g)*u.

`DenseFFN(cfg, ff_dim)` is the K3 / Kimi Linear dense layer (layer 1): x -> W_o act(x W_g, x W_u).
Weights: "wi_gate", "wi_up" [d, ff] logical ("embed", "mlp"), "wo" [ff, d] ("mlp", "embed").
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from moonshot_jax.config import ModelConfig
from moonshot_jax.layers.linear import project

ACTIVATIONS = ("swiglu", "situ")


def swiglu(h_gate: jax.Array, h_up: jax.Array) -> jax.Array:
  return jax.nn.silu(h_gate) * h_up


def situ_glu(h_gate: jax.Array, h_up: jax.Array, beta: float, beta_linear: float) -> jax.Array:
  """Soft-capped SiLU-GLU: the gate's pre-activation and the linear branch both pass through
  beta*tanh(./beta) so outliers cannot blow up (bounded by beta * beta_linear)."""
  capped_gate = beta * jnp.tanh(h_gate / beta)
  return capped_gate * jax.nn.sigmoid(h_gate) * (beta_linear * jnp.tanh(h_up / beta_linear))


def gated_activation(h_gate: jax.Array, h_up: jax.Array, cfg: ModelConfig,
                     activation: str | None = None) -> jax.Array:
  """act(h_gate, h_up) for `activation` (default cfg.expert_activation), computed in fp32."""
  activation = cfg.expert_activation if activation is None else activation
  if h_gate.shape != h_up.shape:
    raise ValueError(f"h_up: expected the shape of h_gate {h_gate.shape}, got {h_up.shape}")
  g32, u32 = h_gate.astype(jnp.float32), h_up.astype(jnp.float32)
  if activation == "swiglu":
    out = swiglu(g32, u32)
  elif activation == "situ":
    out = situ_glu(g32, u32, cfg.situ_beta, cfg.situ_beta_linear)
  else:
    raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
  return out.astype(h_gate.dtype)


class DenseFFN(nn.Module):
  """Gated MLP d -> ff_dim -> d on any leading shape [..., d]."""
  cfg: ModelConfig
  ff_dim: int
  activation: str = "swiglu"  # the shared experts pass cfg.expert_activation

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.cfg
    if x.shape[-1] != cfg.d_model:
      raise ValueError(f"x: expected last dim d_model={cfg.d_model}, got shape {x.shape}")
    if not (isinstance(self.ff_dim, int) and self.ff_dim > 0):
      raise ValueError(f"ff_dim: expected a positive int, got {self.ff_dim!r}")
    dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    init = nn.initializers.normal(cfg.init_std)
    d, f = cfg.d_model, self.ff_dim
    w_gate = self.param("wi_gate", nn.with_logical_partitioning(init, ("embed", "mlp")), (d, f), pdtype)
    w_up = self.param("wi_up", nn.with_logical_partitioning(init, ("embed", "mlp")), (d, f), pdtype)
    w_out = self.param("wo", nn.with_logical_partitioning(init, ("mlp", "embed")), (f, d), pdtype)

    x = x.astype(dtype)
    h_gate = project("...d,df->...f", x, w_gate).astype(dtype)
    h_up = project("...d,df->...f", x, w_up).astype(dtype)
    h = gated_activation(h_gate, h_up, cfg, self.activation)
    if h.ndim == 3:  # [B, T, ff]: keep the hidden sharded over "tensor"
      h = nn.with_logical_constraint(h, ("act_batch", "act_length", "act_mlp"))
    return project("...f,fd->...d", h, w_out).astype(dtype)
