"""The start-up line's expert-dispatch verdict (loop.moe_dispatch_line) against the dispatch itself,
on 8 fake CPU devices: the capacity it states is the one the MoE layer allocates, and the drops it
allows are the drops that happen when every token picks the same experts (the worst case)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from moonshot_jax.parallel import expert as ep_lib
from moonshot_jax.train import loop

ROOT = Path(__file__).resolve().parents[1]


def _tiny_one_layer(**mesh):
  spec = importlib.util.spec_from_file_location("tiny_exp", ROOT / "experiments" / "tiny.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  cfg = mod.get_config()
  cfg.model.n_layers, cfg.model.mla_layers, cfg.model.dense_layers, cfg.model.attn_res = 1, (), (), False
  cfg.train.microbatches = mesh.pop("microbatches", 1)
  for k, v in mesh.items():
    cfg.mesh[k] = v
  return cfg


_LINE = re.compile(r"capacity (\d+) copies per \(rank, expert slot\) for (\d+) tokens per rank "
                   r"\(mesh\.capacity_factor=([\d.]+)\): (CAN DROP|cannot drop)")


@pytest.mark.parametrize("mesh,tokens", [
    (dict(data=1, expert=8, capacity_factor=2.0), 64),  # tiny's default factor: 8 x 64 tokens / 8 ranks
    (dict(data=2, expert=4, capacity_factor=3.9, microbatches=2), 32),  # ceil(31.2) = 32: still dropless
])
def test_dispatch_line_states_what_the_dispatch_does(mesh, tokens):
  cfg = _tiny_one_layer(**mesh)
  trainer = loop.build(cfg)
  line = loop.moe_dispatch_line(trainer)
  m = _LINE.search(line)
  assert m, line
  cap, per_rank, verdict = int(m.group(1)), int(m.group(2)), m.group(4)
  assert per_rank == tokens
  assert cap == ep_lib.dense_capacity(tokens * 2, 8, mesh["capacity_factor"])
  # All-zero weights: every router score ties, so every token picks experts 0 and 1 — the most
  # copies one rank can send one expert. Copies past the capacity drop.
  zeros = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t)
  variables = {"params": zeros(trainer.setup.abstract.params), "moe_state": zeros(trainer.setup.abstract.moe_state)}
  rows, seq = int(cfg.data.batch_size) // int(cfg.train.microbatches), int(cfg.data.seq_len)
  tok = jnp.zeros((rows, seq), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (rows, seq))
  with jax.set_mesh(trainer.mesh):
    _, aux = jax.jit(trainer.model.apply)(variables, tok, jnp.ones_like(tok), pos)
  assert int(aux["ep_capacity"][0]) == cap
  assert float(aux["ep_drop_fraction"][0]) == pytest.approx(max(0, per_rank - cap) / per_rank)
  assert (verdict == "CAN DROP") == (cap < per_rank)


def test_dispatch_line_without_expert_axis():
  cfg = _tiny_one_layer(data=-1, expert=1)
  assert "MoE dropless" in loop.moe_dispatch_line(loop.build(cfg))
