"""python -m launch.moe_eval_gap --config=experiments/small.py --workdir=WORKDIR

Restores WORKDIR's latest checkpoint and prints the eval loss with the router input normalised by
the running statistics (what eval and decode use, model.router_norm="batch") and by each eval
batch's own statistics (what training used): the train / inference gap of the router normalisation.
"""
from __future__ import annotations

import dataclasses
import sys

from absl import app, flags
from ml_collections import config_flags

from moonshot_jax.layers.moe import batch_routing
from moonshot_jax.train import loop, step as step_lib
from moonshot_jax.train.checkpoint import Checkpointer
from moonshot_jax.train.data import make_data

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file")
_WORKDIR = flags.DEFINE_string("workdir", None, "a run's workdir (its checkpoints/ are restored)")


def main(argv) -> None:
  del argv
  cfg = _CONFIG.value
  if cfg.model.router_norm != "batch":
    raise SystemExit("model.router_norm: this compares the two statistics of router_norm='batch'")
  trainer = loop.build(cfg)
  data = make_data(cfg, _WORKDIR.value)
  restored = Checkpointer(f"{_WORKDIR.value}/checkpoints").restore_latest(trainer.setup.abstract)
  if restored is None:
    raise SystemExit(f"workdir: no checkpoint under {_WORKDIR.value}/checkpoints")
  step, state = restored[0], restored[1]
  running = loop.evaluate(trainer, state, data)
  batch_eval = step_lib.make_eval_step(trainer.model.apply, trainer.model_cfg, trainer.setup)
  with batch_routing():  # traced here, under the context: a separate jit of its own function
    own = loop.evaluate(dataclasses.replace(trainer, eval_step=batch_eval), state, data)
  print("| step | eval, running statistics | eval, each batch's own statistics | difference |")
  print(f"| {step} | {running:.4f} | {own:.4f} | {running - own:+.4f} |")
  sys.stdout.flush()


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main)
