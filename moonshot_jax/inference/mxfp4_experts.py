"""Routed experts kept in MXFP4 at inference (weight-only 4-bit): serving memory follows the checkpoint.

The released K3 stores the routed experts as MXFP4 (layers/mxfp4.py: 4-bit E2M1 codes, one E8M0
scale per 32 along the contracted axis, 4.25 bits per weight); decoded to bf16 they take 3.8x the
bytes. Here a model's expert leaves (LatentMoE's w_gate / w_up [E, L, F], w_down [E, F, L], scanned
stacks [R, E, ...] too) are held as `MXFP4Experts(packed, scales)` in the hub's own layout
(out x in: packed [..., E, out, in/2], scales [..., E, out, in/32]) and decoded only inside the
expert matmul, one expert's matrix at a time:

  prefill (many tokens)  token-copies sorted by expert into blocks of one expert each (the layout of
                         layers/moe.py's "blocked" path); a loop over the blocks in use decodes that
                         block's expert and multiplies. Transient: one expert's three matrices.
  decode (T*k <= E)      each token's k experts are gathered as MXFP4 bytes and decoded (T*k
                         matrices, as engine.gathered_experts reads them in bf16).

How it plugs in without touching the model: `MXFP4Experts` is a flax `AxisMetadata` box, so
`self.param("w_gate", ...)` in LatentMoE unboxes it to an `MXFP4Weight` -- not a pytree, only
alive inside the layer's apply, with the logical `.shape` flax's shape check compares -- and
`expert_fn` (the hook LatentMoE already has for expert parallelism) receives it. `routed_experts`
below is that expert_fn; the inference engine passes it for a layer whose experts are boxed
(`has_mxfp4`). Forward-only (no VJP): this is a serving path.

`quantize_experts(variables, cfg)` converts a loaded model's expert leaves (host-side, leaf by
leaf). On values that already are MXFP4 (a checkpoint imported from the hub) this is exact:
layers/mxfp4.quantize returns the same values (tests/test_mxfp4.py), and `max_requant_error`
reports it. `bits_per_weight(variables)` is what the memory test checks (4.25).
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from moonshot_jax.config import ModelConfig
from moonshot_jax.layers import mxfp4
from moonshot_jax.layers.ffn import gated_activation
from moonshot_jax.layers.moe import block_size_for

EXPERT_LEAVES = ("w_gate", "w_up", "w_down")


class MXFP4Weight:
  """Unboxed view of an MXFP4 expert stack inside a layer's apply: `.shape` is our logical
  [..., in, out]; `expert(e, dtype)` / `gather(idx, dtype)` decode only the experts asked for."""

  def __init__(self, packed: jax.Array, scales: jax.Array):
    self.packed, self.scales = packed, scales

  @property
  def shape(self) -> tuple[int, ...]:
    p = self.packed.shape
    return tuple(p[:-2]) + (2 * p[-1], p[-2])

  def gather(self, idx, dtype) -> jax.Array:
    """Experts `idx` (any int array) decoded: [*idx.shape, in, out] in `dtype`."""
    w_oi = mxfp4.dequantize(self.packed[idx], self.scales[idx], dtype)
    return jnp.swapaxes(w_oi, -1, -2)


class MXFP4Experts(flax.struct.PyTreeNode, nn.meta.AxisMetadata):
  """The params-tree form: packed uint8 [..., E, out, in/2] and scales uint8 [..., E, out, in/32]."""
  packed: jax.Array
  scales: jax.Array

  def unbox(self) -> MXFP4Weight:
    return MXFP4Weight(self.packed, self.scales)

  def replace_boxed(self, val):
    if not isinstance(val, MXFP4Weight):
      raise TypeError(f"MXFP4Experts holds packed MXFP4 bytes; cannot box a {type(val).__name__}")
    return self.replace(packed=val.packed, scales=val.scales)

  def add_axis(self, index, params):  # no axis names to track: scan slices the children as is
    return self

  def remove_axis(self, index, params):
    return self

  @property
  def shape(self) -> tuple[int, ...]:
    return self.unbox().shape

  def __getitem__(self, i):  # a leading (stack) index, e.g. one layer of a scanned stack
    return self.replace(packed=self.packed[i], scales=self.scales[i])


def _is_box(x) -> bool:
  return isinstance(x, (MXFP4Experts, nn.Partitioned))


def has_mxfp4(tree: Any) -> bool:
  return any(isinstance(x, MXFP4Experts) for x in jax.tree.leaves(tree, is_leaf=_is_box))


# ---- the expert_fn ------------------------------------------------------------------------------
def routed_experts(x_TL, expert_idx_Tk, expert_w_Tk, w_gate, w_up, w_down, cfg: ModelConfig) -> jax.Array:
  """LatentMoE's expert hook for MXFP4Weight experts: sum_k w_tk E_{idx_tk}(x_t), fp32 [T, L].
  Same numerics as layers.moe.routed_experts (inputs and decoded weights in cfg.dtype, fp32
  accumulation); every MXFP4 value is exact in bf16, so only the summation order differs."""
  for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
    if not isinstance(w, MXFP4Weight):
      raise TypeError(f"mxfp4_experts.routed_experts: {name} is a {type(w).__name__}, not MXFP4 experts")
  t, l = x_TL.shape
  e, _, f = w_gate.shape
  k = expert_idx_Tk.shape[-1]
  if w_up.shape != (e, l, f) or w_down.shape != (e, f, l):
    raise ValueError(f"MXFP4 experts: expected w_gate/w_up [{e},{l},{f}] and w_down [{e},{f},{l}], got "
                     f"{w_gate.shape} / {w_up.shape} / {w_down.shape}")
  dtype = jnp.dtype(cfg.dtype)
  x = x_TL.astype(dtype)
  if t * k <= e:  # decode: gather the T*k experts' bytes, decode them, apply
    mm = lambda spec, a, w: jnp.einsum(spec, a, w, preferred_element_type=jnp.float32)
    h = gated_activation(mm("tl,tklf->tkf", x, w_gate.gather(expert_idx_Tk, dtype)),
                         mm("tl,tklf->tkf", x, w_up.gather(expert_idx_Tk, dtype)), cfg).astype(dtype)
    y_TkL = mm("tkf,tkfl->tkl", h, w_down.gather(expert_idx_Tk, dtype))
  else:
    y_TkL = _blocked(x, expert_idx_Tk, w_gate, w_up, w_down, cfg)
  return jnp.einsum("tkl,tk->tl", y_TkL, expert_w_Tk.astype(jnp.float32))


def _blocked(x_TL, expert_idx_Tk, w_gate, w_up, w_down, cfg) -> jax.Array:
  """Copies sorted by expert into blocks of `bs` rows, one expert per block; a loop over the blocks
  in use decodes the block's expert and runs its MLP. -> y_TkL fp32 (unweighted)."""
  t, l = x_TL.shape
  e, _, f = w_gate.shape
  k = expert_idx_Tk.shape[-1]
  n = t * k
  bs = block_size_for(n, e)
  nb = -(-n // bs) + e  # worst case: every expert's last block partly empty
  dtype = x_TL.dtype
  flat_e = expert_idx_Tk.reshape(-1)
  sizes_E = jnp.bincount(flat_e, length=e).astype(jnp.int32)
  padded_E = -(-sizes_E // bs) * bs
  order = jnp.argsort(flat_e, stable=True)
  e_sorted = flat_e[order]
  rank_sorted = jnp.arange(n, dtype=jnp.int32) - (jnp.cumsum(sizes_E) - sizes_E)[e_sorted]
  dest_sorted = (jnp.cumsum(padded_E) - padded_E)[e_sorted] + rank_sorted
  dest_N = jnp.zeros((n,), jnp.int32).at[order].set(dest_sorted)  # each copy's padded row
  x_nbL = jnp.zeros((nb * bs, l), dtype).at[dest_N].set(jnp.repeat(x_TL, k, axis=0)).reshape(nb, bs, l)
  ends_E = jnp.cumsum(padded_E)
  block_e = jnp.minimum(jnp.sum(ends_E[None, :] <= jnp.arange(nb)[:, None] * bs, axis=1), e - 1)
  n_used = (ends_E[-1] // bs).astype(jnp.int32)

  def body(i, y):
    ei, xb = block_e[i], x_nbL[i]
    dot = lambda a, w: jnp.dot(a, w, preferred_element_type=jnp.float32)
    h = gated_activation(dot(xb, w_gate.gather(ei, dtype)), dot(xb, w_up.gather(ei, dtype)), cfg)
    return y.at[i].set(dot(h.astype(dtype), w_down.gather(ei, dtype)))

  y = jax.lax.fori_loop(0, n_used, body, jnp.zeros((nb, bs, l), jnp.float32))
  return y.reshape(nb * bs, l)[dest_N].reshape(t, k, l)


# ---- conversion and accounting --------------------------------------------------------------------
def _is_expert_path(names: tuple[str, ...]) -> bool:
  return names[-1] in EXPERT_LEAVES and "moe" in names


def _names(kpath) -> tuple[str, ...]:
  return tuple(str(getattr(p, "key", getattr(p, "name", p))) for p in kpath)


def _sharding_like(x, shape) -> jax.sharding.Sharding:
  """The leaf's own split carried over to the hub layout (last two axes swapped); an axis whose
  size the mesh axes no longer divide (in/2, in/32) is replicated instead."""
  sh = getattr(x, "sharding", None)
  if not isinstance(sh, jax.sharding.NamedSharding):
    return sh if sh is not None else jax.sharding.SingleDeviceSharding(jax.devices()[0])
  spec = list(sh.spec) + [None] * (len(shape) - len(sh.spec))
  spec[-1], spec[-2] = spec[-2], spec[-1]
  sizes = dict(zip(sh.mesh.axis_names, sh.mesh.devices.shape))
  for i, ax in enumerate(spec):
    axes = (ax,) if isinstance(ax, str) else tuple(ax or ())
    if shape[i] % int(np.prod([sizes[a] for a in axes] or [1])):
      spec[i] = None
  return jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(*spec))


def quantize_experts(variables: dict, cfg: ModelConfig) -> tuple[dict, dict[str, float]]:
  """{"params", "moe_state"} with every routed-expert leaf replaced by MXFP4Experts (host NumPy
  quantiser, one leaf at a time; the boxes keep the leaf's sharding, see `_sharding_like`). Returns (variables,
  report): report["max_requant_error"] is max |dequant(quant(w)) - w| over all experts -- 0.0 when
  the weights already were MXFP4 values (an imported hub checkpoint)."""
  if not any(f == "moe" for _, f in cfg.layer_kinds):
    raise ValueError("quantize_experts: the model has no MoE layer, so no routed experts to keep in MXFP4")
  worst = 0.0
  count = 0

  def one(kpath, x):
    nonlocal worst, count
    if not _is_expert_path(_names(kpath)):
      return x
    if isinstance(x, MXFP4Experts):
      return x
    box, err = quantize_leaf(x, "/".join(_names(kpath)))
    worst = max(worst, err)
    count += 1
    return box

  params = jax.tree_util.tree_map_with_path(one, variables["params"])
  if count == 0:
    raise ValueError("quantize_experts: found no routed-expert leaf (moe/w_gate, w_up, w_down) in params")
  return dict(variables, params=params), {"max_requant_error": worst, "expert_leaves": count}


def quantize_leaf(x: jax.Array, name: str = "experts") -> tuple[MXFP4Experts, float]:
  """One routed-expert leaf [..., in, out] -> (its MXFP4Experts box, max |requantisation error|)."""
  w = np.asarray(jax.device_get(x), np.float32)
  w_oi = np.swapaxes(w, -1, -2)  # ours [..., in, out] -> the hub's [..., out, in]
  packed, scales = mxfp4.quantize(w_oi, name=name)
  back = mxfp4.dequantize_np(packed, scales, np.float32)
  err = float(np.max(np.abs(back - w_oi))) if w.size else 0.0
  return (MXFP4Experts(jax.device_put(packed, _sharding_like(x, packed.shape)),
                       jax.device_put(scales, _sharding_like(x, scales.shape))), err)


def bits_per_weight(variables_or_params: Any) -> dict[str, float]:
  """Bytes held by the routed experts and by everything else, and bits per expert weight."""
  tree = variables_or_params.get("params", variables_or_params)
  expert_bytes = expert_weights = other_bytes = 0
  for x in jax.tree.leaves(tree, is_leaf=_is_box):
    if isinstance(x, MXFP4Experts):
      expert_bytes += x.packed.nbytes + x.scales.nbytes
      expert_weights += int(np.prod(x.shape))
    else:
      v = x.value if isinstance(x, nn.Partitioned) else x
      other_bytes += v.nbytes
  return {"expert_bytes": expert_bytes, "expert_weights": expert_weights, "other_bytes": other_bytes,
          "expert_bits_per_weight": 8 * expert_bytes / expert_weights if expert_weights else float("nan")}
