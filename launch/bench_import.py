"""nice -n 10 python -m launch.bench_import --out=/tmp/tpu/k3_big [--moe_layers=1 --experts=128] [--keep]

Writes a K3-layout hub checkpoint of full-width K3 layers (d_model 7168, 96 KDA / MLA heads, dense
ff 33792, experts ff 3072 in the 3584-wide latent, shared 6144, vocab 163840; routed experts MXFP4,
the rest bf16) with fewer layers and experts -- layer 1 dense KDA, then --moe_layers MoE layers,
the last one MLA: ~10 GB at --moe_layers=1 --experts=128 -- into --out (sharded <= --shard_gb), then
imports it with the real command in a child process,
  python -m launch.import_checkpoint --hf_dir=OUT --config=experiments/k3.py <the same shape as
      --config overrides, bf16 leaves, one device> --workdir=OUT_run
(header validation, every slab read from its shard, MXFP4 dequantised, written into the orbax train
state as it is read: hub_checkpoint.run_import). Prints a table: hub GB, largest shard, the child's
peak RSS (ru_maxrss of the children), RSS / largest shard, seconds, hub MB/s, checkpoint GB written.
Deletes OUT and OUT_run at the end unless --keep. Heavy disk I/O: run it once, niced.
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

_OUT = flags.DEFINE_string("out", "/tmp/tpu/k3_big", "where the hub checkpoint is written (OUT_run: the import; both deleted after)")
_MOE = flags.DEFINE_integer("moe_layers", 2, "MoE layers after the dense layer 1")
_EXPERTS = flags.DEFINE_integer("experts", 128, "routed experts per MoE layer")
_SHARD_GB = flags.DEFINE_float("shard_gb", 3.0, "largest shard written")
_KEEP = flags.DEFINE_bool("keep", False, "keep the checkpoint")
_CODEC = flags.DEFINE_string("codec", None, "passed to launch.import_checkpoint --codec (default: its default)")
_RUN = flags.DEFINE_string("run", None, "import run directory (default OUT_run)")
_CHUNK_WORKERS = flags.DEFINE_integer("chunk_workers", None, "passed to launch.import_checkpoint --chunk_workers")
_VOCAB = flags.DEFINE_integer("vocab", 0, "vocabulary size (0 = K3's 163840)")
_DENSE_FF = flags.DEFINE_integer("dense_ff", 0, "dense FFN width of layer 1 (0 = K3's 33792)")
_MEASURE_LOAD = flags.DEFINE_bool("measure_load", False, "after the import, peak RSS of launch.generate's "
                                  "--experts_mxfp4 load, new way and the old whole-train-state way (children)")
_LOAD_CHILD = flags.DEFINE_enum("load_child", None, ["new", "old"], "internal: be one measured load")
_PHASE = flags.DEFINE_enum("phase", "both", ["both", "write", "import"],
                           "write: only write --out (kept); import: only import an --out written before "
                           "(so the measured import can run alone on a quiet machine)")


def bench_config(moe_layers: int, experts: int, vocab: int = 0, dense_ff: int = 0):
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
                    num_experts_per_tok=min(16, experts), param_dtype="bfloat16", attn_res_block_size=2,
                    vocab_size=vocab or k3.vocab_size, dense_ff_dim=dense_ff or k3.dense_ff_dim)


def experiment_config(cfg):
  """experiments/k3.py with `cfg`'s shape on one device (what import_overrides gives the CLI)."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("k3", Path(__file__).resolve().parents[1] / "experiments/k3.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  exp = mod.get_config()
  for arg in import_overrides(cfg):
    key, value = arg[len("--config."):].split("=", 1)
    section, name = key.split(".")
    exp[section][name] = type(exp[section][name])(eval(value)) if not isinstance(exp[section][name], str) else value
  return exp


def load_child(kind: str, run: Path, cfg) -> None:
  """One way launch.generate --experts_mxfp4 loads the imported run; prints its peak RSS.
  new: load_latest(experts_mxfp4=True) (params + moe_state only, experts packed leaf by leaf);
  old: the whole train state restored, then every expert leaf packed (the session-12 path)."""
  from moonshot_jax.inference import mxfp4_experts
  from moonshot_jax.inference.load import load_latest
  exp = experiment_config(cfg)
  t0 = time.time()
  if kind == "new":
    loaded = load_latest(exp, run, with_tokenizer=False, experts_mxfp4=True)
    variables = loaded.variables
  else:
    from moonshot_jax.train.checkpoint import Checkpointer
    from moonshot_jax.train.loop import build
    ck = Checkpointer(run / "checkpoints", async_save=False)
    state, _, _ = ck.restore(ck.steps()[-1], build(exp).setup.abstract)
    ck.close()
    variables, _ = mxfp4_experts.quantize_experts({"params": state.params, "moe_state": state.moe_state}, cfg)
    del state
  acct = mxfp4_experts.bits_per_weight(variables)
  print(json.dumps({"kind": kind, "seconds": time.time() - t0, "bits": acct["expert_bits_per_weight"],
                    "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}), flush=True)


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


def import_overrides(cfg) -> list[str]:
  """--config overrides that turn experiments/k3.py into `cfg`'s shape on one device."""
  return [f"--config.model.n_layers={cfg.n_layers}", f"--config.model.mla_layers={tuple(cfg.mla_layers)}",
          f"--config.model.dense_layers={tuple(cfg.dense_layers)}", f"--config.model.num_experts={cfg.num_experts}",
          f"--config.model.num_experts_per_tok={cfg.num_experts_per_tok}",
          f"--config.model.param_dtype={cfg.param_dtype}",
          f"--config.model.attn_res_block_size={cfg.attn_res_block_size}",
          f"--config.model.vocab_size={cfg.vocab_size}", f"--config.model.dense_ff_dim={cfg.dense_ff_dim}",
          "--config.mesh.pipeline=1", "--config.mesh.expert=1", "--config.mesh.data=-1"]


def du(path: Path) -> int:
  return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv) -> None:
  del argv
  cfg = bench_config(_MOE.value, _EXPERTS.value, _VOCAB.value, _DENSE_FF.value)
  out = Path(_OUT.value)
  run = Path(_RUN.value) if _RUN.value else out.with_name(out.name + "_run")
  if _LOAD_CHILD.value:
    load_child(_LOAD_CHILD.value, run, cfg)
    return
  for p in (out, run) if _PHASE.value != "import" else (run,):
    if p.exists():
      raise app.UsageError(f"{p} exists; remove it or choose another --out")
  if _PHASE.value == "import" and not out.is_dir():
    raise app.UsageError(f"--phase=import: {out} does not exist (run --phase=write first)")
  keep = _KEEP.value or _PHASE.value == "write"
  try:
    t0 = time.time()
    if _PHASE.value == "import":
      sizes = [f.stat().st_size for f in out.glob("*.safetensors")]
      info = {"bytes": sum(sizes), "largest_shard": max(sizes), "shards": len(sizes)}
      t_write = float("nan")
    else:
      info = write(cfg, out, int(_SHARD_GB.value * 2 ** 30))
      t_write = time.time() - t0
      os.system("sync")
    if _PHASE.value == "write":
      print(json.dumps({**info, "write_s": t_write}))
      return
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "launch.import_checkpoint", f"--hf_dir={out}", "--config=experiments/k3.py",
           *import_overrides(cfg), f"--workdir={run}", *([f"--codec={_CODEC.value}"] if _CODEC.value else []),
           *([f"--chunk_workers={_CHUNK_WORKERS.value}"] if _CHUNK_WORKERS.value else [])]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=str(root))
    seconds = time.time() - t0
    if r.returncode:
      raise SystemExit(f"import failed ({' '.join(cmd)}):\n{r.stderr[-3000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    rss = ru.ru_maxrss * 1024
    written = du(run / "checkpoints")
    load = os.getloadavg()
    rows = [("hub checkpoint", f"{info['bytes'] / 1e9:.2f} GB in {info['shards']} shards (written in {t_write:.0f} s)"),
            ("largest shard", f"{info['largest_shard'] / 1e9:.2f} GB"),
            ("import peak RSS", f"{rss / 1e9:.2f} GB = {rss / info['largest_shard']:.2f} x largest shard"),
            ("import time", f"{seconds:.1f} s wall (read+write {res['read_write_s']:.1f} s)"),
            ("import rate", f"{info['bytes'] / seconds / 1e6:.0f} MB/s of hub bytes"),
            ("import CPU", f"{ru.ru_utime:.1f} s user + {ru.ru_stime:.1f} s sys, {ru.ru_minflt / 1e6:.2f} M minor "
                           f"faults (huge-page malloc {'off' if os.environ.get('MOONSHOT_HUGEPAGE_MALLOC') == '0' else 'on'})"),
            ("orbax written", f"{written / 1e9:.2f} GB"),
            ("load average", " ".join(f"{x:.1f}" for x in load))]
    loads = {}
    for kind in ("new", "old") if _MEASURE_LOAD.value else ():
      r = subprocess.run([sys.executable, "-m", "launch.bench_import", f"--load_child={kind}", f"--out={out}",
                          f"--moe_layers={_MOE.value}", f"--experts={_EXPERTS.value}", f"--vocab={_VOCAB.value}",
                          f"--dense_ff={_DENSE_FF.value}"], capture_output=True, text=True, cwd=str(root))
      if r.returncode:
        raise SystemExit(f"load child {kind} failed:\n{r.stderr[-3000:]}")
      loads[kind] = json.loads(r.stdout.strip().splitlines()[-1])
      label = {"new": "load, new", "old": "load, old"}[kind]
      rows.append((label, f"peak RSS {loads[kind]['peak_rss'] / 1e9:.2f} GB, {loads[kind]['seconds']:.1f} s, "
                          f"experts {loads[kind]['bits']:.2f} bits/weight"))
    for k, v in rows:
      print(f"{k:<18}{v}")
    print(json.dumps({**info, "import": res, "seconds": seconds, "peak_rss": rss,
                      "cpu_user_s": ru.ru_utime, "cpu_sys_s": ru.ru_stime, "minor_faults": ru.ru_minflt, "orbax_bytes": written,
                      "load": load, "loads": loads, "command": " ".join(cmd[1:])}))
  finally:
    for p in (out, run):
      if not keep and p.exists():
        shutil.rmtree(p)


if __name__ == "__main__":
  app.run(main)
