"""Pipeline engine (moonshot_jax/parallel/pipeline.py) on a toy heterogeneous stack with real AttnRes.

The toy stack has two groups per layer, like the model: a "mixer" of kind "a" (tanh linear) or
"b" (two-layer, different shapes), and an "ffn" of kind "dense" or "moe" (the moe kind emits an aux
statistic). Each sublayer reads its input from an AttnRes site (random, non-zero queries) and adds
its output to the AttnRes state, so block sums must travel across stage boundaries correctly.
The reference is a plain Python loop over the layers in model order.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grad_testutil import assert_grads_close
from moonshot_jax.config import ModelConfig
from moonshot_jax.layers import attn_res as ar
from moonshot_jax.parallel import pipeline as pp
from moonshot_jax.parallel.mesh import make_mesh

D = 8
KINDS = [dict(mixer="a", ffn="dense"), dict(mixer="a", ffn="moe"), dict(mixer="b", ffn="moe"),
         dict(mixer="a", ffn="moe"), dict(mixer="b", ffn="dense")]
CFG = ModelConfig(d_model=D, n_layers=len(KINDS), attn_res_block_size=2, mla_layers=(), dense_layers=())


def _layer_params(key, kinds):
  ks = jax.random.split(key, 6)
  n = lambda k, s: jax.random.normal(k, s) * 0.4
  mixer = dict(q=n(ks[0], (D,)), w=n(ks[1], (D, D)))
  if kinds["mixer"] == "b":
    mixer["w2"] = n(ks[2], (D, 2 * D))
    mixer["w3"] = n(ks[3], (2 * D, D))
  ffn = dict(q=n(ks[4], (D,)), w=n(ks[5], (D, 3 * D)) if kinds["ffn"] == "dense" else n(ks[5], (D, D)))
  return dict(mixer=mixer, ffn=ffn)


def _mixer(kind):
  def f(p, state, layer):
    x = ar.attn_res_mix(state, p["q"], 1e-6)
    if kind == "a":  # normalised input: NaN on an all-zero input, as a bubble on zeros would see
      y = jnp.tanh((x / jnp.linalg.norm(x, axis=-1, keepdims=True)) @ p["w"])
    else:
      y = jnp.tanh(x @ p["w2"]) @ p["w3"] + x @ p["w"]
    return ar.add_output(state, y, CFG, False), jnp.zeros((2,))
  return f


def _ffn(kind):
  def f(p, state, layer):
    x = ar.attn_res_mix(state, p["q"], 1e-6)
    if kind == "dense":
      h = x @ p["w"]
      y = jnp.sin(h[..., :D]) * h[..., D:2 * D] + 0.1 * h[..., 2 * D:]
      aux = jnp.zeros((2,))
    else:
      y = jax.nn.gelu(x @ p["w"])
      aux = jnp.stack([jnp.sum(y * y), jnp.asarray(y.shape[0] * y.shape[1], jnp.float32)])  # sums
    return ar.add_output(state, y, CFG, ar.is_block_end(layer, CFG)), aux
  return f


APPLY = dict(mixer=dict(a=_mixer("a"), b=_mixer("b")), ffn=dict(dense=_ffn("dense"), moe=_ffn("moe")))
# Layer 0's mixer site has one source (the input): softmax weight 1 for any query, so the gradient
# of that query (argument 0, layer 0) is exactly 0.
ZERO_GRADS = ("0/0/mixer/q",)


def _reference(per_layer, x_MBTD, fq_D):
  """All microbatches at once (every op is per token), layers in model order; aux per layer."""
  m, b = x_MBTD.shape[:2]
  state = ar.AttnResState.init(x_MBTD.reshape((m * b,) + x_MBTD.shape[2:]), CFG)
  aux = []
  for i, (p, k) in enumerate(zip(per_layer, KINDS)):
    state, _ = APPLY["mixer"][k["mixer"]](p["mixer"], state, i)
    state, a = APPLY["ffn"][k["ffn"]](p["ffn"], state, i)
    aux.append(a)
  out = ar.attn_res_mix(state, fq_D, 1e-6)
  return out.reshape(x_MBTD.shape), aux


def test_plan_splits_contiguously_and_pads_only_mismatched_kinds():
  plan = pp.plan_stages(KINDS, 2)
  assert plan.stage_layers == ((0, 1, 2), (3, 4))
  assert plan.stack_size["mixer"] == dict(a=2, b=1)  # stage 0: a,a,b  stage 1: a,b
  assert plan.stack_size["ffn"] == dict(dense=1, moe=2)  # stage 0: d,m,m  stage 1: m,d
  assert plan.layer_id.tolist() == [[0, 1, 2], [3, 4, -1]]
  k3_like = [dict(mixer="mla" if (i + 1) % 4 == 0 or i == 92 else "kda", ffn="dense" if i == 0 else "moe")
             for i in range(93)]
  k3 = pp.plan_stages(k3_like, 16)
  assert k3.slots == 6 and sum(map(len, k3.stage_layers)) == 93
  assert k3.stack_size["mixer"] == dict(kda=5, mla=2)
  with pytest.raises(ValueError, match="mesh.pipeline"):
    pp.plan_stages(KINDS, 6)


def test_stack_unstack_round_trip():
  plan = pp.plan_stages(KINDS, 2)
  per_layer = [_layer_params(jax.random.key(i), k) for i, k in enumerate(KINDS)]
  back = jax.jit(lambda t: pp.unstack_layers(plan, pp.stack_layers(plan, t)))(per_layer)
  for a, b in zip(per_layer, back):
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_bubble_fraction():
  assert pp.bubble_fraction(4, 8) == pytest.approx(3 / 11)
  assert pp.bubble_fraction(1, 3) == 0.0
  assert pp.bubble_fraction(4, 8, virtual_stages=2) == pytest.approx(3 / 19)


@pytest.mark.parametrize("shape,remat", [
    (dict(pipeline=2, data=2, tensor=2), False),
    pytest.param(dict(pipeline=4, data=2), True, marks=pytest.mark.slow),
])
def test_gpipe_matches_sequential_value_and_grads(shape, remat):
  mesh = make_mesh(shape)
  s = shape["pipeline"]
  plan = pp.plan_stages(KINDS, s)
  per_layer = [_layer_params(jax.random.key(10 + i), k) for i, k in enumerate(KINDS)]
  x = jax.random.normal(jax.random.key(1), (3, 4, 5, D))  # M=3 microbatches of [B=4, T=5, D]
  fq = jnp.linspace(-1, 1, D)
  stage_fn = pp.make_stage_fn(plan, APPLY, ("mixer", "ffn"))

  # One compile each side: the loss programs also return (out, aux) for the value checks.
  def ref_loss(per_layer, x, fq):
    out, aux = _reference(per_layer, x, fq)
    return jnp.sum(jnp.cos(out) * out) + sum(jnp.sum(a) for a in aux), (out, aux)

  def pipe_loss(stacked, x, fq):  # w.r.t. the stacked [S, n, ...] params: padded entries visible
    states = jax.vmap(lambda xm: ar.AttnResState.init(xm, CFG))(x)
    out, aux = pp.gpipe(stage_fn, stacked, states, mesh, final_fn=lambda q, st: ar.attn_res_mix(st, q, 1e-6),
                        final_params=fq, remat=remat)
    return jnp.sum(jnp.cos(out) * out) + jnp.sum(aux["ffn"]), (out, aux)

  stacked = pp.stack_layers(plan, per_layer)
  with jax.set_mesh(mesh):
    (loss, (out, aux)), (g_stacked, gx, gfq) = jax.jit(
        jax.value_and_grad(pipe_loss, argnums=(0, 1, 2), has_aux=True))(stacked, x, fq)
  # bubbles run on real data: no NaN from mixer "a"'s normalisation reaches any gradient, and the
  # padded stack entries (on 2 stages: stage 1 holds one "a" mixer and one "moe" ffn, stage 0 two)
  # get exactly 0
  real = pp.stack_layers(plan, jax.tree.map(jnp.ones_like, per_layer))  # 0 marks padding
  assert sum(int(np.sum(np.asarray(r) == 0)) for r in jax.tree.leaves(real)) > 0
  for g, r in zip(jax.tree.leaves(g_stacked), jax.tree.leaves(real)):
    assert bool(jnp.isfinite(g).all())
    np.testing.assert_array_equal(np.asarray(g)[np.asarray(r) == 0], 0.0)
  grads = (pp.unstack_layers(plan, g_stacked), gx, gfq)
  (ref_loss_v, (ref_out, ref_aux)), ref_grads = jax.jit(
      jax.value_and_grad(ref_loss, argnums=(0, 1, 2), has_aux=True))(per_layer, x, fq)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-5, atol=1e-6)
  # per-layer aux, summed over microbatches, lands in the (stage, slot) of that layer
  for layer in range(len(KINDS)):
    st, j = np.argwhere(plan.layer_id == layer)[0]
    want = ref_aux[layer]
    np.testing.assert_allclose(np.asarray(aux["ffn"][st, j]), np.asarray(want), rtol=1e-5)
  np.testing.assert_allclose(float(loss), float(ref_loss_v), rtol=1e-5)
  assert_grads_close(grads, ref_grads, zero=ZERO_GRADS)
