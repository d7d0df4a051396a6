"""Public KDA ops: `chunk_kda` (chunked, backend-dispatched) and `recurrent_kda` (token-by-token oracle).

Layout as in fla: q,k [B,T,H,K], v [B,T,HV,V], g [B,T,HV,K] (log decay, ≤ 0), beta [B,T,HV],
states [B,HV,K,V] fp32. HV is a multiple of H: value head h uses q/k head h // (HV // H).
q and k are expected L2-normalised by the caller. Everything accumulates in fp32; o has v's dtype.

`segment_ids` [B,T] packs several documents per row: a segment start is a hard reset of every gate
channel (g = SEGMENT_RESET, whose exp is exactly 0 in fp32), so no state crosses a boundary, and
`initial_state` only reaches the first segment of each row.
"""
from __future__ import annotations

import importlib
import logging

import jax
import jax.numpy as jnp

from pallas_kernels.kda import reference, xla
from pallas_kernels.target import target_platform

IMPLEMENTATIONS = ("xla", "pallas_gpu", "pallas_tpu")
# exp(-200) underflows to exactly 0 in fp32 (smallest subnormal ≈ e^-103.3); a small magnitude keeps
# the chunk cumsum precise (fp32 ulp at 200 is 1.5e-5) when several resets share a chunk.
SEGMENT_RESET = -200.0


# ---- validation --------------------------------------------------------------------------------------
def _shape(x):
  return tuple(getattr(x, "shape", ())) if x is not None else None


def check_inputs(q, k, v, g, beta, *, initial_state=None, segment_ids=None, chunk_size: int = 64,
                 scale=None) -> None:
  """Raises ValueError naming the bad argument and the expected shape/dtype."""
  for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
    if getattr(x, "ndim", None) != 4:
      raise ValueError(f"{name}: expected a 4-D array [B,T,heads,dim], got shape {_shape(x)}")
  for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
    if not jnp.issubdtype(getattr(x, "dtype", None), jnp.floating):
      raise ValueError(f"{name}: expected a floating dtype, got {getattr(x, 'dtype', None)}")
  B, T, H, K = q.shape
  if k.shape != q.shape:
    raise ValueError(f"k: expected shape {q.shape} (same as q [B,T,H,K]), got {k.shape}")
  if v.shape[:2] != (B, T):
    raise ValueError(f"v: expected shape ({B}, {T}, HV, V), got {v.shape}")
  HV, V = v.shape[2], v.shape[3]
  if HV % H:
    raise ValueError(f"v: value heads HV={HV} must be a multiple of the q/k heads H={H}")
  if g.shape != (B, T, HV, K):
    raise ValueError(f"g: expected shape {(B, T, HV, K)} [B,T,HV,K], got {g.shape}")
  if _shape(beta) != (B, T, HV):
    raise ValueError(f"beta: expected shape {(B, T, HV)} [B,T,HV], got {_shape(beta)}")
  if initial_state is not None:
    if _shape(initial_state) != (B, HV, K, V):
      raise ValueError(f"initial_state: expected shape {(B, HV, K, V)} [B,HV,K,V], got "
                       f"{_shape(initial_state)}")
    if not jnp.issubdtype(initial_state.dtype, jnp.floating):
      raise ValueError(f"initial_state: expected a floating dtype, got {initial_state.dtype}")
  if segment_ids is not None:
    if _shape(segment_ids) != (B, T) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"segment_ids: expected an integer array of shape {(B, T)}, got "
                       f"{_shape(segment_ids)} {getattr(segment_ids, 'dtype', None)}")
  if not (isinstance(chunk_size, int) and chunk_size >= 2 and chunk_size & (chunk_size - 1) == 0):
    raise ValueError(f"chunk_size: expected a power of two >= 2 (e.g. 64), got {chunk_size!r}")
  if scale is not None and not isinstance(scale, (int, float)):
    raise ValueError(f"scale: expected a Python float or None, got {type(scale).__name__}")


def segment_starts(segment_ids: jax.Array) -> jax.Array:
  """[B,T] bool: True where a new segment begins (never at t = 0)."""
  return jnp.concatenate([jnp.zeros_like(segment_ids[:, :1], bool),
                          segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)


def _canonical(q, k, v, g, beta, scale, initial_state, segment_ids):
  """fp32, q/k expanded to HV heads, segment resets written into g, zero initial state if None."""
  B, T, H, K = q.shape
  HV, V = v.shape[2], v.shape[3]
  f32 = jnp.float32
  q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))
  if HV != H:
    q, k = (jnp.repeat(x, HV // H, axis=2) for x in (q, k))
  if segment_ids is not None:
    g = jnp.where(segment_starts(segment_ids)[:, :, None, None], SEGMENT_RESET, g)
  h0 = jnp.zeros((B, HV, K, V), f32) if initial_state is None else initial_state.astype(f32)
  # every input takes the varying type the state will have (see xla.zeros_varying_like)
  xs = (q, k, v, g, beta, h0)
  zero = xla.zeros_varying_like((), xs)
  q, k, v, g, beta, h0 = (x + zero for x in xs)
  scale = float(K ** -0.5 if scale is None else scale)
  return q, k, v, g, beta, scale, h0


# ---- public ops --------------------------------------------------------------------------------------
def recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                  segment_ids=None, chunk_size=64, implementation=None, interpret=None):
  """Token-by-token KDA (`lax.scan` in fp32): the golden oracle and the decode step (T = 1).
  `chunk_size`, `implementation` and `interpret` are accepted for signature parity and ignored.
  Returns (o [B,T,HV,V] in v's dtype, final state [B,HV,K,V] fp32 or None)."""
  del chunk_size, implementation, interpret
  check_inputs(q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids, scale=scale)
  out_dtype = v.dtype
  o, hT = reference.recurrent_core(*_canonical(q, k, v, g, beta, scale, initial_state, segment_ids))
  return o.astype(out_dtype), (hT if output_final_state else None)


def _backend(name: str):
  return importlib.import_module(f"pallas_kernels.kda.{name}")


def _default_implementation(*arrays) -> str:
  """The kernel for the platform this call is compiled for (pallas_kernels/target.py)."""
  return {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(target_platform(*arrays)[0], "xla")


def resolve_implementation(implementation, q, k, v, g, beta, chunk_size, interpret) -> str:
  """The backend that will run: explicit requests must be runnable (ValueError otherwise); None picks
  the best for the compilation target (the arguments' devices, the context mesh, else the default
  backend) and falls back to "xla" (one logging.info line) when it cannot run."""
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation: expected one of {IMPLEMENTATIONS} or None, got {implementation!r}")
  name = implementation or _default_implementation(q, k, v, g, beta)
  if name == "xla":
    return name
  try:
    reason = _backend(name).unsupported_reason(q, k, v, g, beta, chunk_size, interpret)
  except ImportError as e:
    reason = f"module pallas_kernels.kda.{name} is unavailable ({e})"
  if reason is None:
    return name
  if implementation is not None:
    raise ValueError(f"implementation={name!r} cannot run this call: {reason}")
  logging.info("chunk_kda: %s unsupported (%s); using the XLA implementation", name, reason)
  return "xla"


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              segment_ids=None, chunk_size=64, implementation=None, interpret=None):
  """Chunked KDA (exact: same math as `recurrent_kda`, chunk-parallel WY/UT form). Differentiable.
  Returns (o [B,T,HV,V] in v's dtype, final state [B,HV,K,V] fp32 or None)."""
  check_inputs(q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids,
               chunk_size=chunk_size, scale=scale)
  name = resolve_implementation(implementation, q, k, v, g, beta, chunk_size, interpret)
  if name != "xla":
    return _backend(name).chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                    output_final_state=output_final_state, segment_ids=segment_ids,
                                    chunk_size=chunk_size, interpret=bool(interpret))
  out_dtype = v.dtype
  args = _canonical(q, k, v, g, beta, scale, initial_state, segment_ids)
  o, hT = xla.chunk_core(*args, chunk_size=chunk_size, segment_ids=segment_ids)
  return o.astype(out_dtype), (hT if output_final_state else None)
