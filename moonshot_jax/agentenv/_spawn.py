"""The compiled spawn helper (_spawn.c): how sandbox commands start without forking init's interpreter.

A fork of init (~14 MB of Python) costs ~0.7 ms of page-table copy plus ~1-2 ms of copy-on-write faults on both
sides, and the child's exec then tears the copy down; posix_spawn of a small C binary that does the same setup
(uid drop, rlimits, seccomp, ... see _spawn.c) and execs the command skips all of that. The hub builds the binary
with the system C compiler once per source hash into a root-only cache, opens it and hands the fd down to every
init (the sandbox root has no path to it). AGENTENV_SPAWN picks the path commands take:
  auto (default): the helper where it builds, else today's fork path with one warning on stderr;
  helper: the helper or a clear error; fork: always the fork path.
hub_stats()["spawn"] says which path this hub's commands take (and "spawn_why" why not the helper).
"""
import fcntl
import hashlib
import os
import shutil
import stat

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_spawn.c")
CFLAGS = ("-O2", "-Wall", "-std=gnu11")
# Linked statically where the C library allows it (glibc: libc6-dev's libc.a): no dynamic loader run per command,
# ~30 fewer page faults and ~0.15 ms less CPU per start (measured, session 24); else dynamically.
LINKS = (("-static",), ())
MODES = ("auto", "helper", "fork")


class SpawnError(RuntimeError):
  pass


def mode() -> str:
  m = os.environ.get("AGENTENV_SPAWN", "auto")
  if m not in MODES:
    raise SpawnError(f"AGENTENV_SPAWN={m!r}: expected one of {', '.join(MODES)}")
  return m


def _cache_dir() -> str:
  """The root-only (0700) cache dir, made if missing; refused if anyone but root could have put a binary there."""
  d = os.environ.get("AGENTENV_SPAWN_CACHE", "/var/cache/agentenv")
  os.makedirs(d, 0o700, exist_ok=True)
  st = os.lstat(d)
  if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
    raise SpawnError(f"spawn helper cache {d} must be a directory owned by uid {os.geteuid()} with mode 0700 "
                     f"(is uid {st.st_uid}, mode {stat.filemode(st.st_mode)})")
  return d


def build() -> str:
  """Path of the helper binary for this source, compiled first if the cache lacks it. Several hubs may start at
  once (pytest-xdist workers): the first takes the cache dir's lock and compiles, the others wait and reuse it;
  the binary appears under its final name only whole (rename)."""
  import subprocess  # (as _hub.probe_missing: not at import time)

  with open(SOURCE, "rb") as f:
    src = f.read()
  cc = os.environ.get("AGENTENV_CC", "cc")
  tag = hashlib.sha256(src + repr((cc, CFLAGS, LINKS)).encode()).hexdigest()[:16]
  d = _cache_dir()
  path = f"{d}/agentenv-spawn-{tag}"
  if os.path.exists(path):
    return _runs(path)
  compiler = shutil.which(cc)
  if compiler is None:
    raise SpawnError(f"no C compiler {cc!r} on PATH {os.environ.get('PATH', '')!r} (install gcc and libc6-dev)")
  lock = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
  try:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if os.path.exists(path):  # built by another hub while we waited
      return _runs(path)
    tmp = f"{d}/.build-{os.getpid()}"
    for link in LINKS:
      r = subprocess.run([compiler, *CFLAGS, *link, "-o", tmp, SOURCE], capture_output=True, text=True,
                         timeout=120, stdin=subprocess.DEVNULL)
      if r.returncode == 0:
        break
      try:
        os.unlink(tmp)
      except FileNotFoundError:
        pass
    else:
      raise SpawnError(f"{cc} failed to build {SOURCE} (exit {r.returncode}): {r.stderr.strip()[-1500:]}")
    os.chmod(tmp, 0o755)  # executable by init (uid 0 of the user namespace, host uid 100000): the dir keeps it private
    os.rename(tmp, path)
    return _runs(path)
  finally:
    os.close(lock)  # (closing drops the lock)


def _runs(path):
  """path, once it has run here: without arguments the helper only prints its usage error. Catches what would
  otherwise fail every command later (a noexec cache mount, a binary for another machine)."""
  import subprocess

  r = subprocess.run([path], capture_output=True, timeout=30, stdin=subprocess.DEVNULL, env={})
  if r.returncode != 126 or b"agentenv: cannot start command: usage" not in r.stderr:
    raise SpawnError(f"{path} does not run here (exit {r.returncode}: {r.stderr[-300:]!r})")
  return path


def open_helper():
  """(fd of the helper binary or -1, "helper" | "fork", why not the helper). Raises SpawnError for
  AGENTENV_SPAWN=helper when the helper cannot be built, or a bad AGENTENV_SPAWN."""
  import subprocess

  m = mode()
  if m == "fork":
    return -1, "fork", "AGENTENV_SPAWN=fork"
  try:
    path = build()
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC), "helper", ""
  except (OSError, SpawnError, subprocess.SubprocessError) as e:
    why = f"{type(e).__name__}: {e}"
    if m == "helper":
      raise SpawnError(f"AGENTENV_SPAWN=helper but the spawn helper is unavailable: {why}") from None
    return -1, "fork", why
