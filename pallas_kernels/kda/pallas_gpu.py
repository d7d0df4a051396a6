"""KDA chunked delta rule as Pallas kernels for NVIDIA GPUs, Triton lowering.

Why Triton and not Mosaic GPU: every per-chunk product is a small (16..64)×(64..128) tile that
Triton's dot maps onto mma without hand-written warpgroup/TMA code, and these latency-bound
small-tile kernels would not repay Mosaic GPU's explicit warpgroup programming; the Triton lowering
also runs on any CUDA GPU (Ampere, Hopper, Blackwell) where Mosaic GPU targets Hopper+. Inputs stay in
fla's token-major layout [B,T,H,D]: Triton blocks are strided pointers, so nothing is transposed.
Products that need fp32 accuracy run as three TF32 mma passes (EXACT_DOT), cumsums as Triton scans.

Kernels (per-chunk math in _chunk_math.py, wiring in vjp.py):
  prepare / output / grads  grid (B, HV, T/C), all parallel;
  fwd / bwd recurrence      grid (B, HV, V/BV), the chunk axis is an in-kernel loop with the fp32
                            state (BV×K) in registers (GPU programs cannot carry state across grid
                            steps); value tiles of BV=32 give B·HV·V/32 programs for occupancy.
On CPU the same kernels run in the Pallas interpreter (`interpret=True`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda import _chunk_math as cm
from pallas_kernels.kda import vjp
from pallas_kernels.target import target_platform

try:
  from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - jaxlib without Triton support
  plgpu = None

BV = 32  # value-tile width of the recurrence kernels
_WARPS = {"prepare": 4, "output": 4, "grads": 8, "fwd_rec": 4, "bwd_rec": 4}
SQ = vjp.SQ


def _compiler_params(name: str, rank: int):
  del rank
  if plgpu is None:
    return None
  return plgpu.CompilerParams(num_warps=_WARPS[name], num_stages=1)


def _seq_spec(plan: vjp.Plan, T: int, D: int, head=lambda h: h, tiled: bool = False) -> pl.BlockSpec:
  """Whole-sequence (T, D or BV) block of a [B,T,H,D] tensor for a (b, hv, v-tile) grid."""
  if tiled:
    return pl.BlockSpec((SQ, T, SQ, D), lambda b, h, j: (b, 0, head(h), j))
  return pl.BlockSpec((SQ, T, SQ, D), lambda b, h, j: (b, 0, head(h), 0))


def _rec_call(plan, name, kernel, g, args, in_specs, out_shape, out_specs, flops):
  """A recurrence over a (batch, value head, value tile) grid; g fixes B, T, HV, K."""
  B, T, HV, K = g.shape
  V = out_shape[1].shape[-1]
  nbytes = _nbytes(*args) + _nbytes(*out_shape)
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=(B, HV, V // min(BV, V)), in_specs=in_specs, out_specs=out_specs,
      compiler_params=_compiler_params(name, 3), interpret=bool(plan.interpret), name=f"kda_{name}",
      cost_estimate=pl.CostEstimate(flops=int(flops), transcendentals=int(B * HV * T * K * 2),
                                    bytes_accessed=int(nbytes)),
  )(*args)


def _nbytes(*xs) -> int:
  return sum(x.size * jnp.dtype(x.dtype).itemsize for x in xs)


def fwd_recurrence(plan: vjp.Plan, k, g, w, u, h0t):
  """h [B,HV,NT,V,K] (chunk-start states, transposed), V' [B,T,HV,V], final state [B,HV,V,K]."""
  B, T, HV, K = g.shape
  V, C = u.shape[-1], plan.chunk
  NT, bv = T // C, min(BV, V)
  nx = plan.nx

  def kernel(k_ref, w_ref, g_ref, u_ref, h0_ref, h_ref, vn_ref, hT_ref):
    def body(t, St):
      rows = pl.ds(pl.multiple_of(t * C, C), C)
      h_ref[t] = St
      vn, St = cm.fwd_step(nx, St, w_ref[rows, :], u_ref[rows, :], k_ref[rows, :], g_ref[rows, :])
      vn_ref[rows, :] = vn
      return St
    hT_ref[...] = jax.lax.fori_loop(0, NT, body, h0_ref[...].astype(jnp.float32))

  f32, ins = jnp.float32, (k, g, w, u, h0t)
  sds = lambda shape: vjp.out_struct(shape, f32, *ins)
  out_shape = (sds((B, HV, NT, V, K)), sds((B, T, HV, V)), sds((B, HV, V, K)))
  state = pl.BlockSpec((SQ, SQ, bv, K), lambda b, h, j: (b, h, j, 0))
  in_specs = [_seq_spec(plan, T, K, vjp.qk_head(plan)), _seq_spec(plan, T, K), _seq_spec(plan, T, K),
              _seq_spec(plan, T, bv, tiled=True), state]
  out_specs = (pl.BlockSpec((SQ, SQ, NT, bv, K), lambda b, h, j: (b, h, 0, j, 0)),
               _seq_spec(plan, T, bv, tiled=True), state)
  flops = B * HV * NT * cm.flops_step(C, K, V)
  return _rec_call(plan, "fwd_rec", kernel, g, (k, w, g, u, h0t), in_specs, out_shape, out_specs, flops)


def bwd_recurrence(plan: vjp.Plan, q, k, g, w, aqk, do, dhTt):
  """dh [B,HV,NT,V,K] (∂ wrt the state after each chunk), dV' [B,T,HV,V], d initial state."""
  B, T, HV, K = g.shape
  V, C = do.shape[-1], plan.chunk
  NT, bv = T // C, min(BV, V)
  nx = plan.nx

  def kernel(q_ref, k_ref, g_ref, w_ref, aqk_ref, do_ref, dhT_ref, dh_ref, dvn_ref, dh0_ref):
    def body(i, dSt):
      t = NT - 1 - i
      rows = pl.ds(pl.multiple_of(t * C, C), C)
      dh_ref[t] = dSt
      dvn, dSt = cm.bwd_step(nx, dSt, q_ref[rows, :], k_ref[rows, :], g_ref[rows, :], w_ref[rows, :],
                             aqk_ref[rows, :], do_ref[rows, :])
      dvn_ref[rows, :] = dvn
      return dSt
    dh0_ref[...] = jax.lax.fori_loop(0, NT, body, dhT_ref[...].astype(jnp.float32))

  f32, ins = jnp.float32, (q, k, g, w, aqk, do, dhTt)
  sds = lambda shape: vjp.out_struct(shape, f32, *ins)
  out_shape = (sds((B, HV, NT, V, K)), sds((B, T, HV, V)), sds((B, HV, V, K)))
  state = pl.BlockSpec((SQ, SQ, bv, K), lambda b, h, j: (b, h, j, 0))
  qk = _seq_spec(plan, T, K, vjp.qk_head(plan))
  in_specs = [qk, qk, _seq_spec(plan, T, K), _seq_spec(plan, T, K), _seq_spec(plan, T, C),
              _seq_spec(plan, T, bv, tiled=True), state]
  out_specs = (pl.BlockSpec((SQ, SQ, NT, bv, K), lambda b, h, j: (b, h, 0, j, 0)),
               _seq_spec(plan, T, bv, tiled=True), state)
  flops = B * HV * NT * cm.flops_step(C, K, V)
  return _rec_call(plan, "bwd_rec", kernel, g, (q, k, g, w, aqk, do, dhTt), in_specs, out_shape, out_specs,
                   flops)


# fp32-exact products as three TF32 mma passes: Triton's IEEE fp32 dot runs on the CUDA cores
EXACT_DOT = "tf32x3"
BACKEND = vjp.Backend(name="pallas_gpu", layout="bthd", compiler_params=_compiler_params,
                      interpret_arg=bool, exact_dot=EXACT_DOT, scan_cumsum=True,
                      fwd_recurrence=fwd_recurrence, bwd_recurrence=bwd_recurrence)


def unsupported_reason(q, k, v, g, beta, chunk_size, interpret) -> str | None:
  """None when the GPU kernels can run these inputs, else a sentence saying why not."""
  reason = vjp.shape_reason(q, v, chunk_size, k)
  if reason:
    return "pallas_gpu: " + reason
  if not interpret:
    if plgpu is None:
      return "pallas_gpu: this jaxlib has no Pallas Triton support"
    platform, how = target_platform(q, k, v, g, beta)
    if platform != "gpu":
      return (f"pallas_gpu: needs a CUDA GPU target, but this call is compiled for {platform!r} (from "
              f"the {how}); pass interpret=True to run the kernels in the Pallas interpreter")
  return None


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              segment_ids=None, chunk_size=64, interpret=False):
  """Chunked KDA (fla layout: q,k [B,T,H,K], v [B,T,HV,V], g [B,T,HV,K], beta [B,T,HV]) on GPU.
  Returns (o [B,T,HV,V] in v's dtype, final state [B,HV,K,V] fp32 or None). Differentiable."""
  reason = unsupported_reason(q, k, v, g, beta, chunk_size, interpret)
  if reason and vjp.shape_reason(q, v, chunk_size, k) is None:  # shape problems raise ValueError below
    raise RuntimeError(reason)
  return vjp.chunk_kda_pallas(BACKEND, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                              output_final_state=output_final_state, segment_ids=segment_ids,
                              chunk_size=chunk_size, interpret=interpret)
