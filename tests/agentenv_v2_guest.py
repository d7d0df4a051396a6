"""Runs inside a cgroup-v2-only guest kernel (see test_agentenv_cgroup2_vm.py): real memory.max / pids.max
enforcement, kill, freeze and cleanup by agentenv's v2 backend. Prints one JSON line prefixed RESULT."""
import glob
import json
import os
import sys
import time

from moonshot_jax import agentenv
from tests.agentenv_programs import BOMB, FORK_COUNT


def events(path, name):
  with open(f"{path}/{name}") as f:
    return dict(line.split() for line in f)


def main():
  out = {}
  sb = agentenv.create(limits=agentenv.Limits(memory_mb=64, pids=24))
  other = agentenv.create()
  info = sb.info()
  out["info"] = info
  v2 = info["cgroup_v2"]
  out["cmd_cgroup"] = sb.exec("cat /proc/self/cgroup").text.strip()
  out["memory_max"] = open(f"{v2}/agent/memory.max").read().strip()
  out["pids_max"] = open(f"{v2}/pids.max").read().strip()
  mem = sb.exec(["python3", "-c", BOMB], timeout=60)
  out["mem_exit"] = mem.exit_code
  out["mem_last"] = int(mem.text.split()[-1]) if mem.text.split() else -1
  out["agent_oom_kill"] = int(events(f"{v2}/agent", "memory.events")["oom_kill"])
  forks = sb.exec(["python3", "-c", FORK_COUNT], timeout=60)
  out["forks"] = forks.text.split()
  out["pids_events_max"] = int(events(v2, "pids.events")["max"])
  out["after"] = sb.exec("echo ok").text
  out["other"] = other.exec("echo ok").text
  sb.start_service("kv", agentenv.services.KV)
  sb.pause()
  out["frozen"] = events(v2, "cgroup.events")["frozen"]
  sb.resume()
  out["thawed_call"] = sb.call_service("kv", "INCR n")
  pids = [int(p) for p in open(f"{v2}/sys/cgroup.procs").read().split()]
  sb.close()
  other.close()
  deadline = time.time() + 10
  while time.time() < deadline and (any(os.path.exists(f"/proc/{p}") for p in pids) or os.path.exists(v2)):
    time.sleep(0.05)
  out["alive_after_close"] = [p for p in pids if os.path.exists(f"/proc/{p}")]
  out["sb_cgroup_left"] = os.path.exists(v2)
  hub = agentenv.sandbox._Hub.get()
  hub.proc.kill()  # SIGKILL the hub: its reaper must still remove the hub's cgroup
  hub.proc.wait()
  deadline = time.time() + 10
  while time.time() < deadline and glob.glob("/sys/fs/cgroup/**/agentenv-*", recursive=True):
    time.sleep(0.05)
  out["agentenv_cgroups_left"] = glob.glob("/sys/fs/cgroup/**/agentenv-*", recursive=True)
  print("RESULT " + json.dumps(out))


if __name__ == "__main__":
  sys.exit(main())
