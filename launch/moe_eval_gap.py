"""python -m launch.moe_eval_gap --config=experiments/small.py --workdir=WORKDIR

Restores WORKDIR's latest checkpoint and prints its eval loss under four routings of the MoE layers:
  eval      the running router-input statistics + the stored bias (what eval, prefill and decode use)
  train     each eval batch's own statistics + the in-batch balancing shift (what the train step used)
  stats     the batch's own statistics + the stored bias (no in-batch shift)
  shift     the running statistics + the in-batch shift
i.e. what the train / inference routing gap costs, and which part (model.router_norm="batch",
model.balance_in_batch) it comes from. A part the config does not use leaves its columns equal.
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

# column -> (batch statistics, in-batch shift)
ROUTINGS = {"train": (True, True), "stats": (True, False), "shift": (False, True)}


def main(argv) -> None:
  del argv
  cfg = _CONFIG.value
  if cfg.model.num_experts == 0:
    raise SystemExit("model.num_experts: 0, no MoE layer to route")
  trainer = loop.build(cfg)
  data = make_data(cfg, _WORKDIR.value)
  restored = Checkpointer(f"{_WORKDIR.value}/checkpoints").restore_latest(trainer.setup.abstract)
  if restored is None:
    raise SystemExit(f"workdir: no checkpoint under {_WORKDIR.value}/checkpoints")
  step, state = restored[0], restored[1]
  losses = {"eval": loop.evaluate(trainer, state, data)}
  for name, (stats, shift) in ROUTINGS.items():
    ev = step_lib.make_eval_step(trainer.model.apply, trainer.model_cfg, trainer.setup, trainer.model_inputs)
    with batch_routing(stats=stats, shift=shift, step=step):  # traced under the context: a jit of its own
      losses[name] = loop.evaluate(dataclasses.replace(trainer, eval_step=ev), state, data)
  print("| step | " + " | ".join(losses) + " | eval - train |")
  print(f"| {step} | " + " | ".join(f"{v:.4f}" for v in losses.values())
        + f" | {losses['eval'] - losses['train']:+.4f} |")
  sys.stdout.flush()


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main)
