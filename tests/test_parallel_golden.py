"""Golden PartitionSpecs of every parameter (tiny, tiny on 2 pipeline stages, k3 via eval_shape).

A rule change must show up in review: when this fails, inspect the diff and regenerate explicitly
with `python -m moonshot_jax.parallel.golden --write`.
"""
import json

import pytest

from moonshot_jax.parallel import golden


@pytest.mark.parametrize("case", golden.CASES, ids=[c[0] for c in golden.CASES])
def test_partition_specs_match_golden(case):
  name, path, mesh_override, devices = case
  current = golden.render_case(name, path, mesh_override, devices)
  with open(golden.golden_path(name)) as f:
    pinned = f.read()
  if current != pinned:
    old, new = json.loads(pinned)["params"], json.loads(current)["params"]
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    pytest.fail(f"{name}: PartitionSpecs changed for {len(changed)} parameter(s), e.g. {changed[:5]}. "
                f"If intended, run `python -m moonshot_jax.parallel.golden --write` and commit the diff.")


def test_golden_covers_experts_stages_and_data_sharding():
  k3 = json.loads(open(golden.golden_path("k3")).read())["params"]
  w_gate = next(v for k, v in k3.items() if k.endswith("['moe']['w_gate']"))
  # stage axis over pipeline, experts over expert, latent over data in ZeRO-3 (and the moments)
  assert w_gate["mesh_zero3"] == "('pipeline', None, 'expert', 'data', 'tensor')"
  assert w_gate["mesh_zero1"] == "('pipeline', None, 'expert', None, 'tensor')"
  assert w_gate["mesh_zero1_opt"] == w_gate["mesh_zero3"]
