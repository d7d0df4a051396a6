"""Make or reuse `.venv` beside the repo, install the package into it, re-exec under it.

Used by the two README commands so they work on a fresh machine that only has python3.
"""
import hashlib
import os
import subprocess
import sys
import venv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(ROOT, ".venv")
PY = os.path.join(VENV, "bin", "python")
STAMP = os.path.join(VENV, ".moonshot_install_stamp")


def _install_key(extras: str) -> str:
  with open(os.path.join(ROOT, "setup.cfg"), "rb") as f:
    return hashlib.sha256(f.read() + extras.encode()).hexdigest()


def ensure_venv(extras: str = "test") -> None:
  """Re-executes the calling script under .venv's python after installing `.[extras]`."""
  if os.path.abspath(sys.prefix) == os.path.abspath(VENV) and os.environ.get("MOONSHOT_BOOTSTRAPPED"):
    return
  if not os.path.exists(PY):
    print(f"[bootstrap] creating virtual environment {VENV}", flush=True)
    venv.EnvBuilder(with_pip=True).create(VENV)
  key = _install_key(extras)
  have = open(STAMP).read() if os.path.exists(STAMP) else ""
  if have != key:
    print(f"[bootstrap] installing moonshot_jax[{extras}] into {VENV}", flush=True)
    subprocess.check_call([PY, "-m", "pip", "install", "-q", "--upgrade", "pip"])
    subprocess.check_call([PY, "-m", "pip", "install", "-q", "-e", f"{ROOT}[{extras}]"])
    with open(STAMP, "w") as f:
      f.write(key)
  env = dict(os.environ, MOONSHOT_BOOTSTRAPPED="1")
  sys.path.insert(0, ROOT)
  from moonshot_jax import host_memory  # stdlib only: safe before the venv exists
  env = host_memory.huge_page_env(env, host_memory.thp_mode(), host_memory.glibc_version()) or env
  os.execve(PY, [PY] + sys.argv, env)
