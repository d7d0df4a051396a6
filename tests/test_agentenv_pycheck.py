"""Sandbox.exec_python (python_fn's check run by a fork of the hub's pre-started check interpreter): the same
result and isolation as the `python3 -I -S FILE` command it replaces, a timeout that kills, no state from one check
in the next, nothing left behind."""
import os
import secrets
import threading
import time

import pytest

from moonshot_jax import agentenv
from moonshot_jax.agentenv.envs import make_env
from moonshot_jax.agentenv.tasks import CHECK_PATH
from tests.agentenv_testutil import require_namespaces

# What a program can see of its isolation: cgroups, seccomp / no_new_privs / capabilities / ids, namespaces, limits,
# environment, cwd, argv, sys.path, network, OOM score, root listing, stdin, and how errors and exits end.
FACTS = r'''
import os, resource, socket, sys
print("cg", open("/proc/self/cgroup").read().replace("\n", ";"))
st = dict(l.split(":\t", 1) for l in open("/proc/self/status").read().splitlines() if ":\t" in l)
print("status", [st[k] for k in ("Seccomp", "NoNewPrivs", "CapEff", "CapBnd", "Uid", "Gid", "Groups")])
print("pid", os.getpid(), sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
print("ns", socket.gethostname(), [os.readlink(f"/proc/self/ns/{n}") for n in ("net", "ipc", "uts", "user")])
print("rl", [resource.getrlimit(getattr(resource, n)) for n in ("RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_CORE",
      "RLIMIT_NOFILE", "RLIMIT_NPROC", "RLIMIT_AS")])
print("env", os.umask(0o22), os.getcwd(), sys.argv, sys.path, sorted(os.environ.items()))
try:
  socket.create_connection(("1.1.1.1", 53), timeout=1)
  print("net open")
except OSError as e:
  print("net", e.errno)
print("misc", open("/proc/self/oom_score_adj").read().strip(), sorted(os.listdir("/")), repr(sys.stdin.read()))
print("fds", sorted(os.listdir("/proc/self/fd")), os.stat("/proc/self/fd").st_uid, os.access("/proc/self/mem", os.R_OK))
'''
ENDINGS = {"exc": "import json\nx = {}\nx['k']\n", "exit3": "import sys\nprint('a')\nsys.exit(3)\n",
           "exitmsg": "raise SystemExit('bye')\n", "stderr": "import sys\nsys.stderr.write('e')\nprint('o')\n"}


@pytest.fixture
def sb():
  require_namespaces()
  s = agentenv.create()
  yield s
  s.close()


def test_exec_python_equals_the_command(sb):
  for name, src in {"facts": FACTS, **ENDINGS}.items():
    sb.write_file(f"/srv/{name}.py", src)
    want = sb.exec(["python3", "-I", "-S", f"/srv/{name}.py", "x"])
    got = sb.exec_python(f"/srv/{name}.py", ["x"])
    if name == "facts":  # (the command's stdin is /dev/null; fds 0-2 only, whichever way it was started)
      assert b"net 101" in want.stdout and b"'Seccomp'" not in want.stdout and want.exit_code == 0, want
    assert (got.stdout, got.stderr, got.exit_code, got.timed_out) == (want.stdout, want.stderr, want.exit_code,
                                                                      want.timed_out), name


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4])
def test_python_fn_check_equals_the_old_command(difficulty):
  """python_fn is the one family whose verifier runs a check (the others read files / compare answers)."""
  require_namespaces()
  env = make_env("python_fn", difficulty=difficulty)
  try:
    env.reset(difficulty)
    for f_src, reward in (("f=lambda x:" + env.task.secret[0], 1.0), ("f=lambda x:x", 0.0), ("f=lambda x:y", 0.0),
                          ("import sys\nsys.exit(2)", 0.0)):
      env.sb.write_file("f.py", f_src + "\n")
      old = env.sb.exec_hidden(f"python3 -I -S {CHECK_PATH}", timeout=5.0)
      new = env.sb.exec_hidden(CHECK_PATH, timeout=5.0, python=True)
      assert (new.stdout, new.stderr, new.exit_code) == (old.stdout, old.stderr, old.exit_code), f_src
      kid = env.fork(1)[0]
      try:
        assert kid.step("submit").reward == reward, (f_src, kid.note)
      finally:
        kid.close()
  finally:
    env.close()


def test_hung_check_is_killed_at_its_timeout(sb):
  sb.write_file("/srv/hang.py", "import os\nos.system('sleep 60 &')\nwhile True:\n  pass\n")
  t = time.monotonic()
  r = sb.exec_python("/srv/hang.py", timeout=0.5)
  took = time.monotonic() - t
  assert r.timed_out and r.exit_code == -9 and took < 5, (r, took)
  _assert_no_check_process_left(sb)


def _procs():
  """(pid, ppid, comm, start time, PID namespace depth) of every live process, from /proc (one parse for every
  process-tree check below)."""
  out = []
  for p in filter(str.isdigit, os.listdir("/proc")):
    try:
      st = open(f"/proc/{p}/stat").read()
      depth = len(open(f"/proc/{p}/status").read().split("NSpid:")[1].split("\n")[0].split())
    except (OSError, IndexError):  # gone meanwhile
      continue
    f = st[st.rindex(")") + 2:].split()
    out.append((int(p), int(f[1]), st[st.index("(") + 1:st.rindex(")")], int(f[19]), depth))
  return out


def _kids():
  kids = {}
  for p, ppid, comm, _, depth in _procs():
    kids.setdefault(ppid, []).append((p, comm, depth))
  return kids


def _tree(pid):
  """(comm, PID namespace depth) of every descendant of pid, parents before children."""
  kids, out, todo = _kids(), [], [pid]
  while todo:
    for p, comm, depth in sorted(kids.get(todo.pop(0), [])):
      out.append((comm, depth))
      todo.append(p)
  return out


def test_a_check_is_two_processes_under_the_sandboxs_pid_namespace(sb):
  """The check zygote forks W straight into the sandbox's PID namespace and W forks the check itself: two processes
  per check (W in the sandbox's namespace, the check P in one of its own below it), not three (W in the hub's forking a
  W2 into the sandbox's: one interpreter fork + exit, ~3 ms of CPU, more); and both die with the sandbox."""
  hub = agentenv.sandbox._Hub.get().hub_pid
  (pyz,) = [p for p, ppid, comm, _, _ in _procs() if ppid == hub and comm == "agentenv-pyz"]
  sb.write_file("/srv/hang.py", "import time\ntime.sleep(60)\n")
  got = {}

  def run():
    try:
      got["r"] = sb.exec_python("/srv/hang.py", timeout=30)
    except agentenv.SandboxError as e:
      got["r"] = e
  t = threading.Thread(target=run)
  t.start()
  deadline = time.monotonic() + 10
  while not any(d == 3 for _, d in _tree(pyz)) and time.monotonic() < deadline:  # the check P has started
    time.sleep(0.02)
  tree = _tree(pyz)
  sb._hub.call("close", sb.id)  # as the hub closes it (sb.close() itself waits for the running call)
  t.join(10)
  assert tree == [("agentenv-check", 2), ("agentenv-check", 3)], tree
  assert isinstance(got.get("r"), agentenv.SandboxError), got  # closing the sandbox ended the check
  deadline = time.monotonic() + 5
  while _tree(pyz) and time.monotonic() < deadline:
    time.sleep(0.02)
  assert not _tree(pyz)


# What a fork of the hub would carry into a check, and none of it a fresh `python3 -I -S` has: the host-side package
# (its __init__ imports sandbox, pool, ...), the hub, and the modules whose at-fork hooks cost every fork (threading,
# random: ~130 and ~40 page faults per fork, session 24).
HUB_ONLY = ("threading", "random", "subprocess", "moonshot_jax.agentenv._hub", "moonshot_jax.agentenv.sandbox",
            "moonshot_jax.agentenv._service")
MODULES = "import sys\nprint(sorted(m for m in sys.modules if m in %r))\n" % (HUB_ONLY,)


def test_the_check_zygote_is_a_fresh_slim_interpreter(sb):
  """The check zygote is exec'd (its own command line, started by the hub), not a fork of the hub: a check, its fork,
  holds none of the hub's modules, only what the zygote imports (_check's few dependencies and json)."""
  hub = agentenv.sandbox._Hub.get().hub_pid
  (pyz,) = [p for p, ppid, comm, _, _ in _procs() if ppid == hub and comm == "agentenv-pyz"]
  cmdline = open(f"/proc/{pyz}/cmdline", "rb").read().split(b"\0")
  assert cmdline[1:4] == [b"-I", b"-S", b"-c"] and b"_check.main(" in cmdline[4], cmdline
  assert cmdline != open(f"/proc/{hub}/cmdline", "rb").read().split(b"\0")
  sb.write_file("/srv/mods.py", MODULES)
  want = sb.exec(["python3", "-I", "-S", "/srv/mods.py"])
  assert want.stdout == b"[]\n" and want.exit_code == 0, want  # (a fresh interpreter has none of them)
  assert sb.exec_python("/srv/mods.py").stdout == want.stdout
  assert sb.exec_hidden("/srv/mods.py", python=True).stdout == want.stdout


# A check's stdio objects (made once in the check zygote, _pyrun.premake_stdio) as a fresh interpreter's: types, names,
# encodings, buffering, what they report about their fds, and that nothing is in their buffers.
STDIO = r'''
import sys
for n in ("stdin", "stdout", "stderr"):
  f = getattr(sys, n)
  print(n, f is getattr(sys, "__" + n + "__"), type(f).__name__, type(f.buffer).__name__, f.buffer.raw.name,
        f.buffer.raw.mode, f.fileno(), f.encoding, f.errors, f.line_buffering, f.write_through, f.newlines,
        f.seekable(), f.buffer.seekable(), f.isatty(), f.readable(), f.writable(), f.closed)
print(repr(sys.stdin.read()), sys.stdin.tell())
sys.stdout.write("o")
sys.stderr.write("e")
'''


def test_a_checks_stdio_is_a_fresh_interpreters(sb):
  sb.write_file("/srv/stdio.py", STDIO)
  want = sb.exec(["python3", "-I", "-S", "/srv/stdio.py"])
  assert want.exit_code == 0 and want.stdout.endswith(b"\n'' 0\no") and want.stderr == b"e", want
  for got in (sb.exec_python("/srv/stdio.py"), sb.exec_hidden("/srv/stdio.py", python=True),
              sb.exec_python("/srv/stdio.py")):  # (and again: each check gets them unused)
    assert (got.stdout, got.stderr, got.exit_code) == (want.stdout, want.stderr, want.exit_code)


def test_init_inherits_no_other_sandboxs_data():
  """Inits fork from the hub's init spawner, which has seen no task, not from the hub: another sandbox's task files
  (which pass through the hub's memory) are nowhere in a later sandbox's init."""
  require_namespaces()
  secret = secrets.token_hex(16 << 10).encode()  # 32 KB: a malloc block of its own in the hub, freed, not wiped
  other = agentenv.create(files={"a.txt": secret})
  sb = agentenv.create()
  try:
    assert other.read_file("a.txt") == secret
    hub = agentenv.sandbox._Hub.get().hub_pid
    inits = [(start, p) for p, ppid, comm, start, _ in _procs() if ppid == hub and comm == "agentenv-init"]
    assert len(inits) == 2, inits
    pid = max(inits)[1]  # sb's: started after `other`'s files passed the hub
    hits = 0
    with open(f"/proc/{pid}/mem", "rb", 0) as mem:
      for line in open(f"/proc/{pid}/maps").read().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if line.split()[1][0] != "r" or line.endswith(("[vvar]", "[vsyscall]")):
          continue
        try:
          mem.seek(lo)
          hits += mem.read(hi - lo).count(secret[1000:1064])
        except OSError:
          continue
    assert hits == 0, hits
  finally:
    sb.close()
    other.close()


def test_a_check_sees_no_leftovers_of_another(sb):
  sb.write_file("/srv/leave.py", "import builtins, json, os, sys\nbuiltins.LEFT = json.LEFT = 1\n"
                "os.environ['LEFT'] = '1'\nsys.modules['left'] = sys\nopen('/tmp/left', 'w').write('x')\nprint('ok')\n")
  sb.write_file("/srv/look.py", "import builtins, json, os, sys\nprint(hasattr(builtins, 'LEFT'), "
                "hasattr(json, 'LEFT'), 'LEFT' in os.environ, 'left' in sys.modules, os.path.exists('/tmp/left'))\n")
  assert sb.exec_hidden("/srv/leave.py", python=True).stdout == b"ok\n"
  assert sb.exec_hidden("/srv/look.py", python=True).stdout == b"False False False False False\n"  # throwaway forks
  assert sb.exec_python("/srv/leave.py").stdout == b"ok\n"
  # same sandbox: its file stays (as a command's would), nothing of the other process does
  assert sb.exec_python("/srv/look.py").stdout == b"False False False False True\n"


def _sandbox_procs(sb):
  hub = agentenv.sandbox._Hub.get().hub_pid
  out = []
  for p in os.listdir("/proc"):
    try:
      comm = open(f"/proc/{p}/comm").read().strip()
      cg = open(f"/proc/{p}/cgroup").read()
    except OSError:
      continue
    if f"agentenv-{hub}/{sb.id}/" in cg or f"agentenv-{hub}/{sb.id}\n" in cg:
      out.append(comm)
  return out


def _assert_no_check_process_left(sb):
  deadline = time.monotonic() + 5
  while (procs := [c for c in _sandbox_procs(sb) if c != "agentenv-init"]) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not procs, procs


def test_checks_leave_no_process_or_mount_behind():
  require_namespaces()
  hub = agentenv.sandbox._Hub.get().hub_pid
  mounts = open(f"/proc/{hub}/mountinfo").read().count("\n")
  sb = agentenv.create()
  assert _sandbox_procs(sb) == ["agentenv-init"]  # (the cgroup scan sees this sandbox)
  sb.write_file("/srv/bg.py", "import os\nos.system('setsid sleep 60 </dev/null >/dev/null 2>&1 &')\nprint('ok')\n")
  sb_mounts = sb.exec("wc -l < /proc/self/mountinfo").stdout  # (a command sees a copy of the sandbox's mounts)
  assert sb.exec_python("/srv/bg.py").stdout == b"ok\n"
  _assert_no_check_process_left(sb)  # its PID namespace ended with it
  sb.exec_hidden("/srv/bg.py", python=True)
  assert sb.exec("wc -l < /proc/self/mountinfo").stdout == sb_mounts  # no check's /proc landed in the sandbox
  sb.close()
  deadline = time.monotonic() + 10
  while True:
    left = _descendants(hub)  # below the hub's helpers (zygotes, unmounter, reaper): nothing
    now = open(f"/proc/{hub}/mountinfo").read().count("\n")
    if (not left and now == mounts) or time.monotonic() > deadline:
      break
    time.sleep(0.05)
  assert not left and now == mounts, (left, now, mounts)


def _descendants(pid):
  """comm of every descendant of pid below its children."""
  kids = _kids()
  out, todo = [], [p for p, _, _ in kids.get(pid, [])]
  while todo:
    for p, comm, _ in kids.get(todo.pop(), []):
      out.append(comm)
      todo.append(p)
  return out


# Reads its own memory for argv[1] + argv[2] without ever holding that string: a hit is a copy it inherited.
SCAN = r'''
import re, sys
a, b = sys.argv[1].encode(), sys.argv[2].encode()
own = a + b  # the one copy that should be found: the scan works
maps = open("/proc/self/maps").read().splitlines()
n = 0
with open("/proc/self/mem", "rb", 0) as mem:
  for line in maps:
    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
    if line.split()[1][0] != "r" or line.endswith(("[vvar]", "[vsyscall]")):
      continue
    try:
      mem.seek(lo)
      data = mem.read(hi - lo)
    except OSError:
      continue
    n += sum(data[m.end():m.end() + len(b)] == b for m in re.finditer(re.escape(a), data))
    del data
print(n)
'''


def test_check_inherits_no_other_sandboxs_data():
  """The check zygote forks from a hub that has seen no task: another sandbox's task files and service source
  (which pass through the hub's memory) are nowhere in a check's memory."""
  require_namespaces()
  other = agentenv.create(files={"a.txt": "tsk-" + "Qz7Wv9Kp" * 8})
  other.start_service("s", "SECRET = 'svc-" + "Jm4Rx8Tb" * 8 + "'\ndef handle(r):\n  return SECRET\n")
  sb = agentenv.create()
  try:
    sb.write_file("/srv/scan.py", SCAN)
    for a, b in (("tsk-", "Qz7Wv9Kp" * 8), ("svc-", "Jm4Rx8Tb" * 8)):
      r = sb.exec_python("/srv/scan.py", [a, b], timeout=20)
      assert r.exit_code == 0, r.stderr
      assert r.stdout == b"1\n", (a, r.stdout)  # 1: its own copy; more: the other sandbox's data
  finally:
    sb.close()
    other.close()


# ---- exec_hidden: the hidden check in a private copy of the sandbox's files (no throwaway fork) ----------------
# What the sandbox is: its writable tree (names, types, modes, owners, sizes, times, contents), its mount count.
STATE = ("find /etc/ /home/ /tmp/ /var/ /opt/ /run/ /srv/ /mnt/ -printf '%p %y %m %u %g %s %T@\\n' | sort; "
         "find /home/ /tmp/ /srv/ /var/ /opt/ /run/ /mnt/ -type f -exec md5sum {} + | sort; wc -l < /proc/self/mountinfo")
# A check that reads the sandbox's and the hidden files, then changes all it can and leaves a process behind.
MESS = ("cat /home/user/f.py /srv/h.txt; echo y >> /home/user/f.py; rm /home/user/g.txt; mkdir /home/user/d; "
        "echo n > /tmp/new; chmod 600 /home/user/f.py; touch -d 2001-01-01 /home/user; "
        "setsid sleep 60 </dev/null >/dev/null 2>&1 & echo done")
# What a check sees of the sandbox and its own isolation (compared with the throwaway fork's view).
VIEW = r'''
import os, resource, socket, sys
st = dict(l.split(":\t", 1) for l in open("/proc/self/status").read().splitlines() if ":\t" in l)
print([st[k] for k in ("Seccomp", "NoNewPrivs", "CapEff", "CapBnd", "Uid", "Gid", "Groups")], os.getcwd(), sys.argv)
print([resource.getrlimit(getattr(resource, n)) for n in ("RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NPROC", "RLIMIT_AS")])
for d in ("/", "/srv", "/home/user", "/tmp"):
  print(d, sorted((n, oct(s.st_mode), s.st_uid, s.st_gid, 0 if n in ("r", ".store") else s.st_size) for n in os.listdir(d)
                  for s in [os.lstat(os.path.join(d, n))]))
print(open("/srv/h.txt").read(), oct(os.stat("/srv/h.txt").st_mode), os.stat("/srv/h.txt").st_uid)
print(socket.gethostname(), sorted(int(p) for p in os.listdir("/proc") if p.isdigit()), sorted(os.environ.items()))
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen()
socket.create_connection(s.getsockname(), timeout=1).close()
print("lo up")
'''


@pytest.fixture
def agent():
  require_namespaces()
  s = agentenv.create(files={"f.py": "f=lambda x:x\n", "g.txt": "g\n"}, hidden_files={"/srv/h.txt": "hidden\n"})
  s.write_file("/srv/view.py", VIEW)
  yield s
  s.close()


def test_hidden_check_leaves_the_sandbox_unchanged(agent):
  hub = agentenv.sandbox._Hub.get().hub_pid
  mounts = open(f"/proc/{hub}/mountinfo").read().count("\n")
  before = agent.exec(STATE)
  assert before.exit_code == 0 and b"/home/user/g.txt" in before.stdout, before
  r = agent.exec_hidden(MESS)
  assert r.stdout == b"f=lambda x:x\nhidden\ndone\n" and r.exit_code == 0, r
  py = agent.exec_hidden("/srv/mess.py", python=True, files={"/srv/mess.py": f"import os\nos.system({MESS!r})\n"})
  assert py.stdout == b"f=lambda x:x\nhidden\ndone\n", py
  assert agent.exec(STATE).stdout == before.stdout  # files, times, mounts: as they were
  _assert_no_check_process_left(agent)
  assert open(f"/proc/{hub}/mountinfo").read().count("\n") == mounts


def test_hidden_check_sees_what_a_throwaway_fork_sees(agent):
  """Same user, limits, files (the hidden ones written as init writes them), cwd, environment, hostname, PID
  namespace, loopback as in the throwaway fork the check used to run in; its own network and IPC namespaces
  (not the sandbox's: its services and IPC objects are out of reach)."""
  new = agent.exec_hidden("/srv/view.py", python=True)
  old = agent._exec_hidden_forked("/srv/view.py", 30.0, dict(agent._hidden), True)
  assert new.exit_code == 0 and b"lo up" in new.stdout, new
  assert (new.stdout, new.stderr, new.exit_code) == (old.stdout, old.stderr, old.exit_code)
  ns = "readlink /proc/self/ns/net /proc/self/ns/ipc /proc/self/ns/uts"
  mine, check = agent.exec(ns).stdout.split(), agent.exec_hidden(ns).stdout.split()
  assert mine[:2] != check[:2] and mine[2] == check[2], (mine, check)
  # a hidden file the sandbox's own tree blocks fails as the fork's write fails
  agent.write_file("/home/user/blk", "x")
  errors = []
  for run in (lambda: agent.exec_hidden("true", files={"/home/user/blk/y": "y"}),
              lambda: agent._exec_hidden_forked("true", 30.0, {"/home/user/blk/y": b"y"}, False)):
    with pytest.raises(OSError) as e:
      run()
    errors.append(type(e.value))
  assert errors[0] == errors[1], errors


def test_hidden_check_is_killed_at_its_timeout(agent):
  for cmd, python in (("/srv/hang.py", True), ("sleep 60 & while :; do :; done", False)):
    t = time.monotonic()
    r = agent.exec_hidden(cmd, python=python, timeout=0.5,
                          files={"/srv/hang.py": "import os\nos.system('sleep 60 &')\nwhile True:\n  pass\n"})
    took = time.monotonic() - t
    assert r.timed_out and r.exit_code == -9 and took < 5, (cmd, r, took)
    _assert_no_check_process_left(agent)


def test_hidden_check_in_a_sandbox_with_services_sees_copies_of_them(agent):
  """A check needs the sandbox's services but must not change them: such a sandbox runs it in a throwaway fork."""
  agent.start_service("kv", agentenv.services.KV)
  assert agent.exec("svc kv SET k mine").text == "OK\n"
  r = agent.exec_hidden("svc kv GET k; svc kv SET k check")
  assert r.stdout == b"mine\nOK\n", r
  assert agent.exec("svc kv GET k").text == "mine\n"


def test_hidden_files_reach_no_other_check():
  """A sandbox's hidden files pass the hub to its check process, never the check zygote: no other check finds
  them in its memory."""
  require_namespaces()
  other = agentenv.create(hidden_files={"/srv/h.txt": "hid-" + "Vb3Nq8Lw" * 8})
  sb = agentenv.create()
  try:
    assert other.exec_hidden("cat /srv/h.txt").stdout.startswith(b"hid-")
    sb.write_file("/srv/scan.py", SCAN)
    r = sb.exec_python("/srv/scan.py", ["hid-", "Vb3Nq8Lw" * 8], timeout=20)
    assert r.exit_code == 0 and r.stdout == b"1\n", (r.stdout, r.stderr)
  finally:
    sb.close()
    other.close()
