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
