"""python -m launch.import_checkpoint --hf_dir=/ckpt/Kimi-K3 --config=experiments/k3.py --workdir=runs/k3_ft
       python -m launch.import_checkpoint --config=experiments/k3.py --workdir=runs/k3_ft --export=/out/k3 \
           [--export_format=mxfp4|bf16] [--max_shard_gb=5]

Import: checks config.json's text_config against the experiment's model (every differing field is
named), validates every tensor of the hub checkpoint from the headers (missing / unknown / misshapen
/ mistyped tensors are named; vision and multi-token-prediction tensors are skipped by name and
listed), then builds the train state directly in the run's shardings -- each device's slice read
from its safetensors shard, so each host reads only what its devices hold -- and saves it as step 0
of WORKDIR/checkpoints. The zero optimizer state is not written (metadata + one chunk per array): the
step's meta marks it and the restore makes it. `launch.train` with the same
--config and --workdir fine-tunes from it (or RL: the same train state), `launch.generate` samples
from it. An interrupted import resumes: rerun the same command; the leaves already written (recorded
under WORKDIR/import_progress) are kept, the rest is read and written. A workdir that already holds checkpoints is refused (nothing is overwritten).
WORKDIR/hf_import.json records what was read and skipped, and the vision_config for the vision tower.

Export (--export=DIR): the newest checkpoint of WORKDIR back to the hub layout (config.json with a
K3 text_config, the vision_config recorded at import, sharded safetensors + index), routed experts
in MXFP4 (default, the released format) or bf16, other matrices bf16, vectors fp32. DIR must not exist.
Prints one JSON line at the end: what was done, bytes, seconds.
"""
from __future__ import annotations

import json
import os
import sys

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from moonshot_jax.inference.hub_checkpoint import run_export, run_import  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
_HF_DIR = flags.DEFINE_string("hf_dir", None, "hub checkpoint directory (config.json + *.safetensors)")
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (the checkpoint goes to WORKDIR/checkpoints)")
_EXPORT = flags.DEFINE_string("export", None, "export the newest checkpoint of WORKDIR to this new directory")
_FORMAT = flags.DEFINE_enum("export_format", "mxfp4", ["mxfp4", "bf16"], "routed experts' format on export")
_SHARD_GB = flags.DEFINE_float("max_shard_gb", 5.0, "largest safetensors shard written on export (GB)")
_SEED = flags.DEFINE_integer("seed", 0, "seed of the train state's RNG")
_CODEC = flags.DEFINE_enum("codec", "zstd", ["zstd", "lz4", "none"],
                           "chunk compressor of the imported params / moe_state (the zero optimizer state is "
                           "metadata + one chunk per array). zstd: orbax's level 1, smallest; none: raw, ~30% less CPU and time "
                           "on the 10 GB bench, ~2x the disk; lz4: blosc-lz4 + byte shuffle, half zstd's CPU on "
                           "decoded MXFP4 experts, half its ratio. The zarr metadata records it: any restore reads all three")


_CHUNK_WORKERS = flags.DEFINE_integer("chunk_workers", 1, "threads that transpose / fingerprint the chunks of a "
                                      "leaf, several at once (2: XLA's own intra-op threads are turned off, "
                                      "unless XLA_FLAGS names them); session 17: 2 was not consistently faster under load")


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if _CONFIG.value is None or not _WORKDIR.value:
    raise app.UsageError("--config and --workdir are required")
  if bool(_HF_DIR.value) == bool(_EXPORT.value):
    raise app.UsageError("give exactly one of --hf_dir (import) or --export (export)")
  if _HF_DIR.value:
    if _CHUNK_WORKERS.value > 1 and "xla_cpu_multi_thread_eigen" not in os.environ.get("XLA_FLAGS", ""):
      # before jax's backend starts: two transposes at once, each over XLA's own pool, only add spinning
      os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
    out = run_import(_CONFIG.value, _HF_DIR.value, _WORKDIR.value, seed=_SEED.value, codec=_CODEC.value,
                     chunk_workers=_CHUNK_WORKERS.value)
  else:
    out = run_export(_CONFIG.value, _WORKDIR.value, _EXPORT.value, experts_mxfp4=_FORMAT.value == "mxfp4",
                     max_shard_bytes=int(_SHARD_GB.value * 2 ** 30))
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  from moonshot_jax import host_memory
  host_memory.reexec_with_huge_pages()  # the import's fresh read / decode / transpose buffers fault in 2 MB pages
  app.run(main)
