"""agentenv semantics: exec / files, snapshot / restore / fork of files and in-process service state, bad input."""
import pytest

from moonshot_jax import agentenv
from tests.agentenv_testutil import require_namespaces

COUNTER = r'''
import random
n = 0
def handle(req):
    global n
    if req == "rand":
        return repr(random.random())
    n += 1
    return str(n)
'''


@pytest.fixture
def sb():
  require_namespaces()
  with agentenv.create(files={"data/a.txt": "alpha", "/etc/task.json": b"{}"}) as s:
    yield s


def test_exec_and_files(sb):
  r = sb.exec("cat data/a.txt; echo err >&2; exit 3")
  assert (r.stdout, r.stderr, r.exit_code, r.timed_out) == (b"alpha", b"err\n", 3, False)
  assert sb.exec(["python3", "-c", "import sys; print(sys.stdin.read()[::-1])"], stdin="abc").text == "cba\n"
  assert sb.exec("pwd; echo $X", cwd="data", env={"X": "1"}).text == "/home/user/data\n1\n"
  assert sb.exec("cat /etc/task.json; id -un").text == "{}user\n"
  sb.write_file("out/b.bin", bytes(range(256)))
  assert sb.read_file("/home/user/out/b.bin") == bytes(range(256))
  assert sb.exec("stat -c '%U %s' out/b.bin && echo more >> out/b.bin").text == "user 256\n"  # agent owns it
  assert sb.list_dir(".") == ["data", "out"] and sb.list_dir("/etc")[:2] == ["group", "hostname"]
  r = sb.exec("nosuchcommand")
  assert r.exit_code == 127


def test_fork_sees_state_at_fork_time_and_diverges(sb):
  sb.write_file("f", "parent-0")
  sb.start_service("kv", agentenv.services.KV)
  sb.call_service("kv", "SET k 0")
  kids = sb.fork(2)
  try:
    sb.write_file("f", "parent-1")
    sb.call_service("kv", "SET k parent")
    kids[0].write_file("f", "kid0")
    assert kids[0].exec("svc kv SET k kid0").text == "OK\n"
    assert sb.read_file("f") == b"parent-1" and kids[0].read_file("f") == b"kid0"
    assert kids[1].read_file("f") == b"parent-0" and kids[1].read_file("data/a.txt") == b"alpha"
    assert [s.call_service("kv", "GET k") for s in (sb, *kids)] == ["parent", "kid0", "0"]
    grandkid = kids[0].fork(1)[0]
    assert grandkid.read_file("f") == b"kid0" and grandkid.call_service("kv", "GET k") == "kid0"
    grandkid.close()
  finally:
    for k in kids:
      k.close()


def test_restore_is_exact_for_files_and_services(sb):
  sb.start_service("repl", agentenv.services.REPL)
  sb.start_service("ctr", COUNTER)
  sb.call_service("repl", "xs = [1, 2, 3]")
  sb.exec("echo keep > k; echo gone > g; mkdir d && echo x > d/x")
  assert sb.call_service("ctr", "inc") == "1"
  snap = sb.snapshot()
  rnd = sb.call_service("ctr", "rand")
  sb.exec("rm g; rm -r d; echo new > n; echo changed > k; chmod 600 k")
  sb.call_service("repl", "xs.append(4); import os")
  assert sb.call_service("ctr", "inc") == "2"
  for _ in range(2):  # restoring twice gives the same state (randomness included: restore does not reseed)
    sb.restore(snap)
    assert sb.exec("cat k g d/x; ls n; stat -c %a k").text == "keep\ngone\nx\n644\n"
    assert sb.call_service("repl", "xs") == "[1, 2, 3]\n"
    assert sb.call_service("ctr", "inc") == "2"  # 1 at the snapshot, +1 now
    assert sb.call_service("ctr", "rand") == rnd
  # a snapshot is usable from the owner's forks, and forks reseed randomness
  kid_a, kid_b = sb.fork(2)
  try:
    assert kid_a.call_service("ctr", "rand") != kid_b.call_service("ctr", "rand")
    kid_a.exec("echo kid > k")
    kid_a.restore(snap)
    assert kid_a.read_file("k") == b"keep\n"
  finally:
    kid_a.close(), kid_b.close()


def test_snapshot_of_unchanged_sandbox_adds_no_layer(sb):
  sb.exec("echo 1 > one")
  first = sb.snapshot()
  layers = agentenv.hub_stats()["layers"]
  again = [sb.snapshot() for _ in range(5)]
  assert agentenv.hub_stats()["layers"] == layers and len(set(again + [first])) == 6
  sb.exec("echo 2 > two")
  sb.snapshot()
  assert agentenv.hub_stats()["layers"] == layers + 1
  for s in again:
    sb.drop_snapshot(s)
  with pytest.raises(agentenv.SnapshotNotFoundError, match="unknown snapshot"):
    sb.restore(again[0])


def test_bad_input_gives_clear_errors():
  require_namespaces()
  with pytest.raises(ValueError, match="unknown template 'nope'"):
    agentenv.create("nope")
  with pytest.raises(ValueError, match="memory_mb"):
    agentenv.Limits(memory_mb=-1)
  with pytest.raises(ValueError, match="pids"):
    agentenv.Limits(pids="many")
  with pytest.raises(ValueError, match="timeout"):
    agentenv.Limits(timeout=0)
  with pytest.raises(ValueError, match="/usr/x"):
    agentenv.create(files={"/usr/x": "y"})
  with pytest.raises(TypeError, match="limits"):
    agentenv.create(limits={"memory_mb": 1})
  sb = agentenv.create()
  with pytest.raises(agentenv.SnapshotNotFoundError, match="snap-bogus"):
    sb.restore("snap-bogus")
  with pytest.raises(agentenv.SnapshotNotFoundError):
    sb.restore(123)
  with pytest.raises(ValueError, match="fork"):
    sb.fork(0)
  with pytest.raises(agentenv.SandboxError, match="handle"):
    sb.start_service("bad", "x = 1")
  with pytest.raises(LookupError, match="nosvc"):
    sb.call_service("nosvc", "hi")
  with pytest.raises(FileNotFoundError):
    sb.read_file("missing.txt")
  with pytest.raises(ValueError, match="timeout"):
    sb.exec("true", timeout=-1)
  with pytest.raises(TypeError, match="cmd"):
    sb.exec(42)
  sb.close()
  sb.close()  # idempotent
  for call in (lambda: sb.exec("true"), lambda: sb.read_file("x"), sb.snapshot, lambda: sb.fork(1)):
    with pytest.raises(agentenv.SandboxClosedError, match="closed"):
      call()
