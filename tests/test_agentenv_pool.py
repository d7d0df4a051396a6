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
        with pytest.raises(TimeoutError, match="no sandbox free"):
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
