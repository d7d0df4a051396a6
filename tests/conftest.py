"""Test-wide setup: 8 fake CPU devices for mesh tests, fp32 matmuls at full precision."""
import os

# XLA:CPU backend -O0: compiles dominate the fast tier and the backend's LLVM passes are about a
# third of them (tiny's 5-step ZeRO-3 test 41.7 -> 28.1 CPU-s). A user's own XLA_FLAGS win
# (setdefault); the train_loop / launch_cli subprocesses and the KDA kernel tests already ran at -O0.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu (the test extra installs it for the tpu_aot tests) would query the GCE metadata server first
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # subprocesses compile for TPU too

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# Non-partitionable threefry compiles random init several times faster on CPU; tests need no sharded RNG.
try:
  jax.config.update("jax_threefry_partitionable", False)
except AttributeError:  # flag retired in some later jax
  pass

# PyPI's torchvision (the K2.5 image-processor oracle) imports only through this beside torch's CPU wheel.
from tests import torchvision_shim  # noqa: E402

torchvision_shim.install()


# Seconds per test file in the fast tier (session 22, `-n 2 --durations=0`, 2-core box at load ~6: only the
# ratios matter). setup.cfg runs the files on 2 workers (--dist loadfile) in collection order; starting the
# longest ones first keeps one of them from being the last thing running. Files not listed go after, as found.
FILE_SECONDS = {
    "test_train_loop.py": 787, "test_parallel_model.py": 763, "test_moe.py": 415, "test_rl_rollout.py": 404,
    "test_notebooks.py": 391, "test_kda_ops.py": 324, "test_model.py": 313, "test_parallel_plan.py": 267,
    "test_vision_encoder.py": 254, "test_import_checkpoint.py": 183, "test_inference.py": 172,
    "test_vision_k3.py": 155, "test_parallel_expert.py": 142,
}


def pytest_collection_modifyitems(items):
  items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))  # stable: order within a file is kept
