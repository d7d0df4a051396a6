"""How the hub starts its exec'd zygotes (the check zygote, _check; the service zygote, _service): a fresh
`python3 -I -S -c BOOT` that imports one module of this package and runs its main(ctl_fd, lifeline_fd), never a fork of
the hub. A zygote thus holds none of the hub's memory (no task file of any sandbox) and none of its modules: each fork
of it skips the copy-on-write of the hub's heap and the at-fork hooks of modules it never imports (threading's ~130
page faults per child, session 24)."""
import os
import socket
import sys
import traceback

from . import _sys as S
from . import _wire as W

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
# The zygote's first lines: the package modules as bare namespaces (their __init__ files stay unrun: they import the
# host side), then the module's main().
_BOOT = """import sys, types
sys.path.insert(0, {root!r})
for name, path in {pkgs!r}:
  pkg = sys.modules[name] = types.ModuleType(name)
  pkg.__path__ = [path]
from {pkg} import {module}
{module}.main({ctl}, {lifeline})
"""


def command(module: str, ctl_fd: int, lifeline_fd: int) -> list:
  """argv that starts the zygote `module` (a module of this package with main(ctl_fd, lifeline_fd)) on the
  (inheritable) control socket and lifeline fds, with the interpreter and flags of the hub itself (sys.executable -I
  -S: what _pyrun documents a check sees)."""
  if not module.isidentifier() or not os.path.isfile(os.path.join(_PKG_DIR, module + ".py")):
    raise ValueError(f"_zygote: no module {module!r} in {_PKG_DIR}")
  parts = __package__.split(".")
  root = os.path.dirname(os.path.dirname(_PKG_DIR)) if len(parts) == 2 else None
  if root is None or os.path.join(root, *parts) != _PKG_DIR:
    raise RuntimeError(f"_zygote: unexpected package layout {__package__!r} at {_PKG_DIR}")
  pkgs = [(".".join(parts[:i + 1]), os.path.join(root, *parts[:i + 1])) for i in range(len(parts))]
  boot = _BOOT.format(root=root, pkgs=pkgs, pkg=__package__, module=module, ctl=int(ctl_fd),
                      lifeline=int(lifeline_fd))
  return [sys.executable, "-I", "-S", "-c", boot]


def serve(comm: str, what: str, ctl_fd: int, lifeline: int, prepare, loop) -> None:
  """An exec'd zygote's main (never returns): named `comm`, its first exchange with the hub (("setup",) with the
  sandboxes' user namespace fd, made after the zygote starts; every other inherited fd but the lifeline and stderr
  closed), prepare(), then ("ready", pid) and loop(ctl, lifeline, userns) until the hub's lifeline breaks. A failure
  prints its traceback (the hub reports the zygote as failed to start)."""
  S.set_name(comm)
  try:
    ctl = socket.socket(fileno=ctl_fd)
    (op, *_), fds = W.recv(ctl, with_fds=True)
    if op != "setup" or len(fds) != 1:
      raise RuntimeError(f"{what}: expected ('setup',) with the user namespace fd, got {op!r} + {len(fds)} fds")
    userns = fds[0]
    S.close_except({ctl.fileno(), lifeline, userns, 2})
    prepare()
    W.send(ctl, ("ready", os.getpid()))
    loop(ctl, lifeline, userns)
  except BaseException:
    traceback.print_exc()
  finally:
    os._exit(0)
