"""The K3 decoder stack: embedding -> hybrid KDA / MLA layers -> final norm -> LM head.

Layer l (0-indexed) is a mixer sublayer (MLA if l + 1 in cfg.mla_layers, else KDA) then an FFN
sublayer (DenseFFN(cfg.dense_ff_dim) if l + 1 in cfg.dense_layers, else LatentMoE). The value that
flows between sublayers, the *carry*, is
  * cfg.attn_res:  an `AttnResState` (embedding + block sums + partial sum, static shapes); each
    sublayer reads its input from its own AttnRes mixing site, x = mix(state), then adds
    y = f(RMSNorm(x)) as a new source; a final site feeds the output norm.
  * otherwise:     the fp32 residual stream x_BTD; each sublayer does x + f(RMSNorm(x)).

Parameter tree ("params"; "moe_state" mirrors it for the MoE balancing bias):
  embedding [vocab, d] ("vocab", "embed");  lm_head [d, vocab] ("embed", "vocab") unless tied;
  final_norm/scale; final_site/query (AttnRes only);
  layer_{i}/{mixer,ffn}/...         an unrolled layer i (0-indexed);
  layers_{a}_{b}/layer_{j}/...      layers [a, b) scanned with `nn.scan` as (b - a) / p repeats of
                                    a p-layer unit; leaves get a leading [repeats] axis ("layers"),
                                    unit member j is global layer a + r * p + j.
  A sublayer holds site/query (AttnRes), norm/scale and its op: mixer/kda | mixer/mla,
  ffn/dense | ffn/moe. `layer_plan(cfg)` scans the longest run of >= 2 identical units and treats
  what is left on each side the same way (K3: layer 1 unrolled, 22 x [KDA, KDA, MLA, KDA] over
  layers 2..89, 2 x [KDA] and 2 x [MLA]); cfg.scan_layers=False unrolls every layer.

Pieces for pipeline stages and inference (all share the parameters; call them through
`model.apply(variables, ..., method=...)` or, per layer, on `layer_variables(...)`):
  Transformer.embed(tokens_BT) -> x_BTD (cfg.dtype)
  Transformer.init_carry(x_BTD) -> carry
  Transformer.apply_layers(carry, start, end, segment_ids_BT, positions_BT, token_mask_BT)
      -> (carry, aux): layers [start, end); a range may not cut through a scanned segment
      (`segment_bounds(cfg)` lists the legal cut points; cfg.scan_layers=False makes all legal).
  Transformer.head(carry) -> logits_BTV fp32 (final AttnRes site, final norm, LM head)
  Transformer.head_stats(carry, targets_BT) -> per-token lse / target logit / correct, chunked
  Block(cfg, mixer_kind, ffn_kind, expert_fn) — one layer, params {"mixer": ..., "ffn": ...}
  (`block_for_layer(cfg, layer)` builds the right one):
      __call__(carry, layer_idx, segment_ids_BT, positions_BT, token_mask_BT) -> (carry, aux | None)
      (layer_idx may be traced: it decides where AttnRes blocks end). Its sublayers are
      MixerSublayer.run(carry, op_fn) -> (carry, extra) with op_fn(bound KDA/MLA module, h_BTD)
      -> (y_BTD, extra), e.g. `lambda m, h: m.prefill(h)` to get a layer's cache, and
      FFNSublayer(carry, layer_idx, token_mask_BT) -> (carry, aux | None).
  layer_variables / unstack_layers / stack_layers: per-layer variables <-> the model tree.

aux (from __call__ / apply_layers): the MoE statistics stacked in layer order with a leading
[n_moe_layers] axis: "aux_loss" [L], "counts" [L, E], "hist" [L, E, bins], "load_max_over_mean"
[L], "load_entropy" [L]; {} when no MoE layer is in range. MoE statistics skip padding tokens:
token_mask_BT defaults to segment_ids_BT != 0 (the data pipeline's padding id), else all tokens.

Remat: each layer is wrapped in `nn.remat` with the policy named by cfg.remat_policy (`REMAT_POLICIES`).
Memory note: a scanned unit saves its input carry for the backward pass, i.e. with AttnRes the
[N_slots, B, T, D] source buffer once per unit (K3: 27 carries for 93 layers).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from moonshot_jax.config import ModelConfig
from moonshot_jax.layers import attn_res
from moonshot_jax.layers.ffn import DenseFFN
from moonshot_jax.layers.kda import KDA
from moonshot_jax.layers.mla import MLA
from moonshot_jax.layers.moe import LatentMoE
from moonshot_jax.layers.norms import RMSNorm
from moonshot_jax.model.loss import head_logits, head_token_stats

Carry = Any  # AttnResState (cfg.attn_res) or the fp32 residual stream [B, T, D]
Kinds = tuple[tuple[str, str], ...]
_ACT = ("act_batch", "act_length", "act_embed")

# cfg.remat_policy -> jax.checkpoint policy (None: no remat at all; "full" saves nothing).
REMAT_POLICIES: dict[str, Any] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_attn_out": jax.checkpoint_policies.save_only_these_names("mixer_out"),
}


# ---------------------------------------------------------------------------------------------
# Layer plan: which layers are scanned
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Segment:
  start: int  # first layer, 0-indexed
  unit: Kinds  # (mixer, ffn) per layer of the repeating unit
  repeats: int
  scanned: bool

  @property
  def end(self) -> int:
    return self.start + len(self.unit) * self.repeats

  @property
  def name(self) -> str:
    return f"layers_{self.start}_{self.end}" if self.scanned else f"layer_{self.start}"


def _best_run(kinds: Kinds, lo: int, hi: int) -> tuple[int, int, int] | None:
  """(start, period, repeats) of the run of >= 2 identical units covering most layers of [lo, hi);
  ties go to the shorter unit, then the earlier start."""
  best, best_key = None, None
  for p in range(1, (hi - lo) // 2 + 1):
    for s in range(lo, hi - 2 * p + 1):
      r = 1
      while s + (r + 1) * p <= hi and kinds[s + r * p:s + (r + 1) * p] == kinds[s:s + p]:
        r += 1
      key = (r * p, -p, -s)
      if r >= 2 and (best_key is None or key > best_key):
        best, best_key = (s, p, r), key
  return best


@functools.lru_cache(maxsize=64)
def layer_plan(cfg: ModelConfig) -> tuple[Segment, ...]:
  """Contiguous segments covering layers 0..n_layers-1 (unrolled single layers or one scan each)."""
  kinds = cfg.layer_kinds

  def plan(lo: int, hi: int) -> list[Segment]:
    run = _best_run(kinds, lo, hi) if cfg.scan_layers else None
    if run is None:
      return [Segment(i, (kinds[i],), 1, False) for i in range(lo, hi)]
    start, period, repeats = run
    return (plan(lo, start) + [Segment(start, kinds[start:start + period], repeats, True)]
            + plan(start + period * repeats, hi))

  return tuple(plan(0, cfg.n_layers))


def segment_bounds(cfg: ModelConfig) -> tuple[int, ...]:
  """Layer indices where `apply_layers` ranges may start or end."""
  return tuple(sorted({0} | {seg.end for seg in layer_plan(cfg)}))


# ---------------------------------------------------------------------------------------------
# Sublayers and layers
# ---------------------------------------------------------------------------------------------
def _add(carry: Carry, y_BTD: jax.Array, cfg: ModelConfig, block_end) -> Carry:
  if cfg.attn_res:
    return attn_res.add_output(carry, y_BTD, cfg, block_end)
  return carry + y_BTD.astype(carry.dtype)


class MixerSublayer(nn.Module):
  """[AttnRes site ->] RMSNorm -> KDA | MLA -> add to the carry."""
  cfg: ModelConfig
  kind: str  # "kda" | "mla"

  def setup(self) -> None:
    cfg = self.cfg
    if cfg.attn_res:
      self.site = attn_res.AttnResMix(cfg)
    self.norm = RMSNorm(eps=cfg.norm_eps, dtype=jnp.dtype(cfg.dtype))
    if self.kind == "kda":
      self.kda = KDA(cfg)
    elif self.kind == "mla":
      self.mla = MLA(cfg)
    else:
      raise ValueError(f"kind: expected 'kda' or 'mla', got {self.kind!r}")

  @property
  def op(self) -> nn.Module:
    return self.kda if self.kind == "kda" else self.mla

  def run(self, carry: Carry, op_fn: Callable[[nn.Module, jax.Array], tuple[jax.Array, Any]]):
    """`op_fn(op, h_BTD) -> (y_BTD, extra)` runs the bound KDA/MLA module (its __call__, prefill,
    decode, ...); returns (new carry, extra)."""
    x = self.site(carry) if self.cfg.attn_res else carry
    y, extra = op_fn(self.op, self.norm(x))
    y = checkpoint_name(y, "mixer_out")  # for remat_policy="save_attn_out"
    return _add(carry, y, self.cfg, False), extra

  def __call__(self, carry: Carry, segment_ids_BT=None, positions_BT=None) -> Carry:
    if self.kind == "kda":
      op_fn = lambda m, h: (m(h, segment_ids_BT), None)
    else:
      op_fn = lambda m, h: (m(h, segment_ids_BT, positions_BT), None)
    return self.run(carry, op_fn)[0]


class FFNSublayer(nn.Module):
  """[AttnRes site ->] RMSNorm -> DenseFFN | LatentMoE -> add; completes an AttnRes block at its end."""
  cfg: ModelConfig
  kind: str  # "dense" | "moe"
  expert_fn: Callable | None = None

  def setup(self) -> None:
    cfg = self.cfg
    if cfg.attn_res:
      self.site = attn_res.AttnResMix(cfg)
    self.norm = RMSNorm(eps=cfg.norm_eps, dtype=jnp.dtype(cfg.dtype))
    if self.kind == "dense":
      self.dense = DenseFFN(cfg, cfg.dense_ff_dim, activation=cfg.dense_activation)
    elif self.kind == "moe":
      self.moe = LatentMoE(cfg, expert_fn=self.expert_fn)
    else:
      raise ValueError(f"kind: expected 'dense' or 'moe', got {self.kind!r}")

  def __call__(self, carry: Carry, layer_idx, token_mask_BT=None) -> tuple[Carry, dict | None]:
    cfg = self.cfg
    x = self.site(carry) if cfg.attn_res else carry
    h = self.norm(x)
    if self.kind == "dense":
      y, aux = self.dense(h), None
    else:
      y, aux = self.moe(h, token_mask_BT)
    return _add(carry, y, cfg, attn_res.is_block_end(layer_idx, cfg)), aux


class Block(nn.Module):
  """One decoder layer: params {"mixer": ..., "ffn": ...}."""
  cfg: ModelConfig
  mixer_kind: str  # "kda" | "mla"
  ffn_kind: str  # "dense" | "moe"
  expert_fn: Callable | None = None

  def setup(self) -> None:
    self.mixer = MixerSublayer(self.cfg, self.mixer_kind)
    self.ffn = FFNSublayer(self.cfg, self.ffn_kind, self.expert_fn)

  def __call__(self, carry: Carry, layer_idx, segment_ids_BT=None, positions_BT=None,
               token_mask_BT=None) -> tuple[Carry, dict | None]:
    carry = self.mixer(carry, segment_ids_BT, positions_BT)
    return self.ffn(carry, layer_idx, token_mask_BT)


def _block_class(cfg: ModelConfig, in_scan: bool) -> type[nn.Module]:
  if cfg.remat_policy == "none":
    return Block
  # inside a scan the loop already blocks CSE across iterations, so prevent_cse only costs speed
  return nn.remat(Block, policy=REMAT_POLICIES[cfg.remat_policy], prevent_cse=not in_scan)


def _stack_aux(auxes: Sequence[dict]) -> dict:
  return jax.tree.map(lambda *xs: jnp.stack(xs), *auxes) if auxes else {}


def _concat_aux(auxes: Sequence[dict]) -> dict:
  auxes = [a for a in auxes if a]
  return jax.tree.map(lambda *xs: jnp.concatenate(xs), *auxes) if auxes else {}


class _Unit(nn.Module):
  """The repeating unit of a scanned segment; scan body (carry, first_layer, ...) -> (carry, aux)."""
  cfg: ModelConfig
  unit: Kinds
  expert_fn: Callable | None = None

  @nn.compact
  def __call__(self, carry, first_layer, segment_ids_BT, positions_BT, token_mask_BT):
    block_cls = _block_class(self.cfg, in_scan=True)
    auxes = []
    for j, (mixer, ffn) in enumerate(self.unit):
      carry, aux = block_cls(self.cfg, mixer, ffn, self.expert_fn, name=f"layer_{j}")(
          carry, first_layer + j, segment_ids_BT, positions_BT, token_mask_BT)
      if aux is not None:
        auxes.append(aux)
    return carry, _stack_aux(auxes)


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------
def _check_ids(x, shape, name: str) -> None:
  if x is None:
    return
  if tuple(x.shape) != tuple(shape) or not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name}: expected an integer array of shape {tuple(shape)}, got {x.dtype}{tuple(x.shape)}")


class Transformer(nn.Module):
  """The full model; see the module docstring for the pieces and the parameter layout."""
  cfg: ModelConfig
  expert_fn: Callable | None = None  # passed to every LatentMoE (expert parallelism)

  def setup(self) -> None:
    cfg = self.cfg
    pdt = jnp.dtype(cfg.param_dtype)
    init = nn.initializers.normal(cfg.init_std)
    self.embedding = self.param("embedding", nn.with_logical_partitioning(init, ("vocab", "embed")),
                                (cfg.vocab_size, cfg.d_model), pdt)
    if not cfg.tie_embeddings:
      self.lm_head = self.param("lm_head", nn.with_logical_partitioning(init, ("embed", "vocab")),
                                (cfg.d_model, cfg.vocab_size), pdt)
    if cfg.attn_res:
      self.final_site = attn_res.AttnResMix(cfg)
    self.final_norm = RMSNorm(eps=cfg.norm_eps, dtype=jnp.dtype(cfg.dtype))
    self.plan = layer_plan(cfg)
    for seg in self.plan:
      if seg.scanned:
        scan_cls = nn.scan(_Unit, variable_axes={"params": 0, "moe_state": 0},
                           split_rngs={"params": True},
                           in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
                           length=seg.repeats, metadata_params={nn.PARTITION_NAME: "layers"})
        setattr(self, seg.name, scan_cls(cfg, seg.unit, self.expert_fn))
      else:
        (mixer, ffn), = seg.unit
        setattr(self, seg.name, _block_class(cfg, in_scan=False)(cfg, mixer, ffn, self.expert_fn))

  # -- pieces ------------------------------------------------------------------------------------
  def embed(self, tokens_BT: jax.Array) -> jax.Array:
    if tokens_BT.ndim != 2 or not jnp.issubdtype(tokens_BT.dtype, jnp.integer):
      raise ValueError(f"tokens_BT: expected an integer array [B, T], got {tokens_BT.dtype}{tokens_BT.shape}")
    x = jnp.take(self.embedding, tokens_BT, axis=0).astype(jnp.dtype(self.cfg.dtype))
    return nn.with_logical_constraint(x, _ACT)

  def init_carry(self, x_BTD: jax.Array) -> Carry:
    if self.cfg.attn_res:
      return attn_res.AttnResState.init(x_BTD, self.cfg)
    return x_BTD.astype(jnp.float32)

  def apply_layers(self, carry: Carry, start: int, end: int, segment_ids_BT=None, positions_BT=None,
                   token_mask_BT=None) -> tuple[Carry, dict]:
    """Layers [start, end) (static ints on segment bounds); returns (carry, aux of their MoE layers)."""
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= self.cfg.n_layers):
      raise ValueError(f"start, end: expected ints with 0 <= start <= end <= {self.cfg.n_layers}, "
                       f"got {start!r}, {end!r}")
    bounds = segment_bounds(self.cfg)
    for name, v in (("start", start), ("end", end)):
      if v not in bounds:
        raise ValueError(f"{name}: layer {v} is inside a scanned segment; valid bounds are {bounds} "
                         f"(or set scan_layers=False)")
    x_ref = carry.partial if self.cfg.attn_res else carry
    B, T = x_ref.shape[:2]
    _check_ids(segment_ids_BT, (B, T), "segment_ids_BT")
    _check_ids(positions_BT, (B, T), "positions_BT")
    if token_mask_BT is None:
      token_mask_BT = (segment_ids_BT != 0) if segment_ids_BT is not None else jnp.ones((B, T), bool)
    elif token_mask_BT.shape != (B, T):
      raise ValueError(f"token_mask_BT: expected shape {(B, T)}, got {token_mask_BT.shape}")
    auxes = []
    for seg in self.plan:
      if seg.end <= start or seg.start >= end:
        continue
      module = getattr(self, seg.name)
      if seg.scanned:
        firsts = seg.start + len(seg.unit) * jnp.arange(seg.repeats, dtype=jnp.int32)
        carry, aux = module(carry, firsts, segment_ids_BT, positions_BT, token_mask_BT)
        auxes.append(jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), aux))  # [R, m] -> layer order
      else:
        carry, aux = module(carry, jnp.int32(seg.start), segment_ids_BT, positions_BT, token_mask_BT)
        if aux is not None:
          auxes.append(jax.tree.map(lambda a: a[None], aux))
    return carry, _concat_aux(auxes)

  def _head_input(self, carry: Carry) -> tuple[jax.Array, jax.Array, bool]:
    """(final-normed hidden h_BTD, head weight, vocab_major): logits = h @ w (w [V, D] if tied)."""
    cfg = self.cfg
    x = self.final_site(carry) if cfg.attn_res else carry
    h = self.final_norm(x)
    return (h, self.embedding, True) if cfg.tie_embeddings else (h, self.lm_head, False)

  def head(self, carry: Carry) -> jax.Array:
    h, w, vocab_major = self._head_input(carry)
    return head_logits(h, w, vocab_major=vocab_major, dtype=jnp.dtype(self.cfg.dtype))

  def head_stats(self, carry: Carry, targets_BT: jax.Array) -> dict[str, jax.Array]:
    """Per-token loss statistics (loss.head_token_stats) without materialising [B, T, V] logits."""
    h, w, vocab_major = self._head_input(carry)
    return head_token_stats(h, w, targets_BT, vocab_major=vocab_major, chunk=self.cfg.loss_chunk_size,
                            dtype=jnp.dtype(self.cfg.dtype))

  def __call__(self, tokens_BT: jax.Array, segment_ids_BT=None, positions_BT=None,
               token_mask_BT=None, targets_BT=None, image_mask_BT=None, vision_MD=None) -> tuple[Any, dict]:
    """(logits_BTV fp32, aux); with targets_BT, (head_stats dict, aux) for lm_loss_from_stats.
    With image_mask_BT and vision_MD (the vision tower's tokens), the embeddings at the mask's
    positions are those tokens in order (vision/multimodal.py)."""
    x = self.embed(tokens_BT)
    if (image_mask_BT is None) != (vision_MD is None):
      raise ValueError("image_mask_BT and vision_MD: pass both or neither")
    if vision_MD is not None:
      from moonshot_jax.vision.multimodal import merge_vision_embeddings  # noqa: PLC0415
      x = nn.with_logical_constraint(merge_vision_embeddings(x, image_mask_BT, vision_MD), _ACT)
    carry = self.init_carry(x)
    carry, aux = self.apply_layers(carry, 0, self.cfg.n_layers, segment_ids_BT, positions_BT, token_mask_BT)
    return (self.head(carry) if targets_BT is None else self.head_stats(carry, targets_BT)), aux


# ---------------------------------------------------------------------------------------------
# Per-layer views of the variables (pipeline stages, inference, checkpoint conversion)
# ---------------------------------------------------------------------------------------------
def _is_box(x) -> bool:
  return isinstance(x, nn.meta.AxisMetadata)


def _take(tree, i: int):
  """Entry i of a scanned stack; boxed leaves lose their leading "layers" name too."""
  def index(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    return x[i]

  def one(x):
    if isinstance(x, nn.Partitioned):
      return x.replace(value=index(x.value), names=x.names[1:])
    return index(x)
  return jax.tree.map(one, tree, is_leaf=_is_box)


def _stack(trees: Sequence[Any]):
  def stack(xs):  # host arrays stay on the host (checkpoint conversion); abstract stay abstract
    if all(isinstance(x, jax.ShapeDtypeStruct) for x in xs):
      return jax.ShapeDtypeStruct((len(xs),) + tuple(xs[0].shape), xs[0].dtype)
    return np.stack(xs) if all(isinstance(x, np.ndarray) for x in xs) else jnp.stack(xs)

  def one(*xs):
    if isinstance(xs[0], nn.Partitioned):
      return xs[0].replace(value=stack([x.value for x in xs]), names=("layers",) + tuple(xs[0].names))
    return stack(xs)
  return jax.tree.map(one, *trees, is_leaf=_is_box)


def layer_variables(variables: dict, cfg: ModelConfig, layer: int) -> dict:
  """{collection: {"mixer": ..., "ffn": ...}} of one layer (boxed or unboxed trees), for `Block`."""
  if not (isinstance(layer, int) and 0 <= layer < cfg.n_layers):
    raise ValueError(f"layer: expected an int in [0, {cfg.n_layers}), got {layer!r}")
  seg = next(s for s in layer_plan(cfg) if s.start <= layer < s.end)
  out = {}
  r, j = divmod(layer - seg.start, len(seg.unit))
  for col, tree in variables.items():
    if seg.name not in tree:  # e.g. no "moe_state" in a dense layer
      continue
    if not seg.scanned:
      out[col] = tree[seg.name]
    elif f"layer_{j}" in tree[seg.name]:
      out[col] = _take(tree[seg.name][f"layer_{j}"], r)
  return out


def unstack_layers(variables: dict, cfg: ModelConfig) -> tuple[list[dict], dict]:
  """(per-layer variables [n_layers], the rest: embedding, head, final norm/site)."""
  names = {seg.name for seg in layer_plan(cfg)}
  rest = {col: {k: v for k, v in tree.items() if k not in names} for col, tree in variables.items()}
  return [layer_variables(variables, cfg, i) for i in range(cfg.n_layers)], rest


def stack_layers(per_layer: Sequence[dict], rest: dict, cfg: ModelConfig) -> dict:
  """Inverse of `unstack_layers`."""
  if len(per_layer) != cfg.n_layers:
    raise ValueError(f"per_layer: expected {cfg.n_layers} layers, got {len(per_layer)}")
  out = {col: dict(tree) for col, tree in rest.items()}
  for seg in layer_plan(cfg):
    p = len(seg.unit)
    for j in range(p):
      members = [per_layer[seg.start + r * p + j] for r in range(seg.repeats)]
      for col in members[0]:
        tree = out.setdefault(col, {})
        if seg.scanned:
          tree.setdefault(seg.name, {})[f"layer_{j}"] = _stack([m[col] for m in members])
        else:
          tree[seg.name] = members[0][col]
  return out


def block_for_layer(cfg: ModelConfig, layer: int, expert_fn: Callable | None = None) -> Block:
  """The `Block` module (no remat) that `layer_variables(variables, cfg, layer)` plugs into."""
  mixer, ffn = cfg.layer_kinds[layer]
  return Block(cfg, mixer, ffn, expert_fn)
