"""GPipe with remat keeps ONE stack of stage inputs for the backward: final_fn's residuals (the stage
output of every iteration) must not become a second [M+S-1, carry] stack -- XLA:TPU's buffer
assignment for K3's proxy showed two 13.8 GiB stacks before final_fn moved inside the remat body."""
import jax
import jax.numpy as jnp
import numpy as np

from moonshot_jax.parallel import pipeline as pp
from moonshot_jax.parallel.mesh import make_mesh


def test_gpipe_remat_saves_one_carry_stack_with_a_final_fn():
  mesh = make_mesh(dict(pipeline=2, data=4))
  d, m = 24, 3
  stage_fn = lambda p, c, s: ({"x": jnp.tanh(c["x"] @ p["w"])}, {"a": jnp.sum(c["x"])})
  params = {"w": jax.random.normal(jax.random.key(0), (2, d, d)) * 0.3}
  xs = {"x": jax.random.normal(jax.random.key(1), (m, 5, d))}

  def loss(params, xs, q):
    out, _ = pp.gpipe(stage_fn, params, xs, mesh, remat=True, final_params=q,
                      final_fn=lambda q, c: {"x": jnp.tanh(c["x"] * q)})
    return jnp.sum(out["x"] ** 2)

  with jax.set_mesh(mesh):  # jax.vjp's backward is a Partial pytree: its leaves are the residuals
    val, f_vjp = jax.jit(lambda *a: jax.vjp(loss, *a))(params, xs, jnp.float32(2.0))
    grads = jax.jit(lambda f: f(jnp.float32(1.0)))(f_vjp)
  iters = m + 2 - 1
  # residuals shaped like a stack of per-iteration carries [S * (M+S-1), 5, d] (global over "pipeline")
  stacks = [x for x in jax.tree.leaves(f_vjp) if getattr(x, "shape", ())[:1] == (2 * iters,) and x.ndim == 3]
  assert len(stacks) == 1, [x.shape for x in jax.tree.leaves(f_vjp) if hasattr(x, "shape")]
  # and the gradient is the sequential one (two stages applied in order, then final_fn)
  def seq_loss(params, xs, q):
    h = xs["x"]
    for s in range(2):
      h = jnp.tanh(h @ params["w"][s])
    return jnp.sum(jnp.tanh(h * q) ** 2)
  want = jax.grad(seq_loss, argnums=(0, 1, 2))(params, xs, jnp.float32(2.0))
  np.testing.assert_allclose(float(val), float(seq_loss(params, xs, 2.0)), rtol=1e-5)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
