"""The vision-language corpus (offline, deterministic) and its packed static-shape batches.

Documents (token ids; `I` = vl.image_token_id, one per merged vision token of the image):
  qa       <bos> I..I "Q: What colour is the shape? A:" " red" <eos>    (one question per image)
  caption  <bos> I..I "A red circle at the top left." <eos>
  text     <bos> a chunk of <= seq_len - 2 tokens of a corpus document <eos>   (data.corpus, as text runs)
Scenes come from scenes.py with numpy Generators seeded by (vl.scene_seed, split): the same config
gives the same corpus on every machine. Optionally (vl.fashion_train / vl.fashion_eval > 0) real
images join them: Fashion-MNIST photos from local IDX files (fashion.py; held-out ones from the test
file), as captions ("A photo of a sneaker.") and questions (qtype "fashion": the item's class). Held-out scenes are sampled first and every train scene equal
to one of them is dropped, so the splits are disjoint by construction; held-out text chunks come from
the corpus' held-out documents (corpus.split_documents).

Packing (the conventions of train/data.py for one row; documents are never split): documents are
placed in a seeded order, first-fit into the B rows of the open batch; a batch closes when a document
fits in no row or its patches would exceed vl.patch_budget. Per row, as in text training:
segment_ids 1, 2, ... per document (0 = padding), positions restart per document, targets = tokens
shifted by one, loss_mask 1 where the target is a real token of the same document and not an image
placeholder. The vision fields of a batch (VISION_FIELDS) hold its images in the row-major order of
their placeholders, padded to the static budgets: pixel_values [P, 3*p*p] and the PatchLayout arrays
(P patches, M = P / merge_size tokens). The composition of the train batches is fixed; grain shuffles
their order every epoch (checkpointable iterator: `get_state` / `set_state` as in train/data.py).
Single-process only: the images of a batch are not split over processes.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterator, Sequence

import grain
import numpy as np

from moonshot_jax.train import corpus as corpus_lib
from moonshot_jax.train import tokenizer as tokenizer_lib
from moonshot_jax.vision import fashion as fashion_lib
from moonshot_jax.vision import scenes as scenes_lib
from moonshot_jax.vision.config import VisionConfig, check_vl_config
from moonshot_jax.vision.layout import patch_layout
from moonshot_jax.vision.processor import preprocess

TEXT_FIELDS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")
VISION_FIELDS = ("pixel_values", "patch_segment_ids", "patch_pos_hw", "patch_frame_index",
                 "patch_interp_index", "patch_interp_weight", "token_merge_index", "token_merge_weight")
LAYOUT_FIELDS = dict(zip(VISION_FIELDS[1:], ("segment_ids", "pos_hw", "frame_index", "interp_index",
                                          "interp_weight", "merge_index", "merge_weight")))
KINDS = ("text", "caption", "qa")  # doc_kind per token: 1 + index, 0 = padding
QTYPES = tuple(scenes_lib.ANSWERS)  # of the generated scenes; "fashion" for the real photos
_KIND_OF_QTYPE = {"colour": "single", "shape": "single", "position": "single", "count": "count",
                  "digit": "digit"}


@dataclasses.dataclass(frozen=True)
class Doc:
  kind: str  # text | caption | qa
  ids: np.ndarray  # int32 [n]: <bos> ... <eos>, placeholders included
  scene: scenes_lib.Scene | fashion_lib.Photo | None = None  # the image: generated or real
  qtype: str = ""
  answer_len: int = 0  # qa: answer tokens + <eos>, the last targets of the document
  n_patches: int = 0


@dataclasses.dataclass(frozen=True)
class VLStats:
  train_docs: int
  eval_docs: int
  train_tokens: int
  eval_tokens: int
  train_batches: int
  eval_batches: int
  vocab_size: int
  tokenizer: str
  train_images: int
  mean_patches_per_batch: float


def render(image, blank: bool = False):
  """The PIL image of a document's scene or photo."""
  if isinstance(image, fashion_lib.Photo):
    return fashion_lib.render(image, blank)
  return scenes_lib.render(image, blank)


def image_grid(vcfg: VisionConfig, scene) -> tuple[int, int]:
  """(h, w) in patches after the processor (no resize at these sizes; padded to the merge kernel)."""
  p = vcfg.patch_size
  kh, kw = vcfg.merge_kernel
  return -(-scene.h // (p * kh)) * kh, -(-scene.w // (p * kw)) * kw


def _sample_scenes(seed: int, split: str, n: int, exclude=frozenset(),
                   only: str = "") -> list[tuple[scenes_lib.Scene, str]]:
  """n (scene, question type) pairs; question types uniform, so each kind of question is balanced, or
  all `only` (split "extra": a stream of its own, so the uniform train split stays as it is)."""
  rng = np.random.default_rng([seed, {"eval": 1, "train": 2, "extra": 5}[split]])
  out = []
  while len(out) < n:
    qtype = only or QTYPES[rng.integers(len(QTYPES))]
    scene = scenes_lib.sample_scene(rng, _KIND_OF_QTYPE[qtype])
    if scene not in exclude:
      out.append((scene, qtype))
  return out


def _image_doc(tok, vcfg: VisionConfig, image_token_id: int, scene, qtype: str, kind: str) -> Doc:
  gh, gw = image_grid(vcfg, scene)
  placeholders = [image_token_id] * (gh * gw // vcfg.merge_size)
  real = isinstance(scene, fashion_lib.Photo)
  if kind == "caption":
    text = fashion_lib.caption(scene) if real else scenes_lib.caption(scene)
    ids = [tok.bos_id, *placeholders, *tok.encode(text), tok.eos_id]
    return Doc("caption", np.asarray(ids, np.int32), scene, n_patches=gh * gw)
  question = fashion_lib.QUESTION if real else scenes_lib.QUESTIONS[qtype]
  ans = tok.encode(" " + (fashion_lib.answer(scene) if real else scenes_lib.answer(scene, qtype)))
  ids = [tok.bos_id, *placeholders, *tok.encode(f"Q: {question} A:"), *ans, tok.eos_id]
  return Doc("qa", np.asarray(ids, np.int32), scene, qtype, answer_len=len(ans) + 1, n_patches=gh * gw)


def _text_docs(tok, docs: Sequence[corpus_lib.Document], n: int, seq_len: int, seed: int) -> list[Doc]:
  """n chunks of <= seq_len - 2 tokens, taken from the documents in a seeded order."""
  out: list[Doc] = []
  order = np.random.default_rng(seed).permutation(len(docs))
  for i in order:
    ids = tok.encode(docs[int(i)].text)
    for s in range(0, len(ids), seq_len - 2):
      piece = ids[s:s + seq_len - 2]
      if len(piece) >= 8:
        out.append(Doc("text", np.asarray([tok.bos_id, *piece, tok.eos_id], np.int32)))
      if len(out) == n:
        return out
  if n and len(out) < n:
    raise ValueError(f"vl: the corpus gives only {len(out)} text chunks, {n} wanted (lower vl.text_fraction)")
  return out


def pack(docs: Sequence[Doc], order: Sequence[int], rows: int, seq_len: int, patch_budget: int
         ) -> list[tuple[tuple[int, ...], ...]]:
  """Batches of `rows` rows, each a tuple of document indices (see the module docstring)."""
  batches, cur, free, patches = [], [[] for _ in range(rows)], [seq_len] * rows, 0
  for i in order:
    d = docs[int(i)]
    if len(d.ids) > seq_len:
      raise ValueError(f"vl: a {d.kind} document of {len(d.ids)} tokens does not fit data.seq_len={seq_len}")
    if d.n_patches > patch_budget:
      raise ValueError(f"vl.patch_budget={patch_budget}: an image of {d.n_patches} patches does not fit")
    r = next((j for j in range(rows) if free[j] >= len(d.ids)), None)
    if r is None or patches + d.n_patches > patch_budget:
      batches.append(tuple(tuple(x) for x in cur))
      cur, free, patches = [[] for _ in range(rows)], [seq_len] * rows, 0
      r = 0
    cur[r].append(int(i))
    free[r] -= len(d.ids)
    patches += d.n_patches
  if any(cur):
    batches.append(tuple(tuple(x) for x in cur))
  return batches


class BatchBuilder:
  """plan entry (rows of document indices) -> numpy batch; `meta=True` adds the host-only fields
  doc_kind [B, T] (1 + KINDS index, 0 = padding) and answer_id [B, T] (1 + index of the qa document
  at its answer targets, else 0) with qtypes (the question type of each answer id)."""

  def __init__(self, docs: Sequence[Doc], vcfg: VisionConfig, seq_len: int, pad_id: int, image_token_id: int,
               patch_budget: int, blank: bool = False):
    self.docs, self.vcfg, self.T, self.pad_id = docs, vcfg, seq_len, pad_id
    self.image_token_id, self.P, self.blank = image_token_id, patch_budget, blank
    self.M = patch_budget // vcfg.merge_size

  def __call__(self, rows: Sequence[Sequence[int]], meta: bool = False) -> dict[str, Any]:
    B, T = len(rows), self.T
    tok = np.full((B, T + 1), self.pad_id, np.int32)
    seg, pos, kind, ans = (np.zeros((B, T), np.int32) for _ in range(4))
    qtypes, images = [], []
    for b, row in enumerate(rows):
      at = 0
      for s, i in enumerate(row):
        d = self.docs[i]
        n = len(d.ids)
        tok[b, at:at + n] = d.ids
        seg[b, at:at + n], pos[b, at:at + n], kind[b, at:at + n] = s + 1, np.arange(n), 1 + KINDS.index(d.kind)
        if d.kind == "qa":  # targets at t predict token t+1: the answer + <eos> are the last targets
          qtypes.append(d.qtype)
          ans[b, at + n - 1 - d.answer_len:at + n - 1] = len(qtypes)
        if d.scene is not None:
          images.append(render(d.scene, blank=self.blank))
        at += n
    targets = tok[:, 1:]
    same_doc = np.concatenate([seg[:, 1:] == seg[:, :-1], np.zeros((B, 1), bool)], 1)
    loss = (seg > 0) & same_doc & (targets != self.image_token_id)
    out = dict(tokens=tok[:, :T], targets=targets.copy(), segment_ids=seg, positions=pos,
               loss_mask=loss.astype(np.int32), **self._vision(images, tok[:, :T]))
    if meta:
      out.update(doc_kind=kind, answer_id=ans, qtypes=qtypes)
    return out

  def _vision(self, images, tokens) -> dict[str, np.ndarray]:
    vcfg, P = self.vcfg, self.P
    pv = np.zeros((P, vcfg.patch_dim), np.float32)
    if images:
      pixels, grid = preprocess(images, vcfg)
      lay = patch_layout(vcfg, grid, P, self.M)
      pv[:pixels.shape[0]] = pixels.reshape(pixels.shape[0], -1)
      n_tok = lay.n_real_tokens
    else:  # an image-free batch: all padding (no token is ever read)
      lay = patch_layout(vcfg, np.array([[1, *vcfg.merge_kernel]]), P, self.M)
      lay = dataclasses.replace(lay, segment_ids=np.full(P, -1, np.int32), merge_weight=np.zeros_like(lay.merge_weight))
      n_tok = 0
    placeholders = int(np.sum(tokens == self.image_token_id))
    if placeholders != n_tok:  # the packer's invariant; vision/multimodal.py's check, on the host
      raise ValueError(f"image placeholders: the batch holds {placeholders} but its images give {n_tok} tokens")
    out = {"pixel_values": pv}
    out.update({k: np.asarray(getattr(lay, f)) for k, f in LAYOUT_FIELDS.items()})
    return out


class VLData:
  """Tokenizer, stats, the train iterator and the held-out batches of a vision-language experiment."""

  def __init__(self, tokenizer, train_docs, eval_docs, vcfg: VisionConfig, cfg: Any):
    d, vl = cfg.data, cfg.vl
    self.tokenizer, self.vcfg = tokenizer, vcfg
    self.seq_len, self.global_batch_size = int(d.seq_len), int(d.batch_size)
    self.local_batch_size = self.global_batch_size
    self.image_token_id, self.patch_budget = int(vl.image_token_id), int(vl.patch_budget)
    self._seed, self._prefetch = int(d.shuffle_seed), int(d.prefetch)
    self.train_docs, self.eval_docs = train_docs, eval_docs
    B, T, P = self.global_batch_size, self.seq_len, self.patch_budget
    order = np.random.default_rng([self._seed, 7]).permutation(len(train_docs))
    self.train_plan = pack(train_docs, order, B, T, P)
    self.eval_plan = pack(eval_docs, np.arange(len(eval_docs)), B, T, P)
    if bool(vl.text_only):  # the control run: the same batches and steps with every image document dropped
      self.train_plan = _text_rows(train_docs, self.train_plan)
      self.eval_plan = _text_rows(eval_docs, self.eval_plan)
      self.patch_budget = vcfg.merge_size  # no image: the tower runs on one padding token, not P patches
    self.builder = self._builder(train_docs)
    patches = [sum(train_docs[i].n_patches for row in b for i in row) for b in self.train_plan]
    self.stats = VLStats(
        train_docs=len(train_docs), eval_docs=len(eval_docs),
        train_tokens=int(sum(len(x.ids) for x in train_docs)), eval_tokens=int(sum(len(x.ids) for x in eval_docs)),
        train_batches=len(self.train_plan), eval_batches=len(self.eval_plan), vocab_size=tokenizer.vocab_size,
        tokenizer=tokenizer.name, train_images=sum(x.scene is not None for x in train_docs),
        mean_patches_per_batch=float(np.mean(patches)))
    self.num_eval_batches = len(self.eval_plan)

  def _builder(self, docs, blank=False) -> BatchBuilder:
    return BatchBuilder(docs, self.vcfg, self.seq_len, self.tokenizer.pad_id, self.image_token_id,
                        self.patch_budget, blank)

  def train_dataset(self) -> grain.IterDataset:
    plan = self.train_plan
    ds = grain.MapDataset.range(len(plan)).shuffle(seed=self._seed).repeat(None).map(
        lambda j: self.builder(plan[j]))
    threads = 1 if self._prefetch > 0 else 0
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=self._prefetch))

  def train_iter(self) -> grain.DatasetIterator:
    return iter(self.train_dataset())

  def eval_batches(self, blank: bool = False, meta: bool = False) -> Iterator[dict]:
    """Every held-out batch in order; blank=True renders each image as its empty canvas."""
    build = self._builder(self.eval_docs, blank)
    for rows in self.eval_plan:
      yield build(rows, meta=meta)


def _text_rows(docs: Sequence[Doc], plan):
  """The plan with only its text documents (rows keep their place; empty batches dropped)."""
  out = [tuple(tuple(i for i in row if docs[i].kind == "text") for row in b) for b in plan]
  return [b for b in out if any(b)]


@functools.lru_cache(maxsize=4)
def _corpus(data_key: tuple) -> tuple[list, list]:
  d = dict(data_key)
  docs = corpus_lib.load_documents(d)
  return corpus_lib.split_documents(docs, float(d["eval_fraction"]))


def make_vl_data(cfg: Any, vcfg: VisionConfig, workdir) -> VLData:
  """Builds the corpus of cfg.vl (scenes, questions, captions, corpus text) and packs it."""
  import jax  # noqa: PLC0415
  if jax.process_count() != 1:
    raise ValueError(f"vl: vision-language data is single-process (got {jax.process_count()} processes)")
  d, vl = cfg.data, cfg.vl
  data_key = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(d.to_dict().items()))
  text_train, text_eval = _corpus(data_key)
  tok = tokenizer_lib.load_or_train_tokenizer(d, workdir, int(cfg.model.vocab_size),
                                              lambda: (x.text for x in text_train),
                                              corpus_key=corpus_lib.fingerprint(text_train))
  check_vl_config(cfg, vcfg, tok.vocab_size)
  T, seed, img = int(d.seq_len), int(vl.scene_seed), int(vl.image_token_id)
  n_qa, n_cap = int(vl.eval_qa), int(vl.eval_captions)
  held = _sample_scenes(seed, "eval", n_qa + n_cap)
  eval_docs = [_image_doc(tok, vcfg, img, s, q, "qa") for s, q in held[:n_qa]]
  eval_docs += [_image_doc(tok, vcfg, img, s, q, "caption") for s, q in held[n_qa:]]
  eval_docs += _text_docs(tok, text_eval, int(vl.eval_text), T, seed)
  held_out = frozenset(s for s, _ in held)
  train = _sample_scenes(seed, "train", int(vl.train_scenes), exclude=held_out)
  # extra digit scenes (the slowest question type to learn), drawn after the uniform ones from their own stream
  train += _sample_scenes(seed, "extra", int(vl.extra_digit_scenes), exclude=held_out, only="digit")
  is_cap = np.random.default_rng([seed, 3]).random(len(train)) < float(vl.caption_fraction)
  train_docs = [_image_doc(tok, vcfg, img, s, q, "caption" if c else "qa") for (s, q), c in zip(train, is_cap)]
  if int(vl.fashion_train) or int(vl.fashion_eval):  # real photos: half of the held-out ones captioned
    fdir, scale = str(vl.fashion_dir), int(vl.fashion_scale)
    held_p = fashion_lib.sample_photos(fdir, "eval", int(vl.fashion_eval), scale, seed)
    n_cap_p = len(held_p) // 2
    eval_docs += [_image_doc(tok, vcfg, img, p, "fashion", "qa") for p in held_p[n_cap_p:]]
    eval_docs += [_image_doc(tok, vcfg, img, p, "fashion", "caption") for p in held_p[:n_cap_p]]
    photos = fashion_lib.sample_photos(fdir, "train", int(vl.fashion_train), scale, seed)
    cap_p = np.random.default_rng([seed, 4]).random(len(photos)) < float(vl.caption_fraction)
    train_docs += [_image_doc(tok, vcfg, img, p, "fashion", "caption" if c else "qa") for p, c in zip(photos, cap_p)]
  frac = float(vl.text_fraction)
  train_docs += _text_docs(tok, text_train, int(round(len(train_docs) * frac / (1 - frac))), T, seed)
  return VLData(tok, train_docs, eval_docs, vcfg, cfg)
