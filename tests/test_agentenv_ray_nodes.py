"""agentenv backend="ray" on a two-node Ray cluster (ray.cluster_utils.Cluster: two raylets on this machine).

Slow: the cluster takes ~10 s to start at load ~17 on the 2-core dev box (16 s for the whole test).
"""

import pytest

ray = pytest.importorskip("ray")

from moonshot_jax.agentenv import ray_backend  # noqa: E402
from tests.agentenv_testutil import require_namespaces  # noqa: E402

pytestmark = pytest.mark.slow


def test_one_host_per_node_round_robin_and_fork_stays_on_node():
  from ray.cluster_utils import Cluster

  require_namespaces()
  if ray.is_initialized():
    pytest.skip("a Ray cluster is already running in this process")
  cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
  try:
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=ray_backend.NAMESPACE, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ray_backend._repo_root()}})
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    assert len(nodes) == 2
    sbs = [ray_backend.create("python") for _ in range(4)]
    on = [s.id.split("/")[0] for s in sbs]
    assert sorted(on) == sorted(nodes * 2), "new sandboxes are spread round robin over the nodes"
    assert len({ray.get(s.host.pid.remote()) for s in sbs}) == 2, "one host actor per node"
    pinned = ray_backend.create("python", node_id=nodes[1])
    assert pinned.id.startswith(nodes[1] + "/")
    sbs[0].write_file("a.txt", "parent")
    kids = sbs[0].fork(2)
    assert all(k.id.split("/")[0] == on[0] for k in kids), "fork stays on its node (copy-on-write layers)"
    assert [k.read_file("a.txt") for k in kids] == [b"parent", b"parent"]
    assert sbs[1].exec("echo hi").stdout == b"hi\n"
    with pytest.raises(ValueError, match="not an alive node"):
      ray_backend.create("python", node_id="f" * 56)
    for s in sbs + kids + [pinned]:
      s.close()
    assert sum(ray.get(s.host.count.remote()) for s in sbs[:2]) == 0
  finally:
    ray.shutdown()
    cluster.shutdown()
