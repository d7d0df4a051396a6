"""PartitionSpec tables of every parameter, pinned in tests/golden/ so a rule change shows in review.

    python -m moonshot_jax.parallel.golden            # check: exit 1 and print a diff if stale
    python -m moonshot_jax.parallel.golden --write    # regenerate tests/golden/*.json (explicitly)

One JSON file per (experiment, layout): per parameter path its logical names, shape and the specs
for each strategy — pure rules ("zero1", "zero1_opt" for the optimizer moments, "zero3") and the
concrete spec on the experiment's own mesh after divisibility ("mesh_zero1", ...). Everything comes
from `jax.eval_shape` of the init (nothing allocated; k3 included).
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from moonshot_jax import experiment
from moonshot_jax.parallel import rules as rules_lib
from moonshot_jax.parallel import zero
from moonshot_jax.parallel.rules import MESH_AXES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN_DIR = os.path.join(ROOT, "tests", "golden")
# (name, experiment file, mesh override or None = the experiment's own mesh, devices for -1)
CASES = (
    ("tiny", "experiments/tiny.py", None, 8),
    ("tiny_pipeline2", "experiments/tiny.py", dict(pipeline=2, data=2, expert=2, tensor=1), 8),
    ("k3", "experiments/k3.py", None, 16 * 8 * 64),
)


def load_experiment(path: str) -> Any:
  return experiment.load_experiment(os.path.join(ROOT, path))


def _abstract_mesh(sizes: dict[str, int]) -> AbstractMesh:
  return AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)


def _fmt(spec) -> str:
  return str(tuple(spec))


def spec_table(exp_cfg: Any, mesh_sizes: dict[str, int]) -> dict[str, dict[str, Any]]:
  """{param path: {names, shape, zero1, zero1_opt, zero3, mesh_zero1, mesh_zero1_opt, mesh_zero3}}."""
  from moonshot_jax.parallel.parallel_model import ParallelModel  # local: imports the model stack

  cfg = experiment.model_config(exp_cfg)
  mesh = _abstract_mesh(mesh_sizes)
  pm = ParallelModel(cfg, mesh)
  boxed = jax.eval_shape(pm.init, jax.random.key(0), jnp.zeros((1, 16), jnp.int32))["params"]
  out = {}
  is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)
  for path, box in jax.tree_util.tree_flatten_with_path(boxed, is_leaf=is_box)[0]:
    names = tuple(box.names) if isinstance(box, nn.LogicallyPartitioned) else None
    shape = tuple((box.value if names is not None else box).shape)
    row = {"names": list(names) if names else None, "shape": list(shape)}
    for key, rules in (("zero1", rules_lib.logical_axis_rules("zero1")),
                       ("zero1_opt", rules_lib.opt_state_axis_rules("zero1")),
                       ("zero3", rules_lib.logical_axis_rules("zero3"))):
      row[key] = _fmt(zero.spec_for(names, shape, rules))
      row["mesh_" + key] = _fmt(zero.spec_for(names, shape, rules, mesh))
    out[jax.tree_util.keystr(path)] = row
  return out


def render_case(name: str, path: str, mesh_override, devices: int) -> str:
  exp_cfg = load_experiment(path)
  sizes = dict(mesh_override) if mesh_override else experiment.mesh_shape(exp_cfg, devices)
  table = spec_table(exp_cfg, sizes)
  doc = {"experiment": path, "mesh": sizes, "params": table}
  return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def golden_path(name: str) -> str:
  return os.path.join(GOLDEN_DIR, f"partition_specs_{name}.json")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--write", action="store_true", help="regenerate the golden files")
  ap.add_argument("--only", default=None, help="one case name")
  args = ap.parse_args(argv)
  stale = 0
  for name, path, mesh_override, devices in CASES:
    if args.only and name != args.only:
      continue
    text = render_case(name, path, mesh_override, devices)
    gp = golden_path(name)
    if args.write:
      os.makedirs(GOLDEN_DIR, exist_ok=True)
      with open(gp, "w") as f:
        f.write(text)
      print(f"wrote {gp}")
      continue
    old = open(gp).read() if os.path.exists(gp) else ""
    if old != text:
      stale += 1
      sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True), gp, "current"))
  return 1 if stale else 0


if __name__ == "__main__":
  sys.exit(main())
