"""The hub's request loop: background cleanup between requests gives way to a request that has arrived."""
import os
import socket

import pytest

from moonshot_jax.agentenv import _hub


@pytest.fixture(autouse=True)
def _no_reaping(monkeypatch):
  """_collect reaps the hub's dead children; here it must not reap the test process's."""
  def no_children(pid, options):
    raise ChildProcessError
  monkeypatch.setattr(_hub.os, "waitpid", no_children)


def _idle_hub(tmp_path, garbage, pending_cg):
  """A Hub with only what _collect touches (no namespaces needed): layer dirs under tmp_path, a host socket."""
  hub = _hub.Hub.__new__(_hub.Hub)
  host, peer = socket.socketpair()
  hub.host, hub.layers, hub.parked = host, str(tmp_path), {}
  hub.garbage, hub.pending_cg = list(garbage), list(pending_cg)
  for name in garbage:
    os.makedirs(tmp_path / name / "sub")
    (tmp_path / name / "sub" / "f").write_text("x")
  for d in pending_cg:
    os.makedirs(d)
  return hub, peer


def test_collect_frees_garbage_and_cgroup_dirs_while_nothing_waits(tmp_path):
  cgs = [str(tmp_path / "cg" / f"sb-{i}") for i in range(3)]
  hub, peer = _idle_hub(tmp_path, ["u1", "u2", "t3"], cgs)
  with peer, hub.host:
    hub._collect(1.0)
  assert hub.garbage == [] and hub.pending_cg == []
  assert sorted(os.listdir(tmp_path)) == ["cg"] and os.listdir(tmp_path / "cg") == []


def test_collect_stops_as_soon_as_a_request_has_arrived(tmp_path):
  cgs = [str(tmp_path / "cg" / f"sb-{i}") for i in range(3)]
  hub, peer = _idle_hub(tmp_path, ["u1", "u2", "t3"], cgs)
  with peer, hub.host:
    peer.sendall(b"request")
    hub._collect(1.0)
    assert hub.garbage == ["u1", "u2", "t3"] and hub.pending_cg == cgs  # left for after the request
    assert all(os.path.isdir(p) for p in cgs) and os.path.isdir(tmp_path / "u1")
    hub._collect(1.0, yield_to_host=False)  # shutdown: the host socket may be at EOF, i.e. readable for good
  assert hub.garbage == [] and hub.pending_cg == []


def test_a_reply_frees_only_the_layers_its_own_request_dropped(tmp_path):
  """Older garbage (e.g. the 64 layers a squash replaced) must not delay a restore's reply: it is left to the
  yielding background collector; the request's own dropped layers (upper + work) go before the reply."""
  hub, peer = _idle_hub(tmp_path, ["m1", "t2", "u3"], [])
  os.makedirs(tmp_path / "w3")
  with peer, hub.host:
    g0 = 2  # m1, t2 were garbage before the request; it dropped u3 (whose work dir is w3)
    hub._free_own(g0, 1.0)
  assert hub.garbage == ["m1", "t2"]
  assert sorted(os.listdir(tmp_path)) == ["m1", "t2"]
