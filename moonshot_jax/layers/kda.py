"""Kimi Delta Attention layer (Kimi Linear / K3 linear-attention mixer), Flax Linen.

Shapes: B batch, T length, D d_model, H q/k heads of dim K, HV value heads of dim V (HV a multiple
of H), W = cfg.kda_conv_size.

  q, k = L2norm(SiLU(conv(x W_q))), L2norm(SiLU(conv(x W_k)))      [B,T,H,K]  (norm in fp32)
  v    = SiLU(conv(x W_v))                                          [B,T,HV,V]
  g    = −exp(A_log) · softplus(f(x) + dt_bias)                     [B,T,HV,K] log-decay ≤ 0, fp32
         or, with cfg.kda_gate_lower_bound = lb (safe gate):  lb · sigmoid(exp(A_log)·(f(x) + dt_bias))
         f(x) = (x W_fa) W_fb, low-rank d→K→HV·K (Kimi Linear and K3 alike)
  β    = sigmoid(x W_b)                                             [B,T,HV]
  o    = chunk_kda(q, k, v, g, β)  (pallas_kernels.kda; decode: recurrent_kda, one step)
  y    = W_o (RMSNorm_V(o) ⊙ sigmoid(g_out(x))),   g_out low-rank d→V→HV·V with bias (Kimi Linear,
         fla's KDA) or, with cfg.kda_output_gate_full_rank, full rank x W_g, d→HV·V, no bias (K3)

`conv` is a depthwise causal conv (no bias) per channel, taps w[0..W−1] with w[W−1] on the current
token; it never reads across a segment boundary nor before the row start (zeros there).

Parameters: the low-rank bottleneck dim of f_b / g_b is logically unnamed (None: replicated; flax
forbids naming two dims of one array "head_dim", and rules.py has no low-rank name).
`A_log` is [HV] (one decay rate per value head, as fla / the Kimi Linear checkpoints: the
per-channel spread comes from dt_bias and f(x), and HF weights import unchanged); `dt_bias` is
[HV·K] (head-major, fla's layout). Both are fp32 whatever cfg.param_dtype, named exactly so the
optimizer can exclude them from weight decay.

Cache (decode state; `init_cache` / `kda_init_cache` make zeros of the right shapes):
  conv  [B, W−1, 2·H·K + HV·V] cfg.dtype: the last W−1 *pre-conv* projections, oldest first,
        channels concatenated q | k | v, each flattened head-major (h·K + i).
  state [B, HV, K, V] fp32: the delta-rule state.
`prefill(x, segment_ids, lengths_B)` returns the cache of the LAST segment of each row (ending at
position lengths_B − 1, default T − 1; tokens from lengths_B on — right padding — are ignored by the
cache; their outputs are garbage). `decode(x_B1D, cache)` advances one token with the recurrent step.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from moonshot_jax.config import ModelConfig
from moonshot_jax.layers.linear import project
from moonshot_jax.layers.norms import rms_normalize
from moonshot_jax.parallel import kernel_sharding
from pallas_kernels.kda import chunk_kda, recurrent_kda
from pallas_kernels.kda.api import resolve_implementation

_F32 = jnp.float32
_L2_EPS = 1e-6


# ---- initialisers --------------------------------------------------------------------------------
def a_log_init(key, shape, dtype=_F32):
  """A_log = log U(1, 16)."""
  return jnp.log(jax.random.uniform(key, shape, _F32, 1.0, 16.0)).astype(dtype)


def dt_bias_init(key, shape, dtype=_F32, dt_min: float = 1e-3, dt_max: float = 0.1):
  """dt_bias = softplus⁻¹(dt), dt log-uniform in [dt_min, dt_max] (Mamba / fla convention)."""
  log_dt = jax.random.uniform(key, shape, _F32, jnp.log(dt_min), jnp.log(dt_max))
  dt = jnp.exp(log_dt)
  return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)  # inverse of softplus, stable for small dt


def conv_init(key, shape, dtype=_F32):
  """Depthwise conv taps ~ U(±1/sqrt(W)) (PyTorch Conv1d default for fan-in W)."""
  bound = shape[0] ** -0.5
  return jax.random.uniform(key, shape, _F32, -bound, bound).astype(dtype)


# ---- helpers ---------------------------------------------------------------------------------------
def causal_conv(x_BTHC, w_WHC, segment_ids_BT=None) -> jax.Array:
  """Depthwise causal conv in fp32: y[t] = Σ_i w[W−1−i]·x[t−i] over t−i ≥ 0 in t's segment."""
  T = x_BTHC.shape[1]
  W = w_WHC.shape[0]
  x = x_BTHC.astype(_F32)
  w = w_WHC.astype(_F32)
  y = x * w[W - 1]
  for i in range(1, min(W, T + 1)):
    x_i = jnp.pad(x, ((0, 0), (i, 0), (0, 0), (0, 0)))[:, :T]  # zeros before the row start
    if segment_ids_BT is not None:
      same = segment_ids_BT == jnp.pad(segment_ids_BT, ((0, 0), (i, 0)))[:, :T]
      x_i = jnp.where(same[:, :, None, None], x_i, 0.0)
    y = y + x_i * w[W - 1 - i]
  return y


def l2_normalize(x: jax.Array) -> jax.Array:
  x32 = x.astype(_F32)
  return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + _L2_EPS)


def kda_init_cache(cfg: ModelConfig, batch_size: int) -> dict:
  """Zero cache for `KDA.decode` (layout in the module docstring)."""
  if not isinstance(batch_size, int) or batch_size <= 0:
    raise ValueError(f"batch_size: expected a positive int, got {batch_size!r}")
  channels = 2 * cfg.kda_num_heads * cfg.kda_head_dim + cfg.kda_num_v_heads * cfg.kda_v_head_dim  # q | k | v
  conv_shape = (batch_size, cfg.kda_conv_size - 1, channels)
  return dict(conv=jnp.zeros(conv_shape, jnp.dtype(cfg.dtype)),
              state=jnp.zeros((batch_size, cfg.kda_num_v_heads, cfg.kda_head_dim, cfg.kda_v_head_dim), _F32))


def _check_x(x, d_model: int, name: str, length: int | None = None) -> None:
  if x.ndim != 3 or x.shape[-1] != d_model or (length is not None and x.shape[1] != length):
    raise ValueError(f"{name}: expected [B, {length or 'T'}, d_model={d_model}], got shape {x.shape}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name}: expected a floating dtype, got {x.dtype}")


def _check_ids(ids, shape, name: str) -> None:
  if ids is not None and (ids.shape != tuple(shape) or not jnp.issubdtype(ids.dtype, jnp.integer)):
    raise ValueError(f"{name}: expected an integer array of shape {tuple(shape)}, got {ids.dtype}{ids.shape}")


# ---- the module ------------------------------------------------------------------------------------
class KDA(nn.Module):
  """KDA mixer; see the module docstring for the math and the cache layout."""
  cfg: ModelConfig

  def setup(self) -> None:
    cfg = self.cfg
    D, H, HV, K, V, W = (cfg.d_model, cfg.kda_num_heads, cfg.kda_num_v_heads, cfg.kda_head_dim,
                         cfg.kda_v_head_dim, cfg.kda_conv_size)
    pdt = jnp.dtype(cfg.param_dtype)
    normal = nn.initializers.normal(stddev=cfg.init_std)

    def param(name, shape, names, init=normal, dtype=pdt):
      return self.param(name, nn.with_logical_partitioning(init, names), shape, dtype)

    self.q_proj = param("q_proj", (D, H, K), ("embed", "heads", "head_dim"))
    self.k_proj = param("k_proj", (D, H, K), ("embed", "heads", "head_dim"))
    self.v_proj = param("v_proj", (D, HV, V), ("embed", "v_heads", "head_dim"))
    self.q_conv = param("q_conv", (W, H, K), ("conv", "heads", "head_dim"), conv_init)
    self.k_conv = param("k_conv", (W, H, K), ("conv", "heads", "head_dim"), conv_init)
    self.v_conv = param("v_conv", (W, HV, V), ("conv", "v_heads", "head_dim"), conv_init)
    self.f_a = param("f_a", (D, K), ("embed", "head_dim"))
    self.f_b = param("f_b", (K, HV, K), (None, "v_heads", "head_dim"))
    self.A_log = param("A_log", (HV,), ("v_heads",), a_log_init, _F32)
    self.dt_bias = param("dt_bias", (HV * K,), ("v_heads",), dt_bias_init, _F32)
    self.b_proj = param("b_proj", (D, HV), ("embed", "v_heads"))
    if cfg.kda_output_gate_full_rank:
      self.g_proj = param("g_proj", (D, HV, V), ("embed", "v_heads", "head_dim"))
    else:
      self.g_a = param("g_a", (D, V), ("embed", "head_dim"))
      self.g_b = param("g_b", (V, HV, V), (None, "v_heads", "head_dim"))
      self.g_bias = param("g_bias", (HV, V), ("v_heads", "head_dim"), nn.initializers.zeros)
    self.o_norm = param("o_norm", (V,), ("norm",), nn.initializers.ones, _F32)
    self.o_proj = param("o_proj", (HV, V, D), ("v_heads", "head_dim", "embed"))

  # -- pieces ----------------------------------------------------------------------------------
  @property
  def _dtype(self):
    return jnp.dtype(self.cfg.dtype)

  def _mm(self, spec, x, w):
    return project(spec, x, w, self._dtype)

  def _projections(self, x_BTD):
    """Pre-conv q, k [B,T,H,K] and v [B,T,HV,V] in cfg.dtype."""
    q = self._mm("btd,dhk->bthk", x_BTD, self.q_proj).astype(self._dtype)
    k = self._mm("btd,dhk->bthk", x_BTD, self.k_proj).astype(self._dtype)
    v = self._mm("btd,dhv->bthv", x_BTD, self.v_proj).astype(self._dtype)
    return q, k, v

  def _activate(self, q_conv, k_conv, v_conv):
    """Post-conv (fp32) -> SiLU, L2-norm of q, k; q, k, v in cfg.dtype."""
    cons = lambda a: nn.with_logical_constraint(a, ("act_batch", "act_length", "act_heads", None))
    q = cons(l2_normalize(jax.nn.silu(q_conv)).astype(self._dtype))
    k = cons(l2_normalize(jax.nn.silu(k_conv)).astype(self._dtype))
    v = cons(jax.nn.silu(v_conv).astype(self._dtype))
    return q, k, v

  def gate(self, x_BTD) -> jax.Array:
    """Log-decay g [B,T,HV,K] fp32 (≤ 0; in [lower_bound, 0] with the safe gate)."""
    cfg = self.cfg
    f = self._mm("btr,rhk->bthk", self._mm("btd,dr->btr", x_BTD, self.f_a).astype(self._dtype), self.f_b)
    f = f + self.dt_bias.reshape(cfg.kda_num_v_heads, cfg.kda_head_dim)
    a = jnp.exp(self.A_log)[:, None]
    if cfg.kda_gate_lower_bound is not None:
      return cfg.kda_gate_lower_bound * jax.nn.sigmoid(a * f)
    return -a * jax.nn.softplus(f)

  def _beta(self, x_BTD) -> jax.Array:
    return jax.nn.sigmoid(self._mm("btd,dh->bth", x_BTD, self.b_proj))

  def _output(self, o_BTHV, x_BTD):
    o = rms_normalize(o_BTHV, self.cfg.norm_eps) * self.o_norm  # headwise, fp32
    if self.cfg.kda_output_gate_full_rank:
      g_out = self._mm("btd,dhv->bthv", x_BTD, self.g_proj)
    else:
      g_out = self._mm("btr,rhv->bthv", self._mm("btd,dr->btr", x_BTD, self.g_a).astype(self._dtype),
                       self.g_b) + self.g_bias
    o = (o * jax.nn.sigmoid(g_out)).astype(self._dtype)
    y = self._mm("bthv,hvd->btd", o, self.o_proj).astype(self._dtype)
    return nn.with_logical_constraint(y, ("act_batch", "act_length", "act_embed"))

  def _prepare(self, x_BTD, segment_ids_BT):
    _check_x(x_BTD, self.cfg.d_model, "x_BTD")
    _check_ids(segment_ids_BT, x_BTD.shape[:2], "segment_ids_BT")
    return nn.with_logical_constraint(x_BTD.astype(self._dtype), ("act_batch", "act_length", "act_embed"))

  # -- public API ------------------------------------------------------------------------------
  def __call__(self, x_BTD, segment_ids_BT=None):
    return self._forward(x_BTD, segment_ids_BT, None, with_cache=False)[0]

  def prefill(self, x_BTD, segment_ids_BT=None, lengths_B=None):
    """-> (y_BTD, cache) with the cache of each row's last segment (see the module docstring)."""
    return self._forward(x_BTD, segment_ids_BT, lengths_B, with_cache=True)

  def _forward(self, x_BTD, segment_ids_BT, lengths_B, with_cache: bool):
    cfg = self.cfg
    x = self._prepare(x_BTD, segment_ids_BT)
    B, T, _ = x.shape
    _check_ids(lengths_B, (B,), "lengths_B")
    q_raw, k_raw, v_raw = self._projections(x)
    q, k, v = self._activate(causal_conv(q_raw, self.q_conv, segment_ids_BT),
                             causal_conv(k_raw, self.k_conv, segment_ids_BT),
                             causal_conv(v_raw, self.v_conv, segment_ids_BT))
    g, beta = self.gate(x), self._beta(x)
    seg = segment_ids_BT
    if with_cache and lengths_B is not None:
      # Right padding must not touch the state: β = 0 and g = 0 make a step the identity, and the
      # pads inherit the last real token's segment id so no reset fires inside the padding.
      pad_BT = jnp.arange(T)[None, :] >= lengths_B[:, None]
      g = jnp.where(pad_BT[..., None, None], 0.0, g)
      beta = jnp.where(pad_BT[..., None], 0.0, beta)
      if seg is not None:
        last_seg_B1 = jnp.take_along_axis(seg, jnp.maximum(lengths_B - 1, 0)[:, None], axis=1)
        seg = jnp.where(pad_BT, last_seg_B1, seg)
    o, state = _chunk_kda(q, k, v, g, beta, seg, implementation=cfg.kda_implementation,
                          chunk_size=cfg.kda_chunk_size, with_cache=with_cache)
    y = self._output(o, x)
    if not with_cache:
      return y, None
    raw_BTC = jnp.concatenate([a.reshape(B, T, -1) for a in (q_raw, k_raw, v_raw)], axis=-1)
    return y, dict(conv=self._last_window(raw_BTC, segment_ids_BT, lengths_B), state=state)

  def _last_window(self, raw_BTC, segment_ids_BT, lengths_B):
    """[B, W−1, C]: the W−1 inputs ending at lengths_B − 1, zeroed outside the last segment."""
    B, T, _ = raw_BTC.shape
    end_B = jnp.full((B,), T, jnp.int32) if lengths_B is None else lengths_B.astype(jnp.int32)
    pos_BW = end_B[:, None] - (self.cfg.kda_conv_size - 1) + jnp.arange(self.cfg.kda_conv_size - 1)
    valid_BW = pos_BW >= 0
    pos_BW = jnp.clip(pos_BW, 0, T - 1)
    if segment_ids_BT is not None:
      last_B1 = jnp.take_along_axis(segment_ids_BT, jnp.clip(end_B - 1, 0, T - 1)[:, None], axis=1)
      valid_BW &= jnp.take_along_axis(segment_ids_BT, pos_BW, axis=1) == last_B1
    window = jnp.take_along_axis(raw_BTC, pos_BW[..., None], axis=1)
    return jnp.where(valid_BW[..., None], window, 0).astype(self._dtype)

  def decode(self, x_B1D, cache):
    """One token: (y_B1D, new cache). Equivalent to extending the prefilled row by x_B1D."""
    cfg = self.cfg
    _check_x(x_B1D, cfg.d_model, "x_B1D", length=1)
    B = x_B1D.shape[0]
    want = kda_init_cache(cfg, B)
    for name in ("conv", "state"):
      if name not in cache or cache[name].shape != want[name].shape:
        got = cache[name].shape if name in cache else "missing"
        raise ValueError(f"cache[{name!r}]: expected shape {want[name].shape}, got {got}")
    x = x_B1D.astype(self._dtype)
    H, HV, K, V = cfg.kda_num_heads, cfg.kda_num_v_heads, cfg.kda_head_dim, cfg.kda_v_head_dim
    raws = self._projections(x)
    window_BWC = jnp.concatenate(
        [cache["conv"].astype(self._dtype), jnp.concatenate([a.reshape(B, 1, -1) for a in raws], -1)], axis=1)
    outs, start = [], 0
    for w, (heads, dim) in zip((self.q_conv, self.k_conv, self.v_conv), ((H, K), (H, K), (HV, V))):
      win = window_BWC[..., start:start + heads * dim].reshape(B, -1, heads, dim).astype(_F32)
      outs.append(jnp.einsum("bwhc,whc->bhc", win, w.astype(_F32))[:, None])
      start += heads * dim
    q, k, v = self._activate(*outs)
    o, state = recurrent_kda(q, k, v, self.gate(x), self._beta(x), initial_state=cache["state"],
                             output_final_state=True)
    return self._output(o, x), dict(conv=window_BWC[:, 1:], state=state)

  @nn.nowrap
  def init_cache(self, batch_size: int) -> dict:
    """Zero cache; needs no parameters (`KDA(cfg).init_cache(B)` works on an unbound module)."""
    return kda_init_cache(self.cfg, batch_size)


_TOK = ("act_batch", None, "act_heads", None)


def _chunk_kda(q, k, v, g, beta, seg, *, implementation: str, chunk_size: int, with_cache: bool):
  """chunk_kda with the configured implementation. A Pallas kernel runs on per-device blocks
  (XLA cannot partition a Mosaic/Triton call over the automatic mesh axes): shard_map over them,
  batch and heads split as the activations already are."""
  impl = resolve_implementation(implementation, q, k, v, g, beta, chunk_size, None)

  def run(q, k, v, g, beta, *seg):
    o, state = chunk_kda(q, k, v, g, beta, output_final_state=with_cache, segment_ids=seg[0] if seg else None,
                         chunk_size=chunk_size, implementation=impl)
    return (o, state) if with_cache else (o,)

  if impl == "xla":
    fn = run
  else:
    ins = [_TOK] * 4 + [("act_batch", None, "act_heads")] + ([("act_batch", None)] if seg is not None else [])
    outs = [_TOK] + ([("act_batch", "act_heads", None, None)] if with_cache else [])
    fn = kernel_sharding.over_auto_axes(run, ins, outs)
  res = fn(q, k, v, g, beta, *([seg] if seg is not None else []))
  return res[0], (res[1] if with_cache else None)
