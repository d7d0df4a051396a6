"""Training / eval batches: tokenised documents packed into rows, served by a grain pipeline.

Packing. Each split is one token stream: for every document `<bos> tokens <eos>`. Row r is the
window stream[r*T : r*T + T + 1] (T = data.seq_len): `tokens` its first T entries, `targets` its
last T, so consecutive rows overlap by one token and every stream token is an input exactly once
and a target exactly once (except the stream's first/last). Per row position i:
  segment_ids  1, 2, ... per document piece in this row; 0 on padding (after the stream's end).
  positions    index within that piece (restarts at 0 in every row, so < seq_len <= max_seq_len;
               attention is segment-masked, so this is all of the document the row can see).
  loss_mask    1 iff tokens[i] is not padding and targets[i] belongs to the same document: the
               `<eos> -> next <bos>` target and targets on padding are 0. A target in the next row's
               first slot still counts when the document continues there.
A document longer than a row is split across rows; its continuation starts segment 1 (or later)
of the next row. All arrays are int32 [B, T] per batch.

Pipeline (grain): rows -> shuffle(data.shuffle_seed; new permutation each epoch) -> repeat forever
-> build rows -> batch(local batch) -> this process's share. Process p of P receives rows
[p*B/P, (p+1)*B/P) of every global batch of B = data.batch_size rows. `Data.train_iter()` is a
grain DatasetIterator: `get_state()` is JSON-serialisable (grain.checkpoint.CheckpointSave works
with orbax) and `set_state()` resumes exactly. Token streams are cached in
`<workdir>/data_cache/` keyed by tokenizer and split contents.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

import grain
import numpy as np

from moonshot_jax.train import corpus as corpus_lib
from moonshot_jax.train import tokenizer as tokenizer_lib

FIELDS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")
_PACK_VERSION = "pack-v1"  # bump when the stream layout changes: invalidates cached token arrays
_ENCODE_CHUNK = 64  # documents per encode_batch call: bounds the Python-int lists in memory

Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class DataStats:
  train_docs: int
  eval_docs: int
  train_tokens: int  # stream length, <bos>/<eos> included
  eval_tokens: int
  train_rows: int
  eval_rows: int
  vocab_size: int
  tokenizer: str


class PackedRows:
  """Row r of a packed token stream (see module docstring); rows past the end are all padding.

  Picklable for grain workers: when backed by cache files only their paths travel (re-opened as
  memory maps), not the arrays.
  """

  def __init__(self, tokens: np.ndarray, doc_starts: np.ndarray, seq_len: int, pad_id: int,
               files: tuple[str, str] | None = None):
    if tokens.ndim != 1 or tokens.size < 2:
      raise ValueError(f"tokens: expected a 1-D stream of >= 2 tokens (got shape {tokens.shape})")
    if doc_starts.ndim != 1 or doc_starts.size == 0 or doc_starts[0] != 0:
      raise ValueError("doc_starts: expected a 1-D array of document offsets starting at 0")
    if seq_len <= 0:
      raise ValueError(f"seq_len: must be positive (got {seq_len})")
    self.tokens, self.doc_starts = tokens, doc_starts
    self.seq_len, self.pad_id, self._files = int(seq_len), int(pad_id), files
    self.num_rows = -(-(tokens.size - 1) // self.seq_len)

  def __getstate__(self):
    state = dict(self.__dict__)
    if self._files is not None:
      state["tokens"] = state["doc_starts"] = None
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    if self.tokens is None:
      self.tokens = np.load(self._files[0], mmap_mode="r")
      self.doc_starts = np.load(self._files[1])

  def __call__(self, r: int) -> Batch:
    T, n = self.seq_len, self.tokens.size
    window = np.full(T + 1, self.pad_id, np.int32)
    doc = np.full(T + 1, -1, np.int64)  # document index per window slot, -1 = padding
    lo = int(r) * T
    hi = min(lo + T + 1, n)
    if lo < n:
      window[: hi - lo] = self.tokens[lo:hi]
      doc[: hi - lo] = np.searchsorted(self.doc_starts, np.arange(lo, hi), side="right") - 1
    d_in, d_tgt = doc[:T], doc[1:]
    starts = np.ones(T, bool)
    starts[1:] = d_in[1:] != d_in[:-1]
    idx = np.arange(T)
    real = d_in >= 0
    return dict(
        tokens=window[:T],
        targets=window[1:],
        segment_ids=np.where(real, np.cumsum(starts), 0).astype(np.int32),
        positions=np.where(real, idx - np.maximum.accumulate(np.where(starts, idx, 0)), 0).astype(np.int32),
        loss_mask=(real & (d_tgt == d_in)).astype(np.int32),
    )


def build_stream(tok: tokenizer_lib.Tokenizer, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
  """(tokens, doc_starts): `<bos> ids <eos>` per text, concatenated; doc_starts[i] = offset of text i."""
  dtype = np.uint16 if tok.vocab_size <= 2 ** 16 else np.int32
  pieces, lengths = [], []
  for i in range(0, len(texts), _ENCODE_CHUNK):
    for ids in tok.encode_batch(list(texts[i:i + _ENCODE_CHUNK])):
      pieces.append(np.asarray([tok.bos_id, *ids, tok.eos_id], dtype))
      lengths.append(len(ids) + 2)
  if not pieces:
    raise ValueError("texts: no documents to tokenise")
  starts = np.concatenate([[0], np.cumsum(lengths[:-1])]).astype(np.int64)
  return np.concatenate(pieces), starts


class Data:
  """Tokenizer, stats and the batch iterators of one experiment, for one process."""

  def __init__(self, tokenizer: tokenizer_lib.Tokenizer, train_rows: PackedRows, eval_rows: PackedRows,
               stats: DataStats, data_cfg: Any, process_index: int, process_count: int):
    self.tokenizer, self.stats = tokenizer, stats
    self.train_rows, self.eval_rows = train_rows, eval_rows
    self.seq_len = int(data_cfg["seq_len"])
    self.global_batch_size = int(data_cfg["batch_size"])
    self.local_batch_size = self.global_batch_size // process_count
    self.process_index, self.process_count = process_index, process_count
    self._seed = int(data_cfg["shuffle_seed"])
    self._num_workers = int(data_cfg["num_workers"])
    self._prefetch = int(data_cfg["prefetch"])
    max_eval = -(-eval_rows.num_rows // self.global_batch_size)
    want = int(data_cfg["eval_batches"])  # <= 0: the whole held-out split
    self.num_eval_batches = max_eval if want <= 0 else min(want, max_eval)

  def train_dataset(self) -> grain.IterDataset:
    """Infinite, per-epoch reshuffled stream of this process's [B/P, T] batches."""
    ds = (grain.MapDataset.range(self.train_rows.num_rows).shuffle(seed=self._seed).repeat(None)
          .map(self.train_rows).batch(self.local_batch_size, drop_remainder=True))
    ds = ds[self.process_index::self.process_count]
    threads = 1 if self._prefetch > 0 else 0
    it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=self._prefetch))
    if self._num_workers > 0:
      _absl_flags_ready()
      it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(
          num_workers=self._num_workers, per_worker_buffer_size=max(self._prefetch, 1)))
    return it_ds

  def train_iter(self) -> grain.DatasetIterator:
    """Checkpointable iterator (get_state / set_state); close() it when it uses worker processes."""
    return iter(self.train_dataset())

  def eval_batches(self) -> Iterator[Batch]:
    """The first `num_eval_batches` batches of the held-out split, in order; a short last batch
    is filled with all-padding rows (loss_mask 0) so every batch is [B/P, T]."""
    n = self.num_eval_batches * self.global_batch_size
    ds = grain.MapDataset.range(n).map(self.eval_rows).batch(self.local_batch_size)
    ds = ds[self.process_index::self.process_count]
    for i in range(len(ds)):
      yield ds[i]


def make_data(cfg: Any, workdir: str | os.PathLike | None, process_index: int | None = None,
              process_count: int | None = None) -> Data:
  """Reads the corpus, splits it, loads or trains the tokenizer, tokenises (cached) and packs.

  cfg: the experiment ConfigDict (uses cfg.data and cfg.model.vocab_size). workdir: where the
  tokenizer and token caches live (None: no caching). process_index/count default to jax's.
  """
  d = cfg["data"]
  model_vocab = int(cfg["model"]["vocab_size"])
  if process_index is None or process_count is None:
    import jax  # pylint: disable=import-outside-toplevel
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  _check(d, process_index, process_count)

  docs = corpus_lib.load_documents(d)
  train_docs, eval_docs = corpus_lib.split_documents(docs, float(d["eval_fraction"]))
  tok = tokenizer_lib.load_or_train_tokenizer(
      d, workdir, model_vocab, lambda: (x.text for x in train_docs),
      corpus_key=corpus_lib.fingerprint(train_docs))
  cache = None if workdir is None else Path(workdir) / "data_cache"
  rows = {split: _packed(tok, docs_, split, int(d["seq_len"]), cache)
          for split, docs_ in (("train", train_docs), ("eval", eval_docs))}
  stats = DataStats(train_docs=len(train_docs), eval_docs=len(eval_docs),
                    train_tokens=int(rows["train"].tokens.size), eval_tokens=int(rows["eval"].tokens.size),
                    train_rows=rows["train"].num_rows, eval_rows=rows["eval"].num_rows,
                    vocab_size=tok.vocab_size, tokenizer=tok.name)
  return Data(tok, rows["train"], rows["eval"], stats, d, process_index, process_count)


def _packed(tok, docs: Sequence[corpus_lib.Document], split: str, seq_len: int, cache: Path | None) -> PackedRows:
  if cache is None:
    tokens, starts = build_stream(tok, [x.text for x in docs])
    return PackedRows(tokens, starts, seq_len, tok.pad_id)
  key = hashlib.sha256(f"{_PACK_VERSION}|{tok.name}|{corpus_lib.fingerprint(docs)}".encode()).hexdigest()[:16]
  tok_path, starts_path = cache / f"tokens-{split}-{key}.npy", cache / f"docstarts-{split}-{key}.npy"
  if not (tok_path.is_file() and starts_path.is_file()):
    tokens, starts = build_stream(tok, [x.text for x in docs])
    _atomic_save(starts_path, starts)  # tokens last: its presence marks a complete entry
    _atomic_save(tok_path, tokens)
  return PackedRows(np.load(tok_path, mmap_mode="r"), np.load(starts_path), seq_len, tok.pad_id,
                    files=(str(tok_path), str(starts_path)))


def _atomic_save(path: Path, arr: np.ndarray) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  with open(tmp, "wb") as f:
    np.save(f, arr)
  os.replace(tmp, path)


def _check(d: Any, process_index: int, process_count: int) -> None:
  def need(ok: bool, key: str, msg: str):
    if not ok:
      raise ValueError(f"data.{key}: {msg} (got {d[key]!r})")
  need(int(d["seq_len"]) > 0, "seq_len", "must be positive")
  need(int(d["batch_size"]) > 0, "batch_size", "must be positive")
  need(int(d["num_workers"]) >= 0, "num_workers", "must be >= 0")
  need(int(d["prefetch"]) >= 0, "prefetch", "must be >= 0")
  need(0 <= int(d["shuffle_seed"]) < 2 ** 32, "shuffle_seed", "must be in [0, 2**32)")
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(f"process_index/process_count: need 0 <= index < count (got {process_index}, {process_count})")
  need(int(d["batch_size"]) % process_count == 0, "batch_size",
       f"must be divisible by the process count {process_count}")


def _absl_flags_ready() -> None:
  # grain's worker machinery reads absl flags; outside absl.app.run they are unparsed and
  # reading them raises. Marking them parsed keeps their defaults; app.run still parses argv.
  from absl import flags  # pylint: disable=import-outside-toplevel
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
