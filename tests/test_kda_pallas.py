"""Pallas KDA kernels (GPU Triton and TPU Mosaic) in interpret mode against the token-by-token oracle.

Values and gradients of both backends are compared with ‖ref−x‖/‖ref‖ against the token-by-token
oracle `recurrent_kda` (a lax.scan, differentiated by JAX).
Interpret mode is slow on CPU (compiling each kernel dominates), so the fast tier runs a few
representative shapes per backend and the full grid is `slow`. Lowering tests push fwd+bwd through
the real Mosaic-TPU and Triton-CUDA lowerings with jax.export, without a device.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import pallas_gpu, pallas_tpu, recurrent_kda, vjp

BACKENDS = {"gpu": pallas_gpu, "tpu": pallas_tpu}
# fp32 interpret runs: ~5-10x the worst error measured over this file's cases (WORKSPACE_NOTES).
# −1000 resets cost ~30x more than smooth gates. (bf16 checks below keep their own looser bounds.)
FP32_TOL = {
    "smooth": dict(o=3e-6, state=3e-6, dq=3e-6, dk=3e-6, dv=3e-6, dg=4e-6, dbeta=4e-6, dh0=1e-6),
    "reset": dict(o=2e-5, state=1e-4, dq=2e-5, dk=1e-4, dv=1e-4, dg=1e-4, dbeta=5e-5, dh0=1e-6),
}
NAMES = ("o", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0")


# ---- oracle ------------------------------------------------------------------------------------
def reference(q, k, v, g, beta, h0, seg):
  o, s = recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, segment_ids=seg)
  return o.astype(jnp.float32), s


# ---- inputs ------------------------------------------------------------------------------------
def make_inputs(seed, B, T, H, HV, K, V, gate="typical", h0=True, segments=False, dtype=jnp.float32):
  ks = jax.random.split(jax.random.PRNGKey(seed), 9)
  l2 = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = l2(jax.random.normal(ks[0], (B, T, H, K))).astype(dtype)
  k = l2(jax.random.normal(ks[1], (B, T, H, K))).astype(dtype)
  v = jax.random.normal(ks[2], (B, T, HV, V)).astype(dtype)
  # per-channel offsets span slow (≈ −0.01/token) to fast channels, so that long-range terms (the
  # off-diagonal sub-blocks, the state across chunks) carry real weight in every output
  x = jax.random.normal(ks[3], (B, T, HV, K)) + jnp.linspace(-1.0, 5.0, K)
  if gate == "typical":
    g = jax.nn.log_sigmoid(x)
  elif gate == "bounded":  # K3's safe gate: −5·sigmoid, fast channels near the −5 bound
    g = -5.0 * jax.nn.sigmoid(-x + 1.0)
  elif gate == "reset":  # safe gate plus hard resets of single channels and of whole tokens
    g = -5.0 * jax.nn.sigmoid(-x + 1.0)
    g = jnp.where(jax.random.bernoulli(ks[4], 0.02, g.shape), -1000.0, g)
    g = jnp.where(jax.random.bernoulli(ks[5], 0.02, g.shape[:3])[..., None], -1000.0, g)
  else:
    raise ValueError(gate)
  beta = jax.nn.sigmoid(jax.random.normal(ks[6], (B, T, HV)))
  s0 = 0.5 * jax.random.normal(ks[7], (B, HV, K, V)) if h0 else None
  seg = None
  if segments:  # 1-4 documents per row, boundaries at random positions
    cuts = jax.random.bernoulli(ks[8], 3.0 / T, (B, T)).at[:, 0].set(False)
    seg = jnp.cumsum(cuts, axis=1).astype(jnp.int32)
  return q, k, v, g, beta, s0, seg


def rel(ref, x) -> float:
  ref, x = np.asarray(ref, np.float64), np.asarray(x, np.float64)
  return float(np.linalg.norm(ref - x) / max(np.linalg.norm(ref), 1e-30))


def run_kernel(name, q, k, v, g, beta, h0, seg, chunk_size=64):
  return BACKENDS[name].chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                  segment_ids=seg, chunk_size=chunk_size, interpret=True)


# Interpret-mode cost is almost all XLA compile time; the kernels' CPU run time is tiny, so skip
# LLVM's optimisation passes for the jitted test functions.
_FAST_COMPILE = {"xla_backend_optimization_level": 0}


@functools.lru_cache(maxsize=None)
def _value_and_grads(name, chunk_size, argnums, use_seg):
  """jit of (o, final state) and the gradients of a random projection of both, in one compile."""
  fn = (lambda *a: run_kernel(name, *a, chunk_size=chunk_size)) if name in BACKENDS else reference

  def loss(q, k, v, g, beta, s0, seg, wo, ws):
    o, sT = fn(q, k, v, g, beta, s0, seg if use_seg else None)
    return jnp.sum(o.astype(jnp.float32) * wo) + jnp.sum(sT * ws), (o, sT)

  return jax.jit(jax.value_and_grad(loss, argnums, has_aux=True), compiler_options=_FAST_COMPILE)


@functools.lru_cache(maxsize=None)
def _values(name, chunk_size, use_seg):
  fn = (lambda *a: run_kernel(name, *a, chunk_size=chunk_size)) if name in BACKENDS else reference
  return jax.jit(lambda q, k, v, g, beta, s0, seg: fn(q, k, v, g, beta, s0, seg if use_seg else None),
                 compiler_options=_FAST_COMPILE)


def check_case(name, *, T, K, group, gate="typical", h0=True, segments=False, grads=True, B=1, H=1,
               chunk_size=64, seed=0):
  V = K
  q, k, v, g, beta, s0, seg = make_inputs(seed, B, T, H, H * group, K, V, gate, h0, segments)
  seg_arg = seg if segments else jnp.zeros((B, T), jnp.int32)
  if not grads:
    o, sT = _values(name, chunk_size, segments)(q, k, v, g, beta, s0, seg_arg)
    o_r, sT_r = _values("ref", 0, segments)(q, k, v, g, beta, s0, seg_arg)
  else:
    argnums = (0, 1, 2, 3, 4) + ((5,) if h0 else ())
    wo = jax.random.normal(jax.random.PRNGKey(seed + 100), v.shape)
    ws = jax.random.normal(jax.random.PRNGKey(seed + 101), (B, H * group, K, V))
    args = (q, k, v, g, beta, s0, seg_arg, wo, ws)
    (_, (o, sT)), dk = _value_and_grads(name, chunk_size, argnums, segments)(*args)
    (_, (o_r, sT_r)), dr = _value_and_grads("ref", 0, argnums, segments)(*args)
  errs = dict(o=rel(o_r, o), state=rel(sT_r, sT))
  if grads:
    errs.update({n: rel(a, b) for n, a, b in zip(NAMES[2:], dr, dk)})
  check_errors(errs, FP32_TOL["reset" if gate == "reset" else "smooth"])
  return errs


def check_errors(errs: dict, tol: dict) -> None:
  bad = {n: e for n, e in errs.items() if not e <= tol[n]}  # `not <=` also catches NaN / Inf
  assert not bad, f"errors above tolerance: {bad} (all: {errs})"


# ---- fast tier -----------------------------------------------------------------------------------
_CASES = {
    # 4 chunks with the last one padded, HV = 2·H, initial state, typical gates
    "padded_grouped": dict(T=200, K=64, group=2, gate="typical"),
    # K=V=128, K3's safe gate (chunk cumsums reach −320, far past e^{±88}) with −1000 hard resets of
    # single channels and whole tokens, packed documents, initial state
    "resets_segments": dict(T=128, K=128, group=1, gate="reset", segments=True),
    # all of the above at K=64 in one compile: the GPU kernel's fast-tier case
    "padded_grouped_resets_segments": dict(T=200, K=64, group=2, gate="reset", segments=True),
}


@pytest.mark.parametrize("name,case", [
    ("gpu", "padded_grouped_resets_segments"), ("tpu", "resets_segments"),
    pytest.param("gpu", "padded_grouped", marks=pytest.mark.slow),
    pytest.param("tpu", "padded_grouped", marks=pytest.mark.slow),
    pytest.param("gpu", "resets_segments", marks=pytest.mark.slow)])
def test_values_and_gradients(name, case):
  check_case(name, **_CASES[case])


@pytest.mark.parametrize("name,grads", [("tpu", False), pytest.param("tpu", True, marks=pytest.mark.slow),
                                        pytest.param("gpu", True, marks=pytest.mark.slow)])
def test_under_shard_map_batch_and_heads(name, grads):
  """Kernels inside jax.shard_map with batch over 'data' and heads over 'tensor' (fake CPU devices)
  match the unsharded oracle (values; the v-gradient in the slow tier). The GPU kernels run with
  check_vma=False: the Pallas HLO interpreter (not the kernels, which lower fine) trips over
  shard_map's varying-axes check when it evaluates a kernel body."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((2, 2), ("data", "tensor"), devices=jax.devices()[:4])
  q, k, v, g, beta, s0, _ = make_inputs(7, 2, 64, 2, 4, 64, 64)
  tok, st, bt = P("data", None, "tensor", None), P("data", "tensor", None, None), P("data", None, "tensor")

  def local(q, k, v, g, beta, s0):
    return BACKENDS[name].chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                    interpret=True)

  fn = jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, tok, bt, st), out_specs=(tok, st),
                     check_vma=name == "tpu")

  def loss(fn, v, *rest):
    o, sT = fn(rest[0], rest[1], v, *rest[2:])
    return jnp.sum(o ** 2) + jnp.sum(sT), (o, sT)

  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  args = (put(v, tok), put(q, tok), put(k, tok), put(g, tok), put(beta, bt), put(s0, st))
  ref = lambda q, k, v, g, beta, s0: reference(q, k, v, g, beta, s0, None)
  with jax.set_mesh(mesh):
    if grads:
      (_, (o, sT)), dv = jax.jit(jax.value_and_grad(functools.partial(loss, fn), has_aux=True),
                                 compiler_options=_FAST_COMPILE)(*args)
    else:
      o, sT = jax.jit(lambda *a: loss(fn, *a)[1], compiler_options=_FAST_COMPILE)(*args)
  if grads:
    (_, (o_r, sT_r)), dv_r = jax.value_and_grad(functools.partial(loss, ref), has_aux=True)(
        v, q, k, g, beta, s0)
    errs = dict(dv=rel(dv_r, dv))
  else:
    o_r, sT_r = _values("ref", 0, False)(q, k, v, g, beta, s0, None)
    errs = {}
  check_errors(dict(errs, o=rel(o_r, o), state=rel(sT_r, sT)), FP32_TOL["smooth"])


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_fwd_bwd_lower_for_real_devices(platform):
  """jax.export runs the real Mosaic / Triton lowering of every kernel (fwd and bwd) without a
  device; catches primitives or block shapes a backend cannot lower."""
  mod = pallas_tpu if platform == "tpu" else pallas_gpu
  B, T, H, HV, K = 1, 256, 2, 4, 128
  sd = jax.ShapeDtypeStruct
  args = [sd((B, T, H, K), jnp.bfloat16), sd((B, T, H, K), jnp.bfloat16), sd((B, T, HV, K), jnp.bfloat16),
          sd((B, T, HV, K), jnp.float32), sd((B, T, HV), jnp.float32), sd((B, HV, K, K), jnp.float32)]

  def f(q, k, v, g, beta, s0):
    o, sT = vjp.chunk_kda_pallas(mod.BACKEND, q, k, v, g, beta, initial_state=s0, output_final_state=True)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(sT)

  checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  # jax >= 0.11 reads the Triton target from the device: name one (an H200) when lowering off-GPU
  target = contextlib.nullcontext()
  if platform == "cuda" and jax.default_backend() != "gpu":
    gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    target = jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=gpu))
  with target:
    exp = jax.export.export(jax.jit(jax.value_and_grad(f, argnums=range(6))), platforms=[platform],
                            disabled_checks=checks)(*args)
  text = exp.mlir_module()
  assert ("tpu_custom_call" in text) if platform == "tpu" else ("xla.gpu.triton" in text)
  if platform == "cuda":  # fp32 products run as 3xTF32 (pallas_gpu.EXACT_DOT), never as 1xTF32
    dots = _triton_dots(text)
    f32 = [d for d in dots if re.search(r":\s*tensor<[0-9x]+xf32>\s*\*\s*tensor<[0-9x]+xf32>", d)]
    assert f32 and all("inputPrecision = tf32x3" in d for d in f32), [d for d in f32 if "tf32x3" not in d][:3]
    assert len(f32) < len(dots)  # the bf16 operands' dots stay bf16 (no upcast to fp32)


def _triton_dots(stablehlo_text: str) -> list[str]:
  """The `tt.dot` lines of every Triton kernel in an exported module: each custom call carries its
  kernel as MLIR bytecode (an escaped string), parsed here with the Triton dialect jaxlib ships."""
  from jax._src.interpreters import mlir as jax_mlir
  from jax._src.lib.mlir import ir
  triton_dialect = pytest.importorskip("jaxlib.triton.dialect")
  lines = []
  for raw in re.findall(r'ir = "((?:[^"\\]|\\.)*)"', stablehlo_text):
    data = re.sub(rb"\\([0-9A-Fa-f]{2}|\\|\")",
                  lambda m: bytes([int(m.group(1), 16)]) if len(m.group(1)) == 2 else m.group(1)[-1:],
                  raw.encode("latin-1"))
    ctx = jax_mlir.make_ir_context()
    triton_dialect.register_dialect(ctx)
    with ctx:
      lines += [l for l in str(ir.Module.parse(data)).splitlines() if "tt.dot" in l]
  assert lines, "no Triton kernels found in the exported module"
  return lines


# ---- dispatch and reasons -------------------------------------------------------------------------
def test_unsupported_reasons():
  x = jnp.zeros((1, 64, 1, 64))
  x32 = jnp.zeros((1, 64, 1, 32))
  assert pallas_tpu.unsupported_reason(x, x, x, x, x[..., 0], 64, True) is None
  assert pallas_gpu.unsupported_reason(x, x, x, x, x[..., 0], 64, True) is None
  assert "K=32" in pallas_gpu.unsupported_reason(x32, x32, x32, x32, x[..., 0], 64, True)
  assert "chunk_size" in pallas_tpu.unsupported_reason(x, x, x, x, x[..., 0], 48, True)
  if jax.default_backend() == "cpu":
    assert "GPU" in pallas_gpu.unsupported_reason(x, x, x, x, x[..., 0], 64, False)
    assert "TPU" in pallas_tpu.unsupported_reason(x, x, x, x, x[..., 0], 64, False)
    with pytest.raises(RuntimeError, match="interpret=True"):
      pallas_gpu.chunk_kda(x, x, x, x, x[..., 0])


def test_bad_inputs_raise_value_error():
  x = jnp.zeros((1, 64, 2, 64))
  with pytest.raises(ValueError, match="beta"):
    pallas_tpu.chunk_kda(x, x, x, x, jnp.zeros((1, 64, 3)), interpret=True)
  with pytest.raises(ValueError, match="multiple"):
    pallas_tpu.chunk_kda(x, x, jnp.zeros((1, 64, 3, 64)), jnp.zeros((1, 64, 3, 64)), jnp.zeros((1, 64, 3)),
                         interpret=True)
  with pytest.raises(ValueError, match="initial_state"):
    pallas_gpu.chunk_kda(x, x, x, x, jnp.zeros((1, 64, 2)), initial_state=jnp.zeros((1, 2, 64, 32)),
                         interpret=True)


def _api():
  return pytest.importorskip("pallas_kernels.kda.api")


def test_api_routes_pallas_tpu_to_this_kernel(monkeypatch):
  """api.chunk_kda(implementation="pallas_tpu", interpret=True) runs this kernel; with bf16 q/k/v
  (bf16 dot operands, fp32 accumulation) it stays close to the oracle on the same rounded inputs."""
  api = _api()
  calls = []
  real = pallas_tpu.chunk_kda

  def spy(*a, **kw):
    calls.append(kw)
    return real(*a, **kw)

  monkeypatch.setattr(pallas_tpu, "chunk_kda", spy)
  q, k, v, g, beta, s0, _ = make_inputs(11, 1, 64, 1, 2, 64, 64, dtype=jnp.bfloat16)
  run = jax.jit(lambda q, k, v, g, beta, s0: api.chunk_kda(
      q, k, v, g, beta, initial_state=s0, output_final_state=True, implementation="pallas_tpu",
      interpret=True), compiler_options=_FAST_COMPILE)
  o, sT = run(q, k, v, g, beta, s0)
  assert calls and calls[0].get("interpret") and o.dtype == jnp.bfloat16
  o_r, sT_r = reference(q, k, v, g, beta, s0, None)
  assert rel(o_r, o) < 2e-2 and rel(sT_r, sT) < 2e-2, (rel(o_r, o), rel(sT_r, sT))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU-only refusal")
def test_api_pallas_gpu_without_interpret_raises_on_cpu():
  api = _api()
  q = v = g = jnp.full((1, 64, 1, 64), 0.1)
  k, beta = q, jnp.full((1, 64, 1), 0.5)
  with pytest.raises(ValueError, match="GPU"):
    api.chunk_kda(q, k, v, g, beta, implementation="pallas_gpu", interpret=False)


def test_bench_script_smoke_path_is_importable():
  bench = importlib.import_module("launch.bench_kda_gpu")
  assert callable(bench.main) and callable(bench.run_suite)
  cfgs = bench.configs(smoke=True)
  assert cfgs and all(c["T"] <= 256 for c in cfgs)


# ---- slow tier: the grid -------------------------------------------------------------------------
_GRID = [  # (T, K, group, gate, segments, h0): every T×K pair, each gate / grouping / extra present
    (64, 64, 1, "typical", False, False), (64, 128, 2, "reset", True, True),
    (200, 64, 2, "bounded", True, True), (200, 128, 1, "typical", False, True),
    (1024, 64, 1, "reset", False, True), (1024, 128, 2, "bounded", True, False),
    (200, 64, 1, "reset", True, False), (1024, 128, 1, "typical", True, True),
]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpu", "tpu"])
@pytest.mark.parametrize("T,K,group,gate,segments,h0", _GRID)
def test_grid(name, T, K, group, gate, segments, h0):
  check_case(name, T=T, K=K, group=group, gate=gate, segments=segments, h0=h0, B=2 if T < 1024 else 1,
             H=2 if group == 1 and T < 1024 else 1, seed=T + K)


@pytest.mark.slow
@pytest.mark.parametrize("name,chunk_size", list(itertools.product(["gpu", "tpu"], [16, 32, 128])))
def test_other_chunk_sizes(name, chunk_size):
  check_case(name, T=200, K=64, group=2, gate="reset", segments=True, chunk_size=chunk_size, seed=chunk_size)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpu", "tpu"])
def test_bf16_gradients(name):
  q, k, v, g, beta, s0, _ = make_inputs(13, 1, 128, 1, 2, 64, 64)
  qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
  f = lambda fn: lambda v: jnp.sum(fn(qb, kb, v, g, beta, s0, None)[0].astype(jnp.float32) ** 2)
  dv = jax.grad(f(lambda *a: run_kernel(name, *a)))(vb)
  dv_r = jax.grad(f(reference))(vb)
  assert rel(dv_r, dv) < 5e-2
