"""AgentEnv: isolated agent sandboxes (Linux namespaces + overlayfs + cgroups) with millisecond
snapshot / restore / fork. Needs root (user/mount/pid/net namespaces) and /usr/bin/python3 on the host.

  from moonshot_jax import agentenv
  with agentenv.create(files={"task.txt": "..."}, limits=agentenv.Limits(memory_mb=256)) as sb:
    r = sb.exec("cat task.txt && python3 -c 'print(6 * 7)'")   # ExecResult(stdout, stderr, exit_code, ...)
    sb.start_service("kv", agentenv.services.KV)               # in-sandbox: `svc kv GET a`
    snap = sb.snapshot()                                       # files + service memory
    kids = sb.fork(4)                                          # same state, reseeded randomness
    sb.restore(snap)
    sb.exec_python("/srv/check.py")  # = exec(["python3", "-I", "-S", ...]), run by a pre-started interpreter's fork
    sb.info()                  # where its limits live: v1 / v2 cgroups, or rlimits and why (AGENTENV_CGROUPS)

See sandbox.py for the API, pool.py for SandboxPool, and _hub.py / _init.py / _service.py for the mechanics
(launch/bench_agentenv.py measures it), _pyrun.py for exec_python, _cgroup.py for the cgroup v1 / v2 backends (pause() / resume() freeze
a sandbox through its v2 cgroup, else the v1 freezer)."""
from . import services
from .pool import SandboxPool
from .sandbox import (ExecResult, Limits, Sandbox, SandboxClosedError, SandboxError, SnapshotNotFoundError, create,
           drop_recycled, hub_stats)

__all__ = ["create", "Limits", "ExecResult", "Sandbox", "SandboxPool", "SandboxError", "SandboxClosedError",
     "SnapshotNotFoundError", "services", "hub_stats", "drop_recycled"]
