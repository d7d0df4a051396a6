"""Streaming, sharded reading and writing of K3 hub checkpoints (config.json + *.safetensors).

`HubDir(directory)` reads only headers up front: the weight map (model.safetensors.index.json, or
every file's header), every tensor's shape and dtype. `validate` then checks the whole checkpoint
against the layout of `hf_k3.pieces(cfg)` before a byte of weights is read: missing, unknown,
misshapen and mistyped tensors are ValueErrors naming them (vision and multi-token-prediction
tensors are skipped by name and listed in the report).

`load_variables(hub, cfg, shardings)` builds every leaf of the model's {"params", "moe_state"} with
`jax.make_array_from_callback`: a device's callback reads (pread of the tensor's bytes; no mapping)
only the hub tensors of its own slice -- one layer's, one expert's -- so each host reads what its
devices hold and nothing else. `LeafBuilder.slabs` gives the same values one layer / expert at a
time for the import's streamed write. With `cache_dir`, every slice is also written there (atomically)
and read back on a rerun: an interrupted import resumes where it stopped. A tqdm bar counts hub
bytes. Values are exact: bf16 / fp32 hub tensors and MXFP4 experts (layers/mxfp4.py) convert to
the leaf's dtype without rounding unless that dtype is narrower.

`write_hub(variables, cfg, out_dir, experts_mxfp4)` is the export: the same pieces backwards,
streamed into safetensors shards of at most `max_shard_bytes` plus the index and a K3 config.json.
Matrices are written in bf16 (or MXFP4 for the routed experts), vectors (norm scales, AttnRes
queries, A_log, dt_bias, the router bias) and the short-conv taps in float32, so a model imported from the hub exports
back to the same values and re-imports bit for bit.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import jax
import ml_dtypes
import numpy as np

from moonshot_jax.config import ModelConfig
from moonshot_jax.inference import hf_k3
from moonshot_jax.layers import mxfp4

_FLOAT_DTYPES = ("BF16", "F16", "F32")
_FP32_EXPORT = ("_res_proj.weight", "conv1d.weight")  # besides every vector
_NP = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "U8": np.uint8}


class HubDir:
  """Headers of a hub checkpoint directory: name -> (file, shape, dtype) and the parsed config."""

  def __init__(self, directory: str | os.PathLike):
    from safetensors import safe_open  # pip install safetensors
    self.dir = Path(directory)
    cfg_path = self.dir / "config.json"
    if not cfg_path.is_file():
      raise ValueError(f"checkpoint: {cfg_path} not found")
    try:
      self.config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
      raise ValueError(f"checkpoint: {cfg_path} is not valid JSON ({e})") from None
    index = self.dir / "model.safetensors.index.json"
    files = sorted(p.name for p in self.dir.glob("*.safetensors"))
    if not files:
      raise ValueError(f"checkpoint: no *.safetensors files in {self.dir}")
    weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    self.tensors: dict[str, tuple[str, tuple[int, ...], str]] = {}
    self.file_bytes = {f: (self.dir / f).stat().st_size for f in files}
    self._where: dict[str, int] = {}  # name -> absolute byte offset of its data in its file
    for f in files:
      try:
        with safe_open(str(self.dir / f), framework="numpy") as h:  # validates the header and sizes
          for name in h.keys():
            s = h.get_slice(name)
            if name in self.tensors:
              raise ValueError(f"checkpoint: tensor {name!r} appears in both {self.tensors[name][0]} and {f}")
            self.tensors[name] = (f, tuple(int(d) for d in s.get_shape()), str(s.get_dtype()))
        with open(self.dir / f, "rb") as fh:
          n = int.from_bytes(fh.read(8), "little")
          header = json.loads(fh.read(n))
        self._where.update({k: 8 + n + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"})
      except ValueError:
        raise
      except Exception as e:  # safetensors raises SafetensorError for truncated / garbled files
        raise ValueError(f"checkpoint: shard {f} is unreadable or truncated ({type(e).__name__}: {e})") from None
    if weight_map is not None:
      for name, f in weight_map.items():
        if name not in self.tensors:
          raise ValueError(f"checkpoint: the index maps {name!r} to {f}, which does not hold it")
        if self.tensors[name][0] != f:
          raise ValueError(f"checkpoint: the index maps {name!r} to {f} but it is in {self.tensors[name][0]}")
    self._fd: tuple[str, int] | None = None  # the current shard's file descriptor
    self.bytes_read = 0

  @property
  def largest_shard_bytes(self) -> int:
    return max(self.file_bytes.values())

  def read(self, name: str) -> np.ndarray:
    """A tensor as a new array, read with pread (not mapped): a mapping's touched pages count
    towards the process's RSS until it is closed, on top of the array handed out."""
    f, shape, dtype = self.tensors[name]
    if dtype not in _NP:
      raise ValueError(f"checkpoint: {name!r} ({f}) has dtype {dtype}, which this reader does not take")
    if self._fd is None or self._fd[0] != f:
      self.close()
      self._fd = (f, os.open(self.dir / f, os.O_RDONLY))
    x = np.empty(shape, _NP[dtype])
    buf, off, done = memoryview(x.reshape(-1).view(np.uint8)), self._where[name], 0
    while done < x.nbytes:
      n = os.preadv(self._fd[1], [buf[done:]], off + done)
      if n <= 0:
        raise ValueError(f"checkpoint: {name!r} ({f}) ends early (file truncated?)")
      done += n
    self.bytes_read += x.nbytes
    return x

  def close(self) -> None:
    if self._fd is not None:
      os.close(self._fd[1])
      self._fd = None


def validate(hub: HubDir, cfg: ModelConfig, experts_mxfp4: bool | None = None) -> dict[str, Any]:
  """Checks names, shapes and dtypes of every tensor; returns the report {"experts_mxfp4",
  "skipped": {"vision": [...], "mtp": [...]}, "pieces", "bytes"}."""
  if experts_mxfp4 is None:  # as stored: packed pairs or plain weights
    experts_mxfp4 = any(n.endswith(".weight_packed") for n in hub.tensors)
  pcs = hf_k3.pieces(cfg, experts_mxfp4)
  want: dict[str, tuple[int, ...]] = {}
  packed_names = set()
  for pc in pcs:
    for name, shape in pc.hub:
      want[name] = shape
      if pc.mxfp4:
        packed_names.add(name)
  have = set(hub.tensors)
  skipped = {"vision": [], "mtp": []}
  unknown = []
  for name in sorted(have - set(want)):
    kind = hf_k3.classify_extra(name, cfg)
    (skipped[kind] if kind else unknown).append(name)
  missing = sorted(set(want) - have)
  if missing or unknown:
    msg = []
    if missing:
      msg.append(f"{len(missing)} missing tensor(s), e.g. {missing[:6]}")
    if unknown:
      msg.append(f"{len(unknown)} tensor(s) with no place in the model, e.g. {unknown[:6]}")
    raise ValueError(f"checkpoint {hub.dir}: " + "; ".join(msg))
  for name, shape in want.items():
    f, got, dtype = hub.tensors[name]
    if name.endswith("A_log") and got in ((1, 1, cfg.kda_num_heads, 1), (cfg.kda_num_heads,)):
      got = shape  # Kimi Linear's [1,1,H,1] and an unpadded [H] are accepted too
    if got != shape:
      raise ValueError(f"checkpoint: {name!r} ({f}) has shape {got}, expected {shape}")
    ok = dtype == "U8" if name in packed_names else dtype in _FLOAT_DTYPES
    if not ok:
      raise ValueError(f"checkpoint: {name!r} ({f}) has dtype {dtype}, expected "
                       f"{'U8 (MXFP4 bytes)' if name in packed_names else 'a float (BF16/F16/F32)'}")
  return {"experts_mxfp4": experts_mxfp4, "skipped": skipped, "pieces": pcs,
          "bytes": sum(hf_k3.hub_bytes(hub.tensors[n][1], _NP[hub.tensors[n][2]]) for n in want)}


# Exponent field of the 16-bit floats: all ones = inf / NaN. Tested on the bits because
# np.isfinite on ml_dtypes' bfloat16 goes through a per-element float conversion (slow).
_EXP_MASK = {np.dtype(ml_dtypes.bfloat16): np.uint16(0x7F80), np.dtype(np.float16): np.uint16(0x7C00)}


def _all_finite(x: np.ndarray, chunk: int = 1 << 22) -> bool:
  flat = x.reshape(-1)
  mask = _EXP_MASK.get(flat.dtype)
  if mask is not None:  # exponent all ones <=> (bits without the sign) >= mask: an AND and a max per chunk
    bits, buf = flat.view(np.uint16), np.empty(min(chunk, flat.size), np.uint16)
    for i in range(0, flat.size, chunk):
      part = np.bitwise_and(bits[i:i + chunk], np.uint16(0x7FFF), out=buf[:min(chunk, flat.size - i)])
      if part.max() >= mask:
        return False
    return True
  return all(np.isfinite(flat[i:i + chunk]).all() for i in range(0, flat.size, chunk))


def piece_value(hub: HubDir, pc: hf_k3.Piece, dtype=np.float32, with_abs_sum: bool = False):
  """One piece in our layout as `dtype`, read from the hub. Exact: no arithmetic except the
  AttnRes query product (fp32) and the MXFP4 decode; a plain tensor is only transposed / reshaped
  (views) and cast once, so its bytes are in memory once or twice, never as an fp32 detour.
  with_abs_sum: (value, sum |value| or None) -- known for MXFP4 pieces (from the packed bytes, see
  mxfp4.dequantize_np_t), so the checkpoint writer need not sum the decoded values for its fingerprint."""
  arrays = [hub.read(name) for name, _ in pc.hub]
  abs_sum = None
  if pc.mxfp4:
    if np.any(arrays[1] == mxfp4.SCALE_NAN):
      raise ValueError(f"checkpoint: {pc.hub[1][0]!r} holds the E8M0 NaN scale (0xFF): corrupt MXFP4 data")
    ours, abs_sum = pc.to_ours(arrays, dtype=dtype, with_abs_sum=True)
    if np.dtype(ours.dtype) != np.dtype(dtype):
      raise AssertionError(f"{pc.hub[0][0]}: decoded to {ours.dtype}, asked for {np.dtype(dtype)}")
  else:
    if not all(_all_finite(a) for a in arrays):
      raise ValueError(f"checkpoint: {[n for n, _ in pc.hub]} hold NaN or inf values")
    ours = np.asarray(pc.to_ours(arrays)).astype(dtype, copy=False)
  return (ours, abs_sum) if with_abs_sum else ours


# ---------------------------------------------------------------------------------------------
# Leaves of the model tree <-> pieces
# ---------------------------------------------------------------------------------------------
def leaf_locator(cfg: ModelConfig) -> Callable[[str, tuple[str, ...]], list[tuple[Any, ...]]]:
  """(collection, model-tree path) -> [(layer or None, ...)] per leading index of the leaf: the
  layer of each repeat of a scanned leaf, or [layer] / [None] for an unrolled / top-level one, and
  the per-layer path within it."""
  from moonshot_jax.model.transformer import layer_plan
  plan = {seg.name: seg for seg in layer_plan(cfg)}

  def locate(path: tuple[str, ...]):
    seg = plan.get(path[0])
    if seg is None:
      return False, [None], path
    if not seg.scanned:
      return False, [seg.start], path[1:]
    j = int(path[1].split("_")[1])
    return True, [seg.start + r * len(seg.unit) + j for r in range(seg.repeats)], path[2:]
  return locate


def _index_key(index: tuple[slice, ...]) -> str:
  return hashlib.sha1(repr([(s.start, s.stop, s.step) for s in index]).encode()).hexdigest()[:16]


def load_variables(hub: HubDir, cfg: ModelConfig, shardings: Mapping[str, Any] | None = None,
                   report: Mapping[str, Any] | None = None, cache_dir: str | os.PathLike | None = None,
                   progress: bool = True, materialize: bool = True) -> dict | None:
  """{"params", "moe_state"} of `Transformer(cfg)` as jax.Arrays placed by `shardings` (a matching
  tree of Shardings; default: the first device), each device's slice read straight from the hub.
  materialize=False builds each leaf on the host, hands it to `cache_dir` (if given) and drops it:
  one leaf in memory at a time (a prefetch pass); returns None."""
  report = report or validate(hub, cfg)
  bar = progress_bar(report, progress)
  try:
    treedef, leaves = leaf_builders(hub, cfg, shardings, report, cache_dir, bar)
    if not materialize:
      for leaf in leaves:
        leaf.host()
      return None
    return jax.tree_util.tree_unflatten(treedef, [leaf.build() for leaf in leaves])
  finally:
    if bar is not None:
      bar.close()


def progress_bar(report: Mapping[str, Any], progress: bool):
  if not progress or jax.process_index() != 0:
    return None
  from tqdm.auto import tqdm
  return tqdm(total=report["bytes"], unit="B", unit_scale=True, desc="import", dynamic_ncols=True)


class LeafBuilder:
  """One leaf of {"params", "moe_state"}: `build()` makes the jax.Array (each addressable device's
  slice read from the hub by `callback(index)`), `host()` the whole leaf as one host array,
  `slabs(box)` the box one layer / expert at a time along `stack_axes` (checkpoint.LazyLeaf's
  streamed write). Nothing is read before one is called, so a caller can hold one slab in memory."""

  def __init__(self, name: str, abstract: Any, sharding: Any, callback: Callable[..., np.ndarray],
               stack_axes: tuple[int, ...] = ()):
    self.name, self.shape, self.dtype, self.sharding = name, tuple(abstract.shape), abstract.dtype, sharding
    self.callback, self.stack_axes = callback, tuple(stack_axes)

  def build(self) -> jax.Array:
    if _supports_dtype_kw():
      return jax.make_array_from_callback(self.shape, self.sharding, self.callback, dtype=self.dtype)
    return jax.make_array_from_callback(self.shape, self.sharding, self.callback)

  def host(self) -> np.ndarray:
    return self.callback(tuple(slice(None) for _ in self.shape))

  def slabs(self, box: tuple[slice, ...]) -> Iterable[tuple[tuple[slice, ...], np.ndarray, float | None]]:
    """(sub_box, array, sum |array| or None) tiling `box`: one index of each stack axis at a time,
    each piece as read (maybe a transposed view: the writer makes it contiguous chunk by chunk); the
    sum when the piece knew it cheaper than the writer would take it (MXFP4 experts)."""
    box = tuple(slice(*s.indices(n)[:2]) for s, n in zip(box, self.shape))
    ranges = [range(box[a].start, box[a].stop) for a in self.stack_axes]
    for idx in itertools.product(*ranges):
      sub = list(box)
      for a, i in zip(self.stack_axes, idx):
        sub[a] = slice(i, i + 1)
      sub = tuple(sub)
      yield (sub, *self.callback(sub, contiguous=False, with_abs_sum=True))


def leaf_builders(hub: HubDir, cfg: ModelConfig, shardings: Mapping[str, Any] | None = None,
                  report: Mapping[str, Any] | None = None, cache_dir: str | os.PathLike | None = None,
                  bar: Any = None) -> tuple[Any, list[LeafBuilder]]:
  """(treedef, [LeafBuilder per leaf]) of {"params", "moe_state"}: what `load_variables` builds,
  leaf by leaf on demand (hub_checkpoint.run_import streams them into the checkpoint this way).
  `bar`: a tqdm bar updated with the hub bytes read."""
  from moonshot_jax.inference.hf_import import _model_tree
  report = report or validate(hub, cfg)
  want = _model_tree(cfg)
  by_key: dict[tuple, hf_k3.Piece] = {}
  for pc in report["pieces"]:
    by_key[(pc.collection, pc.layer, pc.path, pc.expert)] = pc
  locate = leaf_locator(cfg)
  default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  flat, treedef = jax.tree_util.tree_flatten_with_path(want)
  shard_flat = (jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
                if shardings is not None else [default] * len(flat))
  if len(shard_flat) != len(flat):
    raise ValueError(f"shardings: {len(shard_flat)} leaves, the model has {len(flat)}")
  cache = Path(cache_dir) if cache_dir is not None else None
  if cache is not None:
    cache.mkdir(parents=True, exist_ok=True)
  out = []
  for (kpath, abstract), sharding in zip(flat, shard_flat):
    names = tuple(str(getattr(k, "key", k)) for k in kpath)
    col, path = names[0], names[1:]
    scanned, layers, inner = locate(path)
    expert_leaf = col == "params" and inner[-1:] in (("w_gate",), ("w_up",), ("w_down",)) and "moe" in inner
    leaf_id = "/".join(names)

    def value(layer, expert=None, inner=inner, col=col, dtype=abstract.dtype, leaf_id=leaf_id, with_abs_sum=False):
      pc = by_key.get((col, layer, inner, expert))
      if pc is None:
        raise AssertionError(f"no hub piece for {leaf_id} layer {layer} expert {expert}")
      before = hub.bytes_read
      v = piece_value(hub, pc, dtype, with_abs_sum)
      if bar is not None:
        bar.update(hub.bytes_read - before)
      return v

    def callback(index, contiguous=True, layers=layers, scanned=scanned, expert_leaf=expert_leaf,
                 abstract=abstract, leaf_id=leaf_id, value=value, with_abs_sum=False):
      """The leaf's values at `index`; with_abs_sum (a slab, contiguous=False): (values, sum |values|
      when the piece knew it (MXFP4) and the slab is the whole piece, else None)."""
      index = tuple(index) + (slice(None),) * (len(abstract.shape) - len(index))
      shape = _sliced_shape(abstract.shape, index)
      key = None
      if cache is not None:
        key = cache / f"{hashlib.sha1(leaf_id.encode()).hexdigest()[:16]}_{_index_key(index)}.npy"
        if key.is_file():
          x = np.load(key).view(abstract.dtype).reshape(shape)
          return (x, None) if with_abs_sum else x
      sel_layers = [layers[r] for r in range(len(layers))[index[0]]] if scanned else layers
      rest = index[1:] if scanned else index
      one = len(sel_layers) == 1 and (not expert_leaf or len(range(cfg.num_experts)[rest[0]]) == 1)
      if not contiguous and (scanned or expert_leaf) and one:  # one layer's / expert's piece, as read
        whole, abs_sum = (value(sel_layers[0], range(cfg.num_experts)[rest[0]][0], with_abs_sum=True) if expert_leaf
                          else value(sel_layers[0], with_abs_sum=True))
        v = whole[rest[1:] if expert_leaf else rest]
        v = v[(None,) * (len(shape) - v.ndim)]
        if not with_abs_sum:
          return v
        return v, abs_sum if v.size == whole.size else None  # a slice of the piece: its sum is not known
      if not scanned and not expert_leaf:  # one piece: return it (a view if no cast was needed)
        x = value(layers[0])[rest]
        if contiguous and x.ndim >= 2 and not x.flags.c_contiguous:  # a transposed matrix: copy by tiles
          x = copy_tiled(np.empty(x.shape, x.dtype), x)
      else:  # fill a preallocated array layer by layer, expert by expert: no list-then-stack copy
        x = np.empty(shape, abstract.dtype)
        for r, layer in enumerate(sel_layers):
          dst = x[r] if scanned else x
          if expert_leaf:
            for k, e in enumerate(range(cfg.num_experts)[rest[0]]):
              copy_tiled(dst[k], value(layer, e)[rest[1:]])
          else:
            copy_tiled(dst, value(layer)[rest])
      if key is not None:
        tmp = key.with_suffix(".tmp.npy")
        np.save(tmp, np.ascontiguousarray(x).view(np.uint8))
        os.replace(tmp, key)
      return (x, None) if with_abs_sum else x

    stack = ((0,) if scanned else ()) + ((1 if scanned else 0,) if expert_leaf else ())
    out.append(LeafBuilder(leaf_id, abstract, sharding, callback, stack))
  return treedef, out


def copy_tiled(dst: np.ndarray, src: np.ndarray, tile: int = 256) -> np.ndarray:
  """dst[...] = src, in tiles of the last two axes when src is not C-contiguous (a hub [out, in]
  matrix seen as our [in, out]): a strided whole-matrix copy runs at cache-miss speed (measured on
  one expert matrix, bf16 [3584, 3072]: 55 ms whole, 18 ms in 256-tiles)."""
  if src.ndim < 2 or src.flags.c_contiguous:
    dst[...] = src
    return dst
  d, s = dst, src
  if dst.dtype == src.dtype and src.dtype.itemsize in (1, 2, 4, 8):  # the same bits as plain unsigned ints:
    u = np.dtype(f"u{src.dtype.itemsize}")  # ml_dtypes' bfloat16 copies element by element holding the GIL
    d, s = dst.view(u), src.view(u)
  rows, cols = s.shape[-2:]
  for i in range(0, rows, tile):
    for j in range(0, cols, tile):
      d[..., i:i + tile, j:j + tile] = s[..., i:i + tile, j:j + tile]
  return dst


def _supports_dtype_kw() -> bool:
  import inspect
  return "dtype" in inspect.signature(jax.make_array_from_callback).parameters


def _sliced_shape(shape, index) -> tuple[int, ...]:
  return tuple(len(range(n)[s]) for n, s in zip(shape, index))


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------
def _hub_tensors(variables: Mapping[str, Any], cfg: ModelConfig, experts_mxfp4: bool,
                 matrix_dtype) -> Iterable[tuple[str, np.ndarray]]:
  """(hub name, array) in layer order, reading one leaf of `variables` at a time (host gather)."""
  from moonshot_jax.model.transformer import layer_variables
  pcs = hf_k3.pieces(cfg, experts_mxfp4)
  host = {}

  def layer_tree(layer):  # one layer's leaves, still on the devices (a slice of each scanned stack)
    if layer not in host:
      host.clear()
      host[layer] = (layer_variables(variables, cfg, layer) if layer is not None else
                     {c: {k: v for k, v in variables[c].items() if not k.startswith("layer")} for c in variables})
    return host[layer]

  def get(pc):  # one piece (one expert's matrix at most) to this host
    t = layer_tree(pc.layer)[pc.collection]
    for k in pc.path:
      t = t[k]
    return np.asarray(_to_host(t if pc.expert is None else t[pc.expert]), np.float32)

  def cast(name, a):
    if a.dtype == np.uint8:
      return a
    small = a.ndim < 2 or name.endswith(_FP32_EXPORT)  # kept fp32 as the ports keep them (exact)
    return a.astype(np.float32 if small else matrix_dtype)

  i = 0
  while i < len(pcs):
    pc = pcs[i]
    if pc.to_hub is None:  # pieces sharing one hub tensor: consecutive in `pieces`
      group = [p for p in pcs[i:] if p.hub == pc.hub and p.layer == pc.layer]
      arrays = hf_k3.joint_to_hub(group, [get(p) for p in group])
      i += len(group)
    else:
      arrays = pc.to_hub(get(pc))
      i += 1
    for (name, shape), a in zip(pc.hub, arrays):
      if tuple(a.shape) != tuple(shape):
        raise AssertionError(f"export: {name} came out {a.shape}, layout says {shape}")
      yield name, cast(name, a)


def _to_host(x) -> np.ndarray:
  """An array's whole value on this host; across hosts (not fully addressable) an all-gather,
  which every process must call in the same order (write_hub's loop does)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def write_hub(variables: Mapping[str, Any], cfg: ModelConfig, out_dir: str | os.PathLike, *,
              experts_mxfp4: bool = True, matrix_dtype=ml_dtypes.bfloat16, max_shard_bytes: int = 4 << 30,
              vision_config: Mapping[str, Any] | None = None, progress: bool = True) -> dict[str, Any]:
  """Writes config.json, model-XXXXX-of-YYYYY.safetensors and model.safetensors.index.json to
  `out_dir` (which must not exist yet: an export never overwrites). Returns {"files", "bytes"}.
  Host memory: one piece (an expert's matrix) plus the shard being filled. With several processes
  every one gathers the same pieces in the same order and process 0 alone writes."""
  from safetensors.numpy import save_file
  out = Path(out_dir)
  if out.exists():
    raise ValueError(f"export: {out} already exists; choose a new directory")
  tmp = out.with_name(out.name + ".partial")
  if jax.process_index() == 0:
    tmp.mkdir(parents=True, exist_ok=True)
  shards, cur, cur_bytes, total = [], {}, 0, 0
  bar = None
  if progress:
    from tqdm.auto import tqdm
    bar = tqdm(unit="B", unit_scale=True, desc="export", dynamic_ncols=True)

  writer = jax.process_index() == 0

  def flush():
    nonlocal cur, cur_bytes
    if cur:
      name = f"model-{len(shards) + 1:05d}.safetensors"
      if writer:
        save_file(cur, str(tmp / name), metadata={"format": "pt"})
      shards.append((name, list(cur)))
      cur, cur_bytes = {}, 0

  for name, a in _hub_tensors(variables, cfg, experts_mxfp4, matrix_dtype):
    if cur_bytes + a.nbytes > max_shard_bytes:
      flush()
    cur[name] = np.ascontiguousarray(a)
    cur_bytes += a.nbytes
    total += a.nbytes
    if bar is not None:
      bar.update(a.nbytes)
  flush()
  if bar is not None:
    bar.close()
  n = len(shards)
  if writer:
    weight_map = {}
    for k, (name, names) in enumerate(shards):
      final = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
      os.replace(tmp / name, tmp / final)
      weight_map.update({t: final for t in names})
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1, sort_keys=True))
    top = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
           "text_config": hf_k3.text_config_for(cfg, experts_mxfp4)}
    if vision_config is not None:
      top["vision_config"] = dict(vision_config)
    (tmp / "config.json").write_text(json.dumps(top, indent=1))
    os.replace(tmp, out)
  return {"files": n, "bytes": total}
