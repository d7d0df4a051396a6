"""The LM and the vision tower as one model for training: same init / apply contract as ParallelModel.

    vl = VLModel(lm, vision_cfg, image_token_id)
    variables = vl.init(rng, tokens_BT)          # params = the LM's tree + params["vision"] (the tower)
    stats, aux = vl.apply(variables, tokens_BT, segment_ids_BT, positions_BT, targets_BT=...,
                          **vision_batch)        # the VISION_FIELDS of a vision/data.py batch

Inside apply the tower encodes the batch's packed images (static patch / token budgets), and the LM
embeds them at the image placeholders (tokens == image_token_id, row-major). Both train together
through the one train step (train/step.py passes the extra batch fields through). Without vision
fields apply is the plain LM (text-only batches, generation).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from moonshot_jax.vision.config import VisionConfig
from moonshot_jax.vision.data import LAYOUT_FIELDS, QTYPES, VISION_FIELDS
from moonshot_jax.vision.encoder import VisionTower, init_vision
from moonshot_jax.vision.layout import PatchLayout


def layout_from_batch(batch: dict) -> PatchLayout:
  kw = {f: batch[k] for k, f in LAYOUT_FIELDS.items()}
  return PatchLayout(**kw, n_real_patches=-1, n_real_tokens=-1)  # counts: host-side only


def split_params(variables: dict) -> tuple[dict, Any]:
  params = dict(variables["params"])
  vision = params.pop("vision")
  return dict(variables, params=params), vision


@dataclasses.dataclass(frozen=True)
class VLModel:
  lm: Any  # ParallelModel (no pipeline stages)
  vcfg: VisionConfig
  image_token_id: int

  def __getattr__(self, name):  # stages, to_model_layout, model(), ...: the LM's
    if name == "lm":  # not set yet (copy / unpickle): no recursion
      raise AttributeError(name)
    return getattr(self.lm, name)

  def init(self, rng: jax.Array, tokens_BT: jax.Array) -> dict:
    k_lm, k_v = jax.random.split(rng)
    variables = dict(self.lm.init(k_lm, tokens_BT))
    variables["params"] = dict(variables["params"], vision=init_vision(self.vcfg, k_v)["params"])
    return variables

  def encode(self, vision_params, batch: dict) -> jax.Array:
    """[M, d_model]: the tower's tokens of a batch's packed images."""
    return VisionTower(self.vcfg).apply({"params": vision_params}, batch["pixel_values"], layout_from_batch(batch))

  def apply(self, variables: dict, tokens_BT, segment_ids_BT=None, positions_BT=None, token_mask_BT=None,
            targets_BT=None, **vision):
    lm_vars, vparams = split_params(variables)
    if not vision:
      return self.lm.apply(lm_vars, tokens_BT, segment_ids_BT, positions_BT, token_mask_BT, targets_BT)
    missing = sorted(set(VISION_FIELDS) - set(vision))
    if missing:
      raise ValueError(f"vision batch: missing field(s) {missing}")
    vis_MD = self.encode(vparams, vision)
    mask_BT = tokens_BT == self.image_token_id
    return self.lm.model().apply(lm_vars, tokens_BT, segment_ids_BT, positions_BT, token_mask_BT, targets_BT,
                                 image_mask_BT=mask_BT, vision_MD=vis_MD)


def token_stats_fn(model: VLModel):
  """(params, moe_state, batch) -> (nll_BT, correct_BT): per-token held-out statistics."""
  def fn(params, moe_state, batch):
    vision = {k: batch[k] for k in VISION_FIELDS}
    stats, _ = model.apply({"params": params, "moe_state": moe_state}, batch["tokens"], batch["segment_ids"],
                           batch["positions"], targets_BT=batch["targets"], **vision)
    return stats["lse"] - stats["target_logit"], stats["correct"]
  return fn


def vl_evaluate(trainer, state, data) -> dict[str, float]:
  """Held-out metrics: eval_loss (all loss tokens), eval_text_loss, eval_caption_loss, eval_qa_loss;
  qa_exact_match (greedy answer == reference: every answer target, <eos> included, is the argmax,
  which is what greedy decoding from the question emits) overall and per question type, and
  qa_answer_nll/<type> (nll summed over an answer's targets, mean over answers); the same with every
  image blanked (qa_blank_exact_match..., qa_blank_answer_nll/...)."""
  from moonshot_jax.train.loop import to_global  # noqa: PLC0415
  from moonshot_jax.train.step import step_context  # noqa: PLC0415
  jitted = _jitted_stats(trainer)
  out: dict[str, float] = {}
  for blank in (False, True):
    sums = {k: [0.0, 0.0] for k in ("all", "text", "caption", "qa")}
    hits: dict[str, list[int]] = {q: [0, 0] for q in QTYPES}
    nll_q: dict[str, list[float]] = {}  # per question type: summed answer-target nll, answer count
    for b in data.eval_batches(blank=blank, meta=True):
      with step_context(trainer.setup):
        arrays = to_global(b, trainer.mesh, VISION_FIELDS)
        nll, correct = jax.device_get(jitted(state.params, state.moe_state, arrays))
      mask = b["loss_mask"] > 0
      for i, k in enumerate(("text", "caption", "qa")):
        m = mask & (b["doc_kind"] == i + 1)
        sums[k][0] += float(nll[m].sum())
        sums[k][1] += float(m.sum())
      sums["all"][0] += float(nll[mask].sum())
      sums["all"][1] += float(mask.sum())
      for a, q in enumerate(b["qtypes"]):
        at = b["answer_id"] == a + 1
        hits.setdefault(q, [0, 0])  # "fashion": real photos, when the corpus has them
        hits[q][0] += int(bool(correct[at].all()))
        hits[q][1] += 1
        acc = nll_q.setdefault(q, [0.0, 0])
        acc[0] += float(nll[at].sum())
        acc[1] += 1
    pre = "qa_blank_" if blank else "qa_"
    total = [sum(v[0] for v in hits.values()), sum(v[1] for v in hits.values())]
    if total[1]:  # none in a text-only control run
      out[f"{pre}exact_match"] = total[0] / total[1]
    for q, (h, n) in hits.items():
      if n:
        out[f"{pre}exact_match/{q}"] = h / n
    for q, (s, n) in nll_q.items():  # per answer (its tokens + <eos>): how far each type is from learnt
      out[f"{pre}answer_nll/{q}"] = s / n
    if not blank:
      for k, (s, n) in sums.items():
        if n:
          out["eval_loss" if k == "all" else f"eval_{k}_loss"] = s / n
  return out


def _jitted_stats(trainer):
  if not hasattr(trainer, "_vl_stats"):
    trainer._vl_stats = jax.jit(token_stats_fn(trainer.model))  # pylint: disable=protected-access
  return trainer._vl_stats


def image_prompt(tokenizer, vcfg: VisionConfig, image_token_id: int, vision_params, images, prompt: str,
                 max_seq_len: int | None = None):
  """(ids, image_mask, vision_MD) of `<bos> I..I (per image, in order) prompt`, the layout the
  vision-language corpus trains on; the placeholder count is checked against the images' tokens."""
  from moonshot_jax.vision.encoder import encode_images  # noqa: PLC0415
  from moonshot_jax.vision.layout import token_counts  # noqa: PLC0415
  from moonshot_jax.vision.multimodal import check_placeholders  # noqa: PLC0415
  from moonshot_jax.vision.processor import preprocess  # noqa: PLC0415
  pixel_values, grid = preprocess(images, vcfg)
  n = int(token_counts(vcfg, grid).sum())
  ids = [tokenizer.bos_id] + [image_token_id] * n + list(tokenizer.encode(prompt))
  if max_seq_len is not None and len(ids) >= max_seq_len:
    raise ValueError(f"image: the image(s) give {n} vision tokens ({grid.tolist()} patches as [t, h, w]); "
                     f"with the prompt that is {len(ids)} tokens, over model.max_seq_len={max_seq_len} - 1")
  check_placeholders(ids, image_token_id, n)
  vision_MD = encode_images({"params": vision_params}, vcfg, pixel_values, grid)
  return ids, [t == image_token_id for t in ids], vision_MD
