"""agentenv sandbox recycling (create(recycle=True)): a closed sandbox's init serves a later sandbox, and nothing of
the previous user is visible to, or can act on, the next one (services included, where the hub has cgroups); hub
shutdown leaves no process, mount or cgroup."""
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from moonshot_jax import agentenv
from moonshot_jax.agentenv import _wire as W
from tests.agentenv_testutil import host_mounts, require_namespaces
from tests.test_agentenv_cleanup import REPO, assert_hub_left_nothing

# Each test its own Limits: the hub's pool is keyed by them, so no test takes an init another test left there.
_LIMITS = {name: agentenv.Limits(memory_mb=300 + i, pids=60 + i) for i, name in enumerate(
    ("isolation", "stale", "optin", "fork", "dead", "svc_user", "svc_group", "stuck", "netns"))}


def _procs_of(sb):
  """Host pids of every process in the sandbox's pids cgroup (init, commands, checks: all of the sandbox's).
  sb: a Sandbox or its info()["cgroups"] (info() waits while another thread's call holds the handle)."""
  pids = (sb if isinstance(sb, dict) else sb.info()["cgroups"]).get("pids")
  if pids is None:
    pytest.skip("needs a pids cgroup (v1) to list a sandbox's processes from the host")
  d = pids.split(" ", 1)[1]
  if pids.startswith("v2 "):
    d += "/sys"
  return sorted(int(p) for p in open(f"{d}/cgroup.procs").read().split())


def _init_pid(sb):
  (pid,) = [p for p in _procs_of(sb) if open(f"/proc/{p}/comm").read().strip() == "agentenv-init"]
  return pid


def _only_init(sb):
  """(host view, the sandbox's own /proc view): every process in the sandbox, as seen from the host and from init."""
  ipid = _init_pid(sb)
  seen = sorted(p for p in os.listdir(f"/proc/{ipid}/root/proc") if p.isdigit())
  return _procs_of(sb), ipid, seen


def _recycled(a_cg, b):
  return b.info()["cgroups"] == a_cg  # the same init: its cgroup dirs keep the first user's name


def _has_cgroups():
  st = agentenv.hub_stats()
  return bool(st["cgroup_v1"] or st["cgroup_v2"] or st["freezer"])


@pytest.fixture(autouse=True)
def _ns():
  require_namespaces()
  yield
  agentenv.drop_recycled()  # the hub is shared with the other test files of this process: leave no process


# The previous user: files everywhere it may write, SysV IPC objects of every kind, a TCP connection left in
# TIME_WAIT (it outlives the processes: the kernel keeps it for 60 s in the sandbox's network namespace).
PREV = r"""
set -e
echo s3cr3t > /tmp/prev_tmp; echo s3cr3t > /home/user/prev_home; echo s3cr3t > /var/tmp/prev_var
ipcmk -M 4096 >/dev/null; ipcmk -S 2 >/dev/null; ipcmk -Q >/dev/null
python3 -I -S -c '
import socket
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
c = socket.create_connection(srv.getsockname()); s, _ = srv.accept()
c.close(); s.recv(1); s.close()'
ipcs -m -s -q | grep -c "^0x"
awk "NR > 1 && \$4 == \"06\"" /proc/net/tcp | wc -l
"""
LOOK = r"""
ls -A /tmp /home/user /var/tmp
echo ipc $(ipcs -m -s -q | grep -c "^0x")
echo tw $(awk "NR > 1 && \$4 == \"06\"" /proc/net/tcp | wc -l)
echo env ${PREV_SECRET:-none} pwd $(pwd)
cat task.txt
"""
LOOP = "import os, time\nos.chdir('/tmp')\nwhile True:\n  open('/tmp/leak', 'a').write('x')\n  time.sleep(0.005)\n"


def test_a_recycled_sandbox_shows_nothing_of_its_previous_user():
  """Files, processes (a check still running at close, which holds the previous user's environment and cwd), SysV
  IPC objects and sockets of the previous user are gone for the next one, who gets its own task files and a sandbox
  where /proc, seen from the host and from init, holds init alone."""
  lim = _LIMITS["isolation"]
  a = agentenv.create(files={"task.txt": "task A"}, limits=lim, recycle=True)
  a.write_file("/srv/loop.py", LOOP)
  prev = a.exec(PREV)
  assert prev.ok and prev.stdout.split() == [b"3", b"1"], prev  # what the next user must not see exists here
  a_cg, a_init = a.info()["cgroups"], _init_pid(a)
  got = {}
  t = threading.Thread(target=lambda: got.setdefault("r", _catch(lambda: a.exec_python(
      "/srv/loop.py", env={"PREV_SECRET": "s3cr3t"}, timeout=60))))
  t.start()
  deadline = time.monotonic() + 10
  while not os.path.exists(f"/proc/{a_init}/root/tmp/leak") and time.monotonic() < deadline:
    time.sleep(0.01)
  leaked = [p for p in _procs_of(a_cg) if p != a_init and _cwd(p).endswith("/tmp")]
  assert leaked, "the check's process runs, in the previous user's cwd"
  before = agentenv.hub_stats()["recycled"]
  a._hub.call("close", a.id)  # while the check runs (a.close() would wait for the call holding the handle)
  t.join(10)
  assert isinstance(got.get("r"), agentenv.SandboxError), got  # the close killed the check
  a.close()
  b = agentenv.create(files={"task.txt": "task B"}, limits=lim, recycle=True)
  try:
    assert _recycled(a_cg, b) and agentenv.hub_stats()["recycled"] == before + 1, (a_cg, b.info())
    host, ipid, seen = _only_init(b)
    assert host == [ipid] == [a_init] and seen == ["1"], (host, ipid, seen)
    out = b.exec(LOOK)
    assert out.ok, out
    lines = out.stdout.decode().splitlines()
    assert lines[-4:] == ["ipc 0", "tw 0", "env none pwd /home/user", "task B"], lines
    names = [ln for ln in lines[:-4] if ln and not ln.endswith(":")]
    assert not any(n.startswith(("prev_", "leak")) for n in names), names
    with pytest.raises(FileNotFoundError):
      b.read_file("/srv/loop.py")
    # a check (its namespaces are read from init's /proc entry: the fresh IPC / network ones) sees what b sees
    b.write_file("/srv/look.py", "import os\nprint(sorted(os.listdir('/tmp')), open('/home/user/task.txt').read())\n")
    r = b.exec_hidden("/srv/look.py", python=True)
    assert r.ok and r.stdout == b"[] task B\n", r
  finally:
    b.close()


def _state(pid):
  try:
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
  except OSError:
    return ""


def _cwd(pid):
  try:
    return os.readlink(f"/proc/{pid}/cwd")
  except OSError:
    return ""


def _catch(fn):
  try:
    return fn()
  except agentenv.SandboxError as e:
    return e


def test_a_stale_handle_cannot_act_on_the_recycled_sandbox():
  """The previous user's channel to init is closed when the init is recycled, and the sandbox gets a new id: a copy
  of the old channel reads EOF, the hub answers the old id as closed, and nothing reaches the next user."""
  lim = _LIMITS["stale"]
  a = agentenv.create(limits=lim, recycle=True)
  a_cg, old_id = a.info()["cgroups"], a.id
  stale = socket.socket(fileno=os.dup(a._sock.fileno()))  # what a leaked copy of the handle's channel holds
  a.close()
  b = agentenv.create(limits=lim, recycle=True)
  try:
    assert _recycled(a_cg, b) and b.id != old_id, (a_cg, b.info(), b.id)
    with pytest.raises((EOFError, OSError)):
      W.send(stale, ("write", "/tmp/pwn", b"x", 0o644))
      W.recv(stale)
    with pytest.raises(agentenv.SandboxError, match="unknown or closed sandbox"):
      b._hub.call("exec_python", old_id, ["/srv/x.py"], "/home/user", {}, 5.0)
    with pytest.raises(agentenv.SandboxClosedError):
      a.exec("true")
    assert b.exec("ls -A /tmp").stdout == b"" and b.ping()
  finally:
    stale.close()
    b.close()


def test_recycling_is_opt_in_and_only_for_clean_sandboxes():
  """Off by default; a paused sandbox is killed on close, not pooled, and so is one that ran a service (even stopped
  since) where the hub has no cgroups to find what services leave (with them it is recycled, see the service tests
  below); a pooled init serves only the same Limits."""
  lim = _LIMITS["optin"]
  st = agentenv.hub_stats()
  plain = agentenv.create(limits=lim)
  plain.close()
  assert agentenv.hub_stats()["pooled"] == st["pooled"]  # default: killed, as before
  svc = agentenv.create(limits=agentenv.Limits(memory_mb=lim.memory_mb, pids=lim.pids + 100), recycle=True)
  svc.start_service("kv", agentenv.services.KV)
  svc.stop_service("kv")
  svc.close()
  st["pooled"] += _has_cgroups()
  assert agentenv.hub_stats()["pooled"] == st["pooled"]
  frozen = agentenv.create(limits=lim, recycle=True)
  if frozen.info()["freezer"]:
    frozen.pause()
    frozen.close()
    assert agentenv.hub_stats()["pooled"] == st["pooled"]
  else:
    frozen.close()  # (no freezer here: pause() is refused, the case cannot arise)
    st["pooled"] += 1
  ok = agentenv.create(limits=lim, recycle=True)
  ok_cg = ok.info()["cgroups"]
  ok.close()
  assert agentenv.hub_stats()["pooled"] == st["pooled"] + 1
  other = agentenv.create(limits=agentenv.Limits(memory_mb=lim.memory_mb + 1, pids=lim.pids), recycle=True)
  try:
    assert other.info()["cgroups"] != ok_cg  # other Limits: a new init
  finally:
    other.close()
  with pytest.raises(TypeError, match="recycle must be a bool"):
    agentenv.create(recycle=1)


def test_a_forked_group_runs_on_recycled_inits():
  """fork(n) of a recycle=True sandbox takes pooled inits for its children: each starts from the parent's state, and
  they go back to the pool when closed."""
  lim = _LIMITS["fork"]
  first = [agentenv.create(limits=lim, recycle=True) for _ in range(3)]
  cgs = [s.info()["cgroups"] for s in first]
  for s in first:
    s.exec("echo old > /tmp/old")
    s.close()
  parent = agentenv.create(files={"task.txt": "T"}, limits=lim, recycle=True)
  parent.exec("echo state > /tmp/state")
  kids = parent.fork(3)
  try:
    assert sorted(str(k.info()["cgroups"]) for k in [parent] + kids[:2]) == sorted(map(str, cgs))
    for k in kids:
      assert k.exec("cat task.txt /tmp/state; ls /tmp").stdout == b"Tstate\nstate\n", k
  finally:
    pooled = agentenv.hub_stats()["pooled"]
    inits = [_init_pid(k) for k in [parent] + kids]
    for k in kids:
      k.close()
    parent.close()
  assert agentenv.hub_stats()["pooled"] == pooled + 4
  assert agentenv.drop_recycled() == pooled + 4 and agentenv.hub_stats()["pooled"] == 0
  deadline = time.monotonic() + 5
  while any(_state(p) not in ("Z", "") for p in inits) and time.monotonic() < deadline:
    time.sleep(0.01)
  assert all(_state(p) in ("Z", "") for p in inits), [(p, _state(p)) for p in inits]


def test_a_recycled_init_renews_its_network_namespace_only_after_a_process_used_it():
  """Init.recycle keeps the network / IPC namespaces in which no process but init ever ran (file tools, a hidden
  check: it takes namespaces of its own) and renews them after a command or an exec_python (which join them)."""
  lim = _LIMITS["netns"]
  ns = lambda pid: (os.readlink(f"/proc/{pid}/ns/net"), os.readlink(f"/proc/{pid}/ns/ipc"))

  def next_user(use):
    a = agentenv.create(files={"task.txt": "T"}, limits=lim, recycle=True)
    pid = _init_pid(a)  # (before any other process: a check's W may still be exiting after its call returns)
    a.write_file("/srv/p.py", "print(open('/home/user/task.txt').read())\n")
    a.read_file("task.txt")
    r = a.exec_hidden("/srv/p.py", python=True)
    assert r.ok and r.stdout == b"T\n", r
    if use:
      assert use(a)
    before = ns(pid)
    a.close()
    b = agentenv.create(limits=lim, recycle=True)
    try:
      assert _init_pid(b) == pid, "not recycled"
      return ns(pid) == before
    finally:
      b.close()

  try:
    assert next_user(None), "file tools and a hidden check alone: the namespaces are kept"
    assert not next_user(lambda a: a.exec("true").ok), "a command ran in them: renewed"
    assert not next_user(lambda a: a.exec_python("/srv/p.py").ok), "exec_python ran in them: renewed"
    if _has_cgroups():  # (served sandboxes are recycled only with cgroups)
      svc = lambda a: a.start_service("s", "def handle(r):\n  return r\n") or a.call_service("s", "hi") == "hi"
      assert not next_user(svc), "a service ran in them: renewed"
    assert next_user(None), "and the renewed ones are kept again by a user who ran no process"
  finally:
    agentenv.drop_recycled()


def test_a_pooled_init_that_died_is_not_handed_out():
  lim = _LIMITS["dead"]
  a = agentenv.create(limits=lim, recycle=True)
  a_init, a_cg = _init_pid(a), a.info()["cgroups"]
  a.close()
  os.kill(a_init, 9)  # e.g. the OOM killer, while it waits in the pool
  deadline = time.monotonic() + 5
  while _state(a_init) not in ("Z", "") and time.monotonic() < deadline:  # dead (its sockets closed)
    time.sleep(0.01)
  b = agentenv.create(files={"t": "b"}, limits=lim, recycle=True)  # a new init, not an error
  try:
    assert b.info()["cgroups"] != a_cg and b.read_file("t") == b"b"
  finally:
    b.close()


# A kv-style service that also leaves what outlives a request: a detached child (own session: neither the service's
# death nor init's PID namespace takes it), SysV IPC objects, a TCP connection in TIME_WAIT and 64 MB of memory.
SVC_USER = r"""
import os, socket, subprocess
store, held = {}, []
def handle(request):
  op, _, arg = request.partition(" ")
  if op == "set":
    k, _, v = arg.partition(" ")
    store[k] = v
    return "ok"
  if op == "get":
    return store.get(arg, "(nil)")
  if op == "pid":
    return str(os.getpid())
  if op == "orphan":
    return str(subprocess.Popen(["sleep", "1000"], start_new_session=True).pid)
  if op == "ipc":
    return subprocess.run("ipcmk -M 4096 >/dev/null; ipcmk -Q >/dev/null; ipcs -m -q | grep -c '^0x'", shell=True,
                          capture_output=True, text=True).stdout.strip()
  if op == "tw":
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
    c = socket.create_connection(srv.getsockname()); s, _ = srv.accept()
    c.close(); s.recv(1); s.close(); srv.close()
    return "ok"
  if op == "hold":
    held.append(b"\1" * (int(arg) << 20))
    return "ok"
  return "?"
"""
LOOK_SVC = r"""
svc kv get secret; echo rc $?
echo svc_sockets $(grep -c agentenv-svc /proc/net/unix)
echo ipc $(ipcs -m -s -q | grep -c "^0x")
echo tcp $(awk "NR > 1" /proc/net/tcp | wc -l)
"""


def _mem_mb(cg):
  """The sandbox's memory-cgroup usage in MB (v1 usage_in_bytes / v2 memory.current), None without one."""
  kind, _, d = cg.get("memory", "  ").partition(" ")
  f = {"v1": "memory.usage_in_bytes", "v2": "memory.current"}.get(kind)
  return int(open(f"{d}/{f}").read()) >> 20 if f else None


def _gone(pids, timeout=5.0):
  """pids that still exist (zombies waiting for their reaper count as gone once reaped: wait up to timeout s)."""
  deadline = time.monotonic() + timeout
  while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
    time.sleep(0.01)
  return [p for p in pids if os.path.exists(f"/proc/{p}")]


def test_a_recycled_init_shows_nothing_of_a_service_user():
  """A sandbox that ran a service (with a snapshot, its image and a spare copy, a detached child, IPC objects, a
  TIME_WAIT socket and 64 MB of memory) is recycled on close when the hub has cgroups: every process of the previous
  user outside init (services, images, spares, the orphan) is dead when close() returns, the cgroups hold init
  alone, the memory is uncharged, and the next user finds no service, socket name, IPC object or connection of it;
  the name is free for its own service, which serves its own state."""
  lim = _LIMITS["svc_user"]
  a = agentenv.create(limits=lim, recycle=True)
  if not _has_cgroups():
    a.close()
    pytest.skip("no cgroups: a sandbox that ran a service is killed, not recycled (test_served_sandboxes_by_cgroup_mode)")
  a_cg, a_init = a.info()["cgroups"], _init_pid(a)
  mem0 = _mem_mb(a_cg)
  a.start_service("kv", SVC_USER)
  assert a.call_service("kv", "set secret s3cr3t") == "ok"
  orphan = int(a.call_service("kv", "orphan"))
  assert a.call_service("kv", "ipc") == "2" and a.call_service("kv", "tw") == "ok"  # (shm + queue)
  look = a.exec(LOOK_SVC).stdout.decode().splitlines()  # (the connection: TIME_WAIT, or still on its way there)
  assert look[:4] == ["s3cr3t", "rc 0", "svc_sockets 1", "ipc 2"] and look[4] in ("tcp 1", "tcp 2"), look
  assert a.call_service("kv", "hold 64") == "ok"
  snap = a.snapshot()
  a.restore(snap)  # a live copy of the image; the image keeps a pre-forked spare (all in a's cgroups)
  deadline = time.monotonic() + 5
  while len(outside := [p for p in _procs_of(a_cg) if p != a_init]) < 4 and time.monotonic() < deadline:
    time.sleep(0.01)  # (the image forks its spare after it has answered the restore)
  assert orphan in outside and len(outside) == 4, outside  # the service's copy, the image, its spare, the orphan
  if mem0 is not None:
    assert _mem_mb(a_cg) >= mem0 + 60, (mem0, _mem_mb(a_cg))
  a.close()
  alive = [p for p in outside if _state(p) not in ("Z", "")]
  assert not alive, [(p, _state(p), open(f"/proc/{p}/comm").read()) for p in alive]  # gone when close() returned
  assert not _gone(outside)  # and reaped
  b = agentenv.create(limits=lim, recycle=True)
  try:
    assert _recycled(a_cg, b), (a_cg, b.info())
    host, ipid, seen = _only_init(b)
    assert host == [ipid] == [a_init] and seen == ["1"], (host, ipid, seen)
    if mem0 is not None:
      assert _mem_mb(a_cg) <= mem0 + 8, (mem0, _mem_mb(a_cg))
    out = b.exec(LOOK_SVC)
    assert out.stdout.decode().splitlines() == ["rc 1", "svc_sockets 0", "ipc 0", "tcp 0"], out
    assert b"no service named 'kv'" in out.stderr, out
    assert b.info()["services"] == []
    with pytest.raises(LookupError, match="no service named"):
      b.call_service("kv", "get secret")
    with pytest.raises(KeyError, match="unknown snapshot"):
      b.restore(snap)
    b.start_service("kv", SVC_USER)  # the name is free in b's network namespace
    assert b.call_service("kv", "get secret") == "(nil)"
    assert b.exec("svc kv get secret").stdout == b"(nil)\n"
  finally:
    b.close()


def test_a_forked_service_group_runs_on_recycled_inits():
  """The RL kv group: a sandbox that runs a service and its fork(8) take pooled inits and give all nine back on close,
  so such groups do not drain the pool; every child serves a copy of the parent's service state."""
  lim = _LIMITS["svc_group"]
  warm = [agentenv.create(limits=lim, recycle=True) for _ in range(9)]
  if not _has_cgroups():
    for s in warm:
      s.close()
    pytest.skip("no cgroups: a sandbox that ran a service is killed, not recycled (test_served_sandboxes_by_cgroup_mode)")
  cgs = sorted(str(s.info()["cgroups"]) for s in warm)
  for s in warm:
    s.close()
  for round_ in range(2):
    st = agentenv.hub_stats()
    parent = agentenv.create(files={"task.txt": "T"}, limits=lim, recycle=True)
    parent.start_service("kv", agentenv.services.KV)
    parent.call_service("kv", f"SET k v{round_}")
    kids = parent.fork(8)
    try:
      group = [parent] + kids
      assert sorted(str(k.info()["cgroups"]) for k in group) == cgs  # the nine pooled inits, no new one
      assert agentenv.hub_stats()["recycled"] == st["recycled"] + 9
      for k in kids:
        assert k.call_service("kv", "GET k") == f"v{round_}" and k.exec("cat task.txt").stdout == b"T"
      svc_pids = [p for k in group for p in _procs_of(k) if p != _init_pid(k)]
      assert len(svc_pids) >= 9, svc_pids  # one live service per sandbox (at least)
    finally:
      for k in kids + [parent]:
        k.close()
    assert agentenv.hub_stats()["pooled"] == st["pooled"], (st, agentenv.hub_stats())
    assert all(_state(p) in ("Z", "") for p in svc_pids) and not _gone(svc_pids)  # dead at close, then reaped


@pytest.mark.slow  # (~2 s: the clean-up's deadline)
def test_a_service_that_does_not_die_makes_the_close_kill_the_sandbox():
  """If a process of a sandbox that ran a service outlives its SIGKILL (here: frozen in a v1 freezer cgroup of the
  test's own, as a process stuck in the kernel would be), the clean-up gives up after its deadline and close() kills
  the sandbox as without recycling: its init is not pooled."""
  lim = _LIMITS["stuck"]
  sb = agentenv.create(limits=lim, recycle=True)
  d = f"/sys/fs/cgroup/freezer/svctest-{os.getpid()}"
  if not os.path.isdir("/sys/fs/cgroup/freezer") or "pids" not in sb.info()["cgroups"]:
    sb.close()
    pytest.skip("needs a v1 freezer hierarchy and a pids cgroup")
  sb.start_service("kv", SVC_USER)
  svc, init = int(sb.call_service("kv", "pid")), _init_pid(sb)
  os.mkdir(d)
  try:
    open(f"{d}/cgroup.procs", "w").write(str(svc))  # (still in the sandbox's pids cgroup, which lists it)
    open(f"{d}/freezer.state", "w").write("FROZEN")
    st = agentenv.hub_stats()
    t0 = time.monotonic()
    sb.close()
    assert time.monotonic() - t0 >= 1.9 and agentenv.hub_stats()["pooled"] == st["pooled"], agentenv.hub_stats()
    assert not _gone([init])  # killed and reaped, not pooled
  finally:
    open(f"{d}/freezer.state", "w").write("THAWED")  # its SIGKILL is pending: it dies now
    assert not _gone([svc])
    os.rmdir(d)


MODE = r"""
import json, os, sys, time
from moonshot_jax import agentenv
from tests.test_agentenv_recycle import SVC_USER
lim = agentenv.Limits(memory_mb=400)
hub = agentenv.sandbox._Hub.get().hub_pid
def inits():
  return {p for p in os.listdir("/proc") if p.isdigit() and os.path.exists(f"/proc/{p}/status")
          and f"PPid:\t{hub}\n" in open(f"/proc/{p}/status").read()
          and "agentenv-init" in open(f"/proc/{p}/comm").read()}
def alive(p):
  try:
    return open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False
clean = agentenv.create(limits=lim, recycle=True)
clean.close()
st = agentenv.hub_stats()
out = {"cgroups": st["cgroups"], "v2": bool(st["cgroup_v2"]), "pooled_clean": st["pooled"]}
a = agentenv.create(limits=lim, recycle=True)  # the pooled init
a.start_service("kv", SVC_USER)
kids = a.fork(2)
out["recycled"] = agentenv.hub_stats()["recycled"]
out["inits"] = sorted(map(int, inits()))
out["services"] = [int(s.call_service("kv", "pid")) for s in [a] + kids]
if sys.argv[1] != "0":  # (without cgroups nothing could ever find it: not made there)
  out["services"].append(int(kids[0].call_service("kv", "orphan")))
for s in kids + [a]:
  s.close()
out["pooled_after"] = agentenv.hub_stats()["pooled"]
out["services_alive_at_close"] = [p for p in out["services"] if alive(p)]
deadline = time.monotonic() + 5  # (killed ones are dead once the kernel has run their exit)
while any(map(alive, out["inits"] + out["services"])) and time.monotonic() < deadline and sys.argv[1] == "0":
  time.sleep(0.01)
out["inits_alive"] = [p for p in out["inits"] if alive(p)]
out["services_alive"] = [p for p in out["services"] if alive(p)]
print(json.dumps(out), flush=True)
"""


@pytest.mark.parametrize("mode", ["0", "v2"])
def test_served_sandboxes_by_cgroup_mode(mode):
  """AGENTENV_CGROUPS=0: nothing lists what a service leaves outside init's PID namespace, so a sandbox that ran one
  (and its forks) is killed on close as before, while a clean one is still pooled. AGENTENV_CGROUPS=v2 (where this
  machine has a writable cgroup2 hierarchy): the same sandboxes are recycled through their v2 cgroups, their
  services and a service's detached child dead when close() returns."""
  require_namespaces()
  if mode == "v2":
    from tests.test_agentenv_cgroup2 import _v2_parent_or_skip
    _v2_parent_or_skip()
  env = dict(os.environ, PYTHONPATH=REPO, AGENTENV_CGROUPS=mode)
  r = subprocess.run([sys.executable, "-c", MODE, mode], capture_output=True, text=True, env=env, cwd=REPO,
                     timeout=120)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout)
  assert out["pooled_clean"] == 1 and out["recycled"] == 1 and len(out["inits"]) == 3, out
  if mode == "0":
    assert out["cgroups"] == [] and not out["v2"] and len(out["services"]) == 3, out
    assert out["pooled_after"] == 0 and out["inits_alive"] == out["services_alive"] == [], out  # all killed
  else:
    assert out["v2"] and len(out["services"]) == 4, out
    assert out["pooled_after"] == 3 and len(out["inits_alive"]) == 3, out  # all three recycled
    assert out["services_alive_at_close"] == [], out  # services and the orphan: gone before close() returned


PARENT = r"""
import os, sys, time
from moonshot_jax import agentenv
from tests.test_agentenv_recycle import SVC_USER
lim = agentenv.Limits(memory_mb=400)
sbs = [agentenv.create(files={"t": str(i)}, limits=lim, recycle=True) for i in range(4)]
for s in sbs:
  s.exec("echo x > /tmp/x")
for s in (sbs[0], sbs[1], sbs[3]):  # two closed ones that ran services (with cgroups: pooled), a live one
  s.start_service("kv", SVC_USER)
snap = sbs[1].snapshot()
sbs[1].restore(snap)  # an image and its spare
hub = agentenv.sandbox._Hub.get().hub_pid
inits = [p for p in os.listdir("/proc") if p.isdigit() and os.path.exists(f"/proc/{p}/status")
         and f"PPid:\t{hub}\n" in open(f"/proc/{p}/status").read()
         and "agentenv-init" in open(f"/proc/{p}/comm").read()]
services = [sbs[i].call_service("kv", "pid") for i in (0, 1, 3)]
for s in sbs[:3]:
  s.close()
st = agentenv.hub_stats()
print(hub, st["pooled"], " ".join(inits + services), flush=True)
time.sleep(100 if sys.argv[1] == "wait" else 0)
"""


@pytest.mark.parametrize("end,cgroups", [
    ("exit", "1"), ("hub_sigkill", "0"),  # (~2 s each: a host process and its hub per case; the other two are slow)
    pytest.param("exit", "0", marks=pytest.mark.slow), pytest.param("hub_sigkill", "1", marks=pytest.mark.slow)])
def test_hub_end_with_pooled_sandboxes_leaves_nothing(end, cgroups):
  """The pool holds at most AGENTENV_RECYCLE_MAX inits (with cgroups, some that ran services); when the host process
  exits (the hub shuts down and kills its pool) or the hub is SIGKILLed (pooled inits see their lifeline break), no
  process, cgroup or mount is left. Without cgroups (AGENTENV_CGROUPS=0) the reaper has no cgroup to sweep: the
  lifeline alone must do it, and the two closed sandboxes that ran services were killed, not pooled."""
  mounts = host_mounts()
  env = dict(os.environ, PYTHONPATH=REPO, AGENTENV_RECYCLE_MAX="2", AGENTENV_CGROUPS=cgroups)
  parent = subprocess.Popen([sys.executable, "-c", PARENT, "exit" if end == "exit" else "wait"],
                            stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
  try:
    hub, pooled, *inits = map(int, parent.stdout.readline().split())
    # 4 inits + 3 services; with cgroups the bound: 3 closed, 2 kept, 1 killed; without: only the clean one kept
    assert pooled == (2 if cgroups == "1" else 1) and len(inits) == 7, (pooled, inits)
    if end == "hub_sigkill":
      os.kill(hub, 9)
      parent.kill()
    parent.wait(60)
  finally:
    parent.kill()
  assert_hub_left_nothing(hub, inits, mounts)
  mnt = subprocess.run(["findmnt", "-rn", "-t", "overlay,tmpfs", "-o", "TARGET,SOURCE"], capture_output=True,
                       text=True).stdout
  assert "agentenv" not in mnt, mnt
