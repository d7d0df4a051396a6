"""agentenv backend="ray": the sandbox API through a host actor on a local 2-CPU Ray cluster.

One module-scoped cluster (start ~2.5 s, shutdown ~1.3 s on the 2-core dev box) serves every test here.
"""

import pickle

import pytest

ray = pytest.importorskip("ray")

from moonshot_jax import agentenv  # noqa: E402
from moonshot_jax.agentenv import envs, ray_backend  # noqa: E402
from tests.agentenv_testutil import require_namespaces  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
  require_namespaces()
  if ray.is_initialized():
    pytest.skip("a Ray cluster is already running in this process")
  ray_backend.init_local(num_cpus=2)
  yield
  ray.shutdown()


def test_ray_sandbox_round_trip(cluster):
  sb = agentenv.create("python", backend="ray")
  assert isinstance(sb, ray_backend.RaySandbox)
  host_pid = ray.get(sb.host.pid.remote())
  r = sb.exec("echo hi; cat", stdin="in")
  assert (r.stdout, r.exit_code, r.timed_out) == ("hi\nin", 0, False) or (r.stdout, r.exit_code) == (b"hi\nin", 0)
  sb.write_file("a.txt", "one")
  snap = sb.snapshot()
  sb.write_file("a.txt", "two")
  sb.restore(snap)
  assert _text(sb.read_file("a.txt")) == "one"
  kids = sb.fork(2)
  kids[0].write_file("a.txt", "kid0")
  assert [_text(k.read_file("a.txt")) for k in kids] == ["kid0", "one"]
  assert _text(sb.read_file("a.txt")) == "one"
  # handles are plain ids: picklable, and re-attachable from the id string alone
  again = pickle.loads(pickle.dumps(kids[0]))
  assert _text(again.exec("cat a.txt").stdout) == "kid0"
  assert _text(ray_backend.attach(kids[1].id).exec("cat a.txt").stdout) == "one"
  with pytest.raises(FileNotFoundError):  # the sandbox's own exception class crosses the actor boundary
    sb.read_file("nosuch.txt")
  for k in kids:
    k.close()
  with pytest.raises(agentenv.SandboxError):
    kids[0].exec("true")
  with pytest.raises(agentenv.SandboxError, match="no sandbox"):
    ray_backend.attach(kids[0].id).exec("true")  # closed on the host, not just in this handle
  sb.close()
  assert ray.get(sb.host.count.remote()) == 0
  with agentenv.create("python", backend="ray") as sb:
    assert ray.get(sb.host.pid.remote()) == host_pid, "one host actor per node, reused"
    assert sb.exec("true").exit_code == 0


def test_ray_env_episode_and_forked_group(cluster):
  for family in ("file_lookup", "file_edit"):  # closing an env drops every handle to the host: it must stay
    with envs.make_env(family, difficulty=1, backend="ray") as env:
      for seed in range(3):
        assert envs.rollout_oracle(env, seed)[1][-1][1].reward == 1.0
  with envs.make_env("kv_query", difficulty=2, backend="ray") as env:
    prompt = env.reset(4)
    kids = env.fork(2)
    try:
      first = [k.step(k.oracle_action()) for k in kids]
      assert first[0] == first[1] and first[0].observation.startswith("next ")
      while True:
        r = kids[0].step(kids[0].oracle_action())
        if r.done:
          break
      assert r.reward == 1.0, (prompt, r)
      assert kids[1].step("answer zzz").reward == 0.0
    finally:
      for k in kids:
        k.close()


def _text(x):
  return x.decode() if isinstance(x, bytes) else x


def test_ray_host_death_is_a_sandbox_error_and_an_observation(cluster):
  with envs.make_env("file_lookup", difficulty=1, backend="ray") as env:
    env.reset(1)
    host_pid = ray.get(env.sb.host.pid.remote())
    ray.kill(env.sb.host)  # the node's host actor dies, taking its sandboxes (and their hub) with it
    r = env.step("cat " + env.task.secret[0])
    assert (r.info.get("error"), r.reward, r.done) == ("sandbox_crash", 0.0, False), r
    with pytest.raises(agentenv.SandboxError, match="host actor died"):
      env.sb.exec("true")
    env.reset(1)  # a fresh host actor is started on demand
    assert ray.get(env.sb.host.pid.remote()) != host_pid
    assert env.step("cat " + env.task.secret[0]).observation.startswith("code ")


def test_ray_sandbox_has_the_local_api_pause_included(cluster):
  """Every public method / property of the local Sandbox exists on RaySandbox; pause / resume / paused / info
  behave as locally (paused read from the host, so a second handle to the same sandbox agrees)."""
  local = {n for n in dir(agentenv.Sandbox) if not n.startswith("_")}
  with agentenv.create("python", backend="ray") as sb:
    assert local - set(dir(sb)) - set(ray_backend.RaySandbox.FORWARDED) == set()
    if sb.info()["freezer"] is None:
      pytest.skip("no freezer cgroup on this host (pause needs one)")
    other = ray_backend.attach(sb.id)
    assert sb.paused is False and other.paused is False
    sb.pause()
    assert sb.paused is True and other.paused is True and sb.info()["paused"]
    with pytest.raises(agentenv.SandboxError, match="paused"):
      other.exec("true")
    other.resume()
    assert sb.paused is False and _text(sb.exec("echo ok").stdout) == "ok\n"
