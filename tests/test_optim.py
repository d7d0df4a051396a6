"""Optimizers, schedules and masks (moonshot_jax/train/optim.py) against hand-written references."""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import ml_collections
import pytest

from moonshot_jax import experiment
from moonshot_jax.train import optim

NS = (3.4445, -4.775, 2.0315)  # Muon's quintic Newton-Schulz coefficients (Jordan et al.)


def _ocfg(**kw) -> ml_collections.ConfigDict:
  o = experiment.base_config().optimizer
  o.update(kw)
  return o


def _box(rng, shape, names):
  return nn.LogicallyPartitioned(jnp.asarray(rng.standard_normal(shape), jnp.float32), names)


def _fake_params(seed=0):
  """A params tree with every kind of leaf the model has (names as the layers use them)."""
  r = np.random.default_rng(seed)
  return {
      "embedding": _box(r, (32, 8), ("vocab", "embed")),
      "lm_head": _box(r, (8, 32), ("embed", "vocab")),
      "final_norm": {"scale": _box(r, (8,), ("norm",))},
      "layers_1_3": {"layer_0": {
          "ffn": {"moe": {"router": _box(r, (2, 8, 4), ("layers", "embed", None)),
                          "w_gate": _box(r, (2, 4, 8, 6), ("layers", "expert", "embed", "mlp")),
                          "w_down": _box(r, (2, 4, 6, 8), ("layers", "expert", "mlp", "embed"))},
                  "norm": {"scale": _box(r, (2, 8), ("layers", "norm"))},
                  "site": {"query": _box(r, (2, 8), ("layers", "norm"))}},
          "mixer": {"kda": {"q_proj": _box(r, (2, 8, 2, 3), ("layers", "embed", "heads", "head_dim")),
                            "o_proj": _box(r, (2, 2, 3, 8), ("layers", "v_heads", "head_dim", "embed")),
                            "q_conv": _box(r, (2, 4, 2, 3), ("layers", "conv", "heads", "head_dim")),
                            "A_log": _box(r, (2, 2), ("layers", "v_heads")),
                            "dt_bias": _box(r, (2, 6), ("layers", "v_heads")),
                            "b_proj": _box(r, (2, 8, 2), ("layers", "embed", "v_heads")),
                            "g_bias": _box(r, (2, 2, 3), ("layers", "v_heads", "head_dim")),
                            "o_norm": _box(r, (2, 3), ("layers", "norm"))}}}},
      "layer_0": {"ffn": {"dense": {"wi_gate": _box(r, (8, 16), ("embed", "mlp")),
                                    "wo": _box(r, (16, 8), ("mlp", "embed"))}}},
  }


def _flat(tree):
  return {optim.path_str(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


MUON = {"layer_0/ffn/dense/wi_gate", "layer_0/ffn/dense/wo", "layers_1_3/layer_0/ffn/moe/w_gate",
        "layers_1_3/layer_0/ffn/moe/w_down", "layers_1_3/layer_0/mixer/kda/q_proj",
        "layers_1_3/layer_0/mixer/kda/o_proj"}
NO_DECAY = {"final_norm/scale", "layers_1_3/layer_0/ffn/norm/scale", "layers_1_3/layer_0/ffn/site/query",
            "layers_1_3/layer_0/mixer/kda/A_log", "layers_1_3/layer_0/mixer/kda/dt_bias",
            "layers_1_3/layer_0/mixer/kda/g_bias", "layers_1_3/layer_0/mixer/kda/o_norm"}


def test_labels_and_decay_mask():
  boxed = _fake_params()
  labels = _flat(optim.labels(boxed, "muon"))
  assert {k for k, v in labels.items() if v == "muon"} == MUON
  assert set(_flat(optim.labels(boxed, "adamw")).values()) == {"adamw"}
  decay = _flat(optim.decay_mask(boxed))
  assert {k for k, v in decay.items() if not v} == NO_DECAY
  assert decay["embedding"] and decay["lm_head"] and decay["layers_1_3/layer_0/ffn/moe/router"]


def test_muon_dims_orient_matrices():
  d = optim.muon_dims
  # stacked + expert axes are batch axes; embed-last weights contract their other dims
  assert d("a/w", (2, 4, 8, 6), ("layers", "expert", "embed", "mlp")) == (2, (3,))
  assert d("a/o", (2, 2, 3, 8), ("layers", "v_heads", "head_dim", "embed")) == ((1, 2), 3)
  assert d("a/q", (8, 2, 3), ("embed", "heads", "head_dim")) == (0, (1, 2))
  assert d("a/w", (8, 1), ("embed", "mlp")) is None  # a 1-wide "matrix" is a vector
  assert d("a/router", (8, 4), ("embed", None)) is None
  assert d("embedding", (32, 8), ("vocab", "embed")) is None


def _ns_reference(g: np.ndarray) -> np.ndarray:
  x = g.astype(np.float64)
  x = x / (np.linalg.norm(x) + 1e-8)
  t = x.shape[0] > x.shape[1]
  if t:
    x = x.T
  a, b, c = NS
  for _ in range(5):
    A = x @ x.T
    x = a * x + (b * A + c * A @ A) @ x
  return x.T if t else x


def test_muon_first_step_matches_reference():
  """Step 1 (nesterov, bias-corrected momentum of one gradient = the gradient's direction):
  update = -lr * (0.2 sqrt(max(fan_in, fan_out)) NS5(g) + wd * p) per 2-D slice; AdamW leaves
  get -lr * (g / (|g| + eps) + wd * mask * p)."""
  boxed = _fake_params()
  params = nn.meta.unbox(boxed)
  lr, wd = 0.01, 0.1
  ocfg = _ocfg(name="muon", lr=lr, schedule="constant", warmup_steps=0, weight_decay=wd, clip_norm=0.0,
               muon_lr_scale=1.0)
  tx, _ = optim.make_optimizer(ocfg, boxed, 10)
  rng = np.random.default_rng(1)
  grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)
  upd, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  upd, g, p = _flat(upd), _flat(grads), _flat(params)
  decay = _flat(optim.decay_mask(boxed))

  def muon_ref(name, batch_ndim, fan_in_axes):
    gg = np.asarray(g[name], np.float64)
    shape = gg.shape
    lead = shape[:batch_ndim]
    rows = math.prod(shape[batch_ndim:batch_ndim + fan_in_axes])
    mats = gg.reshape((-1, rows, math.prod(shape) // math.prod(lead) // rows))
    o = np.stack([_ns_reference(m) for m in mats]).reshape(shape)
    scale = 0.2 * math.sqrt(max(mats.shape[1:]))
    return -lr * (scale * o + wd * np.asarray(p[name]))

  cases = {"layer_0/ffn/dense/wi_gate": (0, 1), "layer_0/ffn/dense/wo": (0, 1),
           "layers_1_3/layer_0/ffn/moe/w_gate": (2, 1), "layers_1_3/layer_0/ffn/moe/w_down": (2, 1),
           "layers_1_3/layer_0/mixer/kda/q_proj": (1, 1), "layers_1_3/layer_0/mixer/kda/o_proj": (1, 2)}
  for name, (nb, fi) in cases.items():
    # entries are <= 7.3e-3, measured |diff| <= 5.7e-9 (fp32 NS5 vs float64): atol ~9x that
    np.testing.assert_allclose(np.asarray(upd[name]), muon_ref(name, nb, fi), rtol=1e-5, atol=5e-8,
                               err_msg=name)
  for name in set(upd) - MUON:
    gg, pp = np.asarray(g[name], np.float64), np.asarray(p[name], np.float64)
    want = -lr * (gg / (np.abs(gg) + 1e-8) + wd * decay[name] * pp)
    np.testing.assert_allclose(np.asarray(upd[name]), want, rtol=1e-4, atol=1e-7, err_msg=name)


def test_adamw_two_steps_with_clipping():
  """Two AdamW steps by hand: clip to global norm, bias-corrected moments, decoupled decay."""
  boxed = {"w": _box(np.random.default_rng(0), (4, 3), ("embed", "mlp")),
           "scale": _box(np.random.default_rng(1), (3,), ("norm",))}
  params = nn.meta.unbox(boxed)
  lr, wd, b1, b2, eps, clip = 0.05, 0.1, 0.9, 0.95, 1e-8, 1.0
  ocfg = _ocfg(name="adamw", lr=lr, schedule="constant", warmup_steps=0, weight_decay=wd, b1=b1, b2=b2,
               eps=eps, clip_norm=clip)
  tx, _ = optim.make_optimizer(ocfg, boxed, 10)
  rng = np.random.default_rng(2)
  g1 = jax.tree.map(lambda p: jnp.asarray(10 * rng.standard_normal(p.shape), jnp.float32), params)
  g2 = jax.tree.map(lambda p: jnp.asarray(0.1 * rng.standard_normal(p.shape), jnp.float32), params)
  state = tx.init(params)
  p_ = params
  update = jax.jit(tx.update)
  for g in (g1, g2):
    u, state = update(g, state, p_)
    p_ = jax.tree.map(lambda a, b: a + b, p_, u)

  keys = ("w", "scale")
  mask = {"w": 1.0, "scale": 0.0}
  p = {k: np.asarray(params[k], np.float64) for k in keys}
  m = {k: 0.0 for k in keys}
  v = {k: 0.0 for k in keys}
  for t, g in enumerate((g1, g2), start=1):
    gn = math.sqrt(sum(float(np.sum(np.asarray(g[k], np.float64) ** 2)) for k in keys))
    f = min(1.0, clip / gn)
    for k in keys:
      gk = np.asarray(g[k], np.float64) * f
      m[k] = b1 * m[k] + (1 - b1) * gk
      v[k] = b2 * v[k] + (1 - b2) * gk * gk
      mh, vh = m[k] / (1 - b1 ** t), v[k] / (1 - b2 ** t)
      p[k] = p[k] - lr * (mh / (np.sqrt(vh) + eps) + wd * mask[k] * p[k])
  for k in keys:
    np.testing.assert_allclose(np.asarray(p_[k]), p[k], rtol=1e-5, atol=1e-6, err_msg=k)
  assert int(optim.applied_updates(state)) == 2


@pytest.mark.parametrize("kind", ["cosine", "wsd", "constant"])
def test_schedules(kind):
  lr, warm, total, low, frac = 1e-2, 4, 24, 0.1, 0.25
  sched = optim.make_schedule(_ocfg(lr=lr, schedule=kind, warmup_steps=warm, min_lr_ratio=low,
                                    decay_fraction=frac), total)

  def want(c):  # c = updates applied before this one
    if c < warm:
      return lr * (c + 1) / warm
    if kind == "constant":
      return lr
    if kind == "cosine":
      prog = (c - warm) / (total - warm)
      return lr * (low + (1 - low) * 0.5 * (1 + math.cos(math.pi * prog)))
    n_decay = round(frac * (total - warm))
    start = total - n_decay
    return lr if c < start else lr + (lr * low - lr) * (c - start) / n_decay

  for c in range(total + 2):
    assert float(sched(c)) == pytest.approx(want(min(c, total)), rel=1e-5, abs=1e-9), (kind, c)
  assert float(sched(0)) > 0  # the first update already moves


def test_bad_optimizer_name():
  with pytest.raises(ValueError, match="optimizer.name"):
    optim.make_optimizer(_ocfg(name="sgd"), _fake_params(), 10)


def test_muon_keeps_expert_sharding():
  """Muon on an expert-sharded [layers, expert, a, b] weight orthogonalises each device's own
  experts: the compiled update moves no expert weights between devices. The control, optax's Muon
  applied directly (batch axes merged by a reshape), does."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from optax.contrib import MuonDimensionNumbers, scale_by_muon

  mesh = Mesh(np.array(jax.devices()[:4]), ("expert",))
  boxed = {"w": _box(np.random.default_rng(0), (3, 8, 16, 24), ("layers", "expert", "embed", "mlp"))}
  params = nn.meta.unbox(boxed)
  sh = {"w": NamedSharding(mesh, P(None, "expert", None, None))}
  ocfg = _ocfg(name="muon", schedule="constant", warmup_steps=0, weight_decay=0.0, clip_norm=0.0)
  tx, _ = optim.make_optimizer(ocfg, boxed, 10)
  control = scale_by_muon(weight_dimension_numbers={"w": MuonDimensionNumbers(2, 3)})

  def collectives(t):
    state = jax.eval_shape(t.init, params)
    st_sh = jax.tree.map(lambda s: sh["w"] if s.shape == params["w"].shape else NamedSharding(mesh, P()), state)
    f = jax.jit(lambda g, s, p: t.update(g, s, p), in_shardings=(sh, st_sh, sh))
    text = f.lower(params, state, params).compile().as_text()
    return sum(text.count(op) for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce"))

  assert collectives(control) > 0
  assert collectives(tx) == 0
  # and the numbers are still Muon's: per-matrix NS equals the control's merged-batch NS
  g = jax.tree.map(lambda p: p * 0.5 + 0.1, params)
  u0, _ = control.update(g, control.init(params))
  per_mat = optim.per_matrix(lambda dims: scale_by_muon(weight_dimension_numbers=dims),
                             lambda path: (2, MuonDimensionNumbers(0, 1)))
  u1, s1 = per_mat.update(g, per_mat.init(params))
  assert int(s1.count) == 1
  np.testing.assert_allclose(u1["w"], u0["w"], rtol=1e-5, atol=1e-6)


def test_vision_lr_scale_scales_only_the_tower():
  """optimizer.vision_lr_scale multiplies the whole update (Adam or Muon, + decay) of every leaf under
  params["vision"] and nothing else; at 1.0 the optimizer state keeps the text runs' structure."""
  r = np.random.default_rng(3)
  w = r.standard_normal((8, 16))
  boxed = {"vision": {"blocks_0": {"wqkv": nn.LogicallyPartitioned(jnp.asarray(w, jnp.float32), ("embed", "mlp"))},
                      "pos_emb": nn.LogicallyPartitioned(jnp.ones((4, 8)), (None, None))},
           "layer_0": {"wo": nn.LogicallyPartitioned(jnp.asarray(w, jnp.float32), ("embed", "mlp"))},
           "visionary": {"wo": nn.LogicallyPartitioned(jnp.asarray(w, jnp.float32), ("embed", "mlp"))}}
  params = nn.meta.unbox(boxed)
  grads = jax.tree.map(lambda p: jnp.cos(p) + 0.1, params)
  ups = {}  # (the factor is applied after Adam / Muon alike; AdamW keeps the test fast)
  for scale in (1.0, 0.25):
    tx, _ = optim.make_optimizer(_ocfg(vision_lr_scale=scale, warmup_steps=0), boxed, 10)
    ups[scale] = _flat(jax.jit(tx.update)(grads, tx.init(params), params)[0])
  for path, u in ups[0.25].items():
    want = 0.25 if path.startswith("vision/") else 1.0
    np.testing.assert_allclose(np.asarray(u), want * np.asarray(ups[1.0][path]), rtol=1e-6, err_msg=path)
  plain, _ = optim.make_optimizer(_ocfg(), boxed, 10)
  one, _ = optim.make_optimizer(_ocfg(vision_lr_scale=1.0), boxed, 10)
  assert jax.tree.structure(one.init(params)) == jax.tree.structure(plain.init(params))
  with pytest.raises(ValueError, match="optimizer.vision_lr_scale"):
    optim.make_optimizer(_ocfg(vision_lr_scale=0.0), boxed, 10)


def test_vision_local_lr_scale_moves_only_patch_embedding_and_projector():
  """optimizer.vision_local_lr_scale gives the tower's patch embedding (+ its norm) and projector their own
  factor; the blocks, the position grid (vision_lr_scale) and the LM (1) keep theirs; 0 = off (the group
  follows vision_lr_scale and the optimizer state keeps its structure)."""
  r = np.random.default_rng(5)
  boxed = {"vision": {"encoder": {"patch_embed": {"kernel": _box(r, (12, 8), ("vit_patch", "embed"))},
                                  "patch_norm": {"scale": _box(r, (8,), ("norm",))},
                                  "pos_emb": _box(r, (2, 2, 8), ("vit_pos", None, "embed")),
                                  "block_0": {"wo": {"kernel": _box(r, (8, 8), ("embed", "mlp"))}}},
                      "projector": {"in_proj": {"kernel": _box(r, (8, 8), ("vit_merged", "mlp"))}}},
           "layer_0": {"patch_embed": {"kernel": _box(r, (12, 8), ("embed", "mlp"))}}}
  params = nn.meta.unbox(boxed)
  grads = jax.tree.map(lambda p: jnp.cos(p) + 0.1, params)

  def first_update(**kw):
    tx, _ = optim.make_optimizer(_ocfg(warmup_steps=0, weight_decay=0.0, **kw), boxed, 10)
    return _flat(jax.jit(tx.update)(grads, tx.init(params), params)[0]), tx.init(params)

  one, _ = first_update()
  got, _ = first_update(vision_lr_scale=0.1, vision_local_lr_scale=0.7)
  want = {"vision/encoder/patch_embed/kernel": 0.7, "vision/encoder/patch_norm/scale": 0.7,
          "vision/projector/in_proj/kernel": 0.7, "vision/encoder/pos_emb": 0.1,
          "vision/encoder/block_0/wo/kernel": 0.1, "layer_0/patch_embed/kernel": 1.0}
  assert set(got) == set(want)
  for path, f in want.items():
    np.testing.assert_allclose(np.asarray(got[path]), f * np.asarray(one[path]), rtol=1e-6, err_msg=path)
  off, s_off = first_update(vision_lr_scale=0.1, vision_local_lr_scale=0.0)
  _, s_plain = first_update(vision_lr_scale=0.1)
  assert jax.tree.structure(s_off) == jax.tree.structure(s_plain)
  for path in want:
    f = 1.0 if path.startswith("layer_0") else 0.1
    np.testing.assert_allclose(np.asarray(off[path]), f * np.asarray(one[path]), rtol=1e-6, err_msg=path)
  with pytest.raises(ValueError, match="optimizer.vision_local_lr_scale"):
    first_update(vision_local_lr_scale=-1.0)


def test_vision_lr_ramp_follows_the_schedule_and_resumes():
  """optimizer.vision_lr_scale_to ramps the tower's factor linearly over the updates [begin, begin + steps]:
  update k of every vision/ leaf is factor(k) x the factor-1 update (LM leaves untouched); the ramp's
  count lives in the optimizer state, so a state saved mid-ramp and restored goes on along it."""
  r = np.random.default_rng(4)
  boxed = {"vision": {"w": _box(r, (8, 16), ("embed", "mlp"))}, "layer_0": {"wo": _box(r, (8, 16), ("embed", "mlp"))}}
  params = nn.meta.unbox(boxed)
  ramp = dict(vision_lr_scale=0.1, vision_lr_scale_to=0.5, vision_lr_ramp_begin=2, vision_lr_ramp_steps=4)
  want = [0.1, 0.1, 0.1, 0.2, 0.3, 0.4, 0.5, 0.5]  # linear from 0.1 after update 2 to 0.5 at update 6
  tx, _ = optim.make_optimizer(_ocfg(warmup_steps=0, **ramp), boxed, 20)
  ref, _ = optim.make_optimizer(_ocfg(warmup_steps=0), boxed, 20)
  s, s_ref = tx.init(params), ref.init(params)
  for k, f in enumerate(want):
    grads = jax.tree.map(lambda p, k=k: jnp.cos(p * (k + 1)) + 0.1, params)
    if k == 4:  # mid-ramp, the state rebuilt from its leaves (as a checkpoint restores it) goes on along the ramp
      s = jax.tree.unflatten(jax.tree.structure(s), [np.asarray(x) for x in jax.tree.leaves(s)])
    u, s = tx.update(grads, s, params)
    u_ref, s_ref = ref.update(grads, s_ref, params)
    np.testing.assert_allclose(np.asarray(u["vision"]["w"]), f * np.asarray(u_ref["vision"]["w"]), rtol=1e-5,
                               err_msg=f"update {k}")
    np.testing.assert_allclose(np.asarray(u["layer_0"]["wo"]), np.asarray(u_ref["layer_0"]["wo"]), rtol=1e-6)
  for bad in (dict(vision_lr_scale_to=0.5), dict(vision_lr_ramp_steps=3), dict(vision_lr_scale_to=-1.0)):
    with pytest.raises(ValueError, match="vision_lr_ramp_steps"):
      optim.make_optimizer(_ocfg(**bad), boxed, 10)


def test_router_lr_scale_scales_only_the_moe_routers():
  """optimizer.router_lr_scale multiplies the whole update of every leaf named "router" (the MoE routers,
  layers/moe.py) and of nothing else, also beside vision_lr_scale; at 1.0 the optimizer state keeps its
  structure (a vision run's checkpoints still restore)."""
  r = np.random.default_rng(4)
  w = r.standard_normal((8, 16))
  box = lambda: nn.LogicallyPartitioned(jnp.asarray(w, jnp.float32), ("embed", "mlp"))
  boxed = {"decoder": {"layers": {"moe": {"router": box(), "w_up": box(), "router_out": box()}}},
           "vision": {"blocks_0": {"router": box()}}, "lm_head": box()}
  params = nn.meta.unbox(boxed)
  grads = jax.tree.map(lambda p: jnp.cos(p) + 0.1, params)

  def update(**kw):
    tx, _ = optim.make_optimizer(_ocfg(warmup_steps=0, **kw), boxed, 10)
    state = tx.init(params)
    groups = [sorted(s.inner_states) for s in state if isinstance(s, optax.PartitionState)]
    return _flat(jax.jit(tx.update)(grads, state, params)[0]), groups

  base, base_groups = update()
  assert base_groups == []
  want = {"decoder/layers/moe/router": 0.5, "vision/blocks_0/router": 0.25}
  for kw in ({"router_lr_scale": 0.5}, {"router_lr_scale": 0.5, "vision_lr_scale": 0.25}):
    ups, _ = update(**kw)
    for path, u in ups.items():
      f = want.get(path, 0.25 if path.startswith("vision/") else 1.0) if "vision_lr_scale" in kw else (
          0.5 if path == "decoder/layers/moe/router" else 1.0)
      np.testing.assert_allclose(np.asarray(u), f * np.asarray(base[path]), rtol=1e-6, err_msg=f"{kw} {path}")
  # a scale of 1.0 adds no group: a vision run's optimizer state (and its checkpoints) stays as it was
  assert update(vision_lr_scale=0.25, router_lr_scale=1.0)[1] == [["lm", "vision"]]
  assert update(router_lr_scale=0.5)[1] == [["lm", "router"]]
  # the model's own naming (the scanned MoE layers' router [layers, embed, E]) is the group's only member
  groups = _flat(optim.lr_groups(_fake_params()))
  assert {k for k, v in groups.items() if v != "lm"} == {"layers_1_3/layer_0/ffn/moe/router"}
  with pytest.raises(ValueError, match="optimizer.router_lr_scale"):
    optim.make_optimizer(_ocfg(router_lr_scale=0.0), boxed, 10)
