"""Routed experts kept in MXFP4 at inference (moonshot_jax/inference/mxfp4_experts.py): prefill and
decode with the packed experts equal the same model with the dequantised weights in fp32, the
experts' memory is 4.25 bits per weight, and requantising MXFP4 values is exact."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moonshot_jax.inference import engine, mxfp4_experts
from moonshot_jax.layers import moe, mxfp4
from moonshot_jax.model.transformer import Transformer
from tests.test_hf_k3 import model_cfg


@pytest.fixture(scope="module")
def model():
  cfg = model_cfg(dtype="float32")
  # shapes from eval_shape (a jitted init of this model compiles for a minute); values drawn here:
  # norm scales 1, everything else N(0, 0.1), the experts with block-wise spread magnitudes 2^-3..2^3
  # so that their MXFP4 blocks use many different scale bytes
  shapes = nn.meta.unbox(jax.eval_shape(Transformer(cfg).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
  rng = np.random.default_rng(0)

  def fill(path, a):
    names = [str(getattr(p, "key", p)) for p in path]
    if names[0] == "moe_state":
      return jnp.zeros(a.shape, a.dtype)
    if "scale" in names[-1]:
      return jnp.ones(a.shape, a.dtype)
    x = rng.normal(0, 0.1, a.shape)
    if names[-1] in mxfp4_experts.EXPERT_LEAVES and "moe" in names:
      x = x * np.exp2(rng.integers(-3, 4, size=a.shape[:-2] + (1, a.shape[-1])))
    return jnp.asarray(x, a.dtype)
  v = jax.tree_util.tree_map_with_path(fill, shapes)
  q, rep = mxfp4_experts.quantize_experts(v, cfg)
  # the reference: the same model with every expert leaf replaced by its dequantised fp32 value
  is_box = lambda x: isinstance(x, mxfp4_experts.MXFP4Experts)
  ref_params = jax.tree.map(
      lambda x: jnp.swapaxes(mxfp4.dequantize(x.packed, x.scales, jnp.float32), -1, -2) if is_box(x) else x,
      q["params"], is_leaf=is_box)
  return cfg, q, {"params": ref_params, "moe_state": v["moe_state"]}, rep


@pytest.mark.parametrize("tokens", [2, 24])  # 2 x top-2 <= 4 experts: the gather (decode) path; 24: blocked
def test_expert_fn_equals_routed_experts_on_dequantised_weights(model, tokens):
  cfg, q, ref, _ = model
  sub = lambda b: b[0] if b.packed.ndim == 4 else b  # one layer of a scanned stack
  # the first MoE layer's leaves, in sorted-key order w_down, w_gate, w_up
  boxes = [sub(b) for b in jax.tree.leaves(q["params"], is_leaf=mxfp4_experts._is_box)
           if isinstance(b, mxfp4_experts.MXFP4Experts)][:3]
  wd, wg, wu = boxes
  e, l, f = wg.shape
  x = jax.random.normal(jax.random.key(2), (tokens, l))
  idx = jax.random.randint(jax.random.key(3), (tokens, 2), 0, e)
  w = jax.random.uniform(jax.random.key(4), (tokens, 2))
  deq = lambda b: jnp.swapaxes(mxfp4.dequantize(b.packed, b.scales, jnp.float32), -1, -2)
  want = moe.routed_experts(x, idx, w, deq(wg), deq(wu), deq(wd), cfg)
  got = jax.jit(lambda *a: mxfp4_experts.routed_experts(*a[:3], *(b.unbox() for b in a[3:]), cfg))(
      x, idx, w, wg, wu, wd)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert float(np.abs(np.asarray(want)).max()) > 0.1


@pytest.mark.slow  # four engine compiles of the model: ~40 s quiet, 160 s at load 17
def test_mxfp4_kept_forward_equals_dequantised(model):
  cfg, q, ref, rep = model
  assert rep["expert_leaves"] % 3 == 0 and rep["max_requant_error"] > 0  # random fp32 -> lossy once
  toks = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size)
  lq, cq = engine.prefill(q, cfg, toks, max_len=32)  # 24 copies > 4 experts: the blocked path
  lr, cr = engine.prefill(ref, cfg, toks, max_len=32)
  np.testing.assert_allclose(np.asarray(lq), np.asarray(lr), rtol=2e-5, atol=2e-5)
  for _ in range(2):  # 2 tokens x top-2 = 4 copies <= 4 experts: the gather path
    nxt = jnp.argmax(lr[:, -1] if lr.ndim == 3 else lr, -1)
    lq, cq = engine.decode_step(q, cfg, cq, nxt)
    lr, cr = engine.decode_step(ref, cfg, cr, nxt)
    np.testing.assert_allclose(np.asarray(lq), np.asarray(lr), rtol=2e-5, atol=2e-5)
  assert float(np.abs(np.asarray(lr)).max()) > 0.1  # a real signal, not all-zero logits


def test_expert_memory_is_4_25_bits_and_requantising_is_exact(model):
  cfg, q, ref, _ = model
  acct = mxfp4_experts.bits_per_weight(q)
  assert acct["expert_bits_per_weight"] == 4.25
  n_expert = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(q["params"], is_leaf=mxfp4_experts._is_box)
                 if isinstance(x, mxfp4_experts.MXFP4Experts))
  assert acct["expert_weights"] == n_expert > 0
  # experts whose values already are MXFP4 (an imported checkpoint) requantise to the same bytes
  # (same values; the bytes may differ where a block's largest code is below 4: a smaller exponent)
  q2, rep2 = mxfp4_experts.quantize_experts(ref, cfg)
  assert rep2["max_requant_error"] == 0.0
  boxes = lambda t: [x for x in jax.tree.leaves(t["params"], is_leaf=mxfp4_experts._is_box)
                     if isinstance(x, mxfp4_experts.MXFP4Experts)]
  for a, b in zip(boxes(q), boxes(q2)):
    np.testing.assert_array_equal(mxfp4.dequantize_np(np.asarray(a.packed), np.asarray(a.scales)),
                                  mxfp4.dequantize_np(np.asarray(b.packed), np.asarray(b.scales)))


def test_wrong_weights_are_named(model):
  cfg = model[0]
  x = jnp.zeros((4, 32))
  with pytest.raises(TypeError, match="w_gate is a"):
    mxfp4_experts.routed_experts(x, jnp.zeros((4, 2), jnp.int32), jnp.ones((4, 2)), jnp.zeros((4, 32, 32)),
                                 None, None, cfg)


@pytest.mark.slow  # a hub import + two generate compiles
def test_generate_serves_an_imported_mxfp4_checkpoint(tmp_path):
  """launch.generate --experts_mxfp4's path: a hub checkpoint with MXFP4 experts, imported, served
  with the experts requantised (exactly: they were MXFP4 values) gives the same greedy tokens."""
  from moonshot_jax.inference import hub_checkpoint
  from moonshot_jax.inference.generate import generate
  from moonshot_jax.inference.load import load_latest
  from moonshot_jax.inference.sampling import SamplingParams
  from tests.test_hf_k3 import synthetic_k3, write_checkpoint
  from tests.test_import_checkpoint import _cfg

  hub = write_checkpoint(tmp_path / "hub", synthetic_k3(np.random.default_rng(0)))
  cfg = _cfg()
  hub_checkpoint.run_import(cfg, hub, tmp_path / "run", progress=False)
  loaded = load_latest(cfg, tmp_path / "run", with_tokenizer=False)
  q, rep = mxfp4_experts.quantize_experts(loaded.variables, loaded.cfg)
  assert rep["max_requant_error"] == 0.0
  assert mxfp4_experts.bits_per_weight(q)["expert_bits_per_weight"] == 4.25
  kw = dict(max_new_tokens=5, sampling=SamplingParams(temperature=0.0), mesh=loaded.mesh)
  a = generate(loaded.variables, loaded.cfg, [[1, 5, 7, 9, 11]], **kw)
  b = generate(q, loaded.cfg, [[1, 5, 7, 9, 11]], **kw)
  assert list(a.tokens[0]) == list(b.tokens[0]) and len(a.tokens[0]) == 5
