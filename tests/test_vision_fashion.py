"""Real images: the IDX reader, Fashion-MNIST photos in the vision-language corpus, and bad files
(tiny synthetic IDX files written here; no jax compile: fast). The installed Debian package is read
only by the last test, which skips when it is absent."""
from __future__ import annotations

import gzip
import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

from moonshot_jax.experiment import vision_config
from moonshot_jax.vision import data as vl_data
from moonshot_jax.vision import fashion

ROOT = Path(__file__).resolve().parents[1]


def _idx_bytes(arr: np.ndarray) -> bytes:
  head = bytes([0, 0, 0x08, arr.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in arr.shape)
  return head + arr.astype(np.uint8).tobytes()


def _write(path: Path, data: bytes) -> str:
  if path.name.endswith(".gz"):
    data = gzip.compress(data)
  path.write_bytes(data)
  return str(path)


def _images(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(seed)
  return rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), (np.arange(n) % 10).astype(np.uint8)


@pytest.fixture
def fashion_dir(tmp_path):
  for prefix, n, seed in (("train", 40, 1), ("t10k", 20, 2)):
    images, labels = _images(n, seed)
    _write(tmp_path / f"{prefix}-images-idx3-ubyte.gz", _idx_bytes(images))
    _write(tmp_path / f"{prefix}-labels-idx1-ubyte", _idx_bytes(labels))  # uncompressed works too
  fashion.load.cache_clear()
  yield str(tmp_path)
  fashion.load.cache_clear()


def test_read_idx_round_trip(tmp_path):
  images, _ = _images(3, 0)
  for name in ("x-idx3-ubyte", "x-idx3-ubyte.gz"):
    np.testing.assert_array_equal(fashion.read_idx(_write(tmp_path / name, _idx_bytes(images))), images)


@pytest.mark.parametrize("case", ["magic", "type", "truncated", "trailing", "header", "gzip", "missing"])
def test_bad_idx_file_names_the_file(tmp_path, case):
  good = _idx_bytes(_images(2, 0)[0])
  data = {"magic": b"\x01" + good[1:], "type": good[:2] + b"\x0d" + good[3:], "truncated": good[:-5],
          "trailing": good + b"\x00", "header": good[:9], "gzip": None, "missing": None}[case]
  path = tmp_path / "bad-idx3-ubyte"
  if case == "gzip":
    path = tmp_path / "bad-idx3-ubyte.gz"
    path.write_bytes(b"not gzip at all")
  elif case != "missing":
    path.write_bytes(data)
  with pytest.raises(ValueError, match="bad-idx3-ubyte"):
    fashion.read_idx(str(path))


def test_inconsistent_pair_names_the_file(fashion_dir):
  labels = os.path.join(fashion_dir, "t10k-labels-idx1-ubyte")
  _write(Path(labels), _idx_bytes(np.zeros(19, np.uint8)))  # 19 labels for 20 images
  with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte: 19 labels for the 20 images"):
    fashion.load(fashion_dir, "eval")
  _write(Path(labels), _idx_bytes(np.full(20, 10, np.uint8)))
  fashion.load.cache_clear()
  with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte: label 10 is not a class index"):
    fashion.load(fashion_dir, "eval")
  with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist"):
    fashion.load(os.path.join(fashion_dir, "nowhere"), "train")


def _vl_config(overrides):
  spec = importlib.util.spec_from_file_location("vl_tiny", ROOT / "experiments" / "vl_tiny.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  cfg = mod.get_config()
  small = {"vl.train_scenes": 100, "vl.eval_qa": 20, "vl.eval_captions": 4, "vl.eval_text": 2,
           "vl.patch_budget": 512, "data.batch_size": 8}
  for key, value in {**small, **overrides}.items():
    section, name = key.split(".")
    cfg[section][name] = value
  return cfg


def test_photos_join_the_corpus(fashion_dir):
  cfg = _vl_config({"vl.fashion_dir": fashion_dir, "vl.fashion_train": 30, "vl.fashion_eval": 10})
  d = vl_data.make_vl_data(cfg, vision_config(cfg), None)
  tok = d.tokenizer
  photo_docs = lambda docs: [x for x in docs if isinstance(x.scene, fashion.Photo)]  # noqa: E731
  train, held = photo_docs(d.train_docs), photo_docs(d.eval_docs)
  assert len(train) == 30 and len(held) == 10
  assert {x.scene.split for x in train} == {"train"} and {x.scene.split for x in held} == {"eval"}
  assert sum(x.kind == "qa" for x in held) == 5  # half of the held-out photos are questions
  eval_images, eval_labels = _images(20, 2)
  for x in held:
    text = tok.decode([int(t) for t in x.ids if t != d.image_token_id and t < tok.vocab_size])
    name = fashion.CLASSES[eval_labels[x.scene.index]]
    if x.kind == "qa":
      assert x.qtype == "fashion" and text.endswith(f"Q: {fashion.QUESTION} A: {name}")
    else:
      assert name in text
    # 28 px x scale 2 = 4x4 patches = 4 merged tokens, each one placeholder
    assert x.n_patches == 16 and int(np.sum(x.ids == d.image_token_id)) == 4
    pixels = np.asarray(vl_data.render(x.scene))
    assert pixels.shape == (56, 56, 3)
    np.testing.assert_array_equal(pixels[::2, ::2, 0], eval_images[x.scene.index])
    assert not np.asarray(vl_data.render(x.scene, blank=True)).any()
  # the held-out batches carry the photos: the blanked ones differ only in pixel values
  b, blank = next(d.eval_batches(meta=True)), next(d.eval_batches(blank=True, meta=True))
  assert "fashion" in sum((bb["qtypes"] for bb in d.eval_batches(meta=True)), [])
  assert np.array_equal(b["tokens"], blank["tokens"]) and not np.array_equal(b["pixel_values"], blank["pixel_values"])
  with pytest.raises(ValueError, match="vl.fashion_eval: 21 images wanted, the eval file holds 20"):
    vl_data.make_vl_data(_vl_config({"vl.fashion_dir": fashion_dir, "vl.fashion_eval": 21}),
                         vision_config(cfg), None)


@pytest.mark.skipif(not os.path.isdir(fashion.DEFAULT_DIR),
                    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
def test_installed_fashion_mnist():
  images, labels = fashion.load(fashion.DEFAULT_DIR, "eval")
  assert images.shape == (10000, 28, 28) and np.array_equal(np.bincount(labels), [1000] * 10)
  assert 0 < images.mean() < 255
