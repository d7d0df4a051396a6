"""Load a trained run for inference: the newest good checkpoint of WORKDIR + its tokenizer.

The checkpoint is the training loop's (moonshot_jax/train/checkpoint.py, WORKDIR/checkpoints/<step>):
we rebuild the run's abstract TrainState with `train.loop.build(cfg)` (same model, optimizer and mesh
as training, so the restore reshards onto this machine's devices) and keep params + moe_state.
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


def load_latest(cfg: Any, workdir: str | Path, *, devices=None, with_tokenizer: bool = True) -> LoadedModel:
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
    for step in reversed(steps):
      try:
        state, _, _ = ckpt.restore(step, trainer.setup.abstract)
      except CorruptCheckpoint as e:
        print(f"[load] WARNING: skipping step {step}: {e}", file=sys.stderr, flush=True)
        continue
      tok = load_tokenizer(cfg, workdir) if with_tokenizer else None
      return LoadedModel(cfg=trainer.model_cfg, variables={"params": state.params, "moe_state": state.moe_state},
                         mesh=trainer.mesh, step=int(step), tokenizer=tok, checkpoint_dir=ckpt_dir / str(step))
    raise NoCheckpointError(f"no restorable checkpoint under {ckpt_dir} (steps {steps} all failed to load)")
  finally:
    ckpt.close()
