"""Load a trained run for inference: the newest good checkpoint of WORKDIR + its tokenizer.

The checkpoint is the training loop's (moonshot_jax/train/checkpoint.py, WORKDIR/checkpoints/<step>):
we rebuild the run's abstract TrainState with `train.loop.build(cfg)` (same model, optimizer and mesh
as training, so the restore reshards onto this machine's devices) and restore only params + moe_state
(the optimizer state is never read). With experts_mxfp4 the routed-expert leaves are restored one at
a time and packed to MXFP4 at once (inference/mxfp4_experts.py), so host memory holds the packed
experts plus one expert leaf in the checkpoint's dtype, never all of them.
Read-only: unlike training's resume, an unreadable newest step is reported and skipped, never moved.
The tokenizer comes from the workdir's cache exactly as training built it (data.tokenizer).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from moonshot_jax.config import ModelConfig


class NoCheckpointError(FileNotFoundError):
  pass


@dataclasses.dataclass
class LoadedModel:
  cfg: ModelConfig
  variables: dict  # {"params", "moe_state"}, sharded on `mesh`
  mesh: Any
  step: int
  tokenizer: Any
  checkpoint_dir: Path
  mxfp4_report: dict | None = None  # experts_mxfp4: quantize_experts' report (max_requant_error, ...)


def load_tokenizer(cfg: Any, workdir: str | Path):
  """The run's tokenizer (cached in WORKDIR/data_cache by training; rebuilt identically if missing)."""
  from moonshot_jax.train import corpus as corpus_lib
  from moonshot_jax.train import tokenizer as tokenizer_lib
  d = cfg.data
  if str(d.tokenizer) == "byte":
    return tokenizer_lib.load_or_train_tokenizer(d, workdir, int(cfg.model.vocab_size), lambda: [], "")
  docs = corpus_lib.load_documents(d)
  train_docs, _ = corpus_lib.split_documents(docs, float(d.eval_fraction))
  return tokenizer_lib.load_or_train_tokenizer(d, workdir, int(cfg.model.vocab_size),
                                               lambda: (x.text for x in train_docs),
                                               corpus_key=corpus_lib.fingerprint(train_docs))


def load_latest(cfg: Any, workdir: str | Path, *, devices=None, with_tokenizer: bool = True,
                experts_mxfp4: bool = False) -> LoadedModel:
  """Newest restorable checkpoint of `workdir` for experiment config `cfg` (an experiment ConfigDict).
  Raises NoCheckpointError (naming the directory and the training command) when there is none."""
  from moonshot_jax.train.checkpoint import Checkpointer, CorruptCheckpoint
  from moonshot_jax.train.loop import build

  ckpt_dir = Path(workdir).absolute() / "checkpoints"
  hint = f"train first: python -m launch.train --config=<experiment>.py --workdir={Path(workdir)}"
  if not ckpt_dir.is_dir():
    raise NoCheckpointError(f"no checkpoint: {ckpt_dir} does not exist ({hint})")
  ckpt = Checkpointer(ckpt_dir, async_save=False)
  try:
    steps = ckpt.steps()
    if not steps:
      raise NoCheckpointError(f"no checkpoint: {ckpt_dir} holds no saved step ({hint})")
    trainer = build(cfg, devices)
    abstract = trainer.setup.abstract
    for step in reversed(steps):
      try:
        variables, report = _restore_variables(ckpt, step, abstract, trainer.model_cfg, experts_mxfp4)
      except CorruptCheckpoint as e:
        print(f"[load] WARNING: skipping step {step}: {e}", file=sys.stderr, flush=True)
        continue
      tok = load_tokenizer(cfg, workdir) if with_tokenizer else None
      return LoadedModel(cfg=trainer.model_cfg, variables=variables, mesh=trainer.mesh, step=int(step),
                         tokenizer=tok, checkpoint_dir=ckpt_dir / str(step), mxfp4_report=report)
    raise NoCheckpointError(f"no restorable checkpoint under {ckpt_dir} (steps {steps} all failed to load)")
  finally:
    ckpt.close()


def _restore_variables(ckpt, step: int, abstract, cfg: ModelConfig, experts_mxfp4: bool):
  """{"params", "moe_state"} of `step` (no optimizer state read); with experts_mxfp4 every routed
  expert leaf is restored alone and replaced by its MXFP4 box before the next one is read."""
  import jax

  from moonshot_jax.inference import mxfp4_experts as mx
  variables = {"params": abstract.params, "moe_state": abstract.moe_state}
  if not experts_mxfp4:
    return ckpt.restore_subset(step, variables, abstract), None
  if not any(f == "moe" for _, f in cfg.layer_kinds):
    raise ValueError("experts_mxfp4: the model has no MoE layer, so no routed experts to keep in MXFP4")
  flat, treedef = jax.tree_util.tree_flatten_with_path(variables)
  is_expert = [mx._is_expert_path(mx._names(k)) for k, _ in flat]
  rest = ckpt.restore_subset(step, _nested([(k, a) for (k, a), e in zip(flat, is_expert) if not e]), abstract)
  rest_flat = {mx._names(k): x for k, x in jax.tree_util.tree_flatten_with_path(rest)[0]}
  out, worst = [], 0.0
  for (k, a), e in zip(flat, is_expert):
    if not e:
      out.append(rest_flat[mx._names(k)])
      continue
    leaf = jax.tree_util.tree_flatten_with_path(ckpt.restore_subset(step, _nested([(k, a)]), abstract))[0][0][1]
    box, err = mx.quantize_leaf(leaf, "/".join(mx._names(k)))
    del leaf
    out.append(box)
    worst = max(worst, err)
  return jax.tree_util.tree_unflatten(treedef, out), {"max_requant_error": worst, "expert_leaves": sum(is_expert)}


def _nested(items) -> dict:
  """[(key path, leaf)] -> the nested dicts holding exactly those leaves."""
  out: dict = {}
  for kpath, leaf in items:
    d = out
    names = [str(getattr(p, "key", getattr(p, "name", p))) for p in kpath]
    for n in names[:-1]:
      d = d.setdefault(n, {})
    d[names[-1]] = leaf
  return out
