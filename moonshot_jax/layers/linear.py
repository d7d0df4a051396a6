"""Activation x weight contractions (`project`) with a hand-written VJP.

  y  = einsum("a,b->c", x, w)           (fp32 accumulation, any einsum spec of two operands in
  dx = einsum("c,b->a", dy, w)           which every index appears in at least two of a, b, c:
  dw = einsum("a,c->b", x, dy)           a matmul with batch / free / contracted indices)

The math is autodiff's; only the operand order differs. Autodiff transposes a dot_general by
contracting the cotangent with the other operand and then transposing the result into place, and
XLA:CPU runs that weight gradient as a transposed-operand dot behind an out-of-cache copy of the
[tokens, features] cotangent. Naming the result's layout in the spec lets it pick its fast path
(timings in WORKSPACE_NOTES).

Inside `jax.shard_map` the operands are first cast to vary over the union of their manual axes
(`layers.varying.same_varying`): the products in the backward vary over both operands' axes, and the
cast's transpose psums each gradient back to its operand's type.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moonshot_jax.layers.varying import same_varying

_F32 = jnp.float32


def _terms(spec: str) -> tuple[str, str, str]:
  ins, _, out = spec.replace(" ", "").partition("->")
  a, _, b = ins.partition(",")
  if not out or not b or "," in b:
    raise ValueError(f"project: expected an explicit two-operand einsum spec 'x,w->y', got {spec!r}")
  if "..." in b or ("..." in a) != ("..." in out):
    raise ValueError(f"project: '...' may stand only for the leading dims of x and y, got {spec!r}")
  letters = [t.replace("...", "") for t in (a, b, out)]
  for ch in set("".join(letters)):
    if sum(ch in t for t in letters) < 2:
      raise ValueError(f"project: index {ch!r} of {spec!r} appears in one operand only (a sum or a "
                       "broadcast, not a contraction)")
  return a, b, out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _contract(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
  return jnp.einsum(spec, x, w, preferred_element_type=_F32)


def _contract_fwd(spec, x, w):
  return _contract(spec, x, w), (x, w)


def contraction_grads(spec: str, x: jax.Array, w: jax.Array, dy: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(dx, dw) of y = einsum(spec, x, w) for the cotangent dy, in the layouts above, each in its
  operand's dtype (also the backward of the LM head, model/loss.py)."""
  a, b, c = _terms(spec)
  dy = dy.astype(x.dtype)  # the forward's compute dtype; accumulation stays fp32
  dx = jnp.einsum(f"{c},{b}->{a}", dy, w, preferred_element_type=_F32)
  dw = jnp.einsum(f"{a},{c}->{b}", x, dy, preferred_element_type=_F32)
  return dx.astype(x.dtype), dw.astype(w.dtype)


def _contract_bwd(spec, res, dy):
  return contraction_grads(spec, *res, dy)


_contract.defvjp(_contract_fwd, _contract_bwd)


def project(spec: str, x: jax.Array, w: jax.Array, dtype=None) -> jax.Array:
  """einsum(spec, x, w) in fp32 accumulation with w cast to `dtype` (default x.dtype) first; x is
  cast too when its dtype differs. Returns fp32."""
  _terms(spec)
  dtype = x.dtype if dtype is None else jnp.dtype(dtype)
  x, w = same_varying(x.astype(dtype), w.astype(dtype))
  return _contract(spec, x, w)
