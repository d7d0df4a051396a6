"""The generated vision-language corpus and its packing: determinism, disjoint held-out split, patch
budget, placeholder counts, loss masks, answer spans, and bad inputs (no jax compile: fast)."""
from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from moonshot_jax.config import ConfigError
from moonshot_jax.experiment import vision_config
from moonshot_jax.vision import data as vl_data
from moonshot_jax.vision import scenes

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"vl.train_scenes": 300, "vl.eval_qa": 60, "vl.eval_captions": 10, "vl.eval_text": 4,
         "vl.patch_budget": 512, "data.batch_size": 8}


def vl_config(overrides=None):
  spec = importlib.util.spec_from_file_location("vl_tiny", ROOT / "experiments" / "vl_tiny.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  cfg = mod.get_config()
  for key, value in {**SMALL, **(overrides or {})}.items():
    section, name = key.split(".")
    cfg[section][name] = value
  return cfg


@pytest.fixture(scope="module")
def corpus():
  cfg = vl_config()
  return cfg, vl_data.make_vl_data(cfg, vision_config(cfg), None)


def _digest(batch) -> str:
  h = hashlib.sha256()
  for k in sorted(batch):
    if isinstance(batch[k], np.ndarray):
      h.update(k.encode() + batch[k].tobytes())
  return h.hexdigest()


def test_corpus_is_deterministic(corpus):
  cfg, d = corpus
  again = vl_data.make_vl_data(cfg, vision_config(cfg), None)
  assert d.train_plan == again.train_plan and d.eval_plan == again.eval_plan
  assert all(np.array_equal(a.ids, b.ids) and a.scene == b.scene for a, b in zip(d.train_docs, again.train_docs))
  it_a, it_b = d.train_iter(), again.train_iter()
  for _ in range(3):
    assert _digest(next(it_a)) == _digest(next(it_b))
  # a different scene seed gives a different corpus (the seed is really used)
  other = vl_data.make_vl_data(vl_config({"vl.scene_seed": 1}), vision_config(cfg), None)
  assert [x.scene for x in other.eval_docs[:20]] != [x.scene for x in d.eval_docs[:20]]


def test_held_out_split_is_disjoint(corpus):
  _, d = corpus
  held = {x.scene for x in d.eval_docs if x.scene is not None}
  train = {x.scene for x in d.train_docs if x.scene is not None}
  assert held and train and not held & train
  pixels = lambda docs: {scenes.render(x.scene).tobytes() for x in docs if x.scene is not None}  # noqa: E731
  assert not pixels(d.eval_docs) & pixels(d.train_docs[:400])
  train_text = {x.ids.tobytes() for x in d.train_docs if x.kind == "text"}
  assert not {x.ids.tobytes() for x in d.eval_docs if x.kind == "text"} & train_text
  # the exclusion is what guarantees it: sampling the held-out stream itself with exclusion
  # (every draw a collision) yields none of the held-out scenes
  first = vl_data._sample_scenes(0, "eval", 50)
  again = vl_data._sample_scenes(0, "eval", 50, exclude=frozenset(s for s, _ in first[:25]))
  assert not {s for s, _ in first[:25]} & {s for s, _ in again}
  # every question type and answer occurs in the held-out QA
  qa = [x for x in d.eval_docs if x.kind == "qa"]
  assert {x.qtype for x in qa} == set(vl_data.QTYPES)


def test_packing_respects_budgets_and_placeholders(corpus):
  cfg, d = corpus
  B, T, P, img = int(cfg.data.batch_size), int(cfg.data.seq_len), int(cfg.vl.patch_budget), 300
  used = [i for b in d.train_plan for row in b for i in row]
  assert sorted(used) == list(range(len(d.train_docs)))  # every document exactly once
  for plan in d.train_plan:
    assert len(plan) == B
    assert sum(d.train_docs[i].n_patches for row in plan for i in row) <= P
    assert all(sum(len(d.train_docs[i].ids) for i in row) <= T for row in plan)
  for j, batch in enumerate(d.eval_batches(meta=True)):
    assert batch["pixel_values"].shape == (P, 3 * 14 * 14) and batch["token_merge_index"].shape[0] == P // 4
    n_img = int((batch["tokens"] == img).sum())
    assert n_img == int((batch["token_merge_weight"].sum(1) > 0).sum())  # placeholders == image tokens
    assert int((batch["patch_segment_ids"] >= 0).sum()) <= P
    assert not (batch["loss_mask"].astype(bool) & (batch["targets"] == img)).any()  # no loss on images
    assert (batch["loss_mask"][batch["segment_ids"] == 0] == 0).all()
    for a, q in enumerate(batch["qtypes"]):  # answer targets: " <answer>" of that type, then <eos>
      span = batch["targets"][batch["answer_id"] == a + 1]
      assert span[-1] == d.tokenizer.eos_id
      text = d.tokenizer.decode([int(t) for t in span[:-1]])
      assert text[0] == " " and text[1:] in scenes.ANSWERS[q], (q, text)
    grids = batch["patch_pos_hw"][batch["patch_segment_ids"] >= 0]
    assert grids.shape[0] > 0
    if j >= 2:
      break
  blank = next(d.eval_batches(blank=True))
  real = next(d.eval_batches())
  assert np.array_equal(blank["tokens"], real["tokens"]) and not np.array_equal(blank["pixel_values"],
                                                                                   real["pixel_values"])


def test_mixed_native_sizes(corpus):
  _, d = corpus
  grids = {vl_data.image_grid(d.vcfg, x.scene) for x in d.train_docs if x.scene is not None}
  assert len(grids) >= 5 and any(h != w for h, w in grids)


def test_bad_inputs_are_named():
  with pytest.raises(ConfigError, match="vl.image_token_id: must not be a text id"):
    cfg = vl_config({"vl.image_token_id": 65})
    vl_data.make_vl_data(cfg, vision_config(cfg), None)
  with pytest.raises(ConfigError, match="vl.patch_budget: must be a positive multiple"):
    vl_data.check_vl_config(vl_config({"vl.patch_budget": 30}), vision_config(vl_config()))
  docs = [vl_data.Doc("caption", np.zeros(10, np.int32), n_patches=64)]
  with pytest.raises(ValueError, match="patch_budget=32: an image of 64 patches does not fit"):
    vl_data.pack(docs, [0], 2, 16, 32)
  with pytest.raises(ValueError, match="document of 10 tokens does not fit data.seq_len=8"):
    vl_data.pack(docs, [0], 2, 8, 64)
  cfg = vl_config()
  d = vl_data.make_vl_data(cfg, vision_config(cfg), None)
  doc = next(x for x in d.eval_docs if x.scene is not None)
  bad = vl_data.Doc(doc.kind, doc.ids.copy(), doc.scene, n_patches=doc.n_patches)
  bad.ids[1] = 65  # one placeholder overwritten by text: the images give one token more
  build = vl_data.BatchBuilder([bad], d.vcfg, 128, 256, 300, 512)
  with pytest.raises(ValueError, match="image placeholders: the batch holds"):
    build([[0]])
  with pytest.raises(ValueError, match="kind: expected single, count or digit"):
    scenes.sample_scene(np.random.default_rng(0), "triangle")


def test_text_only_control_keeps_the_text_batches(corpus):
  """vl.text_only: the same text documents in the same rows of the same batches, no image anywhere."""
  cfg, d = corpus
  t = vl_data.make_vl_data(vl_config({"vl.text_only": True}), vision_config(cfg), None)
  want = [tuple(tuple(i for i in row if d.train_docs[i].kind == "text") for row in b) for b in d.train_plan]
  assert t.train_plan == [b for b in want if any(b)] and len(t.train_plan) > 0
  assert all(t.train_docs[i].kind == "text" for b in t.train_plan for row in b for i in row)
  batch = next(t.train_iter())
  assert not np.any(batch["tokens"] == int(cfg.vl.image_token_id)) and batch["loss_mask"].sum() > 0
  assert np.all(batch["patch_segment_ids"] == -1)  # no real patch: the tower's output is never read
  assert batch["pixel_values"].shape[0] == vision_config(cfg).merge_size  # nor run on P padding patches
  kinds = {t.eval_docs[i].kind for b in t.eval_plan for row in b for i in row}
  assert kinds == {"text"}


def test_extra_digit_scenes_add_digits_and_keep_the_rest(corpus):
  """vl.extra_digit_scenes adds that many train scenes, all digits, held-out-disjoint, after the uniform
  ones, which stay as they were (same scenes, same caption / question choice)."""
  _, d = corpus
  cfg = vl_config({"vl.extra_digit_scenes": 120})
  more = vl_data.make_vl_data(cfg, vision_config(cfg), None)
  base = [x for x in d.train_docs if x.scene is not None]
  both = [x for x in more.train_docs if x.scene is not None]
  assert len(both) == len(base) + 120
  assert all(a.scene == b.scene and np.array_equal(a.ids, b.ids) for a, b in zip(base, both))
  extra = both[len(base):]
  assert all(x.scene.kind == "digit" for x in extra) and len({x.scene for x in extra}) > 100
  assert {x.kind for x in extra} == {"qa", "caption"} and {x.qtype for x in extra if x.kind == "qa"} == {"digit"}
  held = {x.scene for x in more.eval_docs if x.scene is not None}
  assert not held & {x.scene for x in extra}
  with pytest.raises(ConfigError, match="vl.extra_digit_scenes"):
    bad = vl_config({"vl.extra_digit_scenes": -1})
    vl_data.make_vl_data(bad, vision_config(bad), None)
