"""Prefill and one-token decode over a `DecodeCache`, composed from the model's own per-layer pieces.

  prefill(variables, cfg, tokens_BT, segment_ids_BT=None, lengths_B=None, *, max_len=None,
          all_logits=True, mesh=None, strategy="zero1") -> (logits, cache)
      Right-padded prompts: row b is tokens_BT[b, :lengths_B[b]] (default: all T; with segment_ids,
      up to the last non-zero id: 0 marks padding as in the data pipeline). KDA layers run the
      chunked path (`KDA.prefill`, padding leaves the state untouched), MLA layers the full
      causal attention (`MLA.prefill`) whose latents are copied into a [B, max_len, C] buffer.
      segment_ids_BT packs several documents per row (attention and KDA state never cross a
      boundary; RoPE positions restart per document); the cache is that of each row's last document.
      logits: [B, T, V] fp32 (all_logits) or [B, V] at position lengths_B - 1.
      T is padded up to a bucket (`bucket_length`), so one compilation serves many prompt lengths.
  decode_step(variables, cfg, cache, token_B, *, mesh=None, strategy="zero1") -> (logits_BV, cache)
      Appends one token per row: KDA layers take the recurrent step (`KDA.decode`), MLA layers attend
      over the latent cache with W_UK / W_UV absorbed (`MLA.decode`), and the new latent row is
      written at cache.lengths. MoE layers run `decode_experts`: every expert on every token
      (`dense_experts`) when the model has few experts per routed slot, else each token's top-k
      expert weights gathered (`gathered_experts`); same math as the training dispatch either way.
      Rows must have cache.lengths < max_len (checked by `generate`).
  extend(variables, cfg, cache, tokens_BL, n_B=None) -> (logits_BLV, cache)
      Appends n_B[b] more tokens to row b without recomputing its prefix (a scan of the masked
      decode step `decode_body`): multi-turn RL inserts environment observations this way.

`variables` is the model's {"params": ..., "moe_state": ...} (a bare params tree is accepted for
models without MoE layers). The per-layer wiring is the Transformer's: `layer_variables` picks a
layer's weights out of the (possibly scanned) tree and `Block.mixer.run` / `Block.ffn` apply its
sublayers, with the AttnRes carry rebuilt per call (see cache.py for why AttnRes needs no cache).
Layers are unrolled in Python inside one jit (cache entries differ per layer kind).

With a mesh, parameters keep their training shardings (pass them sharded), activations follow the
logical rules of `strategy`, and cache arrays are constrained by logical name (cache.py). Each
(cfg, mesh, strategy, shapes) combination compiles once.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from moonshot_jax.config import ModelConfig
from moonshot_jax.inference import cache as cache_lib
from moonshot_jax.inference import mxfp4_experts
from moonshot_jax.inference.cache import DecodeCache
from moonshot_jax.layers.attn_res import AttnResState
from moonshot_jax.layers.ffn import gated_activation
from moonshot_jax.model.transformer import Transformer, block_for_layer, layer_variables
from moonshot_jax.parallel import rules as rules_lib
from moonshot_jax.vision.multimodal import merge_vision_embeddings

MIN_BUCKET = 16


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------
def bucket_length(n: int, minimum: int = MIN_BUCKET) -> int:
  """Smallest power of two >= max(n, minimum): prompt lengths share compilations."""
  if not (isinstance(n, (int, np.integer)) and n > 0):
    raise ValueError(f"n: expected a positive int, got {n!r}")
  return max(minimum, 1 << (int(n) - 1).bit_length())


def as_variables(variables: Any, cfg: ModelConfig) -> dict:
  """{"params", "moe_state"} from a variables dict or a bare params tree."""
  if isinstance(variables, dict) and "params" in variables:
    out = {"params": variables["params"], "moe_state": variables.get("moe_state", {})}
  else:
    out = {"params": variables, "moe_state": {}}
  has_moe = any(ffn == "moe" for _, ffn in cfg.layer_kinds)
  if has_moe and not out["moe_state"]:
    raise ValueError("variables: the model has MoE layers, so pass {'params': ..., 'moe_state': ...} "
                     "(moe_state holds the routers' balancing biases)")
  return out


def positions_in_segment(segment_ids_BT: jax.Array) -> jax.Array:
  """[B, T] int32: index of each token within its segment (restarts where the id changes)."""
  B, T = segment_ids_BT.shape
  t = jnp.arange(T, dtype=jnp.int32)
  starts = jnp.concatenate([jnp.ones((B, 1), bool), segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], 1)
  start_BT = jax.lax.cummax(jnp.where(starts, t[None, :], 0), axis=1)
  return t[None, :] - start_BT


def _last_segment_start(segment_ids_BT, lengths_B) -> jax.Array:
  """[B]: position where the segment holding token lengths_B - 1 begins."""
  last = jnp.maximum(lengths_B - 1, 0)
  pos = jnp.take_along_axis(positions_in_segment(segment_ids_BT), last[:, None], axis=1)[:, 0]
  return last - pos


def _take_token(carry, idx_B):
  """The carry restricted to one position per row (keeps a length-1 time axis)."""
  def take(x, axis):  # axis = time; the batch axis is the one before it
    shape = [1] * x.ndim
    shape[axis - 1] = idx_B.shape[0]
    return jnp.take_along_axis(x, idx_B.reshape(shape), axis=axis)
  if isinstance(carry, AttnResState):
    return carry.replace(buffer=take(carry.buffer, 2), partial=take(carry.partial, 1))
  return take(carry, 1)


def gathered_experts(x_TL, expert_idx_Tk, expert_w_Tk, w_gate_ELF, w_up_ELF, w_down_EFL, cfg):
  """`routed_experts` for a handful of tokens (decode): gather each token's k experts' weights and
  apply them directly. Reads T·k expert matrices instead of sorting token copies through a
  ragged_dot over all E groups (which on CPU costs ~E small matmuls per call)."""
  dtype = jnp.dtype(cfg.dtype)
  x = x_TL.astype(dtype)
  mm = lambda spec, a, w: jnp.einsum(spec, a, w.astype(dtype), preferred_element_type=jnp.float32)
  h = gated_activation(mm("tl,tklf->tkf", x, w_gate_ELF[expert_idx_Tk]),
                       mm("tl,tklf->tkf", x, w_up_ELF[expert_idx_Tk]), cfg).astype(dtype)
  y_TkL = mm("tkf,tkfl->tkl", h, w_down_EFL[expert_idx_Tk])
  return jnp.einsum("tkl,tk->tl", y_TkL, expert_w_Tk.astype(jnp.float32)).astype(x_TL.dtype)


def dense_experts(x_TL, expert_idx_Tk, expert_w_Tk, w_gate_ELF, w_up_ELF, w_down_EFL, cfg):
  """`routed_experts` computed for every (token, expert) pair, unselected experts weighted 0: three
  plain matmuls over the E stacked experts, no per-token weight gather."""
  dtype = jnp.dtype(cfg.dtype)
  x = x_TL.astype(dtype)
  mm = lambda spec, a, w: jnp.einsum(spec, a, w.astype(dtype), preferred_element_type=jnp.float32)
  h_TEF = gated_activation(mm("tl,elf->tef", x, w_gate_ELF), mm("tl,elf->tef", x, w_up_ELF), cfg).astype(dtype)
  y_TEL = mm("tef,efl->tel", h_TEF, w_down_EFL)
  onehot_TkE = jax.nn.one_hot(expert_idx_Tk, w_gate_ELF.shape[0], dtype=jnp.float32)
  w_TE = jnp.einsum("tk,tke->te", expert_w_Tk.astype(jnp.float32), onehot_TkE)  # exact: one nonzero per (t, e)
  return jnp.einsum("tel,te->tl", y_TEL, w_TE).astype(x_TL.dtype)


# Dense is used while E <= DENSE_EXPERTS_MAX_RATIO * k: it computes E / k times the gathered FLOPs but
# reads each expert matrix once, where the gather copies T * k matrices per step. Session 16 (tiny agent
# model, E = 8, k = 2, B = 64, XLA:CPU): the gathers' copies were the largest thunks of the decode step
# (~0.45 ms of ~2.6 ms); K3-sized routing (E / k = 48) keeps the gather. The choice must not depend on
# the number of tokens: the two paths round differently, and a row's logits must not depend on which
# rows share its decode call (rl/rollout.py's working sets change size from call to call).
DENSE_EXPERTS_MAX_RATIO = 4


def decode_experts(x_TL, expert_idx_Tk, expert_w_Tk, w_gate_ELF, w_up_ELF, w_down_EFL, cfg):
  """The decode step's expert_fn: `dense_experts` or `gathered_experts` by the model's E / k (above)."""
  k = expert_idx_Tk.shape[1]
  E = w_gate_ELF.shape[0]
  fn = dense_experts if E <= DENSE_EXPERTS_MAX_RATIO * k else gathered_experts
  return fn(x_TL, expert_idx_Tk, expert_w_Tk, w_gate_ELF, w_up_ELF, w_down_EFL, cfg)


def _context(mesh, strategy):
  if mesh is None:
    return contextlib.nullcontext()
  stack = contextlib.ExitStack()
  stack.enter_context(jax.set_mesh(mesh))
  stack.enter_context(nn.logical_axis_rules(rules_lib.logical_axis_rules(strategy)))
  return stack


def _run_block(block, carry, op_fn, layer: int, token_mask_BT):
  carry, extra = block.mixer.run(carry, op_fn)
  carry, _ = block.ffn(carry, layer, token_mask_BT)
  return carry, extra


def _layer(variables, cfg: ModelConfig, layer: int, carry, op_fn, token_mask_BT=None, expert_fn=None):
  lv = layer_variables(variables, cfg, layer)
  if mxfp4_experts.has_mxfp4(lv.get("params", {})):  # routed experts kept in MXFP4 (serving)
    expert_fn = mxfp4_experts.routed_experts
  return nn.apply(_run_block, block_for_layer(cfg, layer, expert_fn))(lv, carry, op_fn, layer, token_mask_BT)


# ---------------------------------------------------------------------------------------------
# Jitted implementations (cfg, mesh, strategy and sizes are static)
# ---------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("cfg", "max_len", "all_logits", "mesh", "strategy"))
def _prefill_impl(variables, tokens_BT, segment_ids_BT, lengths_B, image_mask_BT=None, vision_MD=None, *, cfg, max_len,
                  all_logits, mesh, strategy):
  del mesh, strategy  # static only to key the compilation cache; the context is set by the caller
  model = Transformer(cfg)
  B, T = tokens_BT.shape
  positions_BT = positions_in_segment(segment_ids_BT)
  token_mask_BT = jnp.arange(T)[None, :] < lengths_B[:, None]
  start_B = _last_segment_start(segment_ids_BT, lengths_B)
  n_B = (lengths_B - start_B).astype(jnp.int32)  # tokens of the last document
  x = model.apply(variables, tokens_BT, method="embed")
  if vision_MD is not None:  # image placeholders take the vision tower's tokens (vision/multimodal.py)
    x = merge_vision_embeddings(x, image_mask_BT, vision_MD)
  carry = model.apply(variables, x, method="init_carry")
  entries = []
  for layer, (mixer, _) in enumerate(cfg.layer_kinds):
    if mixer == "kda":
      op_fn = lambda m, h: m.prefill(h, segment_ids_BT, lengths_B)
    else:
      op_fn = lambda m, h: m.prefill(h, segment_ids_BT, positions_BT)
    carry, extra = _layer(variables, cfg, layer, carry, op_fn, token_mask_BT)
    if mixer == "kda":
      entries.append(extra)
    else:  # rows [start, lengths) of the last document -> rows [0, n) of the buffer
      s_S = jnp.arange(max_len)
      src_BS = jnp.clip(start_B[:, None] + s_S[None, :], 0, T - 1)
      lat = jnp.take_along_axis(extra, src_BS[..., None], axis=1)
      entries.append({"latent": jnp.where((s_S[None, :] < n_B[:, None])[..., None], lat, 0).astype(extra.dtype)})
  cache = cache_lib.constrain(DecodeCache(layers=tuple(entries), lengths=n_B))
  if not all_logits:
    carry = _take_token(carry, jnp.maximum(lengths_B - 1, 0))
  logits = model.apply(variables, carry, method="head")
  return (logits if all_logits else logits[:, 0]), cache


def decode_body(variables, cache: DecodeCache, token_B, valid_B=None, *, cfg):
  """Traceable one-token step (no jit, no checks): rows with valid_B False keep their cache entries
  and length (their logits are computed and meaningless). For loops written inside a jit."""
  model = Transformer(cfg)
  B = token_B.shape[0]
  lengths_B = cache.lengths
  x = model.apply(variables, token_B[:, None], method="embed")
  carry = model.apply(variables, x, method="init_carry")
  entries = []
  for layer, ((mixer, _), entry) in enumerate(zip(cfg.layer_kinds, cache.layers)):
    if mixer == "kda":
      carry, new_entry = _layer(variables, cfg, layer, carry, lambda m, h: m.decode(h, entry),
                                expert_fn=decode_experts)
      if valid_B is not None:  # a skipped row's recurrent state must not move
        new_entry = {k: jnp.where(valid_B.reshape((B,) + (1,) * (v.ndim - 1)), v, entry[k])
                     for k, v in new_entry.items()}
    else:
      latent = entry["latent"]
      # the layer writes the new row first (in place in a carried cache); a skipped row writes out of
      # bounds, which is discarded
      at = lengths_B if valid_B is None else jnp.where(valid_B, lengths_B, latent.shape[1])
      carry, new_latent = _layer(variables, cfg, layer, carry,
                                 lambda m, h: m.decode(h, latent, lengths_B, lengths_B[:, None], write_at_B=at),
                                 expert_fn=decode_experts)
      new_entry = {"latent": new_latent}
    entries.append(new_entry)
  logits = model.apply(variables, carry, method="head")[:, 0]
  step_B = 1 if valid_B is None else valid_B.astype(lengths_B.dtype)
  new_cache = cache_lib.constrain(DecodeCache(layers=tuple(entries), lengths=lengths_B + step_B))
  return logits, new_cache


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "strategy"), donate_argnames=("cache",))
def _decode_impl(variables, cache: DecodeCache, token_B, *, cfg, mesh, strategy):
  del mesh, strategy
  return decode_body(variables, cache, token_B, cfg=cfg)


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "strategy"), donate_argnames=("cache",))
def _extend_impl(variables, cache: DecodeCache, tokens_BL, n_B, *, cfg, mesh, strategy):
  del mesh, strategy

  def body(c, xs):
    tok_B, t = xs
    logits_BV, c = decode_body(variables, c, tok_B, t < n_B, cfg=cfg)
    return c, logits_BV

  L = tokens_BL.shape[1]
  cache, logits_LBV = jax.lax.scan(body, cache, (tokens_BL.T, jnp.arange(L, dtype=jnp.int32)))
  return jnp.swapaxes(logits_LBV, 0, 1), cache


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------
def _check_tokens(tokens_BT, cfg: ModelConfig) -> None:
  if getattr(tokens_BT, "ndim", None) != 2 or not jnp.issubdtype(tokens_BT.dtype, jnp.integer):
    raise ValueError(f"tokens: expected an integer [B, T] array, got {getattr(tokens_BT, 'dtype', None)}"
                     f"{getattr(tokens_BT, 'shape', None)}")
  if tokens_BT.shape[1] == 0:
    raise ValueError("tokens: expected at least one token per row, got T = 0")


def prefill(variables, cfg: ModelConfig, tokens, segment_ids=None, lengths=None, *, max_len: int | None = None,
            all_logits: bool = True, mesh=None, strategy: str = "zero1", image_mask=None,
            vision_MD=None) -> tuple[jax.Array, DecodeCache]:
  """See the module docstring. max_len (cache rows, default cfg.max_seq_len) must be >= T.
  image_mask [B, T] bool + vision_MD [M, d_model]: the embeddings at the mask's positions are the
  vision tower's tokens, in row-major order (both or neither; counts checked by the caller)."""
  tokens = jnp.asarray(tokens)
  _check_tokens(tokens, cfg)
  B, T = tokens.shape
  if (image_mask is None) != (vision_MD is None):
    raise ValueError("image_mask and vision_MD: pass both or neither")
  if image_mask is not None and np.shape(image_mask) != (B, T):
    raise ValueError(f"image_mask: expected shape {(B, T)}, got {np.shape(image_mask)}")
  if segment_ids is not None:
    segment_ids = jnp.asarray(segment_ids)
    if segment_ids.shape != (B, T) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"segment_ids: expected an integer array of shape {(B, T)}, got "
                       f"{segment_ids.dtype}{segment_ids.shape}")
  if lengths is None and segment_ids is not None:  # 0 marks padding, as in the data pipeline
    nonpad = np.asarray(segment_ids) != 0
    lengths = jnp.asarray(np.where(nonpad.any(1), T - np.argmax(nonpad[:, ::-1], axis=1), T), jnp.int32)
  if lengths is None:
    lengths = jnp.full((B,), T, jnp.int32)
  else:
    lengths = jnp.asarray(lengths)
    if lengths.shape != (B,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
      raise ValueError(f"lengths: expected an integer array of shape {(B,)}, got {lengths.dtype}{lengths.shape}")
    lo, hi = int(jnp.min(lengths)), int(jnp.max(lengths))
    if lo < 1 or hi > T:
      raise ValueError(f"lengths: expected values in [1, T={T}], got min {lo}, max {hi}")
  max_len = cfg.max_seq_len if max_len is None else max_len
  if not (isinstance(max_len, int) and max_len >= T):
    raise ValueError(f"max_len: expected an int >= the prompt length T={T}, got {max_len!r}")
  Tb = bucket_length(T)
  pad = Tb - T
  tokens_p = jnp.pad(tokens.astype(jnp.int32), ((0, 0), (0, pad)))
  if segment_ids is None:
    seg_p = jnp.zeros((B, Tb), jnp.int32)
  else:  # padding continues the last id: no spurious segment start inside the pad
    seg_p = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, pad)), mode="edge")
  with _context(mesh, strategy):  # logical rules are read while tracing: set them outside the jit
    mask_p = None if image_mask is None else jnp.pad(jnp.asarray(image_mask, bool), ((0, 0), (0, pad)))
    logits, cache = _prefill_impl(as_variables(variables, cfg), tokens_p, seg_p, lengths.astype(jnp.int32),
                                  mask_p, vision_MD, cfg=cfg, max_len=max_len, all_logits=all_logits, mesh=mesh,
                                  strategy=strategy)
  return (logits[:, :T] if all_logits else logits), cache


def decode_step(variables, cfg: ModelConfig, cache: DecodeCache, token, *, mesh=None,
                strategy: str = "zero1") -> tuple[jax.Array, DecodeCache]:
  """One token per row -> (logits_BV fp32, the advanced cache). The input cache is donated."""
  cache_lib.check_cache(cache, cfg)
  token = jnp.asarray(token)
  B = cache.batch_size
  if token.shape != (B,) or not jnp.issubdtype(token.dtype, jnp.integer):
    raise ValueError(f"token: expected an integer array of shape {(B,)}, got {token.dtype}{token.shape}")
  with _context(mesh, strategy):
    return _decode_impl(as_variables(variables, cfg), cache, token.astype(jnp.int32), cfg=cfg, mesh=mesh,
                        strategy=strategy)


def extend(variables, cfg: ModelConfig, cache: DecodeCache, tokens, n=None, *, mesh=None,
           strategy: str = "zero1") -> tuple[jax.Array, DecodeCache]:
  """Appends tokens_BL[b, :n_B[b]] to row b's cache (n default: all L) WITHOUT recomputing the prefix:
  a scan of the masked decode step, so the KDA state and MLA latents continue exactly where they
  stand (multi-turn RL: an environment observation after the sampled action). Returns
  (logits [B, L, V] fp32, valid at t < n_B, and the cache). L is padded to a bucket (one
  compilation per bucket); the input cache is donated. Rows with n_B = 0 are left untouched."""
  cache_lib.check_cache(cache, cfg)
  tokens = jnp.asarray(tokens)
  _check_tokens(tokens, cfg)
  B, L = tokens.shape
  if B != cache.batch_size:
    raise ValueError(f"tokens: expected {cache.batch_size} rows (the cache's batch), got {B}")
  n = jnp.full((B,), L, jnp.int32) if n is None else jnp.asarray(n, jnp.int32)
  if n.shape != (B,):
    raise ValueError(f"n: expected shape {(B,)}, got {n.shape}")
  nn_ = np.asarray(n)
  if nn_.min() < 0 or nn_.max() > L:
    raise ValueError(f"n: expected values in [0, L={L}], got min {nn_.min()}, max {nn_.max()}")
  if cache.max_len and int(np.max(np.asarray(cache.lengths) + nn_)) > cache.max_len:
    raise ValueError(f"extend: a row would exceed the cache's max_len={cache.max_len}")
  Lb = bucket_length(L, minimum=1)
  tokens = jnp.pad(tokens.astype(jnp.int32), ((0, 0), (0, Lb - L)))
  with _context(mesh, strategy):
    logits, cache = _extend_impl(as_variables(variables, cfg), cache, tokens, n, cfg=cfg, mesh=mesh,
                                 strategy=strategy)
  return logits[:, :L], cache
