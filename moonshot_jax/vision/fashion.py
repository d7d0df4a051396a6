"""Real images for the vision-language corpus: Fashion-MNIST read from local IDX files.

Debian's `dataset-fashion-mnist` installs the four files under /usr/share/datasets/fashion-mnist
(`{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz`); nothing is downloaded. IDX layout: two zero
bytes, a type code (0x08 = unsigned byte, the only one these files use), the number of dimensions,
then each dimension as a big-endian uint32, then the values in C order. A file that breaks the
layout, or a pair whose counts or labels disagree, raises ValueError naming the file.

A `Photo` is a hashable reference (split, index) to one 28x28 grey image, upscaled `scale` times
(nearest neighbour) so that it spans several patches: at scale 2 a 56x56 image is 4x4 patches,
4 merged tokens. `render(photo, blank=True)` is the same-size black canvas (the images' background).
"""
from __future__ import annotations

import dataclasses
import functools
import gzip
import os

import numpy as np
from PIL import Image

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
# the dataset's label order; answers are lower-case
CLASSES = ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot")
QUESTION = "What clothing item is this?"
SPLIT_PREFIX = {"train": "train", "eval": "t10k"}  # held-out questions come from the test file


def read_idx(path: str) -> np.ndarray:
  """The uint8 array stored in an IDX file (gzip-compressed when the name ends in .gz)."""
  try:
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
      raw = f.read()
  except (OSError, EOFError) as e:  # missing, unreadable, or a corrupt gzip stream
    raise ValueError(f"{path}: cannot read IDX file ({e})") from None
  if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
    raise ValueError(f"{path}: not an IDX file (the first two bytes must be zero)")
  if raw[2] != 0x08:
    raise ValueError(f"{path}: IDX type code {raw[2]:#04x} is not supported (only 0x08, unsigned byte)")
  ndim = raw[3]
  if ndim < 1 or len(raw) < 4 + 4 * ndim:
    raise ValueError(f"{path}: IDX header of {ndim} dimensions is missing or truncated")
  dims = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
  body = len(raw) - 4 - 4 * ndim
  if body != int(np.prod(dims)):
    raise ValueError(f"{path}: dimensions {dims} need {int(np.prod(dims))} bytes of data, the file holds {body}")
  return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _find(directory: str, stem: str) -> str:
  for name in (stem + ".gz", stem):
    p = os.path.join(directory, name)
    if os.path.isfile(p):
      return p
  raise FileNotFoundError(f"{os.path.join(directory, stem)}[.gz] not found: install Fashion-MNIST "
                          "(Debian: apt-get install dataset-fashion-mnist) or set vl.fashion_dir")


@functools.lru_cache(maxsize=4)
def load(directory: str, split: str) -> tuple[np.ndarray, np.ndarray]:
  """(images uint8 [n, h, w], labels uint8 [n]) of split "train" or "eval" (the t10k files)."""
  if split not in SPLIT_PREFIX:
    raise ValueError(f"split: expected one of {tuple(SPLIT_PREFIX)}, got {split!r}")
  ipath = _find(directory, f"{SPLIT_PREFIX[split]}-images-idx3-ubyte")
  lpath = _find(directory, f"{SPLIT_PREFIX[split]}-labels-idx1-ubyte")
  images, labels = read_idx(ipath), read_idx(lpath)
  if images.ndim != 3:
    raise ValueError(f"{ipath}: expected images [n, h, w], got dimensions {images.shape}")
  if labels.ndim != 1:
    raise ValueError(f"{lpath}: expected labels [n], got dimensions {labels.shape}")
  if len(images) != len(labels):
    raise ValueError(f"{lpath}: {len(labels)} labels for the {len(images)} images of {ipath}")
  if labels.size and int(labels.max()) >= len(CLASSES):
    raise ValueError(f"{lpath}: label {int(labels.max())} is not a class index (0..{len(CLASSES) - 1})")
  return images, labels


@dataclasses.dataclass(frozen=True)
class Photo:
  directory: str
  split: str  # train | eval
  index: int
  label: int
  h: int  # rendered size in px (the file's size times the scale)
  w: int


def sample_photos(directory: str, split: str, n: int, scale: int, seed: int) -> list[Photo]:
  """n distinct images of the split in a seeded order."""
  images, labels = load(directory, split)
  if n > len(images):
    raise ValueError(f"vl.fashion_{split}: {n} images wanted, the {split} file holds {len(images)}")
  idx = np.random.default_rng([seed, {"eval": 11, "train": 12}[split]]).permutation(len(images))[:n]
  h, w = images.shape[1] * scale, images.shape[2] * scale
  return [Photo(directory, split, int(i), int(labels[i]), h, w) for i in idx]


def render(photo: Photo, blank: bool = False) -> Image.Image:
  if blank:
    return Image.new("RGB", (photo.w, photo.h))
  grey = load(photo.directory, photo.split)[0][photo.index]
  sh, sw = photo.h // grey.shape[0], photo.w // grey.shape[1]
  big = np.repeat(np.repeat(grey, sh, axis=0), sw, axis=1)
  return Image.fromarray(np.stack([big] * 3, -1), "RGB")


def answer(photo: Photo) -> str:
  return CLASSES[photo.label]


def caption(photo: Photo) -> str:
  name = CLASSES[photo.label]
  return f"A photo of {'an' if name[0] in 'aeiou' else 'a'} {name}."
