"""Two processes on localhost (jax.distributed + gloo CPU collectives, 2 x 4 devices) train tiny,
checkpoint, get restarted, resume, and log the same losses as one process with 8 devices.

Slow: three training runs, each compiling the train step (several minutes on a busy machine).
"""
import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH = dict(pipeline=1, data=2, expert=4, tensor=1)  # experts split inside each host's 4 devices

_WORKER = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    try:  # same RNG implementation as tests/conftest.py, so the init matches the 1-process run
      jax.config.update("jax_threefry_partitionable", {partitionable})
    except AttributeError:
      pass
    from moonshot_jax.parallel.mesh import initialize_distributed
    addr, pid, workdir, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    initialize_distributed(addr, num_processes=2, process_id=pid, cpu_collectives="gloo")
    assert jax.device_count() == 8 and jax.local_device_count() == 4, jax.devices()
    sys.path.insert(0, {root!r})
    from tests.test_parallel_multihost import config
    from moonshot_jax.train import loop
    summary = loop.train(config(steps), workdir)
    print("DONE", pid, summary["start_step"], summary["final_step"], flush=True)
""")


def config(steps: int):
  """tiny, MESH, `steps` steps, a checkpoint every 3 steps, no eval / tensorboard."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("tiny", os.path.join(ROOT, "experiments", "tiny.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  cfg = mod.get_config()
  cfg.unlock()
  for k, v in MESH.items():
    cfg.mesh[k] = v
  cfg.mesh.capacity_factor = 8.0  # = num_experts: no overflow, so dispatch is exact
  cfg.train.steps, cfg.train.eval_every, cfg.train.log_every = steps, 0, 1
  # a constant LR: the 3-step first leg and the 6-step resumed run share one schedule
  cfg.optimizer.schedule, cfg.optimizer.warmup_steps = "constant", 0
  cfg.checkpoint.every_steps, cfg.checkpoint.async_save = 3, False
  cfg.logging.tensorboard, cfg.logging.progress_bar = False, False
  cfg.lock()
  return cfg


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _run_two_processes(workdir: str, steps: int) -> list[str]:
  addr = f"localhost:{_free_port()}"
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)
  import jax
  code = _WORKER.format(root=ROOT, partitionable=bool(getattr(jax.config, "jax_threefry_partitionable", True)))
  procs = [subprocess.Popen([sys.executable, "-c", code, addr, str(pid), workdir, str(steps)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for pid in range(2)]
  outs = []
  for p in procs:
    try:
      out, _ = p.communicate(timeout=1500)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
    outs.append(out)
    assert p.returncode == 0, out[-4000:]
  return outs


def _losses(workdir: str) -> dict[int, float]:
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  return {int(r["step"]): float(r["loss"]) for r in rows if "loss" in r}


@pytest.mark.slow
def test_two_processes_train_checkpoint_resume_match_one_process(tmp_path):
  from moonshot_jax.train import loop

  ref_dir = str(tmp_path / "one_process")
  loop.train(config(6), ref_dir)  # this pytest process: 8 fake devices
  ref = _losses(ref_dir)
  two = str(tmp_path / "two_processes")
  first = _run_two_processes(two, 3)
  assert all("DONE" in o and " 0 3" in o for o in first), first
  second = _run_two_processes(two, 6)  # restarted: resumes from the step-3 checkpoint
  assert all("resumed from step 3" in o or "DONE 1 3 6" in o for o in second), second
  got = _losses(two)
  assert sorted(got) == sorted(ref) == list(range(1, 7))
  np.testing.assert_allclose([got[s] for s in range(1, 7)], [ref[s] for s in range(1, 7)], rtol=1e-5)
