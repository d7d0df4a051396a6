"""Prefill / decode against the model's own full forward (the independent reference: no cache)."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moonshot_jax.config import ModelConfig
from moonshot_jax.inference import cache as cache_lib
from moonshot_jax.inference import engine, plan_cache
from moonshot_jax.model.transformer import Transformer, layer_plan

TOL = 1e-4  # fp32 relative error (max-abs over the max-abs of the reference)


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def small_cfg(**kw) -> ModelConfig:
  """4 layers: KDA + dense FFN, [KDA + MoE] x 2 scanned, MLA + MoE; AttnRes blocks of 2 (a block
  boundary inside the scan), RoPE on (positions matter), low-rank q, a latent MoE."""
  base = dict(vocab_size=128, d_model=32, n_layers=4, mla_layers=(4,), dense_layers=(1,),
              kda_num_heads=2, kda_num_v_heads=4, kda_head_dim=8, kda_v_head_dim=8, kda_chunk_size=16,
              mla_num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
              v_head_dim=8, mla_use_rope=True, dense_ff_dim=64, num_experts=4, num_experts_per_tok=2,
              expert_ff_dim=16, moe_latent_dim=16, shared_ff_dim=32, attn_res=True, attn_res_block_size=2,
              max_seq_len=64)
  base.update(kw)
  return ModelConfig(**base)


def random_variables(cfg: ModelConfig, seed: int = 0) -> dict:
  """Random weights in the model's tree (from eval_shape: compiling init would dominate the tests).
  Unlike the real init, AttnRes queries and MoE biases are non-zero so they matter."""
  abstract = nn.meta.unbox(jax.eval_shape(
      lambda: Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))))
  paths, tree = jax.tree_util.tree_flatten_with_path(abstract)
  keys = jax.random.split(jax.random.key(seed), len(paths))

  def fill(path, x, key):
    name = jax.tree_util.keystr(path)
    noise = jax.random.normal(key, x.shape, x.dtype)
    if "scale" in name or "o_norm" in name or "input_var" in name:  # (router-input variances > 0)
      return 1.0 + 0.1 * noise
    if "A_log" in name:
      return 1.0 + 0.5 * noise
    if "dt_bias" in name:
      return -2.0 + 0.5 * noise
    return 0.15 * noise

  return jax.tree.unflatten(tree, [fill(p, x, k) for (p, x), k in zip(paths, keys)])


@pytest.fixture(scope="module")
def model():
  cfg = small_cfg()
  assert any(s.scanned for s in layer_plan(cfg)), "the test config should exercise a scanned segment"
  v = random_variables(cfg)
  full = jax.jit(lambda v, t, s=None: Transformer(cfg).apply(v, t, s)[0])
  return cfg, v, full


def test_decode_matches_full_forward_every_step(model):
  cfg, v, full = model
  B, T_total = 2, 20
  lens = np.array([5, 9])
  toks = np.asarray(jax.random.randint(jax.random.key(7), (B, T_total), 0, cfg.vocab_size), np.int32)
  ref = full(v, toks)  # causal: row b's logits at t only see toks[b, :t+1]
  prompt = np.where(np.arange(9)[None] < lens[:, None], toks[:, :9], 0)  # right-padded
  logits, cache = engine.prefill(v, cfg, prompt, lengths=lens, max_len=32)
  for b in range(B):
    assert rel(logits[b, :lens[b]], ref[b, :lens[b]]) < TOL
  np.testing.assert_array_equal(cache.lengths, lens)
  for i in range(T_total - 9):
    pos = lens + i
    step_logits, cache = engine.decode_step(v, cfg, cache, toks[np.arange(B), pos])
    err = rel(step_logits, ref[np.arange(B), pos])
    assert err < TOL, f"decode step {i}: rel err {err:.2e}"
  np.testing.assert_array_equal(cache.lengths, lens + T_total - 9)


def test_prefill_then_decode_equals_longer_prefill(model):
  cfg, v, _ = model
  toks = np.asarray(jax.random.randint(jax.random.key(3), (2, 11), 0, cfg.vocab_size), np.int32)
  _, c10 = engine.prefill(v, cfg, toks[:, :10], max_len=32)
  lg, c11_dec = engine.decode_step(v, cfg, c10, toks[:, 10])
  lg11, c11 = engine.prefill(v, cfg, toks, max_len=32, all_logits=False)
  assert rel(lg, lg11) < TOL
  np.testing.assert_array_equal(c11_dec.lengths, c11.lengths)
  for l, (a, b) in enumerate(zip(c11_dec.layers, c11.layers)):
    for name in a:
      assert rel(a[name], b[name]) < TOL, f"layer {l} {name}"


def test_packed_prefill_equals_separate_prefills(model):
  cfg, v, _ = model
  key = jax.random.key(11)
  doc_a = np.asarray(jax.random.randint(key, (7,), 0, cfg.vocab_size), np.int32)
  doc_b = np.asarray(jax.random.randint(jax.random.fold_in(key, 1), (6,), 0, cfg.vocab_size), np.int32)
  pad = lambda x, n=16: np.pad(x, (0, n - len(x)))
  # row 0: [doc_a | doc_b | padding] packed; row 1: doc_b alone
  toks = np.stack([pad(np.concatenate([doc_a, doc_b])), pad(doc_b)])
  seg = np.stack([pad(np.array([1] * 7 + [2] * 6)), pad(np.array([1] * 6))]).astype(np.int32)
  lp, cp = engine.prefill(v, cfg, toks, segment_ids=seg, max_len=32)  # lengths from seg != 0
  la, _ = engine.prefill(v, cfg, np.stack([pad(doc_a)] * 2), lengths=np.array([7, 7]), max_len=32)
  assert rel(lp[0, :7], la[0, :7]) < TOL
  assert rel(lp[0, 7:13], lp[1, :6]) < TOL
  # the packed row's cache is that of its last document alone: decoding continues doc_b
  np.testing.assert_array_equal(cp.lengths, [6, 6])
  for l, e in enumerate(cp.layers):
    for name, x in e.items():
      assert rel(x[0], x[1]) < TOL, f"layer {l} {name}"
  d, _ = engine.decode_step(v, cfg, cp, np.array([5, 5], np.int32))
  assert rel(d[0], d[1]) < TOL


def test_kda_cache_is_constant_size_and_matches_planner(model):
  cfg, v, _ = model
  shapes = {}
  for T in (8, 40):
    toks = jnp.zeros((1, T), jnp.int32) + 3
    _, c = jax.eval_shape(lambda t: engine._prefill_impl(  # abstract: nothing runs
        engine.as_variables(v, cfg), t, jnp.zeros_like(t), jnp.full((1,), T, jnp.int32), cfg=cfg,
        max_len=64, all_logits=False, mesh=None, strategy="zero1"), toks)
    shapes[T] = c
  kda = lambda c: [e for e, (m, _) in zip(c.layers, cfg.layer_kinds) if m == "kda"]
  assert jax.tree.map(lambda x: x.shape, kda(shapes[8])) == jax.tree.map(lambda x: x.shape, kda(shapes[40]))
  # planner == the real arrays (lengths [B] int32 is bookkeeping, not cache)
  p = plan_cache.plan(cfg, 64)
  actual = cache_lib.cache_bytes(shapes[40].layers)
  assert p.bytes_per_seq == actual
  assert p.kda_bytes_per_seq == cache_lib.cache_bytes(kda(shapes[40]))


def test_prompt_lengths_share_one_compilation(model):
  cfg, v, _ = model
  before = engine._prefill_impl._cache_size()
  for T in (9, 13, 16):  # one bucket (16)
    engine.prefill(v, cfg, np.ones((2, T), np.int32), max_len=32)
  assert engine._prefill_impl._cache_size() - before <= 1


def test_bad_inputs_raise(model):
  cfg, v, _ = model
  with pytest.raises(ValueError, match="tokens"):
    engine.prefill(v, cfg, np.ones((4,), np.int32))
  with pytest.raises(ValueError, match="lengths"):
    engine.prefill(v, cfg, np.ones((2, 4), np.int32), lengths=np.array([0, 4]))
  with pytest.raises(ValueError, match="max_len"):
    engine.prefill(v, cfg, np.ones((1, 8), np.int32), max_len=4)
  with pytest.raises(ValueError, match="segment_ids"):
    engine.prefill(v, cfg, np.ones((1, 8), np.int32), segment_ids=np.ones((1, 7), np.int32))
  _, c = engine.prefill(v, cfg, np.ones((2, 4), np.int32), max_len=32)
  with pytest.raises(ValueError, match="token"):
    engine.decode_step(v, cfg, c, np.ones((3,), np.int32))
  with pytest.raises(ValueError, match="moe_state"):
    engine.prefill(v["params"], cfg, np.ones((1, 4), np.int32))
  with pytest.raises(ValueError, match=r"cache.layers\[0\]"):
    engine.decode_step(v, cfg, c.replace(layers=(c.layers[3],) + c.layers[1:]), np.ones((2,), np.int32))


def test_dense_and_gathered_decode_experts_equal_the_training_dispatch(monkeypatch):
  """engine.decode_experts picks dense_experts (E <= 4k, whatever the token count: a row's logits must
  not depend on its batch) or gathered_experts; both equal layers/moe.routed_experts (the training
  dispatch) for distinct top-k experts with uneven weights."""
  from moonshot_jax.layers import moe
  cfg = small_cfg(num_experts=8)
  T, k, L, F, E = 6, 2, 16, 12, 8
  ks = jax.random.split(jax.random.key(5), 6)
  x = jax.random.normal(ks[0], (T, L))
  idx = jax.vmap(lambda kk: jax.random.permutation(kk, E)[:k])(jax.random.split(ks[1], T)).astype(jnp.int32)
  w = jax.random.uniform(ks[2], (T, k), minval=0.1, maxval=1.0)
  wg, wu = (0.3 * jax.random.normal(kk, (E, L, F)) for kk in ks[3:5])
  wd = 0.3 * jax.random.normal(ks[5], (E, F, L))
  ref = moe.routed_experts(x, idx, w, wg, wu, wd, cfg)
  assert rel(engine.dense_experts(x, idx, w, wg, wu, wd, cfg), ref) < 1e-5
  assert rel(engine.gathered_experts(x, idx, w, wg, wu, wd, cfg), ref) < 1e-5
  picked = []
  for name in ("dense_experts", "gathered_experts"):
    monkeypatch.setattr(engine, name, lambda *a, _n=name, _f=getattr(engine, name): picked.append(_n) or _f(*a))
  engine.decode_experts(x, idx, w, wg, wu, wd, cfg)  # E = 8 <= 4k
  engine.decode_experts(x[:1], idx[:1], w[:1], wg, wu, wd, cfg)  # one token: still dense
  wide = lambda a: jnp.concatenate([a] * 2)  # E = 16 > 4k
  engine.decode_experts(x, idx, w, wide(wg), wide(wu), wide(wd), cfg)
  assert picked == ["dense_experts", "dense_experts", "gathered_experts"]


def test_planner_variants_and_k3_scale():
  cfg = small_cfg()
  plans = plan_cache.compare(cfg, 1000)
  assert (plans["hybrid"].n_mla, plans["all_mla"].n_mla, plans["all_kda"].n_mla) == (1, 4, 0)
  assert plans["all_kda"].mla_bytes_per_token == 0
  # hybrid per-sequence bytes = (KDA layers' constant) + (MLA layers x rows x latent bytes)
  kda = plan_cache.kda_layer_bytes(cfg)
  assert kda == {"conv": 3 * (2 * 2 * 8 + 4 * 8) * 4, "state": 4 * 8 * 8 * 4}
  assert plans["hybrid"].bytes_per_seq == 3 * (kda["conv"] + kda["state"]) + 1 * 1000 * (16 + 4) * 4
  # a K3-like model at 1M context: 69 KDA + 24 MLA layers, bf16 latents of 512 + 64
  k3 = ModelConfig(n_layers=93, d_model=64, mla_layers=tuple(range(4, 93, 4)) + (93,), dtype="bfloat16",
                   kv_lora_rank=512, qk_rope_head_dim=64, kda_num_heads=64, kda_num_v_heads=64,
                   kda_head_dim=128, kda_v_head_dim=128, max_seq_len=1 << 20)
  p = plan_cache.compare(k3, 1 << 20)
  assert p["hybrid"].n_mla == 24 and p["all_mla"].n_mla == 93
  assert p["hybrid"].mla_bytes_per_token == 24 * 576 * 2
  assert 0.25 < p["hybrid"].bytes_per_seq / p["all_mla"].bytes_per_seq < 0.3
  assert "hybrid" in plan_cache.format_table(p)


def test_sharded_prefill_and_decode_match_single_device(model):
  """Params sharded as in training (zero3 over a data x expert x tensor mesh), batch over data x expert.
  Fast tier: one prefill and decode compile per layout."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec
  from moonshot_jax.parallel import zero
  cfg, v, _ = model
  devs = np.asarray(jax.devices()[:8]).reshape(1, 2, 2, 2)
  mesh = Mesh(devs, ("pipeline", "data", "expert", "tensor"))
  boxed = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
  v_sh = {"params": jax.device_put(v["params"], zero.param_shardings(boxed["params"], mesh, "zero3")),
          "moe_state": jax.device_put(v["moe_state"], NamedSharding(mesh, PartitionSpec()))}
  toks = np.asarray(jax.random.randint(jax.random.key(5), (4, 12), 0, cfg.vocab_size), np.int32)
  lens = np.array([12, 7, 9, 3])
  l0, c0 = engine.prefill(v, cfg, toks, lengths=lens, max_len=32)
  l1, c1 = engine.prefill(v_sh, cfg, toks, lengths=lens, max_len=32, mesh=mesh, strategy="zero3")
  assert rel(l1, l0) < TOL
  assert len(c1.layers[0]["state"].sharding.device_set) == 8
  for _ in range(3):
    nxt = np.argmax(np.asarray(l0 if l0.ndim == 2 else l0[np.arange(4), lens - 1]), -1).astype(np.int32)
    l0, c0 = engine.decode_step(v, cfg, c0, nxt)
    l1, c1 = engine.decode_step(v_sh, cfg, c1, nxt, mesh=mesh, strategy="zero3")
    assert rel(l1, l0) < TOL
