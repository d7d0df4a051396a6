"""Runs the test suite in a local virtual environment: `python3 launch/test.py [pytest args]`.

Creates/reuses .venv, installs moonshot_jax[test], then runs pytest (fast tests by default;
add `-m slow` for the long ones).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bootstrap import ROOT, ensure_venv  # noqa: E402

if __name__ == "__main__":
  ensure_venv("test")
  import pytest  # noqa: E402

  os.chdir(ROOT)
  sys.exit(pytest.main(sys.argv[1:]))
