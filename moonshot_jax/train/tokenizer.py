"""Tokenizers behind one small interface: byte-level BPE trained locally, local files, raw bytes.

`data.tokenizer` selects one:
  "bpe"   HF `tokenizers` byte-level BPE trained on the training split, cached in
          `<workdir>/data_cache/` under a key of (corpus fingerprint, vocab size), so a changed
          corpus or vocab retrains and a restart does not.
  "byte"  the 256 byte values plus <pad>, <bos>, <eos> (259 ids; needs no training).
  a path  tokenizer.json (HF, or a directory holding one), SentencePiece `.model` (needs the
          `sentencepiece` package), tiktoken BPE ranks `.tiktoken`/`.bpe` (needs `tiktoken`).

Every tokenizer encodes text literally: a document containing the string "<eos>" never yields
the eos id, so document boundaries come only from the packer.
"""
from __future__ import annotations

import hashlib
import importlib
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

SPECIALS = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2 of a trained BPE
NUM_BYTES = 256
MIN_BPE_VOCAB = NUM_BYTES + len(SPECIALS)
_BPE_VERSION = "bpe-v1"  # bump when training settings change: invalidates cached tokenizers

# Names other tokenizer.json files use for their specials, most specific first.
_EOS_NAMES = ("<eos>", "</s>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "[SEP]")
_BOS_NAMES = ("<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]")
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")
# GPT-2's pre-tokenisation split, for tiktoken rank files that carry no pattern of their own.
_TIKTOKEN_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class Tokenizer(Protocol):
  name: str  # identifies the vocabulary; part of the token-cache key
  vocab_size: int
  bos_id: int
  eos_id: int  # document separator
  pad_id: int

  def encode(self, text: str) -> list[int]: ...

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

  def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
  """UTF-8 bytes as ids 0..255; specials after them."""

  def __init__(self):
    self.name = "byte-v1"
    self.pad_id, self.bos_id, self.eos_id = NUM_BYTES, NUM_BYTES + 1, NUM_BYTES + 2
    self.vocab_size = MIN_BPE_VOCAB

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [self.encode(t) for t in texts]

  def decode(self, ids: Sequence[int]) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < NUM_BYTES).decode("utf-8", errors="replace")


class HFTokenizer:
  """Wraps a `tokenizers.Tokenizer` (trained here or loaded from tokenizer.json)."""

  def __init__(self, tok: Any, name: str):
    tok.encode_special_tokens = True  # literal text "<eos>" is not the eos id (not serialised)
    self._tok = tok
    self.name = name
    self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
    found = {kind: next((tok.token_to_id(n) for n in names if tok.token_to_id(n) is not None), None)
             for kind, names in (("eos", _EOS_NAMES), ("bos", _BOS_NAMES), ("pad", _PAD_NAMES))}
    if found["eos"] is None:
      raise ValueError(f"data.tokenizer: {name} has no end-of-document token (looked for {_EOS_NAMES})")
    self.eos_id = int(found["eos"])
    self.bos_id = int(found["bos"]) if found["bos"] is not None else self.eos_id
    self.pad_id = int(found["pad"]) if found["pad"] is not None else self.eos_id  # pads are masked

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

  def save(self, path: str | os.PathLike) -> None:
    _atomic_write_text(Path(path), self._tok.to_str())


class SentencePieceTokenizer:

  def __init__(self, path: Path):
    spm = _optional_import("sentencepiece", path)
    self._sp = spm.SentencePieceProcessor(model_file=str(path))
    self.name = f"spm-{_file_digest(path)}"
    self.vocab_size = int(self._sp.get_piece_size())
    if self._sp.eos_id() < 0:
      raise ValueError(f"data.tokenizer: SentencePiece model {path} has no eos piece")
    self.eos_id = int(self._sp.eos_id())
    self.bos_id = int(self._sp.bos_id()) if self._sp.bos_id() >= 0 else self.eos_id
    self.pad_id = int(self._sp.pad_id()) if self._sp.pad_id() >= 0 else self.eos_id

  def encode(self, text: str) -> list[int]:
    return list(self._sp.encode(text, out_type=int))

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [list(ids) for ids in self._sp.encode(list(texts), out_type=int)]

  def decode(self, ids: Sequence[int]) -> str:
    specials = {self.bos_id, self.eos_id, self.pad_id}
    return self._sp.decode([int(i) for i in ids if int(i) not in specials])


class TiktokenTokenizer:
  """A tiktoken rank file; <eos>, <bos>, <pad> are appended after its ranks."""

  def __init__(self, path: Path):
    tiktoken = _optional_import("tiktoken", path)
    ranks = importlib.import_module("tiktoken.load").load_tiktoken_bpe(str(path))
    n = max(ranks.values()) + 1
    self.eos_id, self.bos_id, self.pad_id = n, n + 1, n + 2
    self._enc = tiktoken.Encoding(name=path.stem, pat_str=_TIKTOKEN_PATTERN, mergeable_ranks=ranks,
                                  special_tokens={s: n + i for i, s in enumerate(("<eos>", "<bos>", "<pad>"))})
    self.name = f"tiktoken-{_file_digest(path)}"
    self.vocab_size = n + 3

  def encode(self, text: str) -> list[int]:
    return self._enc.encode_ordinary(text)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return self._enc.encode_ordinary_batch(list(texts))

  def decode(self, ids: Sequence[int]) -> str:
    return self._enc.decode([int(i) for i in ids if int(i) < self.eos_id])


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
  """Byte-level BPE (GPT-2 style pre-tokenisation, no normaliser): lossless round trip."""
  if vocab_size < MIN_BPE_VOCAB:
    raise ValueError(f"vocab_size: byte-level BPE needs >= {MIN_BPE_VOCAB} (got {vocab_size})")
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), min_frequency=2,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator(texts, trainer)
  return HFTokenizer(tok, name=f"bpe-{hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]}")


def load_tokenizer_file(path: str | os.PathLike) -> Tokenizer:
  """A local tokenizer file, chosen by its suffix; a directory must hold tokenizer.json."""
  p = Path(path).expanduser()
  if p.is_dir():
    p = p / "tokenizer.json"
  if not p.is_file():
    raise ValueError(f"data.tokenizer: no tokenizer file at {p} (expected \"bpe\", \"byte\" or a file path)")
  if p.suffix == ".json":
    try:
      tok = tokenizers.Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises its own exception type for malformed files
      raise ValueError(f"data.tokenizer: {p} is not a valid HF tokenizer.json ({e})") from e
    return HFTokenizer(tok, name=f"hf-{_file_digest(p)}")
  if p.suffix == ".model":
    return SentencePieceTokenizer(p)
  if p.suffix in (".tiktoken", ".bpe"):
    return TiktokenTokenizer(p)
  raise ValueError(f"data.tokenizer: unknown tokenizer file type {p.suffix!r} of {p} "
                   "(expected .json, .model or .tiktoken/.bpe)")


def load_or_train_tokenizer(data_cfg: Any, workdir: str | os.PathLike | None, model_vocab_size: int,
                            texts_iter_factory: Callable[[], Iterable[str]], corpus_key: str) -> Tokenizer:
  """The tokenizer `data_cfg["tokenizer"]` names, checked to fit `model_vocab_size`.

  texts_iter_factory: returns a fresh iterable over the training-split texts (called only when a
    BPE has to be trained). corpus_key: a fingerprint of those texts; part of the cache key.
  """
  kind = str(data_cfg["tokenizer"])
  requested = int(data_cfg["tokenizer_vocab_size"])
  if requested < 0:
    raise ValueError(f"data.tokenizer_vocab_size: must be >= 0 (got {requested})")
  if requested > model_vocab_size:
    raise ValueError(f"data.tokenizer_vocab_size={requested} exceeds model.vocab_size={model_vocab_size}")
  if kind == "byte":
    tok: Tokenizer = ByteTokenizer()
  elif kind == "bpe":
    vocab = requested or model_vocab_size
    if vocab < MIN_BPE_VOCAB:
      key = "data.tokenizer_vocab_size" if requested else "model.vocab_size"
      raise ValueError(f"{key}: a byte-level BPE needs a vocab of at least {MIN_BPE_VOCAB} (got {vocab})")
    tok = _cached_bpe(workdir, vocab, texts_iter_factory, corpus_key)
  else:
    tok = load_tokenizer_file(kind)
  if tok.vocab_size > model_vocab_size:
    raise ValueError(f"data.tokenizer: {tok.name} has {tok.vocab_size} ids, more than "
                     f"model.vocab_size={model_vocab_size} (raise model.vocab_size or lower "
                     "data.tokenizer_vocab_size)")
  return tok


def _cached_bpe(workdir, vocab: int, texts_iter_factory, corpus_key: str) -> HFTokenizer:
  if workdir is None:
    return train_bpe(texts_iter_factory(), vocab)
  key = hashlib.sha256(f"{_BPE_VERSION}|{vocab}|{corpus_key}".encode()).hexdigest()[:16]
  path = Path(workdir) / "data_cache" / f"tokenizer-{key}.json"
  if path.is_file():
    tok = tokenizers.Tokenizer.from_file(str(path))
    return HFTokenizer(tok, name=f"bpe-{hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]}")
  trained = train_bpe(texts_iter_factory(), vocab)
  trained.save(path)
  return trained


def _optional_import(module: str, path: Path):
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise ValueError(f"data.tokenizer: {path} needs the `{module}` package, which is not installed "
                     f"(pip install {module})") from e


def _file_digest(path: Path) -> str:
  return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _atomic_write_text(path: Path, text: str) -> None:
  # Several hosts (or tests) may share a workdir: write elsewhere, then rename into place.
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  tmp.write_text(text, encoding="utf-8")
  os.replace(tmp, path)
