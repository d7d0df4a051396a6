"""python -m launch.profile_import --hf_dir=HUB --workdir=RUN --moe_layers=1 --experts=128 [--vocab=0 --dense_ff=0]
       python -m launch.profile_import --write=HUB --moe_layers=1 --experts=32   (only writes a bench hub)

Where an import's time and host memory go. Runs `hub_checkpoint.run_import` in this process on a
hub written by launch.bench_import (same shape flags), with every stage of the import wrapped by a
timer, and a thread sampling /proc/self/status (VmRSS, RssAnon, RssFile) every 50 ms together with
the stage and leaf being worked on. Prints: seconds per stage (exclusive: a stage's time minus the
stages it calls), the RSS peak with what was running at that moment, each leaf's peak RSS, and an
RSS timeline (one line per second). Only this tool wraps anything; the import code is unchanged.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from launch import bench_import  # noqa: E402  (defines the shape flags)

_HF_DIR = flags.DEFINE_string("hf_dir", None, "hub checkpoint to import (written by --write or launch.bench_import)")
_WORKDIR = flags.DEFINE_string("workdir", None, "import run directory (must not hold a checkpoint)")
_WRITE = flags.DEFINE_string("write", None, "only write a bench hub checkpoint here and exit")
_JSON = flags.DEFINE_string("json", None, "also write the samples and stage totals here")
_LOOKAHEAD = flags.DEFINE_bool("lookahead", True, "checkpoint._LOOKAHEAD: make the next slab in a worker thread")
# --moe_layers, --experts, --vocab, --dense_ff, --shard_gb, --codec: launch.bench_import's flags

_PAGE = os.sysconf("SC_PAGE_SIZE")


class Profile:
  """Exclusive time per stage (per thread: nested stages subtract from their caller) and RSS samples
  tagged with every thread's current stage and the leaf being built / written."""

  def __init__(self):
    self.t0 = time.time()
    self.total = collections.Counter()
    self.calls = collections.Counter()
    self.stacks: dict[int, list[list]] = {}
    self.leaf = "-"
    self.samples: list[tuple[float, int, int, int, str, str]] = []
    self._stop = threading.Event()

  @contextlib.contextmanager
  def stage(self, name):
    stack = self.stacks.setdefault(threading.get_ident(), [])
    entry = [name, time.perf_counter(), 0.0]  # name, start, time spent in nested stages
    stack.append(entry)
    try:
      yield
    finally:
      dt = time.perf_counter() - entry[1]
      stack.pop()
      self.total[name] += dt - entry[2]
      self.calls[name] += 1
      if stack:
        stack[-1][2] += dt

  def wrap(self, owner, attr, name, is_async=False):
    fn = getattr(owner, attr)
    if is_async:
      @functools.wraps(fn)
      async def w(*a, **k):
        with self.stage(name):
          return await fn(*a, **k)
    else:
      @functools.wraps(fn)
      def w(*a, **k):
        with self.stage(name):
          return fn(*a, **k)
    setattr(owner, attr, w)

  def now(self) -> str:
    return "+".join(s[-1][0] for s in list(self.stacks.values()) if s) or "-"

  def sample_forever(self):
    while not self._stop.is_set():
      rss = anon = file = 0
      with open("/proc/self/status") as f:
        for line in f:
          if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
          elif line.startswith("RssAnon:"):
            anon = int(line.split()[1]) * 1024
          elif line.startswith("RssFile:"):
            file = int(line.split()[1]) * 1024
      self.samples.append((time.time() - self.t0, rss, anon, file, self.now(), self.leaf))
      self._stop.wait(0.05)

  def start(self):
    self._thread = threading.Thread(target=self.sample_forever, daemon=True)
    self._thread.start()

  def stop(self):
    self._stop.set()
    self._thread.join()


def instrument(prof: Profile) -> None:
  """Wraps the import's stages (module attributes looked up at call time)."""
  import numpy as np
  from moonshot_jax.inference import hub_checkpoint, hub_stream
  from moonshot_jax.train import checkpoint
  from orbax.checkpoint._src.serialization import jax_array_handlers

  prof.wrap(hub_stream.HubDir, "read", "safetensors read")
  prof.wrap(hub_stream, "_all_finite", "finite check")
  prof.wrap(hub_stream, "piece_value", "dequant / transpose / cast")
  if hasattr(hub_stream, "piece_slab"):
    prof.wrap(hub_stream, "piece_slab", "MXFP4 decode+T+sum (one XLA call)")
  prof.wrap(hub_stream, "copy_tiled", "copy into leaf")
  prof.wrap(hub_stream, "validate", "validate headers")
  prof.wrap(hub_checkpoint, "_filled", "optimizer fill")
  fp = checkpoint._leaf_fingerprint

  def leaf_fingerprint(x):  # jitted: block so that its time is its own
    with prof.stage("fingerprint"):
      return fp(x).block_until_ready()
  checkpoint._leaf_fingerprint = leaf_fingerprint
  prof.wrap(jax_array_handlers.ArrayHandler, "serialize", "orbax serialize (d2h, issue)", is_async=True)
  for mod, attr, name in ((np, "save", "cache write"), (np, "load", "cache read")):
    prof.wrap(mod, attr, name)
  build = hub_stream.LeafBuilder.build

  def leaf_build(self):
    prof.leaf = self.name
    with prof.stage("make_array (device put)"):
      return build(self)
  hub_stream.LeafBuilder.build = leaf_build
  # the wait for a leaf's bytes to be committed: concurrent.futures.Future.result run in a thread
  # by _LazyArrayHandler.serialize (asyncio.to_thread(f.result))
  import asyncio
  to_thread = asyncio.to_thread

  async def timed_to_thread(fn, *a, **k):
    with prof.stage("orbax commit wait (tensorstore write)"):
      return await to_thread(fn, *a, **k)
  checkpoint.asyncio = type(sys)("asyncio_profiled")
  checkpoint.asyncio.__dict__.update(asyncio.__dict__)
  checkpoint.asyncio.to_thread = timed_to_thread
  if hasattr(checkpoint._LazyArrayHandler, "_write_slabs"):  # the streamed (slab) writer
    write_slabs = checkpoint._LazyArrayHandler._write_slabs

    async def timed_write_slabs(self, leaf, info, metadata_only):
      prof.leaf = info.name
      with prof.stage("tensorstore write (wait) + loop"):
        return await write_slabs(self, leaf, info, metadata_only)
    checkpoint._LazyArrayHandler._write_slabs = timed_write_slabs
    prof.wrap(checkpoint, "_tiled_contiguous", "chunk copy (contiguous)")
  ser = checkpoint._LazyArrayHandler.serialize

  async def serialize(self, values, infos, args=None):
    prof.leaf = "(lazy leaves)"
    return await ser(self, values, infos, args)
  checkpoint._LazyArrayHandler.serialize = serialize


def report(prof: Profile, wall: float, hub_bytes: int, largest: int) -> dict:
  rows = sorted(prof.total.items(), key=lambda kv: -kv[1])
  accounted = sum(prof.total.values())
  print(f"\nimport wall {wall:.1f} s, {hub_bytes / 1e9:.2f} GB hub -> {hub_bytes / wall / 1e6:.0f} MB/s; "
        f"largest shard {largest / 1e9:.2f} GB")
  print(f"{'stage':<40}{'s':>8}{'share':>8}{'calls':>8}")
  for k, v in rows:
    print(f"{k:<40}{v:8.1f}{v / wall:8.1%}{prof.calls[k]:8d}")
  print(f"{'(not in a stage: setup, jax, orbax)':<40}{wall - accounted:8.1f}{(wall - accounted) / wall:8.1%}")
  s = prof.samples
  peak = max(s, key=lambda r: r[1])
  print(f"\npeak RSS {peak[1] / 1e9:.2f} GB = {peak[1] / largest:.2f} x largest shard "
        f"(anon {peak[2] / 1e9:.2f}, file {peak[3] / 1e9:.2f}) at t={peak[0]:.1f} s in [{peak[4]}] leaf {peak[5]}")
  per_leaf: dict[str, tuple[int, int, int]] = {}
  for t, rss, anon, file, st, leaf in s:
    if rss > per_leaf.get(leaf, (0,))[0]:
      per_leaf[leaf] = (rss, anon, file)
  print("\nleaves by peak RSS while built / written (top 12):")
  for leaf, (rss, anon, file) in sorted(per_leaf.items(), key=lambda kv: -kv[1][0])[:12]:
    print(f"  {rss / 1e9:6.2f} GB (anon {anon / 1e9:5.2f}, file {file / 1e9:5.2f})  {leaf}")
  print("\ntimeline (max per second): t  rss  anon  file  stage  leaf")
  by_sec: dict[int, tuple] = {}
  for r in s:
    k = int(r[0])
    if r[1] >= by_sec.get(k, (0, 0))[1]:
      by_sec[k] = r
  for k in sorted(by_sec):
    t, rss, anon, file, st, leaf = by_sec[k]
    print(f"  {t:6.1f} {rss / 1e9:6.2f} {anon / 1e9:6.2f} {file / 1e9:6.2f}  {st}  {leaf}")
  return {"wall": wall, "stages": dict(prof.total), "calls": dict(prof.calls), "peak_rss": peak[1],
          "largest_shard": largest, "samples": s}


def main(argv) -> None:
  del argv
  b = bench_import
  cfg = b.bench_config(b._MOE.value, b._EXPERTS.value, b._VOCAB.value, b._DENSE_FF.value)
  if _WRITE.value:
    print(json.dumps(b.write(cfg, Path(_WRITE.value), int(b._SHARD_GB.value * 2 ** 30))))
    return
  if not _HF_DIR.value or not _WORKDIR.value:
    raise app.UsageError("--hf_dir and --workdir are required (or --write)")
  exp = bench_import.experiment_config(cfg)
  from moonshot_jax.inference import hub_checkpoint, hub_stream
  from moonshot_jax.train import checkpoint
  checkpoint._LOOKAHEAD = _LOOKAHEAD.value
  prof = Profile()
  instrument(prof)
  hub = hub_stream.HubDir(_HF_DIR.value)
  largest = hub.largest_shard_bytes
  hub.close()
  prof.start()
  t0 = time.time()
  out = hub_checkpoint.run_import(exp, _HF_DIR.value, _WORKDIR.value, progress=False,
                                 **({"codec": b._CODEC.value} if b._CODEC.value else {}))
  wall = time.time() - t0
  prof.stop()
  print(json.dumps(out))
  res = report(prof, wall, out["bytes"], largest)
  if _JSON.value:
    Path(_JSON.value).write_text(json.dumps(res))


if __name__ == "__main__":
  app.run(main)
