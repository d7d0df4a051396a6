"""Joint encoder + LM training through the real loop (experiments/vl_tiny.py at toy size): losses
fall, the encoder gets gradients, held-out QA metrics are logged with and without images, and a
run stopped after its step-2 checkpoint resumes to exactly the uninterrupted run's losses. Then the
`launch.generate --image` CLI: bad images exit 2 naming the problem before any restore.

Training runs in one subprocess (this file is its driver: `python tests/test_vision_train.py
WORKDIR`) with XLA:CPU's -O0 backend and a persistent compilation cache, so the three loop runs
compile the step once.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = {"train.steps": 4, "train.log_every": 1, "train.eval_every": 2, "checkpoint.every_steps": 2,
             "logging.tensorboard": False, "optimizer.warmup_steps": 1, "data.batch_size": 8,
             "vl.patch_budget": 512, "vl.train_scenes": 200, "vl.eval_qa": 20, "vl.eval_captions": 4,
             "vl.eval_text": 2}


class _Stop(Exception):
  pass


def _driver(workdir: str) -> None:
  import jax
  jax.config.update("jax_compilation_cache_dir", str(Path(workdir) / "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  from moonshot_jax.train import loop
  from tests.test_vision_data import vl_config

  cfg = vl_config(OVERRIDES)
  seen = {}

  def keep_init(step, state):
    if step == 1:
      seen["patch_embed"] = np.asarray(state.params["vision"]["encoder"]["patch_embed"]["kernel"])
    return state

  a = loop.train(cfg, Path(workdir) / "a", hooks=loop.Hooks(before_step=keep_init), devices=jax.devices()[:1])
  moved = float(np.abs(np.asarray(a["state"].params["vision"]["encoder"]["patch_embed"]["kernel"])
                       - seen["patch_embed"]).max())

  def stop(step, _):
    if step == 2:
      raise _Stop()
  try:
    loop.train(cfg, Path(workdir) / "b", hooks=loop.Hooks(after_step=stop), devices=jax.devices()[:1])
  except _Stop:
    pass
  b = loop.train(cfg, Path(workdir) / "b", devices=jax.devices()[:1])
  print("RESULT " + json.dumps({"start_b": b["start_step"], "encoder_moved": moved,
                                "final_a": a["final_step"], "stopped": a["stopped"]}))


def _metrics(wd: Path) -> list[dict]:
  return [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]


def _env() -> dict:
  return dict(os.environ, JAX_PLATFORMS="cpu",
              XLA_FLAGS="--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0",
              PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  wd = tmp_path_factory.mktemp("vl")
  r = subprocess.run([sys.executable, __file__, str(wd)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                     timeout=900)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
  return wd, json.loads(line[len("RESULT "):])


@pytest.mark.slow  # three loop runs, one -O0 compile of the joint step (~1-2 min on 2 busy cores)
def test_vl_train_smoke_and_exact_resume(trained):
  wd, res = trained
  assert res["final_a"] == 4 and res["stopped"] is None and res["start_b"] == 2
  assert res["encoder_moved"] > 0  # the encoder trains with the LM
  a, b = _metrics(wd / "a"), _metrics(wd / "b")
  assert [r["step"] for r in a] == [1, 2, 3, 4] and [r["step"] for r in b] == [1, 2, 3, 4]
  assert [r["loss"] for r in a] == [r["loss"] for r in b]  # bit for bit across the stop / resume
  assert a[-1]["loss"] < a[0]["loss"]
  ev = [r for r in a if "eval_loss" in r]
  assert [r["step"] for r in ev] == [2, 4]
  for key in ("eval_text_loss", "eval_caption_loss", "eval_qa_loss", "qa_exact_match", "qa_blank_exact_match",
              "qa_exact_match/digit", "qa_answer_nll/digit", "qa_blank_answer_nll/digit"):
    assert key in ev[-1] and np.isfinite(ev[-1][key]), key
  assert ev[-1]["eval_loss"] < ev[0]["eval_loss"]
  assert {k: v for k, v in ev[-1].items() if k.startswith("qa")} == {k: v for k, v in b[-1].items()
                                                                      if k.startswith("qa")}
  assert (wd / "b" / "checkpoints" / "4").is_dir()


@pytest.mark.slow  # shares the training fixture; + one generate subprocess
def test_generate_image_cli_matches_full_forward(trained, tmp_path):
  import jax
  import jax.numpy as jnp
  from moonshot_jax.experiment import vision_config
  from moonshot_jax.inference.load import load_latest
  from moonshot_jax.model.transformer import Transformer
  from moonshot_jax.vision import scenes
  from moonshot_jax.vision.joint import image_prompt, split_params
  from tests.test_vision_data import vl_config

  wd, _ = trained
  cfg = vl_config(OVERRIDES)
  scene = scenes.sample_scene(np.random.default_rng(5), "digit")
  scenes.render(scene).save(tmp_path / "x.png")
  prompt, n = "Q: What digit is shown? A:", 6
  r = _cli(["--config=experiments/vl_tiny.py", f"--workdir={wd / 'a'}", f"--image={tmp_path / 'x.png'}",
            f"--prompt={prompt}", f"--max_new_tokens={n}", "--temperature=0"]
           + [f"--config.{k}={v}" for k, v in OVERRIDES.items()])
  assert r.returncode == 0, r.stderr[-3000:]
  loaded = load_latest(cfg, wd / "a", devices=jax.devices()[:1])
  lm_vars, vparams = split_params(loaded.variables)
  tok = loaded.tokenizer
  ids, mask, vis = image_prompt(tok, vision_config(cfg), int(cfg.vl.image_token_id), vparams,
                                [scenes.render(scene)], prompt, loaded.cfg.max_seq_len)
  assert sum(mask) == vis.shape[0] == int(np.prod(vl_data_grid(cfg, scene))) // 4
  model, out = Transformer(loaded.cfg), []
  fwd = jax.jit(lambda v, t, m, x: model.apply(v, t, image_mask_BT=m, vision_MD=x)[0])
  for _ in range(n):  # greedy by full re-forward: no cache
    logits = fwd(lm_vars, jnp.asarray([ids]), jnp.asarray([mask]), vis)
    nxt = int(jnp.argmax(logits[0, -1, :tok.vocab_size]))
    if nxt == tok.eos_id:
      break
    out.append(nxt)
    ids, mask = ids + [nxt], mask + [False]
  assert r.stdout.rstrip("\n") == prompt + tok.decode(out)
  # and the image matters: a blank canvas changes the vision tokens the LM sees
  _, _, vis_blank = image_prompt(tok, vision_config(cfg), int(cfg.vl.image_token_id), vparams,
                                 [scenes.render(scene, blank=True)], prompt)
  assert float(jnp.abs(vis_blank - vis).max()) > 1e-4


def vl_data_grid(cfg, scene):
  from moonshot_jax.experiment import vision_config
  from moonshot_jax.vision.data import image_grid
  return image_grid(vision_config(cfg), scene)


def _cli(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "launch.generate", *args], cwd=ROOT, env=_env(),
                        capture_output=True, text=True, timeout=timeout)


def test_generate_image_cli_rejects_bad_images(tmp_path):
  """Each bad image exits 2 with a message naming it, before any checkpoint is read."""
  # (empty images, clips over the time table: tests/test_vision_processor.py, same code path)
  cases = {"two_channels.npy": (np.zeros((28, 28, 2), np.uint8), "expected 1, 3 or 4 channels"),
           "nan.npy": (np.full((28, 28, 3), np.nan, np.float32), "non-finite pixel")}
  args = ["--config=experiments/vl_tiny.py", f"--workdir={tmp_path / 'none'}", "--prompt=Q:"]
  for name, (arr, msg) in cases.items():
    np.save(tmp_path / name, arr)
  r = _cli(args + [f"--image={tmp_path / 'missing.png'}"])
  assert r.returncode == 2 and "missing.png: no such file" in r.stderr, r.stderr[-2000:]
  for name, (_, msg) in cases.items():
    r = _cli(args + [f"--image={tmp_path / name}"])
    assert r.returncode == 2 and msg in r.stderr, (name, r.stderr[-2000:])
  r = _cli(["--config=experiments/tiny.py", f"--workdir={tmp_path}", "--prompt=x",
            f"--image={tmp_path / 'nan.npy'}"])
  assert r.returncode == 2 and "no vision / vl section" in r.stderr


if __name__ == "__main__":
  sys.path.insert(0, str(ROOT))
  _driver(sys.argv[1])
