"""AgentEnv: isolated agent sandboxes (Linux namespaces + overlayfs + cgroups) with millisecond
snapshot / restore / fork. See sandbox.py for the API and _hub.py / _init.py / _service.py for the mechanics."""
from . import services
from .pool import SandboxPool
from .sandbox import (ExecResult, Limits, Sandbox, SandboxClosedError, SandboxError, SnapshotNotFoundError, create,
           hub_stats)

__all__ = ["create", "Limits", "ExecResult", "Sandbox", "SandboxPool", "SandboxError", "SandboxClosedError",
     "SnapshotNotFoundError", "services", "hub_stats"]
