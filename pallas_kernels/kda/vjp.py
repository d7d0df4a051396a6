"""Backend-agnostic driver of the Pallas KDA kernels: input checks, padding, segment resets, layout,
and the `jax.custom_vjp` that strings the kernels together.

Forward (3 kernels):  prepare (parallel over B×HV×chunks: gate cumsum, relation matrices, UT solve
  → W, U, Aqk) → state recurrence (sequential over chunks → chunk-start states h, V' = U − W·S,
  final state) → output (parallel: O = scale·(e^G⊙Q)·S + Aqk·V').
Backward (4 kernels, all Pallas): prepare again (also storing A = (I+L)^-1), the forward recurrence
  again (h, V'), the reverse-chunk state-gradient recurrence (dh, dV', d initial state), and one
  parallel kernel for every local gradient (WY/UT backward + intra-chunk relation backward + gate
  reverse cumsum). Residuals are the inputs only; everything else is recomputed.

A backend (pallas_gpu / pallas_tpu) supplies the tensor layout, BlockSpecs, compiler params and the two
recurrence kernels (a sequential grid axis with VMEM scratch on TPU, an in-kernel chunk loop on GPU);
the per-chunk math is shared (_chunk_math.py).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda import _chunk_math as cm
# one source of truth for input checks and segment resets (api imports the backends lazily: no cycle)
from pallas_kernels.kda.api import SEGMENT_RESET, check_inputs, segment_starts

SUPPORTED_DIMS = (64, 128)
SUPPORTED_CHUNKS = (16, 32, 64, 128)
SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16)
SQ = getattr(pl, "squeezed", None)  # squeezed block dim (None on older jax)
# Log-gates are floored here before the chunk cumsum. e^{-60} ≈ 9e-27 is already a hard reset at fp32
# precision, while a −1000 (or the −200 segment reset) would make the cumsums G large enough that the
# differences G_i − G_j inside a segment lose ~|G|·2^-24 absolute: 5x-10x less accurate results.
GATE_FLOOR = -60.0


@dataclasses.dataclass(frozen=True, eq=False)
class Backend:
  """What a Pallas backend plugs into the driver (hashed by identity: a static custom_vjp arg)."""
  name: str
  layout: str  # "bthd" (token-major, fla's layout) or "bhtd" (head-major)
  compiler_params: Callable[[str, int], Any]  # (kernel name, grid rank) -> compiler params
  interpret_arg: Callable[[bool], Any]  # interpret flag -> pallas_call(interpret=...)
  exact_dot: str  # precision of the fp32-exact products when compiled ("highest" / "tf32x3")
  scan_cumsum: bool  # cumsums by scan (the lowering has one) instead of triangular matmuls
  fwd_recurrence: Callable  # (plan, k, g, w, u, h0t) -> (h, vn, hTt)
  bwd_recurrence: Callable  # (plan, q, k, g, w, aqk, do, dhTt) -> (dh, dvn, dh0t)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static configuration of one call."""
  backend: Backend
  chunk: int
  group: int  # HV // H
  interpret: bool
  nx: cm.Numerics


def out_struct(shape, dtype, *likes) -> jax.ShapeDtypeStruct:
  """ShapeDtypeStruct for a pallas_call output that varies over the same shard_map mesh axes as the
  most-varying of `likes` (required under shard_map's check_vma; the aval attribute is
  `manual_axis_type` on newer jax, `vma` on older ones)."""
  for attr in ("manual_axis_type", "vma"):
    vals = [v for x in likes if (v := getattr(jax.typeof(x), attr, None)) is not None]
    if vals:
      most = max(vals, key=lambda v: len(getattr(v, "varying", v)))
      try:
        return jax.ShapeDtypeStruct(shape, dtype, **{attr: most})
      except TypeError:  # this jax's ShapeDtypeStruct takes no such argument
        pass
  return jax.ShapeDtypeStruct(shape, dtype)


# ---- layout helpers ----------------------------------------------------------------------------
def dims(plan: Plan, x: jax.Array) -> tuple[int, int, int, int]:
  """(B, T, heads, D) of a token tensor in the backend layout."""
  if plan.backend.layout == "bthd":
    return x.shape
  B, H, T, D = x.shape
  return B, T, H, D


def to_layout(plan: Plan, x: jax.Array) -> jax.Array:
  return x if plan.backend.layout == "bthd" else jnp.swapaxes(x, 1, 2)


from_layout = to_layout  # the swap is its own inverse


def token_shape(plan: Plan, B: int, T: int, H: int, D: int) -> tuple[int, ...]:
  return (B, T, H, D) if plan.backend.layout == "bthd" else (B, H, T, D)


def chunk_spec(plan: Plan, D: int, head: Callable = lambda h: h) -> pl.BlockSpec:
  """(C, D) block of a token tensor for a (b, hv, t) grid; `head` maps value head → stored head."""
  C = plan.chunk
  if plan.backend.layout == "bthd":
    return pl.BlockSpec((SQ, C, SQ, D), lambda b, h, t: (b, t, head(h), 0))
  return pl.BlockSpec((SQ, SQ, C, D), lambda b, h, t: (b, head(h), t, 0))


def state_seq_spec(V: int, K: int) -> pl.BlockSpec:
  """(V, K) block of the chunk-start states [B, HV, NT, V, K] for a (b, hv, t) grid."""
  return pl.BlockSpec((SQ, SQ, SQ, V, K), lambda b, h, t: (b, h, t, 0, 0))


def qk_head(plan: Plan) -> Callable:
  # lax.div, not //: floor division lowers through `sign`, which Mosaic cannot lower off-device
  return lambda h: jax.lax.div(h, plan.group)


# ---- the parallel kernels (same grid on both backends) ---------------------------------------------
def _parallel_call(plan: Plan, name: str, kernel, g, args, in_specs, out_shape, out_specs, flops,
                   transcendentals):
  """One pallas_call over the (batch, value head, chunk) grid; g (value heads) fixes the grid."""
  B, T, HV, _ = dims(plan, g)
  grid = (B, HV, T // plan.chunk)
  nbytes = sum(a.size * a.dtype.itemsize for a in args) + sum(
      s.size * jnp.dtype(s.dtype).itemsize for s in jax.tree.leaves(out_shape))
  n = B * HV * (T // plan.chunk)
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
      compiler_params=plan.backend.compiler_params(name, len(grid)),
      interpret=plan.backend.interpret_arg(plan.interpret), name=f"kda_{name}",
      cost_estimate=pl.CostEstimate(flops=int(n * flops), transcendentals=int(n * transcendentals),
                                    bytes_accessed=int(nbytes)),
  )(*args)


def prepare(plan: Plan, q, k, v, g, beta, with_a: bool):
  B, T, HV, K = dims(plan, g)
  V, C = v.shape[-1], plan.chunk
  f32 = jnp.float32
  shp = lambda d: out_struct(token_shape(plan, B, T, HV, d), f32, q, k, v, g, beta)
  outs = [shp(K), shp(V), shp(C)] + ([shp(C)] if with_a else [])
  qk = chunk_spec(plan, K, qk_head(plan))
  in_specs = [qk, qk, chunk_spec(plan, V), chunk_spec(plan, K), chunk_spec(plan, 1)]
  out_specs = [chunk_spec(plan, K), chunk_spec(plan, V)] + [chunk_spec(plan, C)] * (2 if with_a else 1)
  kern = functools.partial(cm.prepare_kernel, nx=plan.nx)
  return _parallel_call(plan, "prepare", kern, g, (q, k, v, g, beta), in_specs, tuple(outs),
                        tuple(out_specs), cm.flops_prepare(C, K, V), C * K * (cm.SUB + 3))


def output(plan: Plan, q, g, h, aqk, vn, out_dtype):
  B, T, HV, K = dims(plan, g)
  V, C = vn.shape[-1], plan.chunk
  in_specs = [chunk_spec(plan, K, qk_head(plan)), chunk_spec(plan, K), state_seq_spec(V, K),
              chunk_spec(plan, C), chunk_spec(plan, V)]
  out = out_struct(token_shape(plan, B, T, HV, V), out_dtype, q, g, h, aqk, vn)
  kern = functools.partial(cm.output_kernel, nx=plan.nx)
  return _parallel_call(plan, "output", kern, g, (q, g, h, aqk, vn), in_specs, out, chunk_spec(plan, V),
                        cm.flops_output(C, K, V), C * K)


def grads(plan: Plan, q, k, v, g, beta, a, h, dh, do, vn, dvn):
  B, T, HV, K = dims(plan, g)
  V, C = v.shape[-1], plan.chunk
  f32 = jnp.float32
  qk = chunk_spec(plan, K, qk_head(plan))
  in_specs = [qk, qk, chunk_spec(plan, V), chunk_spec(plan, K), chunk_spec(plan, 1), chunk_spec(plan, C),
              state_seq_spec(V, K), state_seq_spec(V, K), chunk_spec(plan, V), chunk_spec(plan, V),
              chunk_spec(plan, V)]
  shp = lambda d: out_struct(token_shape(plan, B, T, HV, d), f32, q, k, v, g, beta, a, h, dh, do, vn, dvn)
  outs = (shp(K), shp(K), shp(V), shp(K), shp(1))
  out_specs = tuple(chunk_spec(plan, d) for d in (K, K, V, K, 1))
  kern = functools.partial(cm.grads_kernel, nx=plan.nx)
  return _parallel_call(plan, "grads", kern, g, (q, k, v, g, beta, a, h, dh, do, vn, dvn), in_specs, outs,
                        out_specs, cm.flops_grads(C, K, V), C * K * (2 * cm.SUB + 8))


# ---- custom VJP ----------------------------------------------------------------------------------
def _group_sum(plan: Plan, x: jax.Array) -> jax.Array:
  """Sum per-value-head dq/dk over the value heads that share a q/k head."""
  if plan.group == 1:
    return x
  if plan.backend.layout == "bthd":
    B, T, HV, D = x.shape
    return x.reshape(B, T, HV // plan.group, plan.group, D).sum(3)
  B, HV, T, D = x.shape
  return x.reshape(B, HV // plan.group, plan.group, T, D).sum(2)


def _forward(plan: Plan, q, k, v, g, beta, h0t):
  w, u, aqk = prepare(plan, q, k, v, g, beta, with_a=False)
  h, vn, hTt = plan.backend.fwd_recurrence(plan, k, g, w, u, h0t)
  o = output(plan, q, g, h, aqk, vn, v.dtype)
  return o, hTt


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def kda_core(plan: Plan, q, k, v, g, beta, h0t):
  """Chunked KDA on padded inputs in the backend layout; h0t/hTt are transposed states [B,HV,V,K]."""
  return _forward(plan, q, k, v, g, beta, h0t)


def _core_fwd(plan, q, k, v, g, beta, h0t):
  return _forward(plan, q, k, v, g, beta, h0t), (q, k, v, g, beta, h0t)


def _core_bwd(plan, res, cts):
  q, k, v, g, beta, h0t = res
  do, dhTt = cts
  do = do.astype(v.dtype) if do.dtype != v.dtype else do
  w, u, aqk, a = prepare(plan, q, k, v, g, beta, with_a=True)
  h, vn, _ = plan.backend.fwd_recurrence(plan, k, g, w, u, h0t)
  dh, dvn, dh0t = plan.backend.bwd_recurrence(plan, q, k, g, w, aqk, do, dhTt.astype(jnp.float32))
  dq, dk, dv, dg, dbeta = grads(plan, q, k, v, g, beta, a, h, dh, do, vn, dvn)
  return (_group_sum(plan, dq).astype(q.dtype), _group_sum(plan, dk).astype(k.dtype), dv.astype(v.dtype),
          dg.astype(g.dtype), dbeta.astype(beta.dtype), dh0t.astype(h0t.dtype))


kda_core.defvjp(_core_fwd, _core_bwd)


# ---- public entry used by pallas_gpu / pallas_tpu --------------------------------------------------
def shape_reason(q, v, chunk_size, k=None) -> str | None:
  """Why the kernels cannot take these shapes/dtypes (None when they can)."""
  K, V = q.shape[-1], v.shape[-1]
  if K not in SUPPORTED_DIMS or V not in SUPPORTED_DIMS:
    return f"head dims K={K}, V={V} unsupported: the Pallas KDA kernels need K, V in {SUPPORTED_DIMS}"
  if chunk_size not in SUPPORTED_CHUNKS:
    return f"chunk_size={chunk_size} unsupported: use one of {SUPPORTED_CHUNKS}"
  for x in (q, v) if k is None else (q, k, v):
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
      return f"dtype {x.dtype} unsupported: use float32 or bfloat16"
  return None


def chunk_kda_pallas(backend: Backend, q, k, v, g, beta, *, scale=None, initial_state=None,
                     output_final_state=False, segment_ids=None, chunk_size=64, interpret=False):
  """fla-layout chunk_kda on a Pallas backend; returns (o [B,T,HV,V], final state [B,HV,K,V] or None)."""
  check_inputs(q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids,
               chunk_size=chunk_size, scale=scale)
  reason = shape_reason(q, v, chunk_size, k)
  if reason:
    raise ValueError(reason)
  B, T, H, K = q.shape
  HV, V = v.shape[2], v.shape[3]
  scale = float(K ** -0.5 if scale is None else scale)
  cdt = jnp.bfloat16 if jnp.bfloat16 in (q.dtype, k.dtype, v.dtype) else jnp.float32
  nx = cm.Numerics(scale, jnp.dtype(cdt).name, "highest" if interpret else backend.exact_dot,
                   backend.scan_cumsum)
  plan = Plan(backend, chunk_size, HV // H, bool(interpret), nx)

  g = g.astype(jnp.float32)
  if segment_ids is not None:  # a segment start is a hard reset of every gate channel
    g = jnp.where(segment_starts(segment_ids)[:, :, None, None], SEGMENT_RESET, g)
  g = jnp.maximum(g, GATE_FLOOR)
  beta = beta.astype(jnp.float32)[..., None]
  pad = -T % chunk_size  # padded tokens: k = v = β = 0, g = 0 leave the state untouched
  if pad:
    padt = lambda x: jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
    q, k, v, g, beta = map(padt, (q, k, v, g, beta))
  if initial_state is None:
    h0t = jnp.zeros((B, HV, V, K), jnp.float32)
  else:
    h0t = jnp.swapaxes(initial_state.astype(jnp.float32), 2, 3)

  q, k, v, g, beta = (to_layout(plan, x) for x in (q, k, v, g, beta))
  o, hTt = kda_core(plan, q, k, v, g, beta, h0t)
  o = from_layout(plan, o)[:, :T]
  return o, (jnp.swapaxes(hTt, 2, 3) if output_final_state else None)
