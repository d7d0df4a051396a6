"""Train (or resume) an experiment: all logic lives in `moonshot_jax.train.loop.train`.

    python -m launch.train --config=experiments/tiny.py --workdir=/tmp/tiny \
        --config.train.steps=20 --config.checkpoint.every_steps=5 \
        --config.mesh.pipeline=1 --config.mesh.data=-1 --config.mesh.expert=1 --config.mesh.tensor=1

Re-running the same command resumes from the newest good checkpoint in --workdir. Your own text:
add `--config.data.corpus=files --config.data.paths=~/texts,/data/*.jsonl` (files, directories,
globs; comma-separated). A bad or misspelt --config.* key prints one `config error:` line, exit 2.
"""
from __future__ import annotations

import json
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from moonshot_jax import experiment, host_memory

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (experiments/*.py).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics.jsonl, tb/.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  from moonshot_jax.config import ConfigError  # after flag parsing: jax reads its env at import
  from moonshot_jax.train import loop
  from moonshot_jax.train.checkpoint import CheckpointMismatch

  try:
    summary = loop.train(_CONFIG.value, _WORKDIR.value)
  except (ConfigError, CheckpointMismatch) as e:
    print(f"config error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  keep = ("workdir", "start_step", "final_step", "final_loss", "eval_loss", "last_checkpoint", "stopped")
  print(json.dumps({k: summary.get(k) for k in keep}))
  if summary.get("stopped"):
    raise SystemExit(2)


if __name__ == "__main__":
  host_memory.reexec_with_huge_pages()  # before any jax work: glibc reads it at start-up
  app.run(main, flags_parser=experiment.parse_flags)
