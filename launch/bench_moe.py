"""python -m launch.bench_moe

Routed-expert compute of one LatentMoE layer, forward + backward, at the `small` config's shapes
(8x256 tokens, 32 experts top-2, latent 128, expert width 512): "blocked" vs "ragged_dot" side by
side on this backend. Prints a table (ms per call, ratio to blocked). Why "auto" picks blocked on
CPU: XLA:CPU lowers ragged_dot to a dense masked product over all experts.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from absl import app, flags

from moonshot_jax import host_memory
from moonshot_jax.config import ModelConfig
from moonshot_jax.layers.moe import routed_experts

_TOKENS = flags.DEFINE_integer("tokens", 2048, "tokens per call (batch x sequence)")
_EXPERTS = flags.DEFINE_integer("experts", 32, "routed experts")
_TOPK = flags.DEFINE_integer("topk", 2, "experts per token")
_LATENT = flags.DEFINE_integer("latent", 128, "expert input width (moe_latent_dim)")
_FF = flags.DEFINE_integer("ff", 512, "expert hidden width")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed calls per implementation (best is reported)")


def _time(fn, *args) -> float:
  jax.block_until_ready(fn(*args))  # compile + warm up
  best = float("inf")
  for _ in range(_REPEATS.value):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - t0)
  return best


def main(argv):
  del argv
  t, e, k, l, f = _TOKENS.value, _EXPERTS.value, _TOPK.value, _LATENT.value, _FF.value
  ks = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(ks[0], (t, l))
  # skewed router (like early training): expert popularity ~ Zipf
  logits = -jnp.log1p(jnp.arange(e, dtype=jnp.float32))[None] + jax.random.gumbel(ks[1], (t, e))
  _, idx = jax.lax.top_k(logits, k)
  w = jax.nn.softmax(jax.random.normal(ks[2], (t, k)))
  wg, wu = (jax.random.normal(kk, (e, l, f)) * l ** -0.5 for kk in jax.random.split(ks[3]))
  wd = jax.random.normal(ks[4], (e, f, l)) * f ** -0.5
  needed = 3 * 2 * t * k * l * f * 3  # three matmuls, fwd + 2x bwd
  rows = []
  for impl in ("blocked", "ragged_dot"):
    cfg = ModelConfig(num_experts=e, num_experts_per_tok=k, expert_ff_dim=f, moe_implementation=impl)
    loss = lambda x, wg, wu, wd, cfg=cfg: jnp.sum(routed_experts(x, idx, w, wg, wu, wd, cfg) ** 2)
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    rows.append((impl, _time(fn, x, wg, wu, wd)))
  print(f"backend={jax.default_backend()} tokens={t} experts={e} top-{k} latent={l} ff={f} "
        f"(needed {needed / 1e9:.2f} GFLOP per fwd+bwd)")
  print(f"{'implementation':<14} {'ms/call':>9} {'GFLOP/s':>9} {'x blocked':>10}")
  for impl, sec in rows:
    print(f"{impl:<14} {sec * 1e3:9.1f} {needed / sec / 1e9:9.1f} {sec / rows[0][1]:10.2f}")


if __name__ == "__main__":
  host_memory.reexec_with_huge_pages()  # before any jax work: glibc reads it at start-up
  app.run(main)
