"""nice -n 10 python -m launch.bench_import --out=/work/k3_big [--moe_layers=2 --experts=128] [--keep]

Writes a K3-layout hub checkpoint of full-width K3 layers (d_model 7168, 96 KDA / MLA heads, dense
ff 33792, experts ff 3072 in the 3584-wide latent, shared 6144, vocab 163840; routed experts MXFP4,
the rest bf16) with fewer layers and experts -- layer 1 dense KDA, then --moe_layers MoE layers,
the last one MLA: ~12 GB at the defaults -- into --out (sharded <= --shard_gb), then imports it in
a child process: header validation, then every leaf read memory-mapped, MXFP4 dequantised and
converted to its bf16 leaf, one leaf in memory at a time (`hub_stream.load_variables(...,
materialize=False)`: the reading side of an import, without the device placement). Prints a table:
hub GB, largest shard, child peak RSS (ru_maxrss), RSS / largest shard, seconds, MB/s read.
Deletes --out at the end unless --keep. Heavy disk I/O: run it once, niced.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

_OUT = flags.DEFINE_string("out", "/work/k3_big", "where the checkpoint is written (deleted after)")
_MOE = flags.DEFINE_integer("moe_layers", 2, "MoE layers after the dense layer 1")
_EXPERTS = flags.DEFINE_integer("experts", 128, "routed experts per MoE layer")
_SHARD_GB = flags.DEFINE_float("shard_gb", 3.0, "largest shard written")
_KEEP = flags.DEFINE_bool("keep", False, "keep the checkpoint")
_CHILD = flags.DEFINE_bool("child", False, "internal: be the measured import")


def bench_config(moe_layers: int, experts: int):
  from moonshot_jax import experiment
  from moonshot_jax.config import ModelConfig
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
  import importlib.util
  spec = importlib.util.spec_from_file_location("k3", Path(__file__).resolve().parents[1] / "experiments/k3.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  k3 = experiment.model_config(mod.get_config())
  n = 1 + moe_layers
  return k3.replace(n_layers=n, mla_layers=(n,), dense_layers=(1,), num_experts=experts,
                    num_experts_per_tok=min(16, experts), param_dtype="bfloat16", attn_res_block_size=2)


def write(cfg, out: Path, shard_bytes: int) -> dict:
  """Random but well-formed tensors (bf16 in +-[2^-7, 2^-6), MXFP4 bytes with scale 2^-7)."""
  import ml_dtypes
  import numpy as np
  from safetensors.numpy import save_file

  from moonshot_jax.inference import hf_k3
  rng = np.random.default_rng(0)
  out.mkdir(parents=True)
  cur, cur_b, shards = {}, 0, []

  def flush():
    nonlocal cur, cur_b
    if cur:
      name = f"model-{len(shards) + 1:05d}.safetensors"
      save_file(cur, str(out / name))
      shards.append((name, list(cur)))
      cur, cur_b = {}, 0

  seen = set()
  for pc in hf_k3.pieces(cfg, experts_mxfp4=True):
    for name, shape in pc.hub:
      if name in seen:
        continue
      seen.add(name)
      n = int(np.prod(shape))
      if name.endswith("_scale"):
        a = np.full(shape, 120, np.uint8)
      elif name.endswith("_packed"):
        a = rng.integers(0, 256, size=shape, dtype=np.uint8)
      elif name.endswith("A_log"):
        a = np.zeros(shape, np.float32)
      else:
        bits = (rng.integers(0, 1 << 16, size=n, dtype=np.uint16) & np.uint16(0x807F)) | np.uint16(0x3C00)
        a = bits.view(ml_dtypes.bfloat16).reshape(shape)
      if cur_b + a.nbytes > shard_bytes:
        flush()
      cur[name], cur_b = a, cur_b + a.nbytes
  flush()
  wm = {}
  for k, (name, names) in enumerate(shards):
    final = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
    os.replace(out / name, out / final)
    wm.update({t: final for t in names})
  (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
  (out / "config.json").write_text(json.dumps({"model_type": "kimi_k3",
                                               "text_config": hf_k3.text_config_for(cfg, True)}))
  sizes = [(out / f).stat().st_size for f in set(wm.values())]
  return {"bytes": sum(sizes), "largest_shard": max(sizes), "shards": len(sizes)}


def child(out: Path, cfg) -> None:
  from moonshot_jax.inference import hf_k3, hub_stream
  t0 = time.time()
  hub = hub_stream.HubDir(out)
  hf_k3.check_against(cfg, hf_k3.architecture(hf_k3.split_config(hub.config)[0]))
  report = hub_stream.validate(hub, cfg)
  t_val = time.time() - t0
  hub_stream.load_variables(hub, cfg, report=report, progress=False, materialize=False)
  dt = time.time() - t0
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  print(json.dumps({"seconds": dt, "validate_s": t_val, "read_bytes": hub.bytes_read, "peak_rss": rss}), flush=True)


def main(argv) -> None:
  del argv
  cfg = bench_config(_MOE.value, _EXPERTS.value)
  out = Path(_OUT.value)
  if _CHILD.value:
    child(out, cfg)
    return
  if out.exists():
    raise app.UsageError(f"--out={out} exists; remove it or choose another path")
  try:
    t0 = time.time()
    info = write(cfg, out, int(_SHARD_GB.value * 2 ** 30))
    t_write = time.time() - t0
    os.system("sync")
    r = subprocess.run([sys.executable, "-m", "launch.bench_import", "--child", f"--out={out}",
                        f"--moe_layers={_MOE.value}", f"--experts={_EXPERTS.value}"],
                       capture_output=True, text=True, cwd=str(Path(__file__).resolve().parents[1]))
    if r.returncode:
      raise SystemExit(f"child failed:\n{r.stderr[-3000:]}")
    m = json.loads(r.stdout.strip().splitlines()[-1])
    load = os.getloadavg()
    rows = [("hub checkpoint", f"{info['bytes'] / 1e9:.2f} GB in {info['shards']} shards (written in {t_write:.0f} s)"),
            ("largest shard", f"{info['largest_shard'] / 1e9:.2f} GB"),
            ("import peak RSS", f"{m['peak_rss'] / 1e9:.2f} GB = {m['peak_rss'] / info['largest_shard']:.2f} x largest shard"),
            ("import time", f"{m['seconds']:.1f} s (header validation {m['validate_s']:.1f} s)"),
            ("import read rate", f"{m['read_bytes'] / m['seconds'] / 1e6:.0f} MB/s of {m['read_bytes'] / 1e9:.2f} GB"),
            ("load average", " ".join(f"{x:.1f}" for x in load))]
    for k, v in rows:
      print(f"{k:<18}{v}")
    print(json.dumps({**info, **m, "load": load}))
  finally:
    if not _KEEP.value and out.exists():
      shutil.rmtree(out)


if __name__ == "__main__":
  app.run(main)
