"""generate() against a cache-free greedy loop, and the launch.generate CLI on a freshly trained tiny run."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moonshot_jax.inference import engine
from moonshot_jax.inference.generate import generate
from moonshot_jax.inference.sampling import SamplingParams
from moonshot_jax.model.transformer import Transformer

sys.path.insert(0, str(Path(__file__).parent))
from test_inference import TOL, rel, random_variables, small_cfg  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAX_LEN = 32  # the cache size tests/test_inference.py compiles for: shared compilations


@pytest.fixture(scope="module")
def model():
  cfg = small_cfg()
  v = random_variables(cfg, seed=4)
  full = jax.jit(lambda v, t: Transformer(cfg).apply(v, t)[0])
  return cfg, v, full


def greedy_reference(full, v, prompt, n):
  """Argmax continuation by re-running the whole model on the growing sequence (no cache)."""
  seq = list(prompt)
  for _ in range(n):
    buf = np.zeros((1, MAX_LEN), np.int32)
    buf[0, :len(seq)] = seq
    seq.append(int(np.argmax(np.asarray(full(v, buf))[0, len(seq) - 1])))
  return seq[len(prompt):]


def test_greedy_generate_matches_full_forward_loop(model):
  cfg, v, full = model
  prompts = [[3, 14, 15, 92, 65], [2, 71, 82, 81, 82, 84, 59, 4, 52]]
  steps = []
  out = generate(v, cfg, prompts, max_new_tokens=7, max_len=MAX_LEN,
                 callback=lambda tok, emitted: steps.append((tok.copy(), emitted.copy())))
  for p, got in zip(prompts, out.tokens):
    assert got == greedy_reference(full, v, p, 7)
  assert out.stopped == [False, False] and out.prompt_lengths == [5, 9]
  assert len(steps) == 7 and all(e.all() for _, e in steps)
  np.testing.assert_array_equal(np.stack([t for t, _ in steps], 1), np.array(out.tokens))


def test_anti_repetition_generate_matches_full_forward_loop(model):
  """repetition_penalty + no_repeat_ngram_size through generate's device history buffer, against
  the cache-free loop applying both rules in numpy over prompt + output."""
  cfg, v, full = model
  sp = SamplingParams(repetition_penalty=1.5, no_repeat_ngram_size=2)
  prompts = [[3, 14, 15, 92, 65], [2, 71, 82, 81, 82, 84, 59, 4, 52]]
  out = generate(v, cfg, prompts, max_new_tokens=12, max_len=MAX_LEN, sampling=sp)
  for p, got in zip(prompts, out.tokens):
    seq = list(p)
    for _ in range(12):
      buf = np.zeros((1, MAX_LEN), np.int32)
      buf[0, :len(seq)] = seq
      x = np.asarray(full(v, buf))[0, len(seq) - 1].astype(np.float64)
      for t in set(seq):
        x[t] = x[t] / 1.5 if x[t] > 0 else x[t] * 1.5
      x[[seq[j + 1] for j in range(len(seq) - 1) if seq[j] == seq[-1]]] = -np.inf
      seq.append(int(np.argmax(x)))
    assert got == seq[len(p):]
    pairs = list(zip(seq, seq[1:]))
    assert len(pairs) == len(set(pairs))  # no bigram twice
  assert out.tokens != generate(v, cfg, prompts, max_new_tokens=12, max_len=MAX_LEN).tokens


def test_stop_tokens_end_rows_independently(model):
  cfg, v, _ = model
  prompts = [[3, 14, 15, 92, 65], [2, 71, 82, 81, 82, 84, 59, 4, 52]]
  free = generate(v, cfg, prompts, max_new_tokens=6, max_len=MAX_LEN).tokens
  # the stop token: the first of row 0's tokens (after the first) that is new in row 0 and absent
  # from row 1, so row 0 must stop there and row 1 must run to the end untouched
  cut = next((i for i in range(1, 6) if free[0][i] not in free[0][:i] + free[1]), None)
  assert cut is not None, free  # the fixture's model and prompts give such a token
  stop = free[0][cut]
  out = generate(v, cfg, prompts, max_new_tokens=6, max_len=MAX_LEN,
                 sampling=SamplingParams(stop_tokens=(stop,)))
  assert out.tokens[0] == free[0][:cut] and out.stopped[0]
  assert out.tokens[1] == free[1] and not out.stopped[1]


def test_sampling_is_seeded(model):
  cfg, v, _ = model
  sp = SamplingParams(temperature=1.0, top_p=0.95)
  runs = [generate(v, cfg, [[5, 6, 7]] * 2, max_new_tokens=8, sampling=sp, seed=s, max_len=MAX_LEN).tokens
          for s in (0, 0, 1)]
  assert runs[0] == runs[1] and runs[0] != runs[2]
  assert runs[0][0] != runs[0][1]  # rows draw independently


def test_generate_rejects_bad_requests(model):
  cfg, v, _ = model
  with pytest.raises(ValueError, match="prompts"):
    generate(v, cfg, [], max_new_tokens=2)
  with pytest.raises(ValueError, match="prompts"):
    generate(v, cfg, [[1, cfg.vocab_size]], max_new_tokens=2)
  with pytest.raises(ValueError, match="max_new_tokens"):
    generate(v, cfg, [[1]], max_new_tokens=0)
  with pytest.raises(ValueError, match="max_len"):
    generate(v, cfg, [[1] * 10], max_new_tokens=30, max_len=MAX_LEN)


# ---- the CLI on a real (tiny) training run -----------------------------------------------------
def _tiny_config(steps: int):
  spec = importlib.util.spec_from_file_location("tiny_exp", ROOT / "experiments" / "tiny.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  cfg = mod.get_config()
  with cfg.unlocked():
    cfg.train.steps, cfg.optimizer.warmup_steps, cfg.checkpoint.every_steps = steps, 1, steps
    cfg.train.eval_every, cfg.logging.tensorboard = 0, False
  return cfg


def _cli(args, env_devices: int = 1):
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={env_devices}", JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "launch.generate", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


def test_cli_without_checkpoint_fails_clearly(tmp_path):
  r = _cli(["--config=experiments/tiny.py", f"--workdir={tmp_path / 'empty'}", "--prompt=x"])
  assert r.returncode == 1
  assert "no checkpoint" in r.stderr and str(tmp_path / "empty") in r.stderr
  assert not (tmp_path / "empty").exists()  # read-only: nothing created


@pytest.mark.slow  # trains tiny with the real loop (train-step compile) + a CLI subprocess: ~2 min of CPU
def test_cli_generates_from_trained_tiny_checkpoint(tmp_path):
  from moonshot_jax.inference.load import load_latest
  from moonshot_jax.train.loop import sample_text, train

  steps, prompt, n = 4, "The state of the Union", 10
  cfg = _tiny_config(steps)
  summary = train(cfg, tmp_path, devices=jax.devices()[:1])
  assert (tmp_path / "checkpoints" / str(steps)).is_dir()
  r = _cli(["--config=experiments/tiny.py", f"--workdir={tmp_path}", f"--prompt={prompt}",
            f"--max_new_tokens={n}", "--temperature=0"])
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.startswith(prompt)
  # the training loop's own cache-free greedy sampler is the reference
  ref = sample_text(summary["trainer"], summary["state"], summary["tokenizer"], prompt, n, temperature=0)
  assert r.stdout.rstrip("\n") == ref
  assert "restored step 4" in r.stderr
  # and the engine on the restored weights reproduces the full forward
  loaded = load_latest(cfg, tmp_path, devices=jax.devices()[:1])
  ids = np.array([[loaded.tokenizer.bos_id] + loaded.tokenizer.encode(prompt)], np.int32)
  logits, _ = engine.prefill(loaded.variables, loaded.cfg, ids, max_len=64, mesh=loaded.mesh)
  with jax.set_mesh(loaded.mesh):
    want, _ = jax.jit(Transformer(loaded.cfg).apply)(loaded.variables, jnp.asarray(ids))
  assert rel(logits, want) < TOL
