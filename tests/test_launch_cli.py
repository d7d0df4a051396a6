"""`launch.train` / `launch.generate` as a new user runs them (issue 25): subprocesses on a cut-down tiny.

One training run (module fixture, 2 fake devices, expert=2) serves several tests: own text from the
command line (a directory and a glob, comma-separated), a warm-up longer than the run, the start-up
line's expert-dispatch verdict and the drop fraction in the progress bar; launch.generate then
samples from its checkpoint with the anti-repetition flags.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# tiny cut to one KDA + LatentMoE layer: the run compiles in a fraction of full tiny's time
ONE_LAYER = ["--config.model.n_layers=1", "--config.model.mla_layers=()", "--config.model.dense_layers=()",
             "--config.model.attn_res=False"]
STEPS = 2  # tiny's optimizer.warmup_steps is 5: the whole run is warm-up


def _run(module: str, args: list[str], devices: int = 1, timeout: int = 600) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0")
  return subprocess.run([sys.executable, "-m", module, "--config=experiments/tiny.py", *args], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("module", ["launch.train", "launch.generate"])
@pytest.mark.parametrize("flag,line", [
    ("--config.train.stepz=5", 'config error: config.train.stepz: no such key \'stepz\'; did you mean "steps"?'),
    ("--config.trian.steps=5", 'config error: config.trian.steps: no such key \'trian\'; did you mean "train"?'),
])
def test_misspelt_override_is_one_config_error_line(tmp_path, module, flag, line):
  r = _run(module, [f"--workdir={tmp_path}", flag])
  assert r.returncode == 2, r.stderr[-2000:]
  assert r.stderr.strip() == line
  assert not list(tmp_path.iterdir())  # nothing started


def _corpus(root: Path) -> tuple[str, int]:
  """A directory of .txt and a folder of .md reached by a glob; returns (paths flag value, docs)."""
  (root / "texts" / "sub").mkdir(parents=True)
  (root / "notes").mkdir()
  for i in range(5):
    (root / "texts" / ("sub" if i % 2 else "") / f"t{i}.txt").write_text(f"Plain text file {i}. " * 20)
  for i in range(3):
    (root / "notes" / f"n{i}.md").write_text(f"# Note {i}\nMarkdown body {i}. " * 10)
  (root / "notes" / "n9.txt").write_text("not matched by the glob")
  return f"{root / 'texts'},{root / 'notes' / '*.md'}", 8


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory):
  """Own text, 2 steps, experts split over 2 devices at capacity_factor 0.5 (capacity below the
  per-rank token count, so tokens drop), progress bar on."""
  root = tmp_path_factory.mktemp("ep_run")
  paths, docs = _corpus(root / "corpus")
  wd = root / "run"
  args = [f"--workdir={wd}", "--config.data.corpus=files", f"--config.data.paths={paths}",
          f"--config.train.steps={STEPS}", "--config.train.eval_every=0", "--config.logging.tensorboard=False",
          "--config.logging.progress_bar=True", "--config.mesh.expert=2", "--config.mesh.capacity_factor=0.5",
          *ONE_LAYER]
  r = _run("launch.train", args, devices=2)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  rows = [json.loads(x) for x in (wd / "metrics.jsonl").read_text().splitlines()]
  return dict(r=r, wd=wd, docs=docs, paths=paths, rows=rows)


def test_own_text_from_the_command_line(ep_run):
  out = ep_run["r"].stdout
  m = re.search(r"\[train\] data: (\d+) train / (\d+) eval documents .* from data\.paths (\S+),", out)
  assert m, out
  assert int(m.group(1)) + int(m.group(2)) == ep_run["docs"] and m.group(3) == ep_run["paths"]
  assert json.loads(out.strip().splitlines()[-1])["final_step"] == STEPS


def test_warmup_longer_than_the_run_is_accepted_with_one_warning(ep_run):
  out = ep_run["r"].stdout
  warns = [x for x in out.splitlines() if x.startswith("[train] warning:")]
  assert len(warns) == 1 and "optimizer.warmup_steps=5 >= train.steps=2" in warns[0], out
  lr = [row["lr"] for row in ep_run["rows"]]
  # tiny: lr 3e-3, 5 warm-up steps: lr/5 then 2 lr/5 (the linear ramp), as the warning says
  assert lr == pytest.approx([6e-4, 1.2e-3], rel=1e-5)
  assert "from 0.0006 to 0.0012" in warns[0] and "never reached" in warns[0]


def test_start_line_states_capacity_and_bar_shows_drops(ep_run):
  out, err = ep_run["r"].stdout, ep_run["r"].stderr
  # 8 rows x 64 tokens over data 1 x expert 2 = 256 tokens per rank, 512 copies over 8 experts:
  # capacity ceil(0.5 * 512 / 8) = 32 < 256, so it can drop; dropless from 8 / top-2 = 4
  assert ("MoE dense all_to_all over expert=2: capacity 32 copies per (rank, expert slot) for 256 tokens "
          "per rank (mesh.capacity_factor=0.5): CAN DROP tokens") in out, out
  assert "dropless from mesh.capacity_factor=4" in out
  drops = [row["ep_drop_fraction"] for row in ep_run["rows"]]
  assert len(drops) == STEPS and all(d > 0.4 for d in drops), drops  # half the buffer: ~half dropped
  shown = re.findall(r"ep_drop=([\d.]+)%", err)
  assert shown and float(shown[-1]) == pytest.approx(100 * drops[-1], abs=0.006), err[-2000:]


def test_generate_blocks_repeats_from_the_command_line(ep_run):
  prompt, n = "Plain", 24
  over = [o for o in ep_run["r"].args if o.startswith("--config.") and "mesh" not in o and "logging" not in o]
  base = [f"--workdir={ep_run['wd']}", *over, f"--prompt={prompt}", f"--max_new_tokens={n}", "--temperature=0"]
  bad = _run("launch.generate", base + ["--repetition_penalty=-1"])
  assert bad.returncode == 2 and "--repetition_penalty: expected a float > 0" in bad.stderr
  r = _run("launch.generate", base + ["--no_repeat_ngram_size=1", "--repetition_penalty=1.5"])
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.startswith(prompt)
  # byte tokens, 1-grams banned: no character of the prompt or earlier output comes again
  chars = [c for c in r.stdout.rstrip("\n") if c != "\ufffd"]
  assert len(chars) == len(set(chars)), r.stdout
  assert len(r.stdout.rstrip("\n")) > len(prompt)
