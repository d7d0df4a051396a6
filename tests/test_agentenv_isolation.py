"""agentenv isolation: no network, no host files, writes stay in the sandbox, sandboxes cannot touch each other."""
import os
import socket
import threading
import time

import pytest

from moonshot_jax import agentenv
from tests.agentenv_testutil import SPAWN_PATHS, require_namespaces, spawn_path  # noqa: F401  (fixture)


@pytest.fixture
def sb(spawn_path):
  require_namespaces()
  with agentenv.create() as s:
    yield s


@pytest.mark.parametrize("spawn_path", SPAWN_PATHS, indirect=True)
def test_runs_as_unprivileged_user_in_own_namespaces(sb):
  r = sb.exec("id -u; hostname; cat /proc/self/uid_map | tr -s ' '; readlink /proc/self/ns/net")
  lines = r.text.split("\n")
  assert r.ok and lines[0] == "1000" and lines[1] == "sandbox"
  assert " 1000 101000 1" in r.text  # uid 1000 inside is an unprivileged host uid, not root
  assert os.readlink("/proc/self/ns/net") != lines[-2]


def test_no_network(sb):
  srv = socket.socket()
  srv.bind(("127.0.0.1", 0))
  srv.listen(1)
  port = srv.getsockname()[1]
  try:
    probe = (f"import socket\n"
             f"try:\n socket.create_connection(('127.0.0.1', {port}), timeout=2); print('TCP-OPEN')\n"
             f"except OSError as e: print('tcp-blocked', type(e).__name__)\n"
             f"try:\n socket.getaddrinfo('pypi.org', 443); print('DNS-OK')\n"
             f"except OSError as e: print('dns-blocked')\n"
             f"print(sorted(n for _, n in socket.if_nameindex()))\n")
    r = sb.exec(["python3", "-c", probe], timeout=10)
  finally:
    srv.close()
  assert r.exit_code == 0, r.stderr
  assert "tcp-blocked" in r.text and "dns-blocked" in r.text, r.text
  assert "['lo']" in r.text


def test_host_files_unreadable(sb, tmp_path):
  secret = "agentenv-secret-" + os.urandom(6).hex()
  planted = [tmp_path / "secret.txt", "/root/.agentenv_test_secret"]
  for p in planted:
    with open(p, "w") as f:
      f.write(secret)
  try:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for p in [*map(str, planted), f"{repo}/README.md", "/work", "/root", "/etc/shadow"]:
      r = sb.exec(["cat", p])
      assert r.exit_code != 0 and secret.encode() not in r.stdout, (p, r)
    r = sb.exec(f"grep -rs {secret} /home /tmp /etc /var /opt /run /srv /mnt 2>/dev/null; ls -a /")
    assert not r.timed_out and secret not in r.text and "work" not in r.text.split() and "root" not in r.text.split()
    # a symlink to a host path resolves inside the sandbox, never on the host
    sb.exec(f"ln -s {planted[0]} link")
    with pytest.raises(FileNotFoundError):
      sb.read_file("link")
    with pytest.raises(ValueError, match=r"\.\."):
      sb.read_file("../../../root/.agentenv_test_secret")
  finally:
    os.remove("/root/.agentenv_test_secret")


def test_writes_stay_in_sandbox(sb):
  mark = "agentenv-" + os.urandom(6).hex()
  assert sb.exec(f"echo hi > /tmp/{mark} && echo hi > ~/{mark}").ok
  r = sb.exec(f"echo x > /usr/{mark}")
  assert r.exit_code != 0 and "Read-only file system" in r.stderr.decode()
  r = sb.exec(f"echo x > /etc/{mark}")  # template files belong to in-sandbox root
  assert r.exit_code != 0 and "Permission denied" in r.stderr.decode()
  sb.write_file(f"/etc/{mark}", "host-api")  # ...but the host API may write anywhere writable
  assert sb.read_file(f"/tmp/{mark}") == b"hi\n" and sb.read_file(f"/etc/{mark}") == b"host-api"
  assert not os.path.exists(f"/tmp/{mark}") and not os.path.exists(f"/etc/{mark}")
  with agentenv.create() as other:
    assert other.exec(f"ls /tmp/{mark} ~/{mark}").exit_code != 0
  r = sb.exec("ls /.store")  # the hub's layer store (every sandbox's layers) is host-root only...
  assert r.exit_code != 0 and "Permission denied" in r.stderr.decode()
  sb.start_service("repl", agentenv.services.REPL)  # ...even for in-sandbox root (services run as that)
  assert "PermissionError" in sb.call_service("repl", "import os; os.listdir('/.store/b')")
  assert sb.call_service("repl", "os.getuid()") == "0\n"
  # services (forks of the service zygote, exec'd by the hub) and init (a fork of the hub) have the hub's environment,
  # scrubbed of the host's variables
  assert sb.call_service("repl", "sorted(os.environ)") == "['LANG', 'PATH']\n"
  # ...and services come from a zygote that never held any of the hub's memory (a fresh interpreter, see _zygote): no
  # Hub object up a service's stack, so no other sandbox's state inside
  with agentenv.create(files={"answer.txt": "42"}) as other:
    other.start_service("kv", agentenv.services.KV)
    probe = ("import sys\nf, seen = sys._getframe(), []\nwhile f:\n"  # the hub objects up this service's stack
             "    if type(f.f_locals.get('self')).__name__ == 'Hub': seen.append(len(f.f_locals['self'].sandboxes))\n"
             "    f = f.f_back\nprint(seen)")
    sb.stop_service("repl")
    sb.start_service("repl", agentenv.services.REPL)
    seen = sb.call_service("repl", probe).strip()
    assert seen == "[]", seen  # a zygote forked from the hub: [0, 0]; services forked from the hub itself: [2, 2]


def test_hidden_files_unreadable_from_inside():
  require_namespaces()
  tag = "HIDDEN-" + os.urandom(6).hex()
  with agentenv.create(files={"task.txt": "visible"}, hidden_files={"tests/check.py": f"print('{tag}')"}) as sb:
    r = sb.exec(f"cat task.txt; grep -rs {tag} /home /tmp /etc /var /opt /run /srv /mnt 2>/dev/null; ls tests")
    assert "visible" in r.text and tag not in r.text and r.exit_code != 0
    v = sb.exec_hidden("python3 tests/check.py")
    assert v.ok and v.text.strip() == tag
    assert sb.exec("ls tests").exit_code != 0  # the verifier's fork left nothing behind


@pytest.mark.parametrize("spawn_path", SPAWN_PATHS, indirect=True)
def test_cannot_see_or_signal_other_sandbox(spawn_path):
  require_namespaces()
  with agentenv.create() as a, agentenv.create() as b:
    b.start_service("kv", agentenv.services.KV)
    b.call_service("kv", "SET k v")
    res = {}
    t = threading.Thread(target=lambda: res.update(r=b.exec("sleep 1; echo survived", timeout=10)))
    t.start()
    time.sleep(0.3)
    r = a.exec("ls /proc | grep -c '^[0-9]'; ps -e | grep -c sleep; kill -9 -1; pkill -9 sleep; true")
    t.join()
    assert res["r"].ok and res["r"].text.strip() == "survived"
    assert r.text.split()[1] == "0"
    assert int(r.text.split()[0]) <= 3  # only this command's own processes (sh, ls, grep)
    assert b"kill: No such process" in r.stderr  # kill -1 finds nobody to signal
    assert b.call_service("kv", "GET k") == "v"  # b's service untouched; a cannot reach it at all
    assert a.exec("svc kv GET k").exit_code != 0


@pytest.mark.parametrize("spawn_path", SPAWN_PATHS, indirect=True)
def test_agent_cannot_make_namespaces_or_mounts(sb):
  """seccomp: no nested user/net namespaces (the usual path to kernel bugs), no mounts, no io_uring, while
  threads, subprocesses and pipes still work."""
  r = sb.exec("unshare -Ur id; echo rc=$?; unshare -n true; echo rc=$?")
  assert "rc=1\nrc=1" in r.text and "uid=0" not in r.text, r
  probe = ("import ctypes, os, threading, subprocess\n"
           "libc = ctypes.CDLL(None, use_errno=True)\n"
           "print(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None), ctypes.get_errno())\n"
           "print(libc.syscall(425, 8, None), ctypes.get_errno())\n"  # io_uring_setup
           "t = threading.Thread(target=print, args=('thread-ok',)); t.start(); t.join()\n"
           "print(subprocess.run(['sh', '-c', 'echo sub | cat'], capture_output=True, text=True).stdout.strip())\n")
  r = sb.exec(["python3", "-c", probe])
  assert r.text.split("\n")[:4] == ["-1 1", "-1 1", "thread-ok", "sub"], r
