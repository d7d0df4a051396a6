"""SandboxPool: the bound is hard, waiters queue FIFO, released sandboxes come back pristine, broken ones are replaced."""
import threading
import time

import pytest

from moonshot_jax import agentenv
from tests.agentenv_testutil import require_namespaces


def test_bound_is_hard_and_waiters_queue():
  require_namespaces()
  peak, order, lock = [0], [], threading.Lock()
  with agentenv.SandboxPool(2, files={"t.txt": "t"}) as pool:
    def work(i):
      with pool.sandbox() as sb:
        with lock:
          peak[0] = max(peak[0], agentenv.hub_stats()["sandboxes"], pool.live)
          order.append(i)
        assert sb.exec("cat t.txt").text == "t"
        time.sleep(0.1)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
      t.start()
      time.sleep(0.01)
    for t in threads:
      t.join()
    assert peak[0] == 2 and sorted(order) == list(range(6))
    assert pool.stats["created"] == 2 and pool.stats["leased"] == 6  # the other four leases reused sandboxes
    with pool.sandbox():
      with pool.sandbox():
        with pytest.raises(TimeoutError, match="no room for a sandbox"):
          pool.acquire(timeout=0.1)


def test_release_resets_and_unhealthy_is_replaced():
  require_namespaces()
  with agentenv.SandboxPool(1) as pool:
    with pool.sandbox() as sb:
      sb.exec("echo dirty > f")
      sb.start_service("kv", agentenv.services.KV)
      first = sb.id
    with pool.sandbox() as sb:
      assert sb.id == first and sb.list_dir(".") == [] and sb.exec("svc kv GET a").exit_code != 0
      sb.close()  # broken behind the pool's back
    with pool.sandbox() as sb:
      assert sb.id != first and sb.exec("echo ok").ok
    assert pool.live == 1
  assert agentenv.hub_stats()["sandboxes"] == 0
  with pytest.raises(ValueError, match="max_sandboxes"):
    agentenv.SandboxPool(0)


def test_forks_count_against_the_bound():
  require_namespaces()
  with agentenv.SandboxPool(4, warm=2) as pool:
    with pool.sandbox() as sb:
      sb.write_file("state", "s")
      with pool.forked(sb, 3) as kids:  # 1 leased + 3 forks = 4: the idle warm sandbox had to go
        assert [k.read_file("state") for k in kids] == [b"s"] * 3
        assert pool.live == 4 and agentenv.hub_stats()["sandboxes"] == 4
        with pytest.raises(TimeoutError, match="no room"):
          pool.acquire(timeout=0.1)
      assert pool.live == 1 and all(k.closed for k in kids)
    with pytest.raises(ValueError, match="max_sandboxes"):
      with pool.forked(sb, 5):
        pass
