"""layers/linear.project: value and gradients against autodiff of the plain einsum."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from moonshot_jax.layers.linear import project
from moonshot_jax.parallel import mesh as mesh_lib

SPECS = [  # (spec, x shape, w shape)
    ("btd,dhk->bthk", (2, 5, 8), (8, 3, 4)),
    ("bthv,hvd->btd", (2, 5, 3, 4), (3, 4, 8)),
    ("...d,df->...f", (2, 5, 8), (8, 6)),
    ("td,de->te", (7, 8), (8, 5)),
    ("bhd,hdk->bhk", (2, 3, 4), (3, 4, 6)),  # h in all three terms: a batch index
]


def _plain(spec, x, w, dtype):
  return jnp.einsum(spec, x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)


@pytest.mark.parametrize("spec,xs,ws", SPECS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_project_matches_einsum_value_and_grad(spec, xs, ws, dtype):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=xs), jnp.float32)
  w = jnp.asarray(rng.normal(size=ws), jnp.float32)
  dy = jnp.asarray(rng.normal(size=jnp.einsum(spec, x, w).shape), jnp.float32)
  y = project(spec, x, w, dtype)
  assert y.dtype == jnp.float32
  np.testing.assert_allclose(y, _plain(spec, x, w, dtype), rtol=1e-6, atol=1e-6)
  loss = lambda f: lambda x, w: jnp.sum(f(spec, x, w, dtype) * dy)
  got = jax.jit(jax.grad(loss(project), argnums=(0, 1)))(x, w)
  want = jax.grad(loss(_plain), argnums=(0, 1))(x, w)
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  for g, r, name in zip(got, want, ("dx", "dw")):
    assert g.dtype == jnp.float32, name  # cotangents come back in the operands' own dtype
    np.testing.assert_allclose(g, r, rtol=tol, atol=tol * float(jnp.max(jnp.abs(r))), err_msg=name)


def test_project_under_shard_map_psums_weight_gradients():
  """Tokens over "data", the weight's output features over "tensor": dw must be summed over the data
  shards (the cast's transpose), dx over the tensor shards."""
  mesh = mesh_lib.make_mesh({"data": 2, "tensor": 4})
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(8, 6)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(6, 12)), jnp.float32)

  def local(x, w):
    return jax.lax.psum(jnp.sum(jnp.tanh(project("td,df->tf", x, w))), ("data", "tensor"))

  f = jax.shard_map(local, mesh=mesh, in_specs=(P("data", None), P(None, "tensor")), out_specs=P())
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "tensor")))
    val, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(xs, ws)
  ref = lambda x, w: jnp.sum(jnp.tanh(x @ w))
  np.testing.assert_allclose(val, ref(x, w), rtol=1e-5)
  for g, r in zip(grads, jax.grad(ref, argnums=(0, 1))(x, w)):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec,msg", [("btd,dk", "two-operand"), ("btd,dk,ke->bte", "two-operand"),
                                      ("btd,dk->bk", "one operand only"),
                                      ("btd,...k->btk", r"'\.\.\.'")])
def test_project_rejects_specs_that_are_not_contractions(spec, msg):
  with pytest.raises(ValueError, match=msg):
    project(spec, jnp.ones((2, 3, 4)), jnp.ones((4, 5)))
