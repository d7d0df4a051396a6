"""MXFP4: every (code, scale byte) pair against the spec's bit formulas and against ml_dtypes'
float4_e2m1fn / float8_e8m0fnu (an independent implementation of the OCP MX encodings); the K3 /
vLLM / transformers packing convention; the quantiser's rounding, scale rule and exactness on
MXFP4 data; the weight-only matmul."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from moonshot_jax.layers import mxfp4

CODES = np.arange(16, dtype=np.uint8)
SCALES = np.arange(256, dtype=np.uint8)


def _oracle() -> np.ndarray:
  """[256 scales, 16 codes] float32 from ml_dtypes' spec types (product in float64)."""
  el = CODES.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
  sc = SCALES.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
  with np.errstate(over="ignore", invalid="ignore"):
    return (sc[:, None] * el[None, :]).astype(np.float32)


def _all_pairs():
  """packed [256, 16] (each row: codes 0..15 twice, low nibble first) and scales [256, 1]."""
  codes = np.tile(CODES, 2)
  packed = np.broadcast_to(mxfp4.pack_codes_np(codes), (256, 16)).copy()
  return packed, SCALES[:, None].copy(), np.tile(_oracle(), (1, 2))


def test_value_table_is_the_spec():
  assert np.array_equal(mxfp4.E2M1_VALUES, CODES.view(ml_dtypes.float4_e2m1fn).astype(np.float32))
  assert np.array_equal(np.signbit(mxfp4.E2M1_VALUES), CODES >= 8)  # code 8 is -0.0
  for c in CODES:
    assert mxfp4.reference_decode(int(c), 127) == float(mxfp4.E2M1_VALUES[c])


def test_dequantize_every_code_and_scale_exactly():
  packed, scales, want = _all_pairs()
  ref = np.array([[mxfp4.reference_decode(int(c), int(s)) for c in np.tile(CODES, 2)] for s in SCALES])
  with np.errstate(over="ignore"):
    ref = ref.astype(np.float32)
  np.testing.assert_array_equal(ref, want)  # the bit formulas and ml_dtypes agree
  got = mxfp4.dequantize_np(packed, scales)
  np.testing.assert_array_equal(got, want)  # nan == nan; exact, incl. subnormal 2^-127 and inf
  assert np.isnan(got[255]).all() and np.isinf(got[254, 7]) and got[0, 1] == 2.0 ** -128
  # jnp path (traced; what the expert matmul uses) and bf16: the same values
  got_j = np.asarray(jax.jit(lambda p, s: mxfp4.dequantize(p, s, jnp.float32))(packed, scales))
  normal = ~((np.abs(want) < np.finfo(np.float32).tiny) & (want != 0))  # nan/inf/0/normals: exact
  np.testing.assert_array_equal(got_j[normal], want[normal])
  # float32 subnormal results (|w| < 2^-126, scale bytes 0..2): exact or flushed to zero by XLA:CPU
  sub = ~normal
  assert sub.sum() == 16 and np.all((got_j[sub] == want[sub]) | (got_j[sub] == 0))
  got_bf = np.asarray(jax.jit(lambda p, s: mxfp4.dequantize(p, s, jnp.bfloat16))(packed, scales))
  np.testing.assert_array_equal(got_bf.astype(np.float32)[normal], want[normal])  # exact in bf16


def test_packing_convention_low_nibble_first():
  # bytes of the values 0, .5, 1, ..., -6 in order, twice: element 2j is the low nibble of byte j
  vals = np.tile(mxfp4.E2M1_VALUES, 2)[None]
  packed, scales = mxfp4.quantize(vals)
  assert packed.tolist() == [[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2] and scales.tolist() == [[127]]
  np.testing.assert_array_equal(mxfp4.dequantize_np(np.array([[0x21] * 16], np.uint8), np.array([[128]], np.uint8))[0, :2],
                                [1.0, 2.0])  # 0x21: low nibble 1 (0.5), high 2 (1.0), times 2
  with pytest.raises(ValueError, match="w1.weight"):
    mxfp4.dequantize_np(np.zeros((2, 16), np.uint8), np.zeros((2, 2), np.uint8), name="w1.weight")


def test_quantize_rounds_to_nearest_even_and_picks_the_scale():
  mid = np.array([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4])
  p, s = mxfp4.quantize(mid)
  np.testing.assert_array_equal(mxfp4.dequantize_np(p, s)[0], [0, 1, 1, 2, 2, 4, 4, 6] * 4)
  just = np.array([[0.26, 0.74, 1.26, 1.74, 2.51, 3.49, 5.01, 6.0] * 4])  # off the ties: nearest
  np.testing.assert_array_equal(mxfp4.dequantize_np(*mxfp4.quantize(just))[0], [0.5, 0.5, 1.5, 1.5, 3, 3, 6, 6] * 4)
  amax = np.array([0, 3, 6, 12, np.nextafter(6, 7), 1e-38, 1e30])
  _, s = mxfp4.quantize(np.repeat(amax[:, None], 32, axis=1))
  # ceil(log2(amax/6)) + 127: no clipping (|w|/2^e <= 6), zero block -> 127, tiny blocks clamp at 0
  assert s[:, 0].tolist() == [127, 126, 127, 128, 128, 0, 127 + int(np.ceil(np.log2(1e30 / 6)))]
  for bad in (np.zeros((2, 31)), np.full((1, 32), np.nan), np.full((1, 32), np.inf)):
    with pytest.raises(ValueError, match="expert"):
      mxfp4.quantize(bad, name="expert")


def test_quantize_is_exact_on_mxfp4_data():
  rng = np.random.default_rng(0)
  codes = rng.integers(0, 16, size=(64, 256), dtype=np.uint8)
  scales = rng.integers(100, 150, size=(64, 8), dtype=np.uint8)
  w = mxfp4.dequantize_np(mxfp4.pack_codes_np(codes), scales)
  p2, s2 = mxfp4.quantize(w)
  np.testing.assert_array_equal(mxfp4.dequantize_np(p2, s2), w)  # values always, incl. -0.0 signs
  assert np.array_equal(np.signbit(mxfp4.dequantize_np(p2, s2)), np.signbit(w))
  # bytes too where the block's largest |code| is 4 or 6 (what a fresh quantisation produces)
  canon = np.isin(np.max(codes.reshape(64, 8, 32) & 7, -1), (6, 7))
  assert canon.mean() > 0.9
  np.testing.assert_array_equal(s2[canon], scales[canon])
  c2 = mxfp4.unpack_codes_np(p2).reshape(64, 8, 32)
  np.testing.assert_array_equal(c2[canon], codes.reshape(64, 8, 32)[canon])
  # bf16 inputs (what an exported model holds) quantise the same
  p3, s3 = mxfp4.quantize(w.astype(ml_dtypes.bfloat16))
  np.testing.assert_array_equal(p3, p2) and np.testing.assert_array_equal(s3, s2)


def test_matmul_dequantises_inside():
  rng = np.random.default_rng(1)
  w = rng.normal(size=(24, 64)).astype(np.float32)
  p, s = mxfp4.quantize(w)
  x = rng.normal(size=(5, 64)).astype(np.float32)
  got = jax.jit(lambda x, p, s: mxfp4.matmul(x, p, s, jnp.float32))(x, p, s)
  np.testing.assert_allclose(np.asarray(got), x @ mxfp4.dequantize_np(p, s).T, rtol=1e-5, atol=1e-5)
  assert mxfp4.nbytes((24, 64)) == p.nbytes + s.nbytes


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32, np.float16])
def test_table_decode_is_bit_identical_to_the_formula(dtype):
  """The import's pair-table path against the defining float32 formula, all 256 bytes under every scale byte (shuffled blocks)."""
  rng = np.random.default_rng(1)
  packed = np.tile(np.arange(256, dtype=np.uint8), 256).reshape(-1, 16)  # every byte, 4096 blocks
  scales = rng.permutation(np.repeat(np.arange(256, dtype=np.uint8), 16)).reshape(-1, 1)
  with np.errstate(over="ignore"):
    want = mxfp4._dequantize_np_formula(packed, scales, dtype, 32)
  got = mxfp4.dequantize_np(packed, scales, dtype, chunk_bytes=1000)  # several chunks
  assert got.dtype == np.dtype(dtype) and got.shape == (4096, 32)
  assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32, np.float16])
def test_transposed_decode_and_its_sum_are_exact(dtype):
  """dequantize_np_t (the import's expert path): W.T bit for bit as dequantize_np gives W, for row
  tiles that do or do not divide the rows, one thread or two; sum |W| from the index histogram equals
  the float64 sum of the decoded values, with scale 0 (subnormals), an overflow to inf (dtype's range)
  and -0 in it."""
  rng = np.random.default_rng(5)
  packed = rng.integers(0, 256, (300, 32), dtype=np.uint8)
  scales = rng.integers(120, 135, (300, 2), dtype=np.uint8)
  scales[3, 1], scales[7, 0] = 0, 1
  packed[9, :] = 0x88  # -0, -0
  want = mxfp4.dequantize_np(packed, scales, dtype)
  exact = lambda w: float(np.abs(w.astype(np.float64)).sum())
  u = f"u{np.dtype(dtype).itemsize}"
  for rows, threads in ((1, 1), (7, 2), (128, 2), (1000, 1)):
    got, total = mxfp4.dequantize_np_t(packed, scales, dtype, rows=rows, threads=threads)
    assert got.dtype == np.dtype(dtype) and got.flags.c_contiguous and got.shape == (64, 300)
    np.testing.assert_array_equal(got.view(u), np.ascontiguousarray(want.T).view(u))
    assert total == pytest.approx(exact(want), rel=1e-12, abs=0), (rows, threads)
  big = rng.integers(0, 256, (256, 16384), dtype=np.uint8)  # 4 MB: split over the helper thread
  big_s = rng.integers(110, 140, (256, 1024), dtype=np.uint8)
  got, total = mxfp4.dequantize_np_t(big, big_s, dtype)
  np.testing.assert_array_equal(got.view(u), np.ascontiguousarray(mxfp4.dequantize_np(big, big_s, dtype).T).view(u))
  assert total == pytest.approx(exact(got), rel=1e-12)
  scales[5, 0] = 254  # 6 * 2^127 overflows every dtype here: the sum is inf as the decoded values'
  got, total = mxfp4.dequantize_np_t(packed, scales, dtype)
  assert np.isinf(exact(got)) and total == exact(got)
  with pytest.raises(ValueError, match="w1: dequantize_np_t takes one matrix"):
    mxfp4.dequantize_np_t(packed[None], scales[None], dtype, name="w1")
