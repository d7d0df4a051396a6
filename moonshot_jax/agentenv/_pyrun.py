"""Run a Python file in a forked interpreter as `python3 -I -S FILE ARGS...` would, without starting one.

Used by the check zygote (_check): its fork P, already in the sandbox's namespaces and cgroup, with uid
1000, rlimits and seccomp in place (_init.Init._child), calls run() where a command would exec. The zygote is a
fresh interpreter started before any sandbox existed that only ever sees check requests (paths, env), so P inherits
no task data; each run is a fresh fork that exits when done, so nothing of one run reaches the next.

What a fresh interpreter would give and a fork must reset: argv, os.environ, sys.path (no repo entry), a new
__main__, new stdio objects on fds 0-1-2 (an inherited buffer must never be flushed into the check's output: the
zygote makes them once, premake_stdio, and never writes to them), atexit handlers. What stays the zygote's: the hash
seed (fixed per interpreter) and the modules it imported (PRELOADED: the check's own imports then cost nothing).
"""
import atexit
import io
import json  # noqa: F401  PRELOADED: the checks' one import
import os
import sys
import traceback
import types

PRELOADED = ("json",)
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_FRESH_PATH = [p for p in sys.path if p != _REPO]  # python3 -I -S: the stdlib dirs only


def _stdio(fd, mode, errors, line_buffering):
  raw = io.FileIO(fd, mode, closefd=False)
  raw.name = ("<stdin>", "<stdout>", "<stderr>")[fd]  # (as the interpreter names its own)
  buf = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
  return io.TextIOWrapper(buf, encoding="utf-8", errors=errors, line_buffering=line_buffering)


_PREMADE = []  # [stdin, stdout, stderr] for run(), made by premake_stdio in the check zygote


def _fresh_stdio():
  return [_stdio(0, "r", sys.__stdin__.errors if sys.__stdin__ else "strict", False),
          _stdio(1, "w", "surrogateescape", False),  # a pipe: block buffered
          _stdio(2, "w", "backslashreplace", True)]


def premake_stdio():
  """Make the checks' stdio objects once, in the zygote, instead of in every P (io and codec objects built in a
  fork are ~50 copy-on-write page faults, session 24). Made on what a check's fds 0-1-2 are (Init.exec: /dev/null,
  two pipes), as the objects note at creation whether their fd can seek; nothing ever writes to them before a P
  takes them, so their buffers are empty. The caller's own fds 0-2 are put back."""
  saved = [os.dup(fd) for fd in (0, 1, 2)]
  null = os.open(os.devnull, os.O_RDONLY)
  (r1, w1), (r2, w2) = os.pipe(), os.pipe()
  try:
    for src, fd in ((null, 0), (w1, 1), (w2, 2)):
      os.dup2(src, fd)
    _PREMADE[:] = _fresh_stdio()
  finally:
    for fd, s in zip((0, 1, 2), saved):
      os.dup2(s, fd)
      os.close(s)
    for f in (null, r1, w1, r2, w2):
      os.close(f)


def _exit_code(e: SystemExit) -> int:
  """The interpreter's handling of an uncaught SystemExit."""
  code = e.code
  if code is None:
    return 0
  if isinstance(code, int):
    return code & 0xFF
  try:
    print(code, file=sys.stderr)
  except Exception:
    pass
  return 1


def run(argv, env):
  """Never returns. argv = [path, args...]; env becomes os.environ."""
  path = argv[0]
  os.environ.clear()
  for k, v in env.items():  # (not update(): its Mapping check costs a fork's ABC caches ~20 page faults)
    os.environ[k] = v
  atexit._clear()  # the zygote's handlers are not the check's
  sys.stdin, sys.stdout, sys.stderr = _PREMADE or _fresh_stdio()
  sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
  sys.argv = list(argv)
  sys.path[:] = _FRESH_PATH
  main = types.ModuleType("__main__")
  main.__file__, main.__cached__, main.__spec__ = path, None, None
  main.__builtins__ = __builtins__
  sys.modules["__main__"] = main
  try:
    with open(path, "rb") as f:
      source = f.read()
  except OSError as e:
    sys.stderr.write(f"{sys.executable}: can't open file {path!r}: [Errno {e.errno}] {e.strerror}\n")
    _finish(2)
  code = 0
  try:
    exec(compile(source, path, "exec"), main.__dict__)
  except SystemExit as e:
    code = _exit_code(e)
  except BaseException as e:  # noqa: B036  the interpreter reports any uncaught exception the same way
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # (without this frame)
    code = 1
  _finish(code)


def _finish(code):
  try:
    atexit._run_exitfuncs()
    if "threading" in sys.modules:
      sys.modules["threading"]._shutdown()  # waits for non-daemon threads, as interpreter exit does
    sys.stdout.flush()
    sys.stderr.flush()
  except BaseException:
    code = code or 120  # the interpreter's code when the final flush fails
  os._exit(code)
