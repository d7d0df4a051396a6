"""agentenv semantics: exec / files, snapshot / restore / fork of files and in-process service state, bad input."""
import os
import time

import pytest

from moonshot_jax import agentenv
from tests.agentenv_testutil import SPAWN_PATHS, require_namespaces, spawn_path  # noqa: F401  (fixture)

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
def sb(spawn_path):
  require_namespaces()
  with agentenv.create(files={"data/a.txt": "alpha", "/etc/task.json": b"{}"}) as s:
    yield s


@pytest.mark.parametrize("spawn_path", SPAWN_PATHS, indirect=True)
def test_exec_and_files(sb):
  r = sb.exec("cat data/a.txt; echo err >&2; exit 3")
  assert (r.stdout, r.stderr, r.exit_code, r.timed_out) == (b"alpha", b"err\n", 3, False)
  assert sb.exec(["python3", "-c", "import sys; print(sys.stdin.read()[::-1])"], stdin="abc").text == "cba\n"
  assert sb.exec("pwd; echo $X", cwd="data", env={"X": "1"}).text == "/home/user/data\n1\n"
  assert sb.exec("cat /etc/task.json; id -un").text == "{}user\n"
  sb.write_file("out/b.bin", bytes(range(256)))
  assert sb.read_file("/home/user/out/b.bin") == bytes(range(256))
  assert sb.exec("stat -c '%U %s' out/b.bin && echo more >> out/b.bin").text == "user 256\n"  # agent owns it
  assert sb.list_dir(".") == ["data", "out"] and {"group", "hostname", "passwd"} < set(sb.list_dir("/etc"))
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


def _mounts_in(sb):
  """(mount point, fs type) of each mount in the sandbox's mount namespace, as a command inside sees them."""
  out = []
  for line in sb.exec("cat /proc/self/mountinfo").text.splitlines():
    pre, _, post = line.partition(" - ")
    out.append((pre.split()[4], post.split()[0]))
  return out


def test_restore_swaps_the_overlay_before_it_returns_and_the_old_one_goes(sb):
  """When restore returns, the snapshot's overlay is the one mount at /r; the replaced one (moved aside, out of
  the sandbox's reach, for the unmounter to detach off the request path) is gone soon after, with its layer."""
  sb.exec("echo keep > k")
  snap = sb.snapshot()
  sb.restore(snap)
  deadline = time.monotonic() + 5
  while agentenv.hub_stats()["parked"] and time.monotonic() < deadline:
    time.sleep(0.01)
  layers = agentenv.hub_stats()["layers"]
  for i in range(10):
    sb.exec(f"echo junk{i} > j; echo changed > k")
    sb.restore(snap)
    assert sb.exec("cat k; test -e j || echo no-j").text == "keep\nno-j\n"
    mounts = _mounts_in(sb)
    assert [m for m in mounts if m[0] == "/r"] == [("/r", "overlay")], mounts
    assert all(fs == "overlay" for p, fs in mounts if p.startswith("/.store/")), mounts
  deadline = time.monotonic() + 5
  while agentenv.hub_stats()["parked"] and time.monotonic() < deadline:
    time.sleep(0.01)
  st = agentenv.hub_stats()
  assert st["parked"] == 0 and [m for m in _mounts_in(sb) if m[0].startswith("/.store/")] == []
  assert st["layers"] == layers  # each replaced upper (with j) was freed


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


@pytest.mark.slow
def test_concurrent_threads_keep_sandboxes_apart():
  """8 threads, each with its own sandbox + kv service, interleave exec / files / snapshot / fork / restore;
  every sandbox ends with exactly its own history."""
  import threading
  require_namespaces()
  errors = []

  def worker(w):
    try:
      with agentenv.create() as sb:
        sb.start_service("kv", agentenv.services.KV)
        for i in range(25):
          sb.exec(f"echo {w}-{i} >> log")
          sb.call_service("kv", f"INCR n")
          snap = sb.snapshot()
          (kid,) = sb.fork(1)
          kid.exec("echo junk >> log")
          kid.call_service("kv", "SET n -1")
          kid.close()
          sb.exec("echo oops >> log")
          sb.restore(snap)
          sb.drop_snapshot(snap)
        assert sb.read_file("log").decode().split() == [f"{w}-{i}" for i in range(25)]
        assert sb.call_service("kv", "GET n") == "25"
    except BaseException as e:  # surfaced below
      errors.append((w, repr(e)))

  threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors
  assert agentenv.hub_stats()["sandboxes"] == 0


def test_hung_service_request_is_cut_off():
  """A handler stuck in a loop (say agent code in a REPL) is interrupted after REQUEST_SECONDS (default 10), so
  the service, and every snapshot that queues behind it, gets going again; the host's own call gives up first."""
  require_namespaces()
  import time
  with agentenv.create() as sb:
    sb.start_service("repl", "REQUEST_SECONDS = 1.5\n" + agentenv.services.REPL)
    with pytest.raises(TimeoutError):
      sb.call_service("repl", "while True: pass", timeout=0.5)
    t0 = time.monotonic()
    snap = sb.snapshot()  # queued behind the hung request until the service's own limit cuts it
    assert 0.5 < time.monotonic() - t0 < 5
    assert sb.call_service("repl", "1 + 1") == "2\n"
    sb.restore(snap)
    assert sb.call_service("repl", "2 + 2") == "4\n"


SQUASH = r"""
import json
from moonshot_jax import agentenv
sb = agentenv.create(files={"task/t.txt": "task", "/etc/conf": "c0"})
sb.start_service("kv", agentenv.services.KV)
snaps = []
for i in range(12):
    sb.exec(f"echo {i} > f{i}; rm -f f{i - 2}; echo {i} >> log; chmod 60{i % 8} f{i}; ln -sfn f{i} last; "
            f"mkfifo p{i}; rm -f p{i - 1}; echo c{i} > /etc/conf")
    if i == 3:
        sb.exec("rm task/t.txt; rmdir task")  # deletions of task-layer entries (whiteouts)
    if i == 5:
        sb.exec("mkdir -p d/e && echo x > d/e/x")
    if i == 7:
        sb.exec("rm -r d && mkdir d && echo y > d/y")  # a directory replaced (opaque)
    sb.call_service("kv", f"SET i {i}")
    snaps.append(sb.snapshot())

def state(s):
    return s.exec("ls -la --time-style=+ . d /etc/ 2>&1 | awk '{print $1, $3, $NF}'; cat log d/* /etc/conf; "
                  "readlink last; ls task 2>&1").text

out = {"final": state(sb)}
st = agentenv.hub_stats()
for k in (2, 6, 11):
    sb.restore(snaps[k])
    out[f"snap{k}"] = state(sb) + sb.call_service("kv", "GET i")
out.update(squashes=st["squashes"], depth=st["max_depth"])
print(json.dumps(out))
"""


def test_squash_keeps_exact_state_and_bounds_the_stack():
  """Differential: the same history with a layer squash every 3 snapshots and with none gives identical files
  (contents, modes, owners, deletions of template / task entries, replaced dirs, fifos, symlinks) now and after
  restoring early / middle / late snapshots, while the squashed stack stays shallow."""
  require_namespaces()
  import json
  import os
  import subprocess
  import sys
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  runs = {}
  for at in ("3", "1000"):
    env = dict(os.environ, PYTHONPATH=repo, AGENTENV_SQUASH_AT=at)
    out = subprocess.run([sys.executable, "-c", SQUASH], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    runs[at] = json.loads(out.stdout.strip().split("\n")[-1])
  squashed, plain = runs["3"], runs["1000"]
  assert squashed["squashes"] >= 3 and plain["squashes"] == 0
  assert squashed["depth"] <= 4 < plain["depth"]
  for key in ("final", "snap2", "snap6", "snap11"):
    assert squashed[key] == plain[key], key
  assert "c11" in plain["final"] and "cannot access 'task'" in plain["final"] and "t.txt" in plain["snap2"]
  assert "prw-r--r-- user p11" in plain["final"] and "-rw-----wx user f11" in plain["final"]


# Modules a fork of the hub would carry into a service and that a service does not need: the hub and the host-side
# package, and threading (its at-fork hook is ~130 page faults in every service, image and copy forked, session 24).
HUB_ONLY = ("threading", "subprocess", "moonshot_jax.agentenv._hub", "moonshot_jax.agentenv._init",
            "moonshot_jax.agentenv._check", "moonshot_jax.agentenv.sandbox", "moonshot_jax.agentenv.envs")
MODULES = r'''
import os, sys
def handle(req):
  return repr((os.getppid(), sorted(m for m in sys.modules if m in %r)))
''' % (HUB_ONLY,)


def test_the_service_zygote_is_a_fresh_slim_interpreter(sb):
  """Services fork from an exec'd interpreter (its own command line, started by the hub), not from a fork of the hub:
  a service, and a copy of it (fork), holds none of the hub's modules."""
  hub = agentenv.sandbox._Hub.get().hub_pid
  (zyg,) = [p for p in filter(str.isdigit, os.listdir("/proc")) if _ppid_comm(p) == (hub, "agentenv-zyg")]
  cmdline = open(f"/proc/{zyg}/cmdline", "rb").read().split(b"\0")
  assert cmdline[1:4] == [b"-I", b"-S", b"-c"] and b"_service.main(" in cmdline[4], cmdline
  sb.start_service("mods", MODULES)
  assert sb.call_service("mods", "") == repr((int(zyg), []))
  (kid,) = sb.fork(1)
  with kid:
    assert eval(kid.call_service("mods", ""))[1] == []


def _ppid_comm(pid):
  try:
    st = open(f"/proc/{pid}/stat").read()
  except OSError:  # gone meanwhile
    return None
  return int(st[st.rindex(")") + 2:].split()[1]), st[st.index("(") + 1:st.rindex(")")]
