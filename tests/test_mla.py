"""Gated MLA: independent NumPy reference, causality, segment isolation, absorbed decode, RoPE, flash."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moonshot_jax.config import ModelConfig
from moonshot_jax.layers.mla import MLA, dense_causal_attention, flash_causal_attention
from moonshot_jax.layers.rope import apply_rope

BASE = ModelConfig(d_model=32, mla_num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                   v_head_dim=6)
VARIANTS = {
    "nope": BASE,
    "rope_qlora": BASE.replace(mla_use_rope=True, q_lora_rank=12),
    "nogate": BASE.replace(mla_output_gate=False, rope_theta=100.0, mla_use_rope=True),
}


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@functools.lru_cache(maxsize=None)
def _params(cfg, seed):
  # Random weights of the init's shapes (eval_shape: no init compile, which dominates on a busy
  # CPU). O(1)-scale logits so that attention is far from uniform and every test is sharp.
  shapes = nn.unbox(jax.eval_shape(MLA(cfg).init, jax.random.key(0), jnp.ones((1, 2, cfg.d_model))))
  rng = np.random.default_rng(seed)
  draw = lambda s: rng.normal(size=s.shape) * 0.4 if len(s.shape) > 1 else 1 + 0.2 * rng.normal(size=s.shape)
  return jax.tree.map(lambda s: jnp.asarray(draw(s), s.dtype), shapes)


class Jitted:
  """An MLA whose `apply` is jitted: one compile per test shape instead of one per eager op."""

  def __init__(self, module):
    self.apply = jax.jit(module.apply, static_argnames=("method",))


@functools.lru_cache(maxsize=None)
def jitted(cfg, **kw):
  return Jitted(MLA(cfg, **kw))


def make(cfg, T=10, B=2, seed=0, **kw):
  x = jax.random.normal(jax.random.key(seed), (B, T, cfg.d_model), jnp.float32)
  return jitted(cfg, **kw), _params(cfg, seed), x


# ---- independent float64 reference ----------------------------------------------------------
def np_rope(x, pos, theta):
  R = x.shape[-1]
  inv = theta ** (-np.arange(0, R, 2) / R)
  z = (x[..., : R // 2] + 1j * x[..., R // 2:]) * np.exp(1j * pos[:, :, None, None] * inv)
  return np.concatenate([z.real, z.imag], -1)


def np_mla(cfg, params, x, seg=None, pos=None):
  p = {k: np.asarray(v, np.float64) for k, v in _flat(params["params"]).items()}
  x = np.asarray(x, np.float64)
  B, T, _ = x.shape
  seg = np.zeros((B, T)) if seg is None else np.asarray(seg)
  pos = np.broadcast_to(np.arange(T), (B, T)) if pos is None else np.asarray(pos)
  norm = lambda a, s: a / np.sqrt(np.mean(a * a, -1, keepdims=True) + cfg.norm_eps) * s
  N, R = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
  if cfg.q_lora_rank:
    q = np.einsum("btr,rhk->bthk", norm(x @ p["wq_a"], p["q_norm/scale"]), p["wq_b"])
  else:
    q = np.einsum("btd,dhk->bthk", x, p["wq"])
  c = norm(x @ p["wkv_a"], p["kv_norm/scale"])
  kr = (x @ p["wk_rope"])[:, :, None, :]
  qr = q[..., N:]
  if cfg.mla_use_rope:
    qr, kr = np_rope(qr, pos, cfg.rope_theta), np_rope(kr, pos, cfg.rope_theta)
  k = np.concatenate([np.einsum("btl,lhn->bthn", c, p["w_uk"]),
                      np.broadcast_to(kr, kr.shape[:2] + (cfg.mla_num_heads, R))], -1)
  qf = np.concatenate([q[..., :N], qr], -1)
  v = np.einsum("btl,lhv->bthv", c, p["w_uv"])
  s = np.einsum("bqhd,bkhd->bhqk", qf, k) / np.sqrt(N + R)
  mask = (np.tril(np.ones((T, T), bool))[None] & (seg[:, :, None] == seg[:, None, :]))[:, None]
  s = np.where(mask, s, -np.inf)
  pr = np.exp(s - s.max(-1, keepdims=True))
  pr /= pr.sum(-1, keepdims=True)
  o = np.einsum("bhqk,bkhv->bqhv", pr, v)
  if cfg.mla_output_gate:
    o = o / (1 + np.exp(-np.einsum("btd,dhv->bthv", x, p["w_gate"])))
  return np.einsum("bthv,hvd->btd", o, p["wo"])


def _flat(tree, prefix=""):
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flat(v, prefix + k + "/"))
    else:
      out[prefix + k] = v
  return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_matches_float64_reference(name):
  cfg = VARIANTS[name]
  m, params, x = make(cfg, T=9)
  seg = jnp.array([[0] * 4 + [1] * 5, [3] * 9])
  pos = jnp.array([list(range(4)) + list(range(5)), list(range(9))])
  y = m.apply(params, x, seg, pos)
  assert rel(y, np_mla(cfg, params, x, seg, pos)) < 1e-5


@pytest.mark.parametrize("name", ["nope", "rope_qlora"])
def test_causality(name):
  cfg = VARIANTS[name]
  m, params, x = make(cfg, T=10)
  t = 6
  x2 = x.at[:, t].add(jax.random.normal(jax.random.key(9), x[:, t].shape))
  y, y2 = m.apply(params, x), m.apply(params, x2)
  np.testing.assert_array_equal(np.asarray(y[:, :t]), np.asarray(y2[:, :t]))
  assert np.all(np.abs(np.asarray(y[:, t:] - y2[:, t:])).max(-1) > 1e-4)  # every later token sees it


@pytest.mark.parametrize("name", ["nope", "rope_qlora"])
def test_segment_isolation(name):
  cfg = VARIANTS[name]
  m, params, x = make(cfg, T=11, B=1)
  cuts = [0, 3, 8, 11]
  seg = jnp.array([[i for i in range(3) for _ in range(cuts[i + 1] - cuts[i])]])
  pos = jnp.array([[t - cuts[i] for i in range(3) for t in range(cuts[i], cuts[i + 1])]])
  packed = m.apply(params, x, seg + 5, pos)
  for a, b in zip(cuts[:-1], cuts[1:]):
    alone = m.apply(params, x[:, a:b])
    assert rel(packed[:, a:b], alone) < 1e-6


@pytest.mark.parametrize("name", list(VARIANTS))
def test_absorbed_decode_matches_expanded(name):
  cfg = VARIANTS[name]
  m, params, x = make(cfg, T=12)
  y_full, latent = m.apply(params, x, method="prefill")
  S = 16
  lens = jnp.array([11, 7])
  # Garbage beyond cache_len must be ignored: fill the cache with noise, then the valid prefix.
  cache = jax.random.normal(jax.random.key(3), (2, S, latent.shape[-1])) * 100
  valid = jnp.arange(S)[None, :, None] < lens[:, None, None]
  cache = jnp.where(valid, jnp.pad(latent, ((0, 0), (0, S - 12), (0, 0))), cache)
  x_new = x[jnp.arange(2), lens][:, None]
  y_dec, new_latent = m.apply(params, x_new, cache, lens, method="decode")
  want = y_full[jnp.arange(2), lens]
  assert rel(y_dec[:, 0], want) <= 1e-5
  assert rel(new_latent[:, 0], latent[jnp.arange(2), lens]) <= 1e-6
  assert new_latent.shape == (2, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def test_decode_continues_last_document_of_packed_prefill():
  cfg = VARIANTS["rope_qlora"]
  m, params, x = make(cfg, T=12)
  starts = jnp.array([4, 7])  # row b: doc 0 = [0, start), doc 1 = [start, 12)
  t_B = jnp.arange(12)[None, :]
  seg = (t_B >= starts[:, None]).astype(jnp.int32)
  pos = jnp.where(seg == 1, t_B - starts[:, None], t_B)
  y_full, latent = m.apply(params, x, seg, pos, method="prefill")
  lens = jnp.array([9, 10])  # decode token index `lens` with the doc-1 rows [start, lens) as context
  idx = jnp.arange(2)
  y_dec, _ = m.apply(params, x[idx, lens][:, None], latent, lens, pos[idx, lens][:, None], starts,
                     method="decode")
  assert rel(y_dec[:, 0], y_full[idx, lens]) <= 1e-5


def test_decode_loop_reproduces_forward():
  cfg = VARIANTS["rope_qlora"]
  m, params, x = make(cfg, T=8, B=1)
  y_full = m.apply(params, x)
  cache = jnp.zeros((1, 8, cfg.kv_lora_rank + cfg.qk_rope_head_dim))
  for t in range(8):
    y_t, lat = m.apply(params, x[:, t:t + 1], cache, jnp.array([t]), method="decode")
    cache = cache.at[:, t].set(lat[:, 0])
    assert rel(y_t[:, 0], y_full[:, t]) <= 1e-5


def test_rope_position_sensitivity():
  rope, nope = VARIANTS["rope_qlora"], VARIANTS["nope"]
  T = 8
  pos = jnp.broadcast_to(jnp.arange(T), (2, T))
  m, params, x = make(rope, T=T)
  y = m.apply(params, x, None, pos)
  assert rel(m.apply(params, x, None, pos * 3), y) > 1e-3  # positions matter
  assert rel(m.apply(params, x, None, pos + 17), y) < 1e-5  # only relative positions matter
  m, params, x = make(nope, T=T)
  np.testing.assert_array_equal(np.asarray(m.apply(params, x, None, pos * 3)), np.asarray(m.apply(params, x)))


def test_apply_rope_matches_complex_rotation():
  x = jax.random.normal(jax.random.key(0), (2, 5, 3, 8))
  pos = jax.random.randint(jax.random.key(1), (2, 5), 0, 1000)
  got = apply_rope(x, pos, 500.0)
  assert rel(got, np_rope(np.asarray(x, np.float64), np.asarray(pos), 500.0)) < 1e-5


def test_flash_matches_dense_value_and_grad():
  B, T, H, K, V = 2, 50, 3, 8, 5  # T not a multiple of the block; several segments per row
  ks = jax.random.split(jax.random.key(4), 5)
  q, k = jax.random.normal(ks[0], (B, T, H, K)) * 2, jax.random.normal(ks[1], (B, T, H, K))
  v = jax.random.normal(ks[2], (B, T, H, V))
  seg = jnp.cumsum(jax.random.bernoulli(ks[3], 0.1, (B, T)), axis=1)
  ct = jax.random.normal(ks[4], (B, T, H, V))
  dense = lambda q, k, v: jnp.sum(dense_causal_attention(q, k, v, seg, 0.4) * ct)
  flash = lambda q, k, v: jnp.sum(flash_causal_attention(q, k, v, seg, 0.4, 16) * ct)
  o_flash = jax.jit(flash_causal_attention, static_argnums=(4, 5))(q, k, v, seg, 0.4, 16)
  assert rel(o_flash, dense_causal_attention(q, k, v, seg, 0.4)) < 1e-6
  grad = lambda f: jax.jit(jax.grad(f, (0, 1, 2)))(q, k, v)
  for gf, gd in zip(grad(flash), grad(dense)):
    assert rel(gf, gd) < 1e-5


def test_module_flash_path():
  cfg = VARIANTS["rope_qlora"]
  m, params, x = make(cfg, T=20)
  seg = jnp.array([[0] * 13 + [1] * 7, [0] * 20])
  assert rel(jitted(cfg, attn_block_size=8).apply(params, x, seg), m.apply(params, x, seg)) < 1e-6


@pytest.mark.slow
def test_module_gradients_flash_vs_dense():
  cfg = VARIANTS["rope_qlora"]
  _, params, x = make(cfg, T=20)
  seg = jnp.array([[0] * 13 + [1] * 7, [0] * 20])
  grad = lambda m: jax.jit(jax.grad(lambda p: jnp.sum(m.apply(p, x, seg) ** 2)))(params)
  for g, r in zip(jax.tree.leaves(grad(MLA(cfg, attn_block_size=8))), jax.tree.leaves(grad(MLA(cfg)))):
    assert np.all(np.isfinite(np.asarray(g))) and rel(g, r) < 1e-5


def test_bf16_runs_close_to_fp32():
  cfg = VARIANTS["rope_qlora"]
  m, params, x = make(cfg, T=10)
  y32 = m.apply(params, x)
  y16 = jitted(cfg.replace(dtype="bfloat16")).apply(params, x)
  assert y16.dtype == jnp.bfloat16 and rel(y16.astype(jnp.float32), y32) < 5e-2


def test_logical_names():
  boxed = jax.eval_shape(MLA(BASE).init, jax.random.key(0), jnp.ones((1, 3, BASE.d_model)))["params"]
  assert boxed["wq"].names == ("embed", "heads", "head_dim")
  assert boxed["wkv_a"].names == ("embed", "kv_lora")
  assert boxed["w_uk"].names == ("kv_lora", "heads", "head_dim")
  assert boxed["wo"].names == ("heads", "head_dim", "embed")


def test_bad_inputs():
  m, params, x = make(BASE)
  with pytest.raises(ValueError, match="x_BTD"):
    m.apply(params, x[..., :5])
  with pytest.raises(ValueError, match="segment_ids_BT"):
    m.apply(params, x, jnp.zeros((2, 3), jnp.int32))
  with pytest.raises(ValueError, match="latent_cache_BSC"):
    m.apply(params, x[:, :1], jnp.zeros((2, 4, 7)), jnp.array([1, 1]), method="decode")
  with pytest.raises(ValueError, match="x_B1D"):
    m.apply(params, x[:, :2], jnp.zeros((2, 4, 20)), jnp.array([1, 1]), method="decode")


def test_sharded_matches_unsharded():
  """Under a (data, expert, tensor) = (2, 2, 2) mesh with the zero3 rules, the jitted layer gives the
  unsharded result (forward and absorbed decode)."""
  from moonshot_jax.parallel import mesh as mesh_lib, rules as rules_lib, zero

  cfg = VARIANTS["rope_qlora"]
  m, params, x = make(cfg, T=10, B=4)
  want = m.apply(params, x)
  mesh = mesh_lib.make_mesh({"data": 2, "expert": 2, "tensor": 2})
  boxed = jax.eval_shape(MLA(cfg).init, jax.random.key(0), jnp.ones((1, 2, cfg.d_model)))
  sharded = jax.device_put(params, zero.param_shardings(boxed, mesh, "zero3"))
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules_lib.logical_axis_rules("zero3")):
    got = jax.jit(MLA(cfg).apply)(sharded, x)
  assert rel(got, want) < 1e-5


def test_flash_attention_backward_memory_is_linear_in_T():
  """Forward + backward of the blocked path keep O(T·block) per head, not the [T, T] logits: at
  T = 8192, block 128, the compiled temp memory is far below one T×T fp32 matrix (268 MB) and within
  a small multiple of the inputs, while the dense control needs at least the T×T probabilities."""
  B, T, H, K, block = 1, 8192, 1, 32, 128
  sd = jax.ShapeDtypeStruct
  args = [sd((B, T, H, K), jnp.float32)] * 3 + [sd((B, T), jnp.int32)]

  def temp_bytes(attn):
    loss = lambda q, k, v, seg: jnp.sum(attn(q, k, v, seg))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile(
        compiler_options={"xla_backend_optimization_level": 0})
    return compiled.memory_analysis().temp_size_in_bytes

  square = T * T * 4
  inputs = 3 * B * T * H * K * 4
  flash = temp_bytes(lambda q, k, v, seg: flash_causal_attention(q, k, v, seg, K ** -0.5, block))
  assert flash < 16 * inputs and flash < square / 16, (flash, inputs, square)
  assert temp_bytes(lambda q, k, v, seg: dense_causal_attention(q, k, v, seg, K ** -0.5)) >= square
