"""python launch/bench_agentenv.py [--n=200] [--files=10,100,1000,10000] [--idle=256] [--quick]

AgentEnv latency and memory (root + user/mount/pid/net namespaces needed). Prints three tables:
1. p50 / p90 / p99 of create, exec `true`, snapshot (after one file written), snapshot (unchanged),
   restore and fork (per child, forks of 8) of a sandbox running a key-value service ("+svc") and of one
   without, service call, close, next to AgentENV's published Firecracker numbers (restore 49 ms, snapshot
   133 ms, fork 122 ms per child) and this issue's goals.
2. The files-written curve: snapshot / restore / fork / exec p50 after the sandbox wrote 10 ... 10,000 files
   (goal: flat; layer stacking never copies or walks the files).
3. Memory per idle sandbox with --idle sandboxes up: host MemAvailable drop / N, and the sandboxes' own cgroup
   charge / N (goal: 256 within 2 GiB); and the CPU they (hub and helpers included) use while idle.
Quick check: --quick (n=30, files 10,1000, idle 32).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moonshot_jax import agentenv  # noqa: E402

AGENTENV_MS = {"restore +svc": 49.0, "restore": 49.0, "snapshot": 133.0, "fork/child +svc": 122.0,
               "fork/child": 122.0}
GOAL_MS = {"create": 50.0, "exec true": 10.0, "snapshot": 10.0, "snapshot unchanged": 10.0, "restore +svc": 10.0,
           "restore": 10.0, "fork/child +svc": 10.0, "fork/child": 10.0}
IDLE_CPU_S = 2.0
WRITE_FILES = "import os\nn = int(os.environ['N'])\nos.makedirs('w', exist_ok=True)\n" \
              "for i in range(n):\n    open(f'w/f{i}', 'w').write(str(i))\n"


def pct(xs, q):
  xs = sorted(xs)
  return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def timed(fn):
  t = time.perf_counter()
  out = fn()
  return (time.perf_counter() - t) * 1e3, out


def latencies(n):
  ms = {k: [] for k in ("create", "exec true", "snapshot", "snapshot unchanged", "restore +svc", "restore",
                        "fork/child +svc", "fork/child", "service call", "close")}
  plain = agentenv.create()  # no service: restore / fork are pure layer operations
  base = agentenv.create()
  base.start_service("kv", agentenv.services.KV)
  base.call_service("kv", "SET a 1")
  for i in range(n):
    t, sb = timed(agentenv.create)
    ms["create"].append(t)
    ms["exec true"].append(timed(lambda: sb.exec("true"))[0])
    ms["close"].append(timed(sb.close)[0])
    base.write_file(f"f{i % 7}", str(i))
    t, snap = timed(base.snapshot)
    ms["snapshot"].append(t)
    ms["snapshot unchanged"].append(timed(base.snapshot)[0])
    base.write_file("junk", "x")
    ms["restore +svc"].append(timed(lambda: base.restore(snap))[0])
    ms["service call"].append(timed(lambda: base.call_service("kv", "GET a"))[0])
    plain.write_file(f"f{i % 7}", str(i))
    plain_snap = plain.snapshot()
    plain.write_file("junk", "x")
    ms["restore"].append(timed(lambda: plain.restore(plain_snap))[0])
    plain.drop_snapshot(plain_snap)
    if i % 8 == 0:
      for box, key in ((base, "fork/child +svc"), (plain, "fork/child")):
        t, kids = timed(lambda: box.fork(8))
        ms[key].extend([t / 8] * 8)
        for k in kids:
          k.close()
    if i % 20 == 19:  # keep the snapshot list (and its service images) bounded
      base.close()
      base = agentenv.create()
      base.start_service("kv", agentenv.services.KV)
  base.close()
  plain.close()
  return ms


def files_curve(counts, n):
  rows = []
  for c in counts:
    sb = agentenv.create()
    r = sb.exec(["python3", "-c", WRITE_FILES], env={"N": str(c)}, timeout=600)
    assert r.ok, r
    snap_ms, rest_ms, fork_ms, exec_ms = [], [], [], []
    for i in range(n):
      sb.write_file("touch", str(i))  # a change, so every snapshot really freezes a layer
      t, snap = timed(sb.snapshot)
      snap_ms.append(t)
      rest_ms.append(timed(lambda: sb.restore(snap))[0])
      exec_ms.append(timed(lambda: sb.exec("true"))[0])
      if i % 4 == 0:
        t, kids = timed(lambda: sb.fork(2))
        fork_ms.append(t / 2)
        for k in kids:
          k.close()
      sb.drop_snapshot(snap)
    assert sb.exec(f"ls w | wc -l").text.strip() == str(c)
    sb.close()
    rows.append((c, *(statistics.median(x) for x in (snap_ms, rest_ms, fork_ms, exec_ms))))
  return rows


def mem_available():
  for line in open("/proc/meminfo"):
    if line.startswith("MemAvailable:"):
      return int(line.split()[1]) << 10
  raise RuntimeError("no MemAvailable in /proc/meminfo")


def hub_pids(hub):
  """The hub and every process in its cgroups (inits, commands, services, helpers)."""
  out = []
  for pid in os.listdir("/proc"):
    try:
      if pid.isdigit() and (int(pid) == hub or f"agentenv-{hub}/" in open(f"/proc/{pid}/cgroup").read()):
        out.append(int(pid))
    except OSError:
      pass
  return out


def cpu_ns(hub):
  """CPU time (ns) used so far by the hub's processes (the hub, its helpers, and the sandboxes' processes)."""
  total = 0
  pids = set(hub_pids(hub))
  for pid in os.listdir("/proc"):  # helpers (zygote, unmounter) are the hub's children outside any cgroup
    try:
      if pid.isdigit() and int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]) == hub:
        pids.add(int(pid))
    except OSError:
      pass
  for pid in pids:
    try:
      total += int(open(f"/proc/{pid}/schedstat").read().split()[0])
    except OSError:
      pass
  return total


def idle_memory(n):
  agentenv.hub_stats()  # hub up before the baseline
  time.sleep(0.5)
  before = mem_available()
  sbs = []
  t0 = time.perf_counter()
  for _ in range(n):
    sbs.append(agentenv.create())
  t_create = time.perf_counter() - t0
  assert all(sb.exec("true").ok for sb in sbs[:: max(1, n // 16)])
  time.sleep(0.5)
  after = mem_available()
  hub = agentenv.sandbox._Hub.get().hub_pid
  cg_root = f"/sys/fs/cgroup/memory/agentenv-{hub}"
  charged = 0
  if os.path.isdir(cg_root):
    for d in os.listdir(cg_root):
      p = f"{cg_root}/{d}/memory.usage_in_bytes"
      if os.path.exists(p):
        charged += int(open(p).read())
  pss = 0  # proportional set size of every process of this hub (hub, inits, their shared pages split fairly)
  for pid in hub_pids(hub):
    try:
      for line in open(f"/proc/{pid}/smaps_rollup"):
        if line.startswith("Pss:"):
          pss += int(line.split()[1]) << 10
    except OSError:
      pass
  cpu0 = cpu_ns(hub)  # nothing asked of the sandboxes meanwhile: the hub and every sandbox process should sleep
  time.sleep(IDLE_CPU_S)
  idle_cpu = (cpu_ns(hub) - cpu0) / IDLE_CPU_S / 1e6
  for sb in sbs:
    sb.close()
  return (before - after) / n, charged / n, pss / n, t_create / n, idle_cpu


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[2])
  ap.add_argument("--n", type=int, default=200)
  ap.add_argument("--files", default="10,100,1000,10000")
  ap.add_argument("--idle", type=int, default=256)
  ap.add_argument("--quick", action="store_true")
  a = ap.parse_args(argv)
  if a.quick:
    a.n, a.files, a.idle = 30, "10,1000", 32
  counts = [int(x) for x in a.files.split(",") if x]
  print(f"# agentenv bench  n={a.n}  loadavg={open('/proc/loadavg').read().split()[:3]}  "
        f"cpus={os.cpu_count()}  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
  ms = latencies(a.n)
  print(f"\n{'op':<20}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'p99/p50':>9}{'goal p50':>10}{'AgentENV':>10}")
  for k, xs in ms.items():
    p50, p90, p99 = pct(xs, 50), pct(xs, 90), pct(xs, 99)
    goal = f"{GOAL_MS[k]:.0f}" if k in GOAL_MS else "-"
    ref = f"{AGENTENV_MS[k]:.0f}" if k in AGENTENV_MS else "-"
    print(f"{k:<20}{p50:>9.2f}{p90:>9.2f}{p99:>9.2f}{p99 / p50:>9.1f}{goal:>10}{ref:>10}")
  rows = files_curve(counts, max(8, a.n // 10))
  print(f"\n{'files written':>14}{'snapshot':>10}{'restore':>10}{'fork/child':>12}{'exec true':>11}   (p50 ms)")
  for c, s, r, f, e in rows:
    print(f"{c:>14}{s:>10.2f}{r:>10.2f}{f:>12.2f}{e:>11.2f}")
  host, charged, pss, t_create, idle_cpu = idle_memory(a.idle)
  print(f"\n{a.idle} idle sandboxes (goal: 256 within 2 GiB), MiB per sandbox and GiB for all:")
  for name, v in (("processes' PSS (hub included)", pss), ("cgroup charge (user + kernel memory)", charged),
                  ("host MemAvailable drop (noisy on a shared box)", host)):
    print(f"  {name:<48}{v / 2**20:>8.2f} MiB{v * a.idle / 2**30:>8.2f} GiB")
  print(f"  create with {a.idle} up: {t_create * 1e3:.1f} ms/sandbox")
  print(f"  CPU while idle (hub, helpers, all {a.idle} sandboxes; {IDLE_CPU_S:.0f} s): {idle_cpu:.2f} ms per s")


if __name__ == "__main__":
  main()
