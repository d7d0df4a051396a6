"""python -m launch.generate --config=experiments/tiny.py --workdir=DIR --prompt="..." --max_new_tokens=N --temperature=0

Loads the newest checkpoint in DIR (written by launch.train with the same --config and overrides),
prints the prompt, then streams its continuation to stdout token by token (logs go to stderr).
Sampling: --temperature (0 = greedy), --top_k, --top_p, --seed; against loops ("and the United
States, and the United States, ..."), --repetition_penalty (CTRL's, e.g. 1.3) and
--no_repeat_ngram_size (e.g. 3), under greedy and sampling alike, over prompt + output tokens.
Generation stops at the tokenizer's end-of-document token or after --max_new_tokens.
--experts_mxfp4 serves the routed experts as MXFP4 (inference/mxfp4_experts.py): e.g. a K3 hub
checkpoint imported with launch.import_checkpoint, whose experts were MXFP4, serves at 4.25 bits
per expert weight, bit-exact to the imported values. Exits with
status 1 and a message naming DIR when there is no checkpoint, 2 on a bad flag value. Prefill / decode use the KDA state and MLA latent caches
(moonshot_jax.inference).

Vision-language runs (a config with `vision` and `vl` sections, e.g. experiments/vl_tiny.py):
--image=PATH (repeatable) puts each image's vision tokens before the prompt, as in training
(`<bos> <image tokens> prompt`), prefills them with the prompt, then decodes as above:
    python -m launch.generate --config=experiments/vl_tiny.py --workdir=DIR --image=x.png \
        --prompt="Q: What colour is the shape? A:" --temperature=0
A bad image (unreadable file, wrong channel count, empty, non-finite pixels) exits 2 naming it.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time

if __package__ in (None, ""):  # `python launch/generate.py`: make the repo root importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from moonshot_jax import experiment, host_memory  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "training run directory (holds checkpoints/)")
_PROMPT = flags.DEFINE_string("prompt", "", "text to continue")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "tokens to generate at most")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "sampling temperature; 0 = greedy")
_TOP_K = flags.DEFINE_integer("top_k", 0, "keep the k most likely tokens (0 = off)")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass (1 = off)")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")
_REP_PENALTY = flags.DEFINE_float("repetition_penalty", 1.0,
                                  "divide positive / multiply negative logits of tokens already seen (1 = off)")
_NO_REPEAT = flags.DEFINE_integer("no_repeat_ngram_size", 0, "never repeat an n-gram of this size (0 = off)")
_MXFP4 = flags.DEFINE_bool("experts_mxfp4", False,
                           "keep the routed experts in MXFP4 (4.25 bits/weight, decoded inside the expert "
                           "matmul; exact for a checkpoint imported from MXFP4 hub weights)")
_IMAGE = flags.DEFINE_multi_string("image", [], "image file(s) (PNG/JPEG/...; .npy: an HWC array) placed "
                                   "before the prompt; needs a vision-language config")


class _Streamer:
  """Prints the decoded continuation incrementally (holding back an incomplete UTF-8 character)."""

  def __init__(self, tokenizer):
    self.tok, self.ids, self.printed = tokenizer, [], ""

  def __call__(self, new_tokens, emitted) -> None:
    if not emitted[0]:
      return
    self.ids.append(int(new_tokens[0]))
    text = self.tok.decode(self.ids)
    if text.endswith("\ufffd"):
      return
    sys.stdout.write(text[len(self.printed):])
    sys.stdout.flush()
    self.printed = text


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if _CONFIG.value is None or not _WORKDIR.value:
    raise app.UsageError("--config and --workdir are required")
  from moonshot_jax.inference.generate import generate
  from moonshot_jax.inference.load import NoCheckpointError, load_latest
  from moonshot_jax.inference.sampling import SamplingParams

  try:  # bad sampling flags fail before the (slow) restore
    sampling = SamplingParams(temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value,
                              repetition_penalty=_REP_PENALTY.value, no_repeat_ngram_size=_NO_REPEAT.value)
  except ValueError as e:  # the message starts with the parameter's (= the flag's) name
    print(f"error: --{e}", file=sys.stderr, flush=True)
    sys.exit(2)
  images = []
  if _IMAGE.value:
    if "vision" not in _CONFIG.value or "vl" not in _CONFIG.value:
      print("error: --image: the config has no vision / vl section (use a vision-language experiment, "
            "e.g. experiments/vl_tiny.py)", file=sys.stderr, flush=True)
      sys.exit(2)
    try:
      images = [_read_image(p) for p in _IMAGE.value]
      from moonshot_jax.vision.processor import preprocess
      preprocess(images, experiment.vision_config(_CONFIG.value))  # bad pixels fail before the restore
    except (OSError, ValueError) as e:
      print(f"error: --image: {e}", file=sys.stderr, flush=True)
      sys.exit(2)
  try:
    loaded = load_latest(_CONFIG.value, _WORKDIR.value, experts_mxfp4=_MXFP4.value)
  except NoCheckpointError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(1)
  except ValueError as e:  # e.g. --experts_mxfp4 on a model without routed experts, a config mismatch
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  tok = loaded.tokenizer
  logging.info("restored step %d from %s", loaded.step, loaded.checkpoint_dir)
  variables, vision = loaded.variables, {}
  if "vision" in variables["params"]:  # a vision-language checkpoint: the tower's params ride along
    from moonshot_jax.vision.joint import image_prompt, split_params
    variables, vparams = split_params(variables)
  if _MXFP4.value:  # the experts were packed leaf by leaf as they were restored
    from moonshot_jax.inference import mxfp4_experts
    rep = loaded.mxfp4_report
    acct = mxfp4_experts.bits_per_weight(variables)
    logging.info("routed experts in MXFP4: %.2f bits/weight, %.3g GB (bf16: %.3g GB), other weights %.3g GB; "
                 "requantisation max |error| %.3g (0: the checkpoint's experts were MXFP4 values)",
                 acct["expert_bits_per_weight"], acct["expert_bytes"] / 1e9, 2 * acct["expert_weights"] / 1e9,
                 acct["other_bytes"] / 1e9, rep["max_requant_error"])
  if images:
    vcfg = experiment.vision_config(_CONFIG.value)
    try:
      ids, mask, vision_MD = image_prompt(tok, vcfg, int(_CONFIG.value.vl.image_token_id), vparams, images,
                                          _PROMPT.value, loaded.cfg.max_seq_len)
    except ValueError as e:
      print(f"error: --image: {e}", file=sys.stderr, flush=True)
      sys.exit(2)
    vision = dict(image_mask=[mask], vision_MD=vision_MD)
  else:
    ids = [tok.bos_id] + list(tok.encode(_PROMPT.value))  # training documents start with <bos>
    ids = ids[-(loaded.cfg.max_seq_len - 1):]
  max_new = max(1, min(_MAX_NEW.value, loaded.cfg.max_seq_len - len(ids)))
  sampling = dataclasses.replace(sampling, stop_tokens=(tok.eos_id,), vocab_limit=tok.vocab_size)
  sys.stdout.write(_PROMPT.value)
  sys.stdout.flush()
  t0 = time.perf_counter()
  out = generate(variables, loaded.cfg, [ids], max_new_tokens=max_new, sampling=sampling,
                 seed=_SEED.value, callback=_Streamer(tok), mesh=loaded.mesh, **vision)
  sys.stdout.write("\n")
  sys.stdout.flush()
  dt = time.perf_counter() - t0
  n = len(out.tokens[0])
  logging.info("%d tokens in %.2fs (compile included)%s", n, dt, ", stopped at <eos>" if out.stopped[0] else "")


def _read_image(path: str):
  """A PIL image, or the HWC array of a .npy file (validated by the processor)."""
  import numpy as np
  from PIL import Image
  if not os.path.isfile(path):
    raise ValueError(f"{path}: no such file")
  if path.endswith(".npy"):
    return np.load(path)
  with Image.open(path) as im:
    im.load()
    return im.copy()


if __name__ == "__main__":
  host_memory.reexec_with_huge_pages()  # before any jax work: glibc reads it at start-up
  app.run(main, flags_parser=experiment.parse_flags)
