"""host_memory: when the glibc huge-page tunable is added, and that it removes XLA:CPU's per-run page faults."""
import os
import subprocess
import sys
import textwrap

import pytest

from moonshot_jax import host_memory as hm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("environ,thp,glibc,want", [
    ({}, "madvise", (2, 36), hm.TUNABLE),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise", (2, 36), "glibc.malloc.arena_max=2:" + hm.TUNABLE),
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", (2, 36), None),  # the user's choice stands
    ({hm.OPT_OUT: "0"}, "madvise", (2, 36), None),
    ({}, "always", (2, 36), None),  # already huge pages
    ({}, "never", (2, 36), None),  # the tunable cannot help
    ({}, None, (2, 36), None),  # no THP (not Linux)
    ({}, "madvise", (2, 34), None),  # glibc before the tunable existed
    ({}, "madvise", None, None),  # musl / not glibc
])
def test_huge_page_env(environ, thp, glibc, want):
  env = hm.huge_page_env(environ, thp, glibc)
  if want is None:
    assert env is None
  else:
    assert env["GLIBC_TUNABLES"] == want
    assert {k: v for k, v in env.items() if k != "GLIBC_TUNABLES"} == {
        k: v for k, v in environ.items() if k != "GLIBC_TUNABLES"}


def test_thp_mode_reads_the_bracketed_mode(tmp_path):
  f = tmp_path / "enabled"
  f.write_text("always [madvise] never\n")
  assert hm.thp_mode(str(f)) == "madvise"
  f.write_text("[always] madvise never\n")
  assert hm.thp_mode(str(f)) == "always"
  assert hm.thp_mode(str(tmp_path / "missing")) is None


_PROBE = textwrap.dedent("""
    import resource, sys
    from moonshot_jax import host_memory
    host_memory.reexec_with_huge_pages()
    import jax, jax.numpy as jnp
    f = jax.jit(lambda x: x * 2 + 1)  # a fresh 64 MB output each call: glibc mmaps it (> 32 MB)
    x = jnp.ones((16 * 2**20,), jnp.float32)
    f(x).block_until_ready()
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
      f(x).block_until_ready()
    print("FAULTS", (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) // 4, host_memory.describe())
""")


def _faults_per_call(opt_out: bool) -> tuple[int, str]:
  env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, **{hm.OPT_OUT: "0" if opt_out else "1"})
  out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  line = [ln for ln in out.stdout.splitlines() if ln.startswith("FAULTS")][-1]
  return int(line.split()[1]), line.split(" ", 2)[2]


@pytest.mark.skipif(hm.thp_mode() != "madvise" or (hm.glibc_version() or (0, 0)) < (2, 35),
                    reason="needs Linux THP in madvise mode and glibc >= 2.35")
def test_reexec_removes_most_page_faults_of_fresh_xla_buffers():
  plain, plain_desc = _faults_per_call(opt_out=True)
  huge, huge_desc = _faults_per_call(opt_out=False)
  assert "4 KB pages" in plain_desc and hm.TUNABLE in huge_desc
  # 64 MB in 4 KB pages is 16384 faults per call; in 2 MB pages, 32
  assert plain > 8000, plain
  assert huge < plain / 20, (huge, plain)
