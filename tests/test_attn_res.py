"""Block AttnRes: mixing math, source bookkeeping against hand-written NumPy stacks, scan/traced use."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moonshot_jax.config import ModelConfig
from moonshot_jax.layers.attn_res import (AttnResMix, AttnResState, add_output, attn_res_mix,
                                          is_block_end, num_slots)

B, T, D = 2, 3, 8
EPS = 1e-6


def np_mix(sources, w):
  """softmax_i(w . rmsnorm(v_i)) v_i, straight from the definition (fp64)."""
  v = np.stack([np.asarray(s, np.float64) for s in sources])  # [N, B, T, D]
  normed = v / np.sqrt(np.mean(v * v, -1, keepdims=True) + EPS)
  logits = np.einsum("nbtd,d->nbt", normed, np.asarray(w, np.float64))
  p = np.exp(logits - logits.max(0))
  p /= p.sum(0)
  return np.einsum("nbt,nbtd->btd", p, v)


def sublayer(x, w_DD):
  """A stand-in for attention / FFN: any nonlinear map works for source bookkeeping."""
  return np.tanh(np.asarray(x, np.float64) @ w_DD)


def rand(seed, shape, scale=1.0):
  return np.random.default_rng(seed).standard_normal(shape) * scale


def test_zero_init_is_uniform_mean_over_valid_sources():
  cfg = ModelConfig(d_model=D, n_layers=6, attn_res_block_size=2)  # 1 + 3 slots
  n = num_slots(cfg)
  buf = rand(0, (n, B, T, D), 3.0)  # every slot holds data: invalid ones must be ignored
  part = rand(1, (B, T, D))
  mix = AttnResMix(cfg)
  for mask, pvalid in [([1, 0, 0, 0], False), ([1, 1, 0, 1], False), ([1, 1, 1, 0], True),
                       ([1, 0, 0, 0], True)]:
    st = AttnResState(buffer=jnp.asarray(buf, jnp.float32), mask=jnp.asarray(mask, bool),
                      partial=jnp.asarray(part, jnp.float32), partial_valid=jnp.asarray(pvalid),
                      count=jnp.array(0, jnp.int32))
    params = jax.jit(mix.init)(jax.random.key(0), st)
    np.testing.assert_array_equal(np.asarray(params["params"]["query"].value), 0.0)
    srcs = [buf[i] for i in range(n) if mask[i]] + ([part] if pvalid else [])
    np.testing.assert_allclose(jax.jit(mix.apply)(params, st), np.mean(srcs, 0), rtol=1e-5, atol=1e-5)


def test_mix_matches_definition_with_random_query():
  cfg = ModelConfig(d_model=D, n_layers=4, attn_res_block_size=2)
  buf = rand(2, (3, B, T, D), 2.0)
  part = rand(3, (B, T, D))
  w = rand(4, (D,), 2.0)
  st = AttnResState(buffer=jnp.asarray(buf, jnp.float32), mask=jnp.array([True, False, True]),
                    partial=jnp.asarray(part, jnp.float32), partial_valid=jnp.array(True),
                    count=jnp.array(1, jnp.int32))
  mix = jax.jit(attn_res_mix, static_argnums=2)
  got = mix(st, jnp.asarray(w, jnp.float32), EPS)
  np.testing.assert_allclose(got, np_mix([buf[0], buf[2], part], w), rtol=1e-5, atol=1e-5)
  # scores see rmsnorm(v): scaling a source leaves its weight unchanged, so the output is linear in it
  st2 = st.replace(buffer=st.buffer.at[2].multiply(7.0))
  np.testing.assert_allclose(mix(st2, jnp.asarray(w, jnp.float32), EPS),
                             np_mix([buf[0], 7.0 * buf[2], part], w), rtol=1e-5, atol=1e-4)


def _autodiff_mix(buffer, mask, partial, partial_valid, w):
  """The definition in plain jnp, differentiated by JAX: the oracle for the hand-written VJP."""
  v = jnp.concatenate([buffer, partial[None]])
  ok = jnp.concatenate([mask, partial_valid[None]])
  logits = jnp.einsum("nbtd,d->nbt", v, w) * jax.lax.rsqrt(jnp.mean(v * v, -1) + EPS)
  p = jax.nn.softmax(jnp.where(ok[:, None, None], logits, -jnp.inf), axis=0)
  return jnp.einsum("nbt,nbtd->btd", p, v)


@pytest.mark.parametrize("mask,pvalid", [([1, 0, 1], True), ([1, 1, 0], False), ([1, 0, 0], True)])
def test_mix_gradients_match_autodiff_of_the_definition(mask, pvalid):
  buf = jnp.asarray(rand(5, (3, B, T, D), 2.0), jnp.float32)
  part = jnp.asarray(rand(6, (B, T, D)), jnp.float32)
  w = jnp.asarray(rand(7, (D,)), jnp.float32)
  dy = jnp.asarray(rand(8, (B, T, D)), jnp.float32)
  mask, pvalid = jnp.asarray(mask, bool), jnp.asarray(pvalid)

  def ours(buf, part, w):
    st = AttnResState(buffer=buf, mask=mask, partial=part, partial_valid=pvalid, count=jnp.array(1, jnp.int32))
    return jnp.sum(attn_res_mix(st, w, EPS) * dy)

  ref = lambda buf, part, w: jnp.sum(_autodiff_mix(buf, mask, part, pvalid, w) * dy)
  got = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(buf, part, w)
  want = jax.grad(ref, argnums=(0, 1, 2))(buf, part, w)
  for g, r, name in zip(got, want, ("dbuffer", "dpartial", "dquery")):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=name)
  # invalid sources get no gradient at all
  for i in range(3):
    if not mask[i]:
      np.testing.assert_array_equal(got[0][i], 0.0)
  if not pvalid:
    np.testing.assert_array_equal(got[1], 0.0)


def _run_stack(cfg, emb, queries, weights):
  """Our AttnRes pieces, unrolled in Python. queries [2L+1, D], weights [2L, D, D]."""
  @jax.jit
  def run(emb, queries, weights):
    st = AttnResState.init(emb, cfg)
    inputs = []
    for l in range(cfg.n_layers):
      for j in range(2):
        x = attn_res_mix(st, queries[2 * l + j], EPS)
        inputs.append(x)
        st = add_output(st, jnp.tanh(x @ weights[2 * l + j]), cfg,
                        block_end=(j == 1) & is_block_end(l, cfg))
    return inputs + [attn_res_mix(st, queries[-1], EPS)]

  return run(*(jnp.asarray(a, jnp.float32) for a in (emb, queries, weights)))


def test_four_layer_block_two_hand_written_sources():
  cfg = ModelConfig(d_model=D, n_layers=4, attn_res_block_size=2)
  emb = rand(5, (B, T, D))
  q = rand(6, (9, D))
  w = rand(7, (8, D, D), 0.5)
  e = emb
  # layer 1 (block 1)
  x = [np_mix([e], q[0])]; a1 = sublayer(x[-1], w[0])
  x.append(np_mix([e, a1], q[1])); f1 = sublayer(x[-1], w[1])
  # layer 2 (block 1): partial = a1 + f1, block 1 completes after f2
  x.append(np_mix([e, a1 + f1], q[2])); a2 = sublayer(x[-1], w[2])
  x.append(np_mix([e, a1 + f1 + a2], q[3])); f2 = sublayer(x[-1], w[3])
  b1 = a1 + f1 + a2 + f2
  # layer 3 (block 2): partial starts empty
  x.append(np_mix([e, b1], q[4])); a3 = sublayer(x[-1], w[4])
  x.append(np_mix([e, b1, a3], q[5])); f3 = sublayer(x[-1], w[5])
  # layer 4 (block 2)
  x.append(np_mix([e, b1, a3 + f3], q[6])); a4 = sublayer(x[-1], w[6])
  x.append(np_mix([e, b1, a3 + f3 + a4], q[7])); f4 = sublayer(x[-1], w[7])
  b2 = a3 + f3 + a4 + f4
  x.append(np_mix([e, b1, b2], q[8]))  # final site
  got = _run_stack(cfg, emb, q, w)
  assert len(got) == cfg.num_attn_res_sites == 9
  for i, (g, r) in enumerate(zip(got, x)):
    np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5, err_msg=f"site {i}")


def np_paper_stack(emb, queries, weights, n_layers, block_size):
  """Reference in the paper's list style: `blocks` grows, `partial` is None while empty."""
  blocks, partial, inputs = [emb], None, []
  for l in range(n_layers):
    for j in range(2):
      x = np_mix(blocks + ([partial] if partial is not None else []), queries[2 * l + j])
      inputs.append(x)
      y = sublayer(x, weights[2 * l + j])
      partial = y if partial is None else partial + y
    if (l + 1) % block_size == 0 or l == n_layers - 1:
      blocks.append(partial)
      partial = None
  inputs.append(np_mix(blocks, queries[-1]))
  return inputs


def _scan_stack(cfg):
  """Our pieces under jax.lax.scan over layers: the layer index and block-end flag are traced."""
  n_layers = cfg.n_layers
  mixers = [AttnResMix(cfg) for _ in range(2)]

  def stack(q_SD, w_SDD, emb_BTD):
    def layer(st, xs):
      l, q2, w2 = xs
      ins = []
      for j in range(2):
        x = mixers[j].apply({"params": {"query": q2[j]}}, st)
        ins.append(x)
        st = add_output(st, jnp.tanh(x @ w2[j]), cfg, (j == 1) & is_block_end(l, cfg))
      return st, jnp.stack(ins)

    xs = (jnp.arange(n_layers), q_SD[:-1].reshape(n_layers, 2, D), w_SDD.reshape(n_layers, 2, D, D))
    st, ins = jax.lax.scan(layer, AttnResState.init(emb_BTD, cfg), xs)
    return ins.reshape(2 * n_layers, B, T, D), attn_res_mix(st, q_SD[-1], EPS), st

  return stack


def _f32(*arrays):
  return tuple(jnp.asarray(a, jnp.float32) for a in arrays)


@pytest.mark.parametrize("n_layers,block_size", [(5, 2), (4, 4), (3, 1)])
def test_scan_with_traced_layer_index_matches_reference(n_layers, block_size):
  cfg = ModelConfig(d_model=D, n_layers=n_layers, attn_res_block_size=block_size,
                    mla_layers=(), dense_layers=())
  emb, q, w = rand(8, (B, T, D)), rand(9, (2 * n_layers + 1, D)), rand(10, (2 * n_layers, D, D), 0.5)
  ins, final, st = jax.jit(_scan_stack(cfg))(*_f32(q, w, emb))
  ref = np_paper_stack(emb, q, w, n_layers, block_size)
  for i in range(2 * n_layers):
    np.testing.assert_allclose(ins[i], ref[i], rtol=2e-5, atol=2e-5, err_msg=f"site {i}")
  np.testing.assert_allclose(final, ref[-1], rtol=2e-5, atol=2e-5)
  assert int(st.count) == -(-n_layers // block_size) and bool(st.mask.all())
  assert not bool(st.partial_valid)


def test_scan_gradients_match_unrolled_stack():
  """Gradients flow through the traced buffer writes as through a Python-unrolled stack."""
  n_layers = 3
  cfg = ModelConfig(d_model=D, n_layers=n_layers, attn_res_block_size=2, mla_layers=(), dense_layers=())
  emb, q, w = _f32(rand(12, (B, T, D)), rand(13, (2 * n_layers + 1, D)),
                   rand(14, (2 * n_layers, D, D), 0.5))
  stack = _scan_stack(cfg)

  def loss_unrolled(q_, w_):
    st = AttnResState.init(emb, cfg)
    for l in range(n_layers):
      for j in range(2):
        x = attn_res_mix(st, q_[2 * l + j], EPS)
        st = add_output(st, jnp.tanh(x @ w_[2 * l + j]), cfg, (j == 1) & is_block_end(l, cfg))
    return jnp.sum(attn_res_mix(st, q_[-1], EPS) ** 2)

  g_scan = jax.jit(jax.grad(lambda q_, w_: jnp.sum(stack(q_, w_, emb)[1] ** 2), (0, 1)))(q, w)
  g_ref = jax.jit(jax.grad(loss_unrolled, (0, 1)))(q, w)
  for a, r in zip(g_scan, g_ref):
    assert np.all(np.isfinite(a)) and np.abs(r).max() > 0
    np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-5)


def test_dtype_and_bad_inputs():
  cfg = ModelConfig(d_model=D, n_layers=2, attn_res_block_size=1, dtype="bfloat16", mla_layers=())
  st = AttnResState.init(jnp.asarray(rand(11, (B, T, D)), jnp.bfloat16), cfg)
  assert st.buffer.dtype == jnp.float32 and st.buffer.shape == (3, B, T, D)
  mix = AttnResMix(cfg)
  out = mix.apply(mix.init(jax.random.key(0), st), st)
  assert out.dtype == jnp.bfloat16 and out.shape == (B, T, D)
  with pytest.raises(ValueError, match="emb_BTD"):
    AttnResState.init(jnp.zeros((B, T, D + 1)), cfg)
  with pytest.raises(ValueError, match="y_BTD"):
    add_output(st, jnp.zeros((B, T + 1, D)), cfg, False)
  with pytest.raises(ValueError, match="d_model"):
    AttnResMix(cfg.replace(d_model=2 * D)).init(jax.random.key(0), st)
