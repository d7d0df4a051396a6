"""Held-out success of an agent checkpoint: one greedy episode per held-out task.

    python -m launch.eval_agent --config=experiments/agent_tiny_grpo.py --workdir=/tmp/agent_grpo \
        --episodes=500 --seed=0 --json

Tasks: the config's task families round-robin, seeds 1_000_000 + 100_000 * seed + i (held out: the
training runs draw seeds below 1_000_000), so the SFT and GRPO configs (same task mix) see the same
tasks for the same --seed. Loads params + balancing biases of the workdir's newest checkpoint, or of
--step=N (read-only: the workdir is not modified) and prints {"success_rate", "episodes", "mean_reward",
"tool_calls", "per_family", "seconds", ...} (--json) or a short line.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from absl import app, flags, logging
from ml_collections import config_flags

from moonshot_jax import experiment

_CONFIG = config_flags.DEFINE_config_file("config", None, "Agent experiment config (experiments/agent_*.py).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory holding checkpoints/.")
_EPISODES = flags.DEFINE_integer("episodes", 500, "Held-out episodes (tasks).")
_STEP = flags.DEFINE_integer("step", 0, "Checkpoint step to evaluate (0 = the newest).")
_SEED = flags.DEFINE_integer("seed", 0, "Which block of held-out tasks (and sampling key).")
_BATCH = flags.DEFINE_integer("batch", 0, "Episodes rolled out together (0 = data.batch_size).")
_SAMPLE = flags.DEFINE_bool("sample", False, "Sample at temperature 1 instead of greedy decoding.")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  from moonshot_jax.config import ConfigError
  from moonshot_jax.rl import source
  from moonshot_jax.train import loop

  cfg = _CONFIG.value
  if "rl" not in cfg:
    print("config error: --config has no `rl` section (use experiments/agent_*.py)", file=sys.stderr)
    raise SystemExit(2)
  try:
    trainer = loop.build(cfg)
    ckpts = Path(_WORKDIR.value).expanduser() / "checkpoints"
    step = source.checkpoint_step(ckpts, _STEP.value)
    init = source.restore_params(ckpts, trainer.setup.abstract, step)
  except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  variables = trainer.model.to_model_layout(init)
  out = source.evaluate_policy(cfg, trainer, variables, _EPISODES.value, seed=_SEED.value, batch=_BATCH.value,
                               greedy=not _SAMPLE.value)
  out.update(workdir=str(_WORKDIR.value), step=step, seed=_SEED.value)
  if _JSON.value:
    print(json.dumps(out))
  else:
    print(f"success {out['success_rate']:.3f} over {out['episodes']} held-out episodes (seed {_SEED.value}); "
          f"per family {out['per_family']}; {out['seconds']:.0f} s")


if __name__ == "__main__":
  app.run(main, flags_parser=experiment.parse_flags)
