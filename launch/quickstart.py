"""The README's first command: `python3 launch/quickstart.py [--steps N] [--workdir DIR] [--config F]`.

Makes or reuses .venv (launch/_bootstrap.py), trains experiments/small.py on the bundled State of
the Union corpus with a progress bar into ./runs/small (re-running resumes there), then samples
text from the trained model, greedy and at temperature 0.8, both with --repetition_penalty
(default 1.3) and --no_repeat_ngram_size (default 3): plain greedy decoding of a small model loops
("and the United States, and the United States, ..."). --repetition_penalty=1
--no_repeat_ngram_size=0 turns both off.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bootstrap import ROOT, ensure_venv  # noqa: E402


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", default=os.path.join("experiments", "small.py"), help="experiment file")
  ap.add_argument("--steps", type=int, default=None, help="training steps (default: the config's)")
  ap.add_argument("--workdir", default=None, help="run directory (default: ./runs/<config name>)")
  ap.add_argument("--prompt", default=None, help="sampling prompt (default: the config's)")
  ap.add_argument("--tokens", type=int, default=None, help="tokens to sample (default: the config's)")
  ap.add_argument("--repetition_penalty", type=float, default=1.3,
                  help="CTRL repetition penalty for the samples (1 = off)")
  ap.add_argument("--no_repeat_ngram_size", type=int, default=3,
                  help="never repeat an n-gram of this many tokens in the samples (0 = off)")
  args = ap.parse_args()

  os.chdir(ROOT)
  import importlib.util  # noqa: E402  (inside the venv from here on)

  name = os.path.splitext(os.path.basename(args.config))[0]
  workdir = args.workdir or os.path.join(ROOT, "runs", name)

  from absl import logging as absl_logging
  absl_logging.set_verbosity(absl_logging.WARNING)  # orbax is chatty at INFO
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, args.config))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  cfg = mod.get_config()
  if args.steps is not None:
    cfg.train.steps = args.steps
  cfg.train.sample_after = False  # sampled below, both ways
  cfg.logging.progress_bar = True

  from moonshot_jax.train import loop  # noqa: E402

  print(f"[quickstart] training {args.config} for {cfg.train.steps} steps into {workdir} "
        f"(re-run to resume)", flush=True)
  summary = loop.train(cfg, workdir)
  if summary.get("stopped"):
    print(f"[quickstart] training stopped early: {summary['stopped']}")
    sys.exit(2)
  print(f"[quickstart] step {summary['final_step']}: train loss {summary['final_loss']:.3f}, "
        f"eval loss {summary['eval_loss'] if summary['eval_loss'] is None else round(summary['eval_loss'], 3)}")
  prompt = args.prompt or str(cfg.train.sample_prompt)
  n = args.tokens or int(cfg.train.sample_tokens)
  for temperature in (0.0, 0.8):
    text = loop.sample_text(summary["trainer"], summary["state"], summary["tokenizer"], prompt, n,
                            temperature=temperature, repetition_penalty=args.repetition_penalty,
                            no_repeat_ngram_size=args.no_repeat_ngram_size)
    label = "greedy" if temperature == 0 else f"temperature {temperature}"
    label += f", repetition penalty {args.repetition_penalty:g}, no repeated {args.no_repeat_ngram_size}-grams"
    print(f"\n[sample, {label}]\n{text}\n", flush=True)
  print(f"[quickstart] metrics: {workdir}/metrics.jsonl; plots: python -m launch.plot {workdir}")


if __name__ == "__main__":
  ensure_venv("test")
  main()
