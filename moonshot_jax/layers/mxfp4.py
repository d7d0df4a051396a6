"""MXFP4 (OCP Microscaling, FP4 E2M1 elements, one E8M0 scale per 32): exact dequantisation, the
round-to-nearest-even quantiser of the released K3 checkpoint, and a weight-only 4-bit matmul.

Encoding (OCP MX v1.0; the byte layout of the K3 hub checkpoint, NeMo-AutoModel's kimi_k3 port,
vLLM's and transformers' gpt-oss MXFP4 loaders):
  element  4 bits S E E M, bias 1: E > 0: (-1)^S 2^(E-1) (1 + M/2), E = 0: (-1)^S M/2
           -> codes 0..15 = 0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, -1, -1.5, -2, -3, -4, -6 (no inf/NaN)
  scale    1 byte, 2^(byte - 127); byte 255 is NaN (the spec's only special value)
  packing  a weight W [..., out, in] (in = the contracted axis, a multiple of 32) is stored as
           packed [..., out, in/2] uint8, element 2j in the LOW nibble of byte j, 2j+1 in the high
           one; scales [..., out, in/32] uint8, scale g covering elements 32g .. 32g+31.
Every MXFP4 value is exact in bfloat16 and float32 (3 significant bits, exponents -128..129 of
which float32 holds -149..127: 6·2^127 overflows to inf, as the spec leaves it).

Quantiser (`quantize`, host NumPy; the export path): per block, exponent ceil(log2(amax / 6))
clamped to [-127, 127] (so |w| / 2^exp <= 6 never clips), 0 for an all-zero block; elements
rounded to the nearest E2M1 value, ties to the even code; the sign bit kept (so -0.0 survives).
On a block that already is MXFP4 it returns exactly those values (see tests/test_mxfp4.py), and
the same bytes whenever the block's largest code is 4 or 6, as a fresh quantisation makes it.

`dequantize` (jnp, traced inside the expert matmul) and `dequantize_np` (host NumPy, the importer)
share the lookup table; `reference_decode` is the plain bit-formula reference they are tested
against (with ml_dtypes' float4_e2m1fn / float8_e8m0fnu as a second, independent oracle).
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
SCALE_NAN = 255
# RNE thresholds between the positive levels; ties go to the even code (odd entries use >=).
_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def check_shapes(packed_shape, scales_shape, name: str = "mxfp4") -> int:
  """-> `in` (the unpacked contracted size); ValueError naming `name` when the pair is inconsistent."""
  packed_shape, scales_shape = tuple(packed_shape), tuple(scales_shape)
  if (len(packed_shape) < 1 or len(packed_shape) != len(scales_shape)
      or packed_shape[:-1] != scales_shape[:-1] or packed_shape[-1] != 16 * scales_shape[-1]):
    raise ValueError(f"{name}: packed {packed_shape} and scales {scales_shape} are not an MXFP4 pair "
                     f"(want [..., in/2] and [..., in/32])")
  return 2 * packed_shape[-1]


# ---- reference ------------------------------------------------------------------------------------
def reference_decode(code: int, scale_byte: int) -> float:
  """One element from the spec's bit formulas (no table): the reference for the fast paths."""
  if scale_byte == SCALE_NAN:
    return math.nan
  s, e, m = (code >> 3) & 1, (code >> 1) & 3, code & 1
  mag = m / 2 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
  return math.copysign(mag, -1.0 if s else 1.0) * 2.0 ** (scale_byte - 127)


# ---- host NumPy (import / export) ------------------------------------------------------------------
def unpack_codes_np(packed: np.ndarray) -> np.ndarray:
  """uint8 [..., n/2] -> codes uint8 [..., n] (low nibble first)."""
  p = np.asarray(packed, np.uint8)
  return np.stack([p & 0x0F, p >> 4], axis=-1).reshape(p.shape[:-1] + (2 * p.shape[-1],))


def pack_codes_np(codes: np.ndarray) -> np.ndarray:
  c = np.asarray(codes, np.uint8)
  return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def _dequantize_np_formula(packed, scales, dtype, n) -> np.ndarray:
  """The defining computation: table value times 2^(s-127) in float32, then one cast."""
  vals = E2M1_VALUES[unpack_codes_np(packed)].reshape(np.shape(scales) + (BLOCK,))
  s = np.asarray(scales, np.int32)
  with np.errstate(over="ignore", invalid="ignore"):
    factor = np.where(s == SCALE_NAN, np.float32(np.nan), np.ldexp(np.float32(1), s - 127).astype(np.float32))
    out = vals * factor[..., None]
  return out.reshape(np.shape(scales)[:-1] + (n,)).astype(dtype, copy=False)


_PAIR_LUTS: dict = {}


def _pair_lut(dtype) -> np.ndarray | None:
  """(scale byte << 8 | packed byte) -> the two decoded elements (low nibble first) of `dtype`,
  as one unsigned word of twice its size: 65536 entries, computed by the defining formula itself,
  so a lookup is bit-identical to it (NaN scale, overflow and subnormal rounding included)."""
  dtype = np.dtype(dtype)
  if dtype.itemsize not in (2, 4):
    return None
  if dtype not in _PAIR_LUTS:
    s = np.repeat(np.arange(256, dtype=np.uint8), 256)[:, None]  # [65536, 1]: one block per entry
    b = np.zeros((65536, BLOCK // 2), np.uint8)
    b[:, 0] = np.tile(np.arange(256, dtype=np.uint8), 256)  # the entry's byte leads its block
    pairs = _dequantize_np_formula(b, s, dtype, BLOCK)[:, :2]
    pairs = np.ascontiguousarray(pairs)
    _PAIR_LUTS[dtype] = pairs.view(np.dtype(f"u{2 * dtype.itemsize}")).reshape(65536)
  return _PAIR_LUTS[dtype]


def _pair_index(s_R1: np.ndarray, p_RB: np.ndarray, out_RB: np.ndarray) -> np.ndarray:
  """out = scale byte << 8 | packed byte: each packed byte's entry in `_pair_lut` (rows = scale blocks)."""
  np.left_shift(s_R1, 8, out=out_RB, dtype=np.intp, casting="unsafe")
  return np.bitwise_or(out_RB, p_RB, out=out_RB, casting="unsafe")


def dequantize_np(packed: np.ndarray, scales: np.ndarray, dtype=np.float32, name: str = "mxfp4",
                  chunk_bytes: int = 1 << 20) -> np.ndarray:
  """[..., in/2] uint8 + [..., in/32] uint8 -> [..., in] in `dtype` (exact for float32 / bfloat16).

  The import's hot loop: one 65536-entry table lookup per packed byte (indexed by scale and
  byte) writes both elements straight into the output in `dtype` -- no float32 intermediate, no
  separate scale pass -- in chunks of `chunk_bytes` packed bytes so the index temporaries stay
  in cache. Bit-identical to `_dequantize_np_formula` (the table is built by it)."""
  n = check_shapes(np.shape(packed), np.shape(scales), name)
  dtype = np.dtype(dtype)
  lut = _pair_lut(dtype)
  if lut is None:
    return _dequantize_np_formula(packed, scales, dtype, n)
  out_shape = np.shape(scales)[:-1] + (n,)
  p = np.ascontiguousarray(packed, np.uint8).reshape(-1, BLOCK // 2)  # one row per scale block
  s = np.ascontiguousarray(scales, np.uint8).reshape(-1, 1)
  # word k of a row holds elements 2k, 2k+1 in memory order (a word is copied, never reinterpreted)
  out = np.empty((p.shape[0], BLOCK // 2), lut.dtype)
  rows = max(1, chunk_bytes // (BLOCK // 2))
  idx = np.empty((min(rows, p.shape[0]), BLOCK // 2), np.intp)
  for r0 in range(0, p.shape[0], rows):
    r1 = min(r0 + rows, p.shape[0])
    np.take(lut, _pair_index(s[r0:r1], p[r0:r1], idx[:r1 - r0]), out=out[r0:r1])
  return out.view(dtype).reshape(out_shape)


_ABS_PAIR_SUMS: dict = {}


def _abs_pair_sums(dtype) -> np.ndarray:
  """float64 |lo| + |hi| of each `_pair_lut(dtype)` entry: what one (scale, byte) adds to sum |W|
  (inf where the decode overflows, NaN for the NaN scale, as the decoded elements are)."""
  dtype = np.dtype(dtype)
  if dtype not in _ABS_PAIR_SUMS:
    pairs = _pair_lut(dtype).view(dtype).reshape(65536, 2).astype(np.float64)
    with np.errstate(invalid="ignore"):
      _ABS_PAIR_SUMS[dtype] = np.abs(pairs).sum(axis=1)
  return _ABS_PAIR_SUMS[dtype]


def dequantize_np_t(packed: np.ndarray, scales: np.ndarray, dtype=np.float32, name: str = "mxfp4",
                    rows: int = 128, threads: int = 2) -> tuple[np.ndarray, float]:
  """[out, in/2] uint8 + [out, in/32] uint8 -> (W.T as a C-contiguous [in, out] array in `dtype`,
  sum |W| in float64): the import's expert path (our expert leaves are [in, out]).

  `rows` rows of W at a time are decoded by `dequantize_np`'s pair table into a cache-sized buffer
  and stored transposed, so the layout change costs no separate pass over W in memory. sum |W| is
  taken from the histogram of the same table indices (scale << 8 | byte) times each entry's
  |lo| + |hi|: exactly the decoded values' sum (inf / NaN included), without a pass over them
  (a checkpoint fingerprint: 4.25 bits per value read instead of 16). A matrix of >= 4 MB packed is
  split in two row ranges decoded at once (threads=2) (numpy's loops release the GIL): the import's
  look-ahead thread is otherwise the only one busy while it streams the experts."""
  n = check_shapes(np.shape(packed), np.shape(scales), name)
  if np.ndim(packed) != 2:
    raise ValueError(f"{name}: dequantize_np_t takes one matrix [out, in/2], got {np.shape(packed)}")
  if threads not in (1, 2) or rows < 1:
    raise ValueError(f"{name}: dequantize_np_t threads must be 1 or 2 and rows >= 1 (got {threads}, {rows})")
  dtype = np.dtype(dtype)
  lut = _pair_lut(dtype)
  if lut is None:
    w = _dequantize_np_formula(packed, scales, dtype, n)
    return np.ascontiguousarray(w.T), float(np.abs(w.astype(np.float64)).sum())
  p = np.ascontiguousarray(packed, np.uint8)
  s = np.ascontiguousarray(scales, np.uint8)
  out = np.empty((n, p.shape[0]), dtype)
  dst = out.view(f"u{dtype.itemsize}")  # copied as unsigned ints: bit-exact, no per-element float calls
  parts = max(1, min(threads, p.shape[0] // rows)) if p.nbytes >= (4 << 20) else 1
  bounds = [p.shape[0] * k // parts for k in range(parts + 1)]
  futures = [_decode_pool().submit(_decode_rows_t, lut, p, s, dst, bounds[k], bounds[k + 1], rows)
             for k in range(1, parts)]
  try:
    counts = _decode_rows_t(lut, p, s, dst, bounds[0], bounds[1], rows)
  finally:  # the helper's rows are waited for even when this thread's part raised
    done = [f.result() for f in futures]
  counts = sum(done, counts)
  used = counts > 0
  return out, float(counts[used].astype(np.float64) @ _abs_pair_sums(dtype)[used])


def _decode_rows_t(lut, p, s, dst, r_start: int, r_stop: int, rows: int) -> np.ndarray:
  """Rows [r_start, r_stop) of W decoded into the columns of `dst` (W.T as unsigned ints), `rows`
  at a time; returns the histogram of their table indices."""
  per_row = 2 * p.shape[1] // BLOCK
  ix = np.empty((max(0, min(rows, r_stop - r_start)) * per_row, BLOCK // 2), np.intp)
  buf = np.empty(ix.shape, lut.dtype)
  counts = np.zeros(65536, np.int64)
  for r0 in range(r_start, r_stop, rows):
    r1 = min(r0 + rows, r_stop)
    i = _pair_index(s[r0:r1].reshape(-1, 1), p[r0:r1].reshape(-1, BLOCK // 2), ix[:(r1 - r0) * per_row])
    b = np.take(lut, i, out=buf[:(r1 - r0) * per_row])
    counts += np.bincount(i.reshape(-1), minlength=65536)
    dst[:, r0:r1] = b.view(dst.dtype).reshape(r1 - r0, dst.shape[0]).T
  return counts


_POOL: list = []


def _decode_pool():
  """One helper thread shared by every `dequantize_np_t` call (made on first use)."""
  if not _POOL:
    import concurrent.futures
    _POOL.append(concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mxfp4"))
  return _POOL[0]


def quantize(w: np.ndarray, name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
  """float [..., in] (in % 32 == 0) -> (packed uint8 [..., in/2], scales uint8 [..., in/32])."""
  w = np.asarray(w)
  if w.ndim < 1 or w.shape[-1] % BLOCK or w.shape[-1] == 0:
    raise ValueError(f"{name}: the last (contracted) axis must be a positive multiple of {BLOCK}, got {w.shape}")
  if not np.issubdtype(w.dtype, np.floating) and w.dtype.name != "bfloat16":
    raise ValueError(f"{name}: expected a floating array, got {w.dtype}")
  x = w.astype(np.float64).reshape(w.shape[:-1] + (-1, BLOCK))
  if not np.all(np.isfinite(x)):
    raise ValueError(f"{name}: holds NaN or inf; MXFP4 has no encoding for them")
  amax = np.max(np.abs(x), axis=-1)
  with np.errstate(divide="ignore"):
    exp = np.where(amax > 0, np.ceil(np.log2(amax / 6.0)), 0.0)
  exp = np.clip(exp, -127, 127).astype(np.int32)
  a = np.abs(x) / np.ldexp(1.0, exp)[..., None]
  code = np.zeros(a.shape, np.uint8)
  for i, t in enumerate(_MIDPOINTS):
    code += (a >= t) if i % 2 else (a > t)
  code |= np.signbit(x).astype(np.uint8) << 3
  packed = pack_codes_np(code.reshape(w.shape))
  return packed, (exp + 127).astype(np.uint8)


# ---- jnp (inside jit: the weight-only matmul) -------------------------------------------------------
def dequantize(packed: jax.Array, scales: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
  """jnp version of `dequantize_np`: the value and exponent are applied in float32 (exact), then
  cast (exact to bfloat16). Scale 255 gives NaN. Results below 2^-126 (float32 subnormals,
  scale bytes 0..2 only) may be flushed to zero by the backend (XLA:CPU does).
  Elementwise on the codes (no table gather, no [..., in/32, 32] view): XLA fuses it into one
  pass, where a table lookup kept an int32 index and a 32-wide minor axis (padded 4x by TPU
  (8, 128) tiles: 2.6 GiB per 16 gathered K3 experts at decode, measured on XLA:TPU v5p)."""
  n = check_shapes(packed.shape, scales.shape)
  p = packed.astype(jnp.uint8)
  codes = jnp.stack([p & 0x0F, p >> 4], axis=-1).reshape(p.shape[:-1] + (n,))
  e = (codes >> 1) & 3
  m = (codes & 1).astype(jnp.float32)
  # E2M1: e > 0: 2^(e-1) (1 + m/2); e = 0: m/2
  pow2 = jnp.where(e == 3, 4.0, jnp.where(e == 2, 2.0, 1.0)).astype(jnp.float32)  # 2^(e-1), exact selects
  mag = jnp.where(e == 0, 0.5 * m, pow2 * (1 + 0.5 * m))
  vals = jnp.where((codes >> 3) == 1, -mag, mag)
  s = jnp.repeat(scales.astype(jnp.int32), BLOCK, axis=-1)
  # 2^(s-127) as float32 exponent bits. Scale 0 (2^-127) is a subnormal that backends with
  # denormals-are-zero would read as 0, so it becomes 2^-126 times the halved (exact) values.
  factor = jax.lax.bitcast_convert_type(jnp.maximum(s, 1) << 23, jnp.float32)
  factor = jnp.where(s == SCALE_NAN, jnp.float32(jnp.nan), factor)
  vals = jnp.where(s == 0, vals * 0.5, vals)
  return (vals * factor).astype(dtype)


def matmul(x: jax.Array, packed: jax.Array, scales: jax.Array, dtype=None) -> jax.Array:
  """x [..., in] @ W^T with W [out, in] held as MXFP4 (packed [out, in/2], scales [out, in/32]):
  the weight is dequantised to `dtype` (default x.dtype) right here, so under jit only this one
  weight exists in that dtype at a time. fp32 accumulation; returns fp32 [..., out]."""
  dtype = x.dtype if dtype is None else jnp.dtype(dtype)
  w = dequantize(packed, scales, dtype)
  return jnp.einsum("...i,oi->...o", x.astype(dtype), w, preferred_element_type=jnp.float32)


def nbytes(shape_out_in: tuple[int, ...]) -> int:
  """Bytes of one MXFP4 weight [..., out, in]: 0.5 per element + 1 per 32."""
  n = int(np.prod(shape_out_in))
  return n // 2 + n // BLOCK


def tree_is_mxfp4(x: Any) -> bool:
  return isinstance(x, dict) and set(x) == {"packed", "scales"}
