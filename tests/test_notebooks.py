"""Executes the notebooks end to end (nbclient) at tiny sizes, injecting parameter values the way
papermill does: a cell right after the one tagged "parameters" overrides its assignments."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NB_DIR = Path(__file__).resolve().parents[1] / "notebooks"


def _parameter_names(cell_source: str) -> set[str]:
  names = set()
  for node in ast.parse(cell_source).body:
    if isinstance(node, ast.Assign):
      names.update(t.id for t in node.targets if isinstance(t, ast.Name))
  return names


def run_notebook(name: str, params: dict, tmp_path: Path, timeout: int = 600):
  nb = nbformat.read(NB_DIR / name, as_version=4)
  idx = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
  assert len(idx) == 1, f"{name}: expected exactly one cell tagged 'parameters'"
  unknown = set(params) - _parameter_names(nb.cells[idx[0]].source)
  assert not unknown, f"{name}: parameters {sorted(unknown)} are not set in its parameters cell"
  injected = nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in params.items()))
  injected.metadata["tags"] = ["injected-parameters"]
  nb.cells.insert(idx[0] + 1, injected)
  client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                   resources={"metadata": {"path": str(NB_DIR)}})
  client.execute()
  nbformat.write(nb, tmp_path / name)  # executed copy, for debugging a failure
  return nb


def _text_outputs(nb) -> str:
  out = []
  for c in nb.cells:
    for o in c.get("outputs", []):
      if o.get("output_type") == "stream":
        out.append(o.get("text", ""))
      elif "data" in o and "text/plain" in o["data"]:
        out.append(o["data"]["text/plain"])
  return "\n".join(out)


def _count_images(nb) -> int:
  return sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))


def test_kda_explained_runs(tmp_path):
  nb = run_notebook("kda_explained.ipynb", dict(T=64, K=16, V=16, chunk_size=16, timing_lengths=(64, 128),
                                                check_pallas=True, check_pallas_grad=False,
                                                pallas_T=32), tmp_path)
  text = _text_outputs(nb)
  assert "chunk_kda vs recurrent_kda" in text and "pallas" in text
  assert _count_images(nb) >= 4


# Fast tier on purpose (~80 s on 2 cores, train-step compile dominates): issue 7 wants both notebooks run in CI.
def test_small_variant_runs(tmp_path):
  nb = run_notebook("small_variant.ipynb", dict(experiment_file="experiments/tiny.py", steps=3, overrides={},
                                                workdir=str(tmp_path / "run"), num_devices=1, max_new_tokens=8),
                    tmp_path)
  text = _text_outputs(nb)
  assert "trained to step 3" in text and "tokens in" in text
  assert _count_images(nb) >= 2
  assert (tmp_path / "run" / "checkpoints").is_dir()


# Fast tier (issue 19: executed in CI at tiny size): a toy corpus, a 2-layer dense LM, 3 steps.
def test_vision_small_runs(tmp_path):
  toy = {"vl.train_scenes": 200, "vl.eval_qa": 20, "vl.eval_captions": 4, "vl.eval_text": 2, "vl.patch_budget": 512,
         "data.batch_size": 8, "train.eval_every": 3, "checkpoint.every_steps": 3, "logging.tensorboard": False,
         "model.n_layers": 2, "model.mla_layers": (2,), "model.dense_layers": (1, 2), "model.attn_res": False,
         "vision.n_layers": 1}
  nb = run_notebook("vision_small.ipynb", dict(experiment_file="experiments/vl_tiny.py", steps=3, overrides=toy,
                                                workdir=str(tmp_path / "run"), max_new_tokens=4), tmp_path)
  text = _text_outputs(nb)
  assert "trained to step 3" in text and "placeholders:" in text and "blanked, chance" in text
  assert text.count("(truth: ") == 3
  assert _count_images(nb) >= 3
  assert (tmp_path / "run" / "checkpoints" / "3").is_dir()
