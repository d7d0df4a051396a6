"""Transparent huge pages for host malloc (glibc), set before the process starts.

Why: XLA:CPU allocates each execution's temporary buffer afresh (small's train step: 1.8 GB,
`compiled.memory_analysis().temp_size_in_bytes`). glibc serves any block over 32 MB with its own
mmap and unmaps it on free, so every step page-faults its whole temp buffer again, one 4 KB page at
a time, which costs a large share of a CPU step in kernel time. With glibc's `glibc.malloc.hugetlb=1`
tunable, malloc asks for transparent huge pages (madvise), the faults come in 2 MB pages instead of
4 KB ones (measured fault counts and step times in WORKSPACE_NOTES).

glibc reads tunables only at start-up, so the launchers re-execute themselves once with the tunable
added (`reexec_with_huge_pages`). Nothing here imports jax: it must run before anything heavy.
Opt out with MOONSHOT_HUGEPAGE_MALLOC=0. Where the tunable cannot help (not Linux, glibc < 2.35,
THP "always" already or "never") the environment is left alone.
"""
from __future__ import annotations

import os
import sys
from typing import Mapping

TUNABLE = "glibc.malloc.hugetlb=1"
OPT_OUT = "MOONSHOT_HUGEPAGE_MALLOC"
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_ENABLED) -> str | None:
  """The kernel's THP mode ("always", "madvise", "never"), or None where unknown."""
  try:
    with open(path) as f:
      text = f.read()
  except OSError:
    return None
  start, end = text.find("["), text.find("]")
  return text[start + 1:end] if 0 <= start < end else None


def glibc_version() -> tuple[int, int] | None:
  """(major, minor) of the running glibc, or None (musl, macOS, Windows)."""
  try:
    name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
    major, minor = version.split(".")[:2]
    return (int(major), int(minor)) if name == "glibc" else None
  except (AttributeError, ValueError, OSError):
    return None


def huge_page_env(environ: Mapping[str, str], thp: str | None,
                  glibc: tuple[int, int] | None) -> dict[str, str] | None:
  """`environ` with the hugetlb tunable appended to GLIBC_TUNABLES, or None when the environment
  should stay as it is (opted out, tunable already present, or it would do nothing here)."""
  if environ.get(OPT_OUT, "1") == "0" or thp != "madvise" or glibc is None or glibc < (2, 35):
    return None
  tunables = environ.get("GLIBC_TUNABLES", "")
  if "glibc.malloc.hugetlb" in tunables:
    return None
  env = dict(environ)
  env["GLIBC_TUNABLES"] = f"{tunables}:{TUNABLE}" if tunables else TUNABLE
  return env


def reexec_with_huge_pages() -> None:
  """Restart this very command (same interpreter, same argv) with the tunable, once; a no-op when
  `huge_page_env` says there is nothing to add. Call it first thing under `__main__`."""
  env = huge_page_env(os.environ, thp_mode(), glibc_version())
  if env is None:
    return
  argv = list(getattr(sys, "orig_argv", []))[1:] or sys.argv
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, [sys.executable] + argv, env)


def describe(environ: Mapping[str, str] = os.environ) -> str:
  """How this process's large host allocations are paged (for benchmark headers)."""
  mode = thp_mode()
  if mode == "always":
    return "huge pages (THP always)"
  if mode == "madvise" and TUNABLE in environ.get("GLIBC_TUNABLES", ""):
    return f"huge pages ({TUNABLE})"
  return f"4 KB pages (THP {mode or 'unknown'}, no {TUNABLE})"
