"""Memory planner (moonshot_jax/parallel/plan_memory.py; CLI: launch/plan.py --mesh): the per-device
state estimate equals the bytes the real sharded train state puts on a device, and XLA's own
memory_analysis of the compiled step agrees."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moonshot_jax import experiment
from moonshot_jax.layers import attn_res
from moonshot_jax.parallel import plan_memory as pm_lib
from moonshot_jax.parallel.mesh import make_mesh
from moonshot_jax.parallel.parallel_model import ParallelModel


def test_parse_mesh():
  assert pm_lib.parse_mesh("pipeline=16,data=8,expert=64") == dict(pipeline=16, data=8, expert=64, tensor=1)
  for bad in ("pipe=2", "data", "data=0"):
    with pytest.raises(ValueError, match="--mesh"):
      pm_lib.parse_mesh(bad)


def _tiny_setup(strategy, shape):
  from moonshot_jax.train import optim, state as state_lib

  exp = pm_lib._load("experiments/tiny.py")
  exp.unlock()
  exp.mesh.strategy = strategy
  for a, v in shape.items():
    exp.mesh[a] = v
  sizes = experiment.mesh_shape(exp, 8)
  mesh = make_mesh(exp)
  pm = ParallelModel.from_experiment(exp, mesh)
  init_fn = lambda rng: pm.init(rng, jnp.zeros((1, 16), jnp.int32))
  setup = state_lib.setup_state(init_fn, lambda bp: optim.make_optimizer(exp.optimizer, bp, 10), mesh, strategy)
  return exp, sizes, mesh, setup, init_fn


CASES = [("zero1", dict(data=8)), ("zero3", dict(pipeline=2, data=2, expert=2)), ("zero3", dict(data=4, tensor=2))]


@pytest.mark.parametrize("strategy,shape", CASES)
def test_state_estimate_equals_jax_shard_shapes(strategy, shape):
  """Against jax's own NamedSharding.shard_shape of the train state's shardings (no compile)."""
  exp, sizes, mesh, setup, _ = _tiny_setup(strategy, shape)
  rep = pm_lib.plan_memory(exp, sizes)

  def nbytes(abstract, shardings):
    return sum(int(np.prod(sh.shard_shape(a.shape))) * a.dtype.itemsize
               for a, sh in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)))

  assert rep["bytes"]["params"] == nbytes(setup.abstract.params, setup.shardings.params)
  assert rep["bytes"]["optimizer"] == nbytes(setup.abstract.opt_state, setup.shardings.opt_state)
  mcfg = experiment.model_config(exp)
  t = rep["tokens_per_device_per_microbatch"]
  assert rep["activations_detail"]["carry"] == (attn_res.num_slots(mcfg) + 1) * t * mcfg.d_model * 4
  if sizes["pipeline"] > 1:
    m = rep["microbatches"]
    assert rep["bubble_fraction"] == pytest.approx((sizes["pipeline"] - 1) / (m + sizes["pipeline"] - 1))


@pytest.mark.slow
def test_state_estimate_equals_bytes_on_a_device():
  """Against the bytes a really created (sharded) train state holds on device 0."""
  from moonshot_jax.train import state as state_lib

  exp, sizes, mesh, setup, init_fn = _tiny_setup(*CASES[1])
  rep = pm_lib.plan_memory(exp, sizes)
  state = state_lib.create_train_state(setup, init_fn, 0)
  dev0 = mesh.devices.flat[0]
  on_dev0 = lambda tree: sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
                             if s.device == dev0)
  assert rep["bytes"]["params"] == on_dev0(state.params)
  assert rep["bytes"]["optimizer"] == on_dev0(state.opt_state)


@pytest.mark.slow
def test_k3_plan_on_the_paper_mesh():
  exp = pm_lib._load("experiments/k3.py")
  rep = pm_lib.plan_memory(exp, pm_lib.parse_mesh("pipeline=16,data=8,expert=64,tensor=1"))
  assert rep["devices"] == 8192 and rep["stage_slots"] == 6
  b = rep["bytes"]
  # experts dominate: 2.7T routed params over 16 stages x 64 EP ranks ~ 2.7B params = ~11 GB fp32
  assert 8 * 2**30 < b["params"] < 60 * 2**30
  assert all(np.isfinite(v) and v > 0 for v in b.values())
  lines = pm_lib.format_report(rep)
  assert "bubble" in lines[0] and any("all_to_all" in line for line in lines)


def test_rows_that_do_not_split_are_an_error():
  exp = pm_lib._load("experiments/tiny.py")  # batch_size 8
  with pytest.raises(ValueError, match="data.batch_size=8 .* 16 ranks"):
    pm_lib.plan_memory(exp, pm_lib.parse_mesh("data=4,expert=4"))
  with pytest.raises(ValueError, match="3 microbatches"):
    pm_lib.plan_memory(exp, pm_lib.parse_mesh("pipeline=2,data=2"), microbatches=3)


def _plan_cli(*args, timeout=600):
  """launch/plan.py on tiny with --json: (stdout, the JSON report)."""
  import json
  from test_plan import _run_plan
  proc = _run_plan("--config=experiments/tiny.py", "--json", *args, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout, json.loads(proc.stdout.strip().splitlines()[-1])


def test_plan_cli_mesh_and_fit():
  text, rep = _plan_cli("--mesh=pipeline=2,data=2,expert=2", "--config.mesh.strategy=zero3", "--hbm=big=1e12,small=1e3")
  exp = pm_lib._load("experiments/tiny.py")
  exp.unlock()
  exp.mesh.strategy = "zero3"
  want = pm_lib.plan_memory(exp, pm_lib.parse_mesh("pipeline=2,data=2,expert=2"))
  assert rep["mesh_plan"]["strategy"] == "zero3"  # the --config override reached the section
  assert rep["mesh_plan"]["bytes"]["total"] == pytest.approx(want["bytes"]["total"])
  assert rep["fits"] == {"big": True, "small": False}
  assert "memory per device" in text and "decode cache per sequence" in text and "kv_cache" in rep


def test_worker_argv_keeps_overrides_and_drops_output_flags():
  argv = ["--config=experiments/k3.py", "--config.mesh.strategy=zero3", "--mesh=pipeline=16", "--aot", "--json"]
  assert pm_lib.worker_argv(argv) == argv[:3]


def test_aot_worker_keeps_the_callers_xla_flags_but_its_own_device_count(monkeypatch):
  """The --aot worker compiles with the caller's XLA flags (the tests' -O0 keeps its compile cheap);
  only the fake device count is the proxy mesh's."""
  import math
  seen = {}
  monkeypatch.setattr(pm_lib, "run_plan_worker", lambda argv, env, **kw: seen.setdefault("flags", env["XLA_FLAGS"]))
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
  pm_lib.run_aot_worker(["--config=experiments/tiny.py"])
  n = math.prod(pm_lib.PROXY_MESH.values())
  assert seen["flags"].split() == ["--xla_backend_optimization_level=0", f"--xla_force_host_platform_device_count={n}"]


def test_aot_proxy_memory_analysis_matches_the_estimate():
  """XLA's own accounting of the compiled tiny train step (2 stages x data 2 x expert 4, the proxy
  mesh itself) against the estimate: arguments are the params + optimizer state (+ a small batch
  and step/moe_state), and the compiled step must alias (donate) the state."""
  _, rep = _plan_cli("--mesh=pipeline=2,data=2,expert=4", "--config.mesh.strategy=zero3", "--aot")
  xla, est = rep["aot"]["xla"], rep["aot"]["proxy_estimate"]["bytes"]
  state = est["params"] + est["optimizer"]
  assert state <= xla["argument_size_in_bytes"] <= 1.25 * state + 2**20
  assert xla["alias_size_in_bytes"] >= 0.9 * state  # donation reaches XLA
  assert xla["temp_size_in_bytes"] > 0
