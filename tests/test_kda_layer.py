"""KDA layer: float64 reference, causality, segment isolation, prefill + decode, gates, gradients, init.

Every module call is jitted and shapes are shared between tests: compiling chunk_kda dominates the
run time on a busy CPU, so each distinct (config, shape, method) costs one compile.
"""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moonshot_jax.config import ModelConfig
from moonshot_jax.layers.kda import KDA, a_log_init, dt_bias_init

CFG = ModelConfig(d_model=32, kda_num_heads=2, kda_num_v_heads=4, kda_head_dim=8, kda_v_head_dim=6,
                  kda_chunk_size=16)
CFG_K3 = CFG.replace(kda_num_v_heads=2, kda_output_gate_full_rank=True, kda_gate_lower_bound=-5.0)
T = 12


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@functools.lru_cache(maxsize=None)
def params_for(cfg, seed=0):
  """Random O(1) weights of the init's shapes (eval_shape: no init compile); A_log, dt_bias, o_norm
  from their real initialisers' ranges so the gates are realistic."""
  shapes = nn.unbox(jax.eval_shape(KDA(cfg).init, jax.random.key(0), jnp.ones((1, 2, cfg.d_model))))
  rng = np.random.default_rng(seed)
  special = {"A_log": lambda s: np.log(rng.uniform(1, 16, s)),
             "dt_bias": lambda s: np.log(np.expm1(np.exp(rng.uniform(np.log(1e-3), np.log(0.1), s)))),
             "o_norm": lambda s: 1 + 0.2 * rng.normal(size=s), "g_bias": lambda s: 0.2 * rng.normal(size=s)}
  out = {name: jnp.asarray(special.get(name, lambda s: rng.normal(size=s) * 0.5)(s.shape), s.dtype)
         for name, s in shapes["params"].items()}
  return {"params": out}


@functools.lru_cache(maxsize=None)
def fn(cfg, method="__call__"):
  return jax.jit(functools.partial(KDA(cfg).apply, method=method))


def rand(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


# ---- float64 reference of the whole layer (literal recurrence) ----------------------------------------
def np_kda(cfg, params, x, seg=None):
  p = {k: np.asarray(v, np.float64) for k, v in params["params"].items()}
  x = np.asarray(x, np.float64)
  B, T_, _ = x.shape
  H, HV, K, V, W = (cfg.kda_num_heads, cfg.kda_num_v_heads, cfg.kda_head_dim, cfg.kda_v_head_dim,
                    cfg.kda_conv_size)
  seg = np.zeros((B, T_), int) if seg is None else np.asarray(seg)
  sig = lambda a: 1 / (1 + np.exp(-a))

  def conv(a, w):  # a [B,T,h,c], w [W,h,c]; explicit loop over taps and positions
    out = np.zeros_like(a)
    for t in range(T_):
      for j in range(W):
        s = t - (W - 1) + j
        if s >= 0:
          out[:, t] += np.where((seg[:, s] == seg[:, t])[:, None, None], a[:, s] * w[j], 0)
    return out

  silu = lambda a: a * sig(a)
  l2 = lambda a: a / np.sqrt(np.sum(a * a, -1, keepdims=True) + 1e-6)
  q = l2(silu(conv(np.einsum("btd,dhk->bthk", x, p["q_proj"]), p["q_conv"])))
  k = l2(silu(conv(np.einsum("btd,dhk->bthk", x, p["k_proj"]), p["k_conv"])))
  v = silu(conv(np.einsum("btd,dhv->bthv", x, p["v_proj"]), p["v_conv"]))
  f = np.einsum("btr,rhk->bthk", x @ p["f_a"], p["f_b"])
  f = f + p["dt_bias"].reshape(HV, K)
  a = np.exp(p["A_log"])[:, None]
  if cfg.kda_gate_lower_bound is None:
    g = -a * np.log1p(np.exp(f))
  else:
    g = cfg.kda_gate_lower_bound * sig(a * f)
  beta = sig(x @ p["b_proj"])
  o = np.zeros((B, T_, HV, V))
  for b in range(B):
    S = np.zeros((HV, K, V))
    for t in range(T_):
      if t > 0 and seg[b, t] != seg[b, t - 1]:
        S = np.zeros_like(S)
      for h in range(HV):
        qh, kh = q[b, t, h // (HV // H)], k[b, t, h // (HV // H)]
        Sd = np.exp(g[b, t, h])[:, None] * S[h]
        S[h] = Sd + beta[b, t, h] * np.outer(kh, v[b, t, h] - kh @ Sd)
        o[b, t, h] = (qh * K ** -0.5) @ S[h]
  o = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + cfg.norm_eps) * p["o_norm"]
  if cfg.kda_output_gate_full_rank:  # K3: g_proj, no bias
    o = o * sig(np.einsum("btd,dhv->bthv", x, p["g_proj"]))
  else:
    o = o * sig(np.einsum("btr,rhv->bthv", x @ p["g_a"], p["g_b"]) + p["g_bias"])
  return np.einsum("bthv,hvd->btd", o, p["o_proj"])


@pytest.mark.parametrize("cfg", [CFG, CFG_K3], ids=["kimi_linear", "k3_safe_gate"])
def test_matches_float64_reference(cfg):
  params = params_for(cfg)
  x = rand((2, T, cfg.d_model), 1)
  seg = jnp.array([[0] * 5 + [1] * 7, [2] * T])
  assert rel(fn(cfg)(params, x, seg), np_kda(cfg, params, x, seg)) < 1e-5


def test_causality():
  params = params_for(CFG)
  x = rand((2, T, CFG.d_model), 2)
  seg = jnp.zeros((2, T), jnp.int32)
  t = 7
  x2 = x.at[:, t].add(rand(x[:, t].shape, 3))
  y, y2 = fn(CFG)(params, x, seg), fn(CFG)(params, x2, seg)
  np.testing.assert_array_equal(np.asarray(y[:, :t]), np.asarray(y2[:, :t]))
  assert np.all(np.abs(np.asarray(y[:, t:] - y2[:, t:])).max(-1) > 1e-4)


def test_segment_isolation():
  """Each document of a packed row equals that document alone (conv window included); the lone
  documents are right-padded with noise to the same shape so one compile serves both calls."""
  params = params_for(CFG)
  lens = [3, 5, 4]  # the 3-token doc is shorter than the conv window, the others are not
  x = rand((1, T, CFG.d_model), 4)
  seg = jnp.array([sum([[i] * n for i, n in enumerate(lens)], [])])
  packed = fn(CFG)(params, jnp.repeat(x, 3, 0), jnp.repeat(seg, 3, 0))[0]
  noise = rand((3, T, CFG.d_model), 5)
  starts = np.cumsum([0] + lens[:-1])
  alone_x = jnp.stack([noise[i].at[:n].set(x[0, s:s + n]) for i, (s, n) in enumerate(zip(starts, lens))])
  alone = fn(CFG)(params, alone_x, jnp.zeros((3, T), jnp.int32))
  for i, (s, n) in enumerate(zip(starts, lens)):
    assert rel(packed[s:s + n], alone[i, :n]) < 1e-5


def test_prefill_then_decode_matches_forward():
  """Rows: [doc A | doc B] packed, and one plain doc, T=40 with chunk 16; prefill right-padded
  prompts (lengths 34 and 17, noise beyond), then decode on token by token: equal to the full
  forward's outputs. Row 0's prompt ends 2 tokens into doc B, so its conv window must drop doc A's
  last token; row 1's padding starts one token into chunk 2 and spans the chunk edge at 32, so the
  state must stay that of the prompt across chunk boundaries."""
  T40 = 40
  params = params_for(CFG)
  x = rand((2, T40, CFG.d_model), 6)
  seg = jnp.array([[0] * 32 + [1] * 8, [0] * T40])
  lengths = jnp.array([34, 17])
  y_full = fn(CFG)(params, x, seg)
  pad = jnp.arange(T40)[None, :, None] >= lengths[:, None, None]
  prompt = jnp.where(pad, rand(x.shape, 7) * 3, x)
  y_pre, cache = fn(CFG, "prefill")(params, prompt, seg, lengths)
  assert cache["conv"].shape == (2, CFG.kda_conv_size - 1, 2 * 2 * 8 + 4 * 6)
  assert cache["state"].shape == (2, 4, 8, 6) and cache["state"].dtype == jnp.float32
  for b in range(2):
    assert rel(y_pre[b, :lengths[b]], y_full[b, :lengths[b]]) < 1e-5
  decode = fn(CFG, "decode")
  for step in range(4):
    pos = lengths + step
    y_t, cache = decode(params, x[jnp.arange(2), pos][:, None], cache)
    assert rel(y_t[:, 0], y_full[jnp.arange(2), pos]) < 1e-4, step


def test_decode_from_zero_cache_matches_forward():
  params = params_for(CFG)
  x = rand((2, T, CFG.d_model), 8)
  y_full = fn(CFG)(params, x, jnp.zeros((2, T), jnp.int32))
  cache = KDA(CFG).init_cache(2)
  # the layout spelled out from the config: conv keeps the last W-1 inputs of the q, k, v channels
  # (H·K + H·K + HV·V) in the model dtype, state one K×V fp32 matrix per value head; all zero
  assert sorted(cache) == ["conv", "state"]
  assert cache["conv"].shape == (2, CFG.kda_conv_size - 1, 2 * 8 + 2 * 8 + 4 * 6)
  assert cache["conv"].dtype == jnp.dtype(CFG.dtype)
  assert cache["state"].shape == (2, 4, 8, 6) and cache["state"].dtype == jnp.float32
  assert not any(bool(jnp.any(a)) for a in jax.tree.leaves(cache))
  ys = []
  for t in range(5):
    y_t, cache = fn(CFG, "decode")(params, x[:, t:t + 1], cache)
    ys.append(y_t)
  assert rel(jnp.concatenate(ys, 1), y_full[:, :5]) < 1e-4


@pytest.mark.parametrize("cfg", [CFG, CFG_K3], ids=["softplus", "safe"])
def test_gate_range(cfg):
  params = params_for(cfg)
  x = rand((2, T, cfg.d_model), 9)
  # Moderate inputs: strictly negative. Wide ones (both tails of sigmoid / softplus): the decay may
  # underflow to exactly 0 in fp32 ("no forgetting"), never positive, never below the bound.
  assert np.all(np.asarray(fn(cfg, "gate")(params, x * 0.2)) < 0)
  g = np.asarray(fn(cfg, "gate")(params, x * 4))
  assert g.shape == (2, T, cfg.kda_num_v_heads, cfg.kda_head_dim) and g.dtype == np.float32
  assert np.all(g <= 0)
  if cfg.kda_gate_lower_bound is not None:
    assert np.all(g >= cfg.kda_gate_lower_bound)
    assert g.min() < 0.9 * cfg.kda_gate_lower_bound and g.max() > 0.1 * cfg.kda_gate_lower_bound


def test_gradients_finite():
  params = params_for(CFG)
  x = rand((2, T, CFG.d_model), 10)
  seg = jnp.array([[0] * 5 + [1] * 7, [0] * T])
  loss = lambda p, x: jnp.sum(KDA(CFG).apply(p, x, seg) ** 2)
  gp, gx = jax.jit(jax.grad(loss, (0, 1)))(params, x)
  for name, g in gp["params"].items():
    assert np.all(np.isfinite(np.asarray(g))) and np.any(np.asarray(g) != 0), name
  assert np.all(np.isfinite(np.asarray(gx)))


def test_init_ranges_and_param_dtypes():
  a = np.asarray(a_log_init(jax.random.key(0), (4096,)))
  assert np.all(a >= 0) and np.all(a <= np.log(16)) and a.min() < 0.05 and a.max() > np.log(15.5)
  dt = np.log1p(np.exp(np.asarray(dt_bias_init(jax.random.key(1), (4096,)), np.float64)))  # softplus
  assert np.all(dt >= 1e-3 * 0.999) and np.all(dt <= 0.1 * 1.001)
  assert np.mean(dt < 1e-2) == pytest.approx(0.5, abs=0.05)  # log-uniform: half below the geometric mid
  boxed = jax.eval_shape(KDA(CFG.replace(param_dtype="bfloat16")).init, jax.random.key(0),
                         jnp.ones((1, 2, CFG.d_model)))["params"]
  assert boxed["A_log"].value.shape == (4,) and boxed["A_log"].value.dtype == jnp.float32
  assert boxed["dt_bias"].value.shape == (4 * 8,) and boxed["dt_bias"].value.dtype == jnp.float32
  assert boxed["q_proj"].value.dtype == jnp.bfloat16
  assert boxed["q_proj"].names == ("embed", "heads", "head_dim")
  assert boxed["v_proj"].names == ("embed", "v_heads", "head_dim")
  assert boxed["o_proj"].names == ("v_heads", "head_dim", "embed")


def test_bad_inputs():
  params = params_for(CFG)
  m = KDA(CFG)
  with pytest.raises(ValueError, match="x_BTD"):
    m.apply(params, jnp.ones((2, 4, 7)))
  with pytest.raises(ValueError, match="segment_ids_BT"):
    m.apply(params, jnp.ones((2, 4, 32)), jnp.zeros((2, 5), jnp.int32))
  with pytest.raises(ValueError, match="cache\\['conv'\\]"):
    m.apply(params, jnp.ones((2, 1, 32)), dict(conv=jnp.zeros((2, 2, 3)), state=jnp.zeros((2, 4, 8, 6))),
            method="decode")
  with pytest.raises(ValueError, match="batch_size"):
    m.init_cache(0)


def test_sharded_matches_unsharded():
  """Under a (data, expert, tensor) = (2, 2, 2) mesh with the zero3 rules (embed over data, heads
  over tensor), the jitted layer gives the unsharded result."""
  from moonshot_jax.parallel import mesh as mesh_lib, rules as rules_lib, zero

  params = params_for(CFG)
  x = rand((4, T, CFG.d_model), 11)
  seg = jnp.array([[0] * 5 + [1] * 7] * 4)
  want = fn(CFG)(params, x, seg)
  mesh = mesh_lib.make_mesh({"data": 2, "expert": 2, "tensor": 2})
  boxed = jax.eval_shape(KDA(CFG).init, jax.random.key(0), jnp.ones((1, 2, CFG.d_model)))
  sharded = jax.device_put(params, zero.param_shardings(boxed, mesh, "zero3"))
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules_lib.logical_axis_rules("zero3")):
    got = jax.jit(KDA(CFG).apply)(sharded, x, seg)
  assert rel(got, want) < 1e-5


def test_bf16_close_to_fp32():
  cfg = CFG.replace(dtype="bfloat16")
  params = params_for(CFG)
  x = rand((2, T, CFG.d_model), 12)
  seg = jnp.zeros((2, T), jnp.int32)
  y16 = fn(cfg)(params, x, seg)
  assert y16.dtype == jnp.bfloat16
  assert rel(y16.astype(jnp.float32), fn(CFG)(params, x, seg)) < 5e-2
