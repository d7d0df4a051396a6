"""Pallas KDA for TPU compiled without a TPU (libtpu's deviceless topologies) and the target-aware
implementation choice (pallas_kernels/target.py).

The `tpu_aot` tests need libtpu (`pip install "jax[tpu]"`, in the test extra) and skip cleanly when it
does not import. The fast tier compiles one case per generation (each K, dtype and mode at least once,
~25 s of CPU); the whole grid (v5e/v5p/v6e x K=V 64/128 x bf16/fp32 x fwd/fwd+bwd, ~105 s of CPU) is
`slow` (also `python -m launch.aot_kda_tpu`, which prints every memory_analysis).
"""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

from moonshot_jax.parallel import tpu_aot
from pallas_kernels.kda import api, pallas_tpu, vjp
from pallas_kernels.target import target_platform


@pytest.fixture(scope="module")
def libtpu():
  if (reason := tpu_aot.unavailable_reason()) is not None:
    pytest.skip(reason)


def _aot():
  from launch import aot_kda_tpu  # imported lazily: it sets env defaults for the TPU compiler
  return aot_kda_tpu


def _inputs(K=64, dtype=jnp.float32):
  x = jnp.full((1, 64, 1, K), 0.1, dtype)
  return x, x, x, jnp.full((1, 64, 1, K), -0.1), jnp.full((1, 64, 1), 0.5, dtype)


# ---- target selection on CPU (no libtpu needed) ------------------------------------------------
def test_eager_and_cpu_jit_still_refuse_pallas_tpu():
  args = _inputs()
  with pytest.raises(ValueError, match=r"TPU target.*'cpu' \(from the argument devices\)"):
    api.chunk_kda(*args, implementation="pallas_tpu")
  with pytest.raises(ValueError, match=r"TPU target.*'cpu'"):
    jax.jit(lambda *a: api.chunk_kda(*a, implementation="pallas_tpu"))(*args)
  assert api.resolve_implementation(None, *args, 64, False) == "xla"


@pytest.mark.parametrize("implementation", ["pallas_tpu", None])
def test_tpu_context_mesh_selects_and_lowers_mosaic(implementation):
  """Under a TPU abstract mesh (as inside shard_map or jax.set_mesh over TPU devices) the kernels are
  chosen and lowered to Mosaic custom calls, though this process's backend is the CPU."""
  tpu = jax.sharding.AbstractDevice(device_kind="TPU v6 lite", num_cores=1, platform="tpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=tpu)
  args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _inputs(128, jnp.bfloat16)]
  f = lambda *a: api.chunk_kda(*a, implementation=implementation)[0]
  with jax.sharding.use_abstract_mesh(mesh):
    assert target_platform(*args) == ("tpu", "context mesh")
    text = jax.export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()
  assert text.count("tpu_custom_call") == 3  # prepare, recurrence, output


def test_unknown_target_is_the_default_backend():
  assert target_platform(None) == (jax.default_backend(), "default backend")


# ---- deviceless XLA:TPU compiles (libtpu) -------------------------------------------------------
@pytest.mark.tpu_aot
@pytest.mark.parametrize("implementation", ["pallas_tpu", None])
def test_argument_shardings_select_pallas_tpu(libtpu, implementation):
  """A plain jit whose inputs are sharded over TPU devices compiles the Mosaic kernels (the target
  is read from the arguments' avals, not from jax.default_backend(), which is 'cpu' here)."""
  mesh = tpu_aot.mesh("v5e:2x2", {"x": 4})
  one = jax.sharding.Mesh(mesh.devices[:1], ("x",))
  rep = jax.sharding.NamedSharding(one, jax.P())
  args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep) for a in _inputs(128)]
  lowered = jax.jit(lambda *a: api.chunk_kda(*a, implementation=implementation)[0]).lower(*args)
  assert lowered.as_text().count("tpu_custom_call") == 3
  assert jax.default_backend() == "cpu"


FAST_CASES = [("v5e", 64, "bfloat16", "fwd_bwd"), ("v5p", 128, "float32", "fwd_bwd"),
              ("v6e", 128, "bfloat16", "fwd_bwd"), ("v6e", 64, "float32", "fwd")]
ALL_CASES = [(g, K, dt, mode) for g in ("v5e", "v5p", "v6e") for K in (64, 128)
             for dt in ("bfloat16", "float32") for mode in ("fwd", "fwd_bwd")]
SLOW_CASES = [c for c in ALL_CASES if c not in FAST_CASES]


def _check_case(case, record_property):
  gen, K, dtype, mode = case
  aot = _aot()
  T = 1024
  r = aot.compile_case(gen, K, dtype, mode, T=T)  # a VMEM overflow raises here: the test fails
  record_property("memory_analysis", r["memory"])
  print(gen, K, dtype, mode, r["memory"], f"compile {r['compile_s']:.1f}s")
  expect = {"fwd": ["kda_fwd_rec", "kda_output", "kda_prepare"],
            "fwd_bwd": ["kda_bwd_rec", "kda_fwd_rec", "kda_grads", "kda_output", "kda_prepare"]}[mode]
  assert r["kernels"] == expect and r["tpu_custom_calls"] == {"fwd": 3, "fwd_bwd": 7}[mode]
  # per-chip arguments: q, k (H=2), v (HV=4) and beta in `dtype`, g and the state in fp32, segment ids
  L, b = aot.LOCAL, jnp.dtype(dtype).itemsize
  hv = L["H"] * L["group"]
  args = T * (2 * L["H"] * K * b + hv * K * b + hv * K * 4 + hv * b + 4) + hv * K * K * 4
  # fwd: o (v's dtype) and the final state; fwd_bwd: the loss and gradients shaped like the inputs
  outs = {"fwd": T * hv * K * b + hv * K * K * 4, "fwd_bwd": 4 + args - 4 * T}[mode]
  # per chip, not the global 4x; XLA:TPU's (8,128) tiles pad small minor dims (measured: up to 6%)
  for field, want in (("argument_size_in_bytes", args * L["B"]), ("output_size_in_bytes", outs * L["B"])):
    assert want <= r["memory"][field] <= 1.25 * want + 4096, (field, r["memory"][field], want)


@pytest.mark.tpu_aot
@pytest.mark.parametrize("case", FAST_CASES, ids=lambda c: "-".join(map(str, c)))
def test_kda_kernels_compile_for_tpu(libtpu, case, record_property):
  _check_case(case, record_property)


@pytest.mark.tpu_aot
@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=lambda c: "-".join(map(str, c)))
def test_kda_kernels_compile_for_tpu_full_grid(libtpu, case, record_property):
  _check_case(case, record_property)


@pytest.mark.tpu_aot
def test_vmem_overflow_fails_the_compile(libtpu):
  """The control for the grid above: the same kernels under a 128 KiB scoped-VMEM limit (their
  blocks need ~0.5 MiB) must fail XLA:TPU's compile, so an oversized kernel cannot pass the grid."""
  aot = _aot()
  base = pallas_tpu.BACKEND

  def tight(name, rank):
    return dataclasses.replace(base.compiler_params(name, rank), vmem_limit_bytes=128 * 1024)

  backend = dataclasses.replace(base, compiler_params=tight)
  mesh = tpu_aot.mesh("v5e:2x2", aot.MESH_AXES)
  tok, st = jax.P("batch", None, "heads", None), jax.P("batch", "heads", None, None)
  f = lambda q, k, v, g, b, h0, seg: vjp.chunk_kda_pallas(backend, q, k, v, g, b, initial_state=h0,
                                                          segment_ids=seg, output_final_state=True)
  prog = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(tok,) * 4 + (jax.P("batch", None, "heads"), st,
                                                                     jax.P("batch", None)),
                               out_specs=(tok, st)))
  with pytest.raises(Exception, match="(?i)vmem"):
    prog.lower(*aot.case_args(mesh, 1024, 128, jnp.float32)).compile()


# ---- the model's kernel call under automatic mesh axes ------------------------------------------
def test_over_auto_axes_maps_blocks_and_replicates_what_does_not_divide():
  """kernel_sharding.over_auto_axes: per-device blocks split by the logical rules (batch over
  data x expert), a dimension the axes do not divide stays whole; without a mesh fn is unchanged."""
  import flax.linen as nn
  import numpy as np
  from moonshot_jax.parallel import kernel_sharding, rules

  seen = []

  def fn(x, y):
    seen.append((x.shape, y.shape))
    return (x * 2, y + 1)

  logical = [("act_batch", None), ("act_batch", None)]
  out_logical = [("act_batch", None), (None, None)]  # an output takes its inputs' split per name
  assert kernel_sharding.over_auto_axes(fn, logical, out_logical) is fn
  devs = np.array(jax.devices()[:8]).reshape(1, 2, 4, 1)
  mesh = jax.sharding.Mesh(devs, ("pipeline", "data", "expert", "tensor"))
  x, y = jnp.arange(16.0).reshape(8, 2), jnp.arange(6.0).reshape(3, 2)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules.logical_axis_rules("zero1")):
    out = jax.jit(lambda x, y: kernel_sharding.over_auto_axes(fn, logical, out_logical)(x, y))(x, y)
  assert seen[-1] == ((1, 2), (3, 2))  # 8 rows over data x expert = 8; 3 rows replicated
  np.testing.assert_array_equal(out[0], x * 2)
  np.testing.assert_array_equal(out[1], y + 1)


@pytest.mark.tpu_aot
@pytest.mark.slow
def test_plan_target_tpu_compiles_the_proxy_train_step_with_mosaic_kda(libtpu):
  """launch/plan.py --aot --target=tpu:v5p on tiny (KDA head dims 64 so the Pallas kernels apply):
  the proxy train step compiles for a 16-chip v5p slice with the Mosaic KDA kernels inside, XLA's
  arguments cover the estimated state and the state is donated. (~70 s of CPU, hence slow.)"""
  from test_parallel_plan import _plan_cli
  text, rep = _plan_cli("--mesh=pipeline=2,data=2,expert=4", "--config.mesh.strategy=zero3",
                        "--config.model.kda_head_dim=64", "--config.model.kda_v_head_dim=64", "--aot",
                        "--target=tpu:v5p", timeout=900)
  t = rep["tpu_aot"]
  m, est = t["xla"]["memory"], t["proxy_estimate"]["bytes"]
  assert t["topology"] == "v5p:2x2x4" and t["xla"]["mosaic_calls"] > 0
  state = est["params"] + est["optimizer"]
  # tiny's 64-wide weights fill (8,128) tiles half-empty: up to 2x the unpadded state
  assert state <= m["argument_size_in_bytes"] <= 2 * state + 2**20
  assert m["alias_size_in_bytes"] >= 0.9 * state and t["fits"] is True
  assert t["cost"]["model_flops_per_chip"] > 0 and 0 < t["cost"]["mfu_upper_bound"] <= 1
  assert "fits v5p" in text and "ESTIMATE (roofline" in text
