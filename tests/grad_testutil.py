"""Per-leaf gradient comparison shared by the parallel-layout, pipeline and accumulation tests.

Every leaf is judged against its own norm: the small gradients (KDA f_a/f_b/A_log/dt_bias, the
router, latent_norm are 1e-3 of the rms leaf norm on tiny) are exactly where a sharding bug hides.
Only leaves whose true gradient is exactly zero get an absolute bound, and the caller names them.
"""
from __future__ import annotations

from typing import Iterable

import jax
import numpy as np


def path_str(path) -> str:
  """'layer_0/mixer/site/query' for dict keys, list indices and attributes alike."""
  parts = []
  for k in path:
    for attr in ("key", "idx", "name"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
  return "/".join(parts)


def assert_grads_close(grads, ref_grads, *, rtol: float = 1e-5, zero: Iterable[str] = (),
                       zero_atol: float = 1e-6) -> None:
  """|g − ref| <= rtol·|ref| per leaf. `zero`: paths whose true gradient is exactly 0 (both sides
  must then be <= zero_atol in norm); every other reference leaf must be non-zero, so a stale
  `zero` list or a gradient that vanished fails too."""
  zero = set(zero)
  flat_ref = [(path_str(p), np.asarray(x, np.float64))
              for p, x in jax.tree_util.tree_flatten_with_path(ref_grads)[0]]
  flat = [np.asarray(x, np.float64) for x in jax.tree.leaves(grads)]
  assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
  missing = zero - {p for p, _ in flat_ref}
  assert not missing, f"zero-gradient paths not in the tree: {sorted(missing)}"
  bad = []
  for (path, r), g in zip(flat_ref, flat):
    n, err = float(np.linalg.norm(r)), float(np.linalg.norm(g - r))
    if path in zero:
      ok = n <= zero_atol and float(np.linalg.norm(g)) <= zero_atol
    else:
      ok = n > 0 and err <= rtol * n  # `ok` is False for NaN too
    if not ok:
      bad.append(f"{path}: |dg| = {err:.3g}, |g_ref| = {n:.3g}, rel = {err / max(n, 1e-300):.3g}")
  assert not bad, "gradients differ:\n" + "\n".join(bad)
