"""agentenv's two ways of starting a command (agentenv/_spawn.py): the compiled spawn helper and the fork of init.
Every setup step a command gets must be the same on both and observable from inside it; init must not fork on the
helper path; the helper's build and its AGENTENV_SPAWN switch fail clearly."""
import json
import os
import stat
import subprocess
import sys

import pytest

from moonshot_jax import agentenv
from tests.agentenv_testutil import SPAWN_PATHS, require_namespaces, spawn_path  # noqa: F401  (fixture)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMITS = agentenv.Limits(cpu_seconds=7, file_size_mb=3)
BASE_ENV = {"PATH": "/opt/agentenv/bin:/usr/local/bin:/usr/bin:/bin", "HOME": "/home/user", "USER": "user",
            "LOGNAME": "user", "LANG": "C.UTF-8", "TERM": "dumb", "PYTHONDONTWRITEBYTECODE": "1"}
# Everything the command's setup leaves behind, as the command (sh, pid 1 of its namespace) sees it
PROBE = r"""
echo "ids $(id -u) $(id -g) [$(id -G)]"
grep -E '^(Uid|Gid|Groups|NoNewPrivs|Seccomp|SigIgn|SigBlk):' /proc/self/status | tr -s '\t ' ' '
echo "oom $(cat /proc/self/oom_score_adj)"
grep -E '^Max (cpu time|file size|core file size|address space|processes) ' /proc/$$/limits | tr -s ' '
echo "pid $$ cwd $(pwd)"
echo procs; ls -1 /proc
echo fds; ls -1 /proc/$$/fd
"""  # (no pipe or redirection around the two ls: sh itself must hold no extra fd while they look)
SYSCALLS = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print(libc.unshare(0x10000000), ctypes.get_errno())\n"  # CLONE_NEWUSER
            "print(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None), ctypes.get_errno())\n")


@pytest.fixture
def sb(spawn_path):
  require_namespaces()
  with agentenv.create(limits=LIMITS, files={"work/a.txt": "a"}) as s:
    yield s


HOST_IGNORES = r"""
import signal, sys
for s in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT):  # as under nohup / a background job of a script
  signal.signal(s, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
from moonshot_jax import agentenv
with agentenv.create() as sb:
  r = sb.exec(["grep", "-E", "^Sig(Ign|Blk):", "/proc/self/status"])
  print(agentenv.hub_stats()["spawn"], r.stdout.decode().split())
"""


@pytest.mark.parametrize("path", ["helper", "fork"])
def test_a_command_starts_with_default_signals_whatever_the_host_process_ignored(path):
  """The hub, its inits and so their commands inherit the host process's ignored signals and mask (CI under nohup once
  gave every command SIGHUP / SIGINT / SIGQUIT ignored): both paths reset them before the command runs."""
  require_namespaces()
  env = dict(os.environ, PYTHONPATH=REPO, AGENTENV_SPAWN=path)
  r = subprocess.run([sys.executable, "-c", HOST_IGNORES], env=env, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.split(None, 1) == [path, "['SigBlk:', '0000000000000000', 'SigIgn:', '0000000000000000']\n"], r.stdout


@pytest.mark.parametrize("spawn_path", SPAWN_PATHS, indirect=True)
def test_every_setup_step_is_seen_from_inside_the_command(sb):
  r = sb.exec(PROBE, cwd="work")
  assert r.exit_code == 0 and r.stderr == b"", r
  lines = r.text.splitlines()
  assert lines[0] == "ids 1000 1000 [1000]"  # setgroups([]) + setresgid / setresuid 1000
  status = dict(ln.split(": ", 1) if ": " in ln else ln.split(":", 1) for ln in lines[1:8])
  assert status["Uid"].split() == ["1000"] * 4 and status["Gid"].split() == ["1000"] * 4
  assert status["Groups"].strip() == ""
  assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2"  # filter mode
  # nothing ignored or blocked: SIGPIPE / SIGXFSZ back to the default (init's Python ignores them), no glibc-internal
  # signal left ignored by posix_spawn
  assert status["SigIgn"].strip() == "0000000000000000" and status["SigBlk"].strip() == "0000000000000000"
  assert "oom 1000" in lines
  lim = {ln.strip().rsplit(" ", 3)[0]: ln.strip().rsplit(" ", 3)[1:3] for ln in lines if ln.startswith("Max ")}
  assert lim["Max cpu time"] == ["7", "7"] and lim["Max file size"] == [str(3 << 20)] * 2
  assert lim["Max core file size"] == ["0", "0"]
  if agentenv.hub_stats()["cgroups"]:  # (the rlimit fallback without cgroups: test_agentenv_limits)
    assert lim["Max address space"] == ["unlimited"] * 2
  assert "pid 1 cwd /home/user/work" in lines  # sh is pid 1 of its own PID namespace...
  procs = [p for p in lines[lines.index("procs") + 1:lines.index("fds")] if p.isdigit()]
  assert len(procs) == 2 and procs[0] == "1", procs  # ...and its /proc is that namespace's: sh and the ls alone
  assert lines[lines.index("fds") + 1:] == ["0", "1", "2"]  # nothing of init's (sockets, lifeline, the helper...)
  # the seccomp filter: no new namespaces, no mounts
  assert sb.exec(["python3", "-c", SYSCALLS]).text.split("\n")[:2] == ["-1 1", "-1 1"]
  assert sb.exec("yes | head -1").stderr == b""  # a default SIGPIPE ends `yes` quietly


@pytest.mark.parametrize("spawn_path", SPAWN_PATHS, indirect=True)
def test_environment_and_start_errors_are_the_same_on_both_paths(sb):
  env = dict(kv.split("=", 1) for kv in sb.exec(["env", "-0"], env={"X": "1 2"}, cwd="work").text.split("\0")[:-1])
  assert env == {**BASE_ENV, "PWD": "/home/user/work", "X": "1 2"}  # exactly this, nothing of init's
  r = sb.exec(["true"], cwd="/nonexistent")
  assert (r.exit_code, r.stderr) == (126, b"agentenv: cannot chdir to /nonexistent: No such file or directory\n")
  r = sb.exec(["no-such-program", "x"])
  assert (r.exit_code, r.stderr) == (127, b"agentenv: cannot exec no-such-program: No such file or directory\n")
  sb.write_file("bin/plain", "echo from-plain\n")  # no #! line and not executable
  r = sb.exec(["bin/plain"])
  assert (r.exit_code, r.stderr) == (127, b"agentenv: cannot exec bin/plain: Permission denied\n")
  # PATH is searched as os.execvpe does: in order, a file without #! is an error (glibc's execvpe would run it with
  # /bin/sh), the first error other than "not found" is the one reported
  sb.exec("chmod +x bin/plain; mkdir -p b2; printf '#!/bin/sh\\necho from-b2\\n' > b2/tool; chmod +x b2/tool; "
          "cp b2/tool bin/tool")
  path = {"PATH": "/nonexistent:/home/user/bin:/home/user/b2"}
  r = sb.exec(["plain"], env=path)
  assert (r.exit_code, r.stderr) == (127, b"agentenv: cannot exec plain: Exec format error\n")
  assert sb.exec(["tool"], env={"PATH": "/nonexistent:/home/user/b2/:/home/user/bin"}).text == "from-b2\n"
  assert sb.exec(["tool"], env={"PATH": ""}, cwd="bin").text == "from-b2\n"  # "" = the cwd
  r = sb.exec(["tru\0e"])  # nothing can exec this: the same start error on both paths
  assert r.exit_code == 126 and r.stderr.startswith(b"agentenv: cannot start command: "), r
  r = sb.exec(["true", "x" * 200_000])  # one argument over the kernel's MAX_ARG_STRLEN (128 KiB)
  assert (r.exit_code, r.stderr) == (127, b"agentenv: cannot exec true: Argument list too long\n")
  r = sb.exec(["env"], env={"A=B": "1"})
  assert (r.exit_code, r.stderr) == (126, b"agentenv: cannot start command: illegal environment variable name\n")
  with pytest.raises(ValueError, match=r"cmd\[0\]"):
    sb.exec([""])


def _init_pid(sb):
  hub = agentenv.sandbox._Hub.get().hub_pid
  for p in os.listdir("/proc"):
    try:
      if (open(f"/proc/{p}/comm").read().strip() == "agentenv-init"
          and f"agentenv-{hub}/{sb.id}\n" in open(f"/proc/{p}/cgroup").read()):
        return int(p)
    except OSError:
      pass
  pytest.skip("no per-sandbox cgroup to find the sandbox's init by")


def _minflt(pid):
  return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[7])


@pytest.mark.parametrize("spawn_path", SPAWN_PATHS, indirect=True)
@pytest.mark.parametrize("recycle", [False, True], ids=["fresh", "recycled"])
def test_the_helper_path_does_not_fork_init(spawn_path, recycle):
  """A fork of init costs it ~130 copy-on-write page faults per command (measured: 129-132); posix_spawn of the
  helper none. Also on an init that served an earlier sandbox (create(recycle=True))."""
  require_namespaces()
  agentenv.drop_recycled()  # so that the recycled sandbox below gets the first one's init
  sb = agentenv.create(recycle=recycle)
  pid = _init_pid(sb)
  if recycle:
    sb.close()
    n = agentenv.hub_stats()["recycled"]
    sb = agentenv.create(recycle=True)
    assert agentenv.hub_stats()["recycled"] == n + 1 and agentenv.hub_stats()["pooled"] == 0
  try:
    sb.exec(["true"])
    f0 = _minflt(pid)
    for _ in range(10):
      assert sb.exec(["true"]).ok
    per_cmd = (_minflt(pid) - f0) / 10
    assert (per_cmd < 20) if spawn_path == "helper" else (per_cmd > 50), per_cmd
    r = sb.exec("echo pid $$; ls -1 /proc/$$/fd")
    assert r.text == "pid 1\n0\n1\n2\n", r
  finally:
    sb.close()
    agentenv.drop_recycled()


SWITCH = r"""
import json, os, sys, threading
from moonshot_jax import agentenv
from moonshot_jax.agentenv.sandbox import _Hub
cache = sys.argv[1]
out = {}

def hub(**env):  # a fresh hub with these variables (the previous one ends on its socket's EOF)
  if _Hub._inst is not None:
    _Hub._inst.sock.close()
    _Hub._inst.proc.wait()
    _Hub._inst = None
  for k in ("AGENTENV_SPAWN", "AGENTENV_CC", "AGENTENV_SPAWN_CACHE"):
    os.environ.pop(k, None)
  os.environ.update(env)
  try:
    st = agentenv.hub_stats()
  except agentenv.SandboxError as e:
    return {"error": str(e)}
  with agentenv.create() as sb:
    return {"spawn": st["spawn"], "why": st["spawn_why"], "echo": sb.exec(["echo", "ok"]).text}

def listing(d):
  return {n: [oct(os.stat(f"{d}/{n}").st_mode), os.stat(f"{d}/{n}").st_uid, os.stat(f"{d}/{n}").st_ino]
          for n in sorted(os.listdir(d))}

out["bogus"] = hub(AGENTENV_SPAWN="bogus")
nocc = dict(AGENTENV_CC="/nonexistent/cc", AGENTENV_SPAWN_CACHE=f"{cache}/nocc")
out["helper_nocc"] = hub(AGENTENV_SPAWN="helper", **nocc)
print("--- auto without a compiler ---", file=sys.stderr, flush=True)
out["auto_nocc"] = hub(**nocc)
print("--- end ---", file=sys.stderr, flush=True)
# two hubs building into one empty cache at once
_Hub._inst.sock.close(); _Hub._inst.proc.wait(); _Hub._inst = None
os.environ.pop("AGENTENV_CC"); os.environ["AGENTENV_SPAWN_CACHE"] = f"{cache}/c"
hubs = []
ts = [threading.Thread(target=lambda: hubs.append(_Hub())) for _ in range(2)]
[t.start() for t in ts]; [t.join() for t in ts]
out["both"] = [h.call("stats")[0]["spawn"] for h in hubs]
for h in hubs:
  h.sock.close(); h.proc.wait()
out["cache_mode"] = oct(os.stat(f"{cache}/c").st_mode)
out["built"] = listing(f"{cache}/c")
out["again"] = hub(AGENTENV_SPAWN="helper", AGENTENV_SPAWN_CACHE=f"{cache}/c")
out["built_again"] = listing(f"{cache}/c")
for name in out["built"]:  # a binary that does not run (as from a noexec mount or another machine)
  with open(f"{cache}/c/{name}", "w") as f:
    f.write("#!/bin/sh\nexit 0\n")
out["broken"] = hub(AGENTENV_SPAWN_CACHE=f"{cache}/c")
os.mkdir(f"{cache}/open", 0o777); os.chmod(f"{cache}/open", 0o777)
out["open_auto"] = hub(AGENTENV_SPAWN_CACHE=f"{cache}/open")
out["open_helper"] = hub(AGENTENV_SPAWN="helper", AGENTENV_SPAWN_CACHE=f"{cache}/open")
print(json.dumps(out))
"""


def test_the_switch_and_the_build_fail_clearly_and_the_cache_is_built_once(tmp_path):
  """AGENTENV_SPAWN: a bad value and `helper` without a compiler are errors naming why; `auto` without one takes the
  fork path (hub_stats says so) with one warning. The cache: root-only, one complete binary when two hubs build
  into it at once, reused (not rebuilt) by the next hub, not used when it does not run, refused when others could
  write there."""
  require_namespaces()
  env = dict(os.environ, PYTHONPATH=REPO)
  out = subprocess.run([sys.executable, "-c", SWITCH, str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  res = json.loads(out.stdout.strip().split("\n")[-1])
  assert "AGENTENV_SPAWN='bogus': expected one of auto, helper, fork" in res["bogus"]["error"], res
  assert "AGENTENV_SPAWN=helper but the spawn helper is unavailable" in res["helper_nocc"]["error"], res
  assert "no C compiler '/nonexistent/cc'" in res["helper_nocc"]["error"], res
  assert res["auto_nocc"]["spawn"] == "fork" and "no C compiler" in res["auto_nocc"]["why"], res
  assert res["auto_nocc"]["echo"] == "ok\n"
  warned = out.stderr.split("--- auto without a compiler ---")[1].split("--- end ---")[0]
  assert warned.count("agentenv: warning: sandbox commands fork") == 1, out.stderr[-3000:]
  assert out.stderr.count("agentenv: warning") == 3 and "mode 0700" in out.stderr.split("--- end ---")[1]  # open_auto
  assert "Traceback" not in out.stderr  # the hubs that failed to start said why to the host, nothing else
  assert res["both"] == ["helper", "helper"] and res["cache_mode"] == oct(stat.S_IFDIR | 0o700), res
  (name, (mode, uid, ino)), = res["built"].items()  # one binary, nothing half-built left
  assert name.startswith("agentenv-spawn-") and mode == oct(stat.S_IFREG | 0o755) and uid == 0, res
  assert res["again"]["spawn"] == "helper" and res["built_again"] == res["built"], res  # same inode: not rebuilt
  assert res["broken"]["spawn"] == "fork" and "does not run here (exit 0" in res["broken"]["why"], res
  assert res["broken"]["echo"] == "ok\n"
  assert res["open_auto"]["spawn"] == "fork" and "mode 0700" in res["open_auto"]["why"], res
  assert "mode 0700" in res["open_helper"]["error"], res
