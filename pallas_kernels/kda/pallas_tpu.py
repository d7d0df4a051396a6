"""KDA chunked delta rule as Pallas kernels for TPU (Mosaic).

Tensors are moved to a head-major layout [B,H,T,D] so every block is a (C, D) tile whose last two
dims satisfy Mosaic's (8,128) rule (C is a multiple of 16, D is the full head dim).

Kernels (per-chunk math in _chunk_math.py, wiring in vjp.py):
  prepare / output / grads  grid (B, HV, T/C), all "parallel";
  fwd / bwd recurrence      grid (B, HV, T/C) with the chunk axis innermost and "arbitrary": the fp32
                            state (V×K, transposed) lives in a VMEM scratch across grid steps and the
                            chunk blocks are double-buffered by the Pallas pipeline; the reverse
                            recurrence walks the chunk axis backwards through its index maps.
On CPU the kernels run in the Mosaic TPU interpreter (`interpret=True` →
`pltpu.InterpretParams(uninitialized_memory="nan")`, so an output block left unwritten shows as NaN).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kda import _chunk_math as cm
from pallas_kernels.kda import vjp
from pallas_kernels.target import target_platform

SQ = vjp.SQ


def _compiler_params(name: str, rank: int):
  sem = ("parallel",) * rank if name in ("prepare", "output", "grads") else (
      ("parallel",) * (rank - 1) + ("arbitrary",))
  return pltpu.CompilerParams(dimension_semantics=sem)


def _interpret_arg(interpret: bool):
  if not interpret:
    return False
  try:
    return pltpu.InterpretParams(uninitialized_memory="nan")
  except TypeError:  # a jax whose InterpretParams lacks the argument
    return pltpu.InterpretParams()


def _specs(plan: vjp.Plan, V: int, K: int, reverse: bool, NT: int):
  """BlockSpec factories for a (b, hv, t) grid whose chunk axis may run backwards."""
  C = plan.chunk
  tt = (lambda t: NT - 1 - t) if reverse else (lambda t: t)
  chunk = lambda D, head=lambda h: h: pl.BlockSpec((SQ, SQ, C, D), lambda b, h, t: (b, head(h), tt(t), 0))
  states = pl.BlockSpec((SQ, SQ, SQ, V, K), lambda b, h, t: (b, h, tt(t), 0, 0))
  state = pl.BlockSpec((SQ, SQ, V, K), lambda b, h, t: (b, h, 0, 0))
  return chunk, states, state


def _rec_call(plan, name, kernel, g, args, in_specs, out_shape, out_specs, flops):
  B, HV, T, K = g.shape
  V = out_shape[1].shape[-1]
  nbytes = sum(x.size * jnp.dtype(x.dtype).itemsize for x in list(args) + list(out_shape))
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=(B, HV, T // plan.chunk), in_specs=in_specs, out_specs=out_specs,
      scratch_shapes=[pltpu.VMEM((V, K), jnp.float32)], compiler_params=_compiler_params(name, 3),
      interpret=_interpret_arg(plan.interpret), name=f"kda_{name}",
      cost_estimate=pl.CostEstimate(flops=int(flops), transcendentals=int(B * HV * T * K * 2),
                                    bytes_accessed=int(nbytes)),
  )(*args)


def fwd_recurrence(plan: vjp.Plan, k, g, w, u, h0t):
  """h [B,HV,NT,V,K] (chunk-start states, transposed), V' [B,HV,T,V], final state [B,HV,V,K]."""
  B, HV, T, K = g.shape
  V, C = u.shape[-1], plan.chunk
  NT = T // C
  nx = plan.nx

  def kernel(k_ref, w_ref, g_ref, u_ref, h0_ref, h_ref, vn_ref, hT_ref, s_ref):
    t = pl.program_id(2)

    @pl.when(t == 0)
    def _():
      s_ref[...] = h0_ref[...].astype(jnp.float32)

    St = s_ref[...]
    h_ref[...] = St
    vn, St = cm.fwd_step(nx, St, w_ref[...], u_ref[...], k_ref[...], g_ref[...])
    vn_ref[...] = vn
    s_ref[...] = St

    @pl.when(t == NT - 1)
    def _():
      hT_ref[...] = St

  chunk, states, state = _specs(plan, V, K, False, NT)
  f32, ins = jnp.float32, (k, g, w, u, h0t)
  sds = lambda shape: vjp.out_struct(shape, f32, *ins)
  out_shape = (sds((B, HV, NT, V, K)), sds((B, HV, T, V)), sds((B, HV, V, K)))
  in_specs = [chunk(K, vjp.qk_head(plan)), chunk(K), chunk(K), chunk(V), state]
  out_specs = (states, chunk(V), state)
  return _rec_call(plan, "fwd_rec", kernel, g, (k, w, g, u, h0t), in_specs, out_shape, out_specs,
                   B * HV * NT * cm.flops_step(C, K, V))


def bwd_recurrence(plan: vjp.Plan, q, k, g, w, aqk, do, dhTt):
  """dh [B,HV,NT,V,K] (∂ wrt the state after each chunk), dV' [B,HV,T,V], d initial state."""
  B, HV, T, K = g.shape
  V, C = do.shape[-1], plan.chunk
  NT = T // C
  nx = plan.nx

  def kernel(q_ref, k_ref, g_ref, w_ref, aqk_ref, do_ref, dhT_ref, dh_ref, dvn_ref, dh0_ref, s_ref):
    t = pl.program_id(2)

    @pl.when(t == 0)
    def _():
      s_ref[...] = dhT_ref[...].astype(jnp.float32)

    dSt = s_ref[...]
    dh_ref[...] = dSt
    dvn, dSt = cm.bwd_step(nx, dSt, q_ref[...], k_ref[...], g_ref[...], w_ref[...], aqk_ref[...],
                           do_ref[...])
    dvn_ref[...] = dvn
    s_ref[...] = dSt

    @pl.when(t == NT - 1)
    def _():
      dh0_ref[...] = dSt

  chunk, states, state = _specs(plan, V, K, True, NT)
  f32, ins = jnp.float32, (q, k, g, w, aqk, do, dhTt)
  sds = lambda shape: vjp.out_struct(shape, f32, *ins)
  out_shape = (sds((B, HV, NT, V, K)), sds((B, HV, T, V)), sds((B, HV, V, K)))
  qk = chunk(K, vjp.qk_head(plan))
  in_specs = [qk, qk, chunk(K), chunk(K), chunk(C), chunk(V), state]
  out_specs = (states, chunk(V), state)
  return _rec_call(plan, "bwd_rec", kernel, g, (q, k, g, w, aqk, do, dhTt), in_specs, out_shape, out_specs,
                   B * HV * NT * cm.flops_step(C, K, V))


BACKEND = vjp.Backend(name="pallas_tpu", layout="bhtd", compiler_params=_compiler_params,
                      interpret_arg=_interpret_arg, exact_dot="highest", scan_cumsum=False,
                      fwd_recurrence=fwd_recurrence, bwd_recurrence=bwd_recurrence)


def unsupported_reason(q, k, v, g, beta, chunk_size, interpret) -> str | None:
  """None when the TPU kernels can run these inputs, else a sentence saying why not. Compiled
  kernels need the computation to be compiled for TPU (pallas_kernels/target.py: the arguments'
  devices, the context mesh, else the default backend), not a TPU on this host: deviceless AOT
  against a libtpu topology lowers them too."""
  reason = vjp.shape_reason(q, v, chunk_size, k)
  if reason:
    return "pallas_tpu: " + reason
  if not interpret:
    platform, how = target_platform(q, k, v, g, beta)
    if platform != "tpu":
      return (f"pallas_tpu: needs a TPU target, but this call is compiled for {platform!r} (from the "
              f"{how}); pass interpret=True to run the kernels in the Mosaic TPU interpreter")
  return None


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              segment_ids=None, chunk_size=64, interpret=False):
  """Chunked KDA (fla layout: q,k [B,T,H,K], v [B,T,HV,V], g [B,T,HV,K], beta [B,T,HV]) on TPU.
  Returns (o [B,T,HV,V] in v's dtype, final state [B,HV,K,V] fp32 or None). Differentiable."""
  reason = unsupported_reason(q, k, v, g, beta, chunk_size, interpret)
  if reason and vjp.shape_reason(q, v, chunk_size, k) is None:  # shape problems raise ValueError below
    raise RuntimeError(reason)
  return vjp.chunk_kda_pallas(BACKEND, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                              output_final_state=output_final_state, segment_ids=segment_ids,
                              chunk_size=chunk_size, interpret=interpret)
