"""`backend="ray"`: the local sandbox API served by one sandbox-host actor per Ray node.

    sb = agentenv.create("python", backend="ray")          # or ray_backend.create(...)
    sb.exec("echo hi"); kids = sb.fork(4); sb.close()     # same calls as the local Sandbox

Each node runs one named host actor (`agentenv-host-<node id>`, namespace "agentenv", pinned to its node,
0 CPUs so it never blocks tasks) that owns that node's sandboxes in a dict keyed by id. A `RaySandbox`
is a small picklable handle (actor handle + sandbox id): a rollout worker anywhere in the cluster can
use it, and `fork` stays on the sandbox's node because the children share its copy-on-write layers.
`attach(sandbox_id)` rebuilds a handle from the id string alone ("<node id>/<n>").

A host actor belongs to the process that started it (the first `create` on that node; other processes
find it by name) and ends with that process, taking its sandboxes along: no orphans on a shared cluster.
Ray is imported only here, and only when backend="ray" is asked for; the local backend never needs it.
Errors: an exception raised by the local sandbox reaches the caller as that same class (Ray re-raises
the cause); a dead host actor becomes `agentenv.SandboxError`.
"""

from __future__ import annotations

import itertools
import os
import threading

NAMESPACE = "agentenv"
HOST_CONCURRENCY = 64  # concurrent calls per host actor: one slow exec must not stall the node's other sandboxes

_lock = threading.Lock()
_rr = itertools.count()
_host_cls = None
_hosts: dict = {}  # node id -> host actor handle (node ids are unique per cluster start)


def _ray():
  try:
    import ray
  except ImportError as e:  # a clear message instead of a bare ModuleNotFoundError deep in a rollout
    raise ImportError("agentenv backend='ray' needs Ray: pip install 'moonshot_jax[agentenv]' (or ray)") from e
  return ray


def _repo_root() -> str:
  import moonshot_jax

  return os.path.dirname(os.path.dirname(os.path.abspath(moonshot_jax.__file__)))


def init_local(num_cpus: int | None = None, **kw):
  """Starts a local Ray cluster (all CPUs unless `num_cpus`) whose workers import this checkout's
  moonshot_jax, not an installed copy. create() calls it when no Ray cluster is up yet."""
  ray = _ray()
  env = {"PYTHONPATH": os.pathsep.join(p for p in (_repo_root(), os.environ.get("PYTHONPATH")) if p)}
  kw.setdefault("include_dashboard", False)
  kw.setdefault("log_to_driver", False)
  return ray.init(num_cpus=num_cpus, runtime_env={"env_vars": env}, namespace=NAMESPACE, **kw)


class _SandboxHost:
  """The actor body: the local backend's sandboxes of one node, addressed by id."""

  def __init__(self, node_id: str):
    self.node_id, self.boxes, self.next = node_id, {}, itertools.count()
    self.lock = threading.Lock()

  def _add(self, sb) -> str:
    with self.lock:
      sid = f"{self.node_id}/{next(self.next)}"
      self.boxes[sid] = sb
    return sid

  def _get(self, sid: str):
    from moonshot_jax import agentenv

    try:
      return self.boxes[sid]
    except KeyError:
      raise agentenv.SandboxError(f"no sandbox {sid!r} on host {self.node_id} (closed or never created)") from None

  def create(self, template: str, kw: dict) -> str:
    from moonshot_jax import agentenv

    return self._add(agentenv.create(template, **kw))

  def call(self, sid: str, method: str, args: tuple, kw: dict):
    if method not in RaySandbox.FORWARDED:
      raise ValueError(f"method {method!r} is not forwarded to sandboxes")
    return getattr(self._get(sid), method)(*args, **kw)

  def fork(self, sid: str, n: int) -> list[str]:
    return [self._add(child) for child in self._get(sid).fork(n)]

  def close(self, sid: str) -> None:
    with self.lock:
      sb = self.boxes.pop(sid, None)
    if sb is not None:
      sb.close()

  def count(self) -> int:
    return len(self.boxes)

  def pid(self) -> int:
    return os.getpid()


def _host(node_id: str, fresh: bool = False):
  """The host actor of `node_id`, started on that node on first use. This process keeps a handle to each
  host it used: Ray ends a non-detached actor once no handle to it is left (e.g. between two episodes)."""
  global _host_cls
  ray = _ray()
  from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

  with _lock:
    if not fresh and node_id in _hosts:
      return _hosts[node_id]
    if _host_cls is None:
      _host_cls = ray.remote(_SandboxHost)
    _hosts[node_id] = _host_cls.options(
        name=f"agentenv-host-{node_id}", namespace=NAMESPACE, get_if_exists=True, num_cpus=0,
        max_concurrency=HOST_CONCURRENCY, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(node_id)
    return _hosts[node_id]


def _pick_node(node_id: str | None) -> str:
  ray = _ray()
  alive = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
  if not alive:
    raise RuntimeError("agentenv backend='ray': the Ray cluster has no alive node")
  if node_id is None:
    return alive[next(_rr) % len(alive)]  # round robin: spread new sandboxes over the nodes
  if node_id not in alive:
    raise ValueError(f"agentenv backend='ray': node_id={node_id!r} is not an alive node of the cluster")
  return node_id


def create(template: str = "python", *, node_id: str | None = None, **kw) -> "RaySandbox":
  """A sandbox on a Ray node (round robin unless `node_id`); `kw` goes to the node's local `agentenv.create`."""
  ray = _ray()
  from moonshot_jax import agentenv

  if not ray.is_initialized():
    init_local()
  node = _pick_node(node_id)
  host = _host(node)
  try:
    return RaySandbox(host, _get(host.create.remote(template, kw)))
  except agentenv.SandboxError:
    if _alive(host):
      raise  # the host is fine: the sandbox itself failed
    host = _host(node, fresh=True)  # the host died (its sandboxes with it): start a new one, once
    return RaySandbox(host, _get(host.create.remote(template, kw)))


def attach(sandbox_id: str) -> "RaySandbox":
  """A handle to an existing sandbox from its id alone (e.g. sent to another process)."""
  node_id, sep, _ = sandbox_id.partition("/")
  if not sep:
    raise ValueError(f"bad Ray sandbox id {sandbox_id!r}; expected '<node id>/<n>'")
  return RaySandbox(_host(_pick_node(node_id)), sandbox_id)


def _get(ref):
  ray = _ray()
  from moonshot_jax import agentenv

  try:
    return ray.get(ref)
  except ray.exceptions.RayTaskError as e:  # the sandbox's own exception, without Ray's remote traceback
    if isinstance(e.cause, Exception):
      raise e.cause from None
    raise
  except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
    raise agentenv.SandboxError(f"sandbox host actor died: {e}") from e


def _alive(host) -> bool:
  ray = _ray()
  try:
    ray.get(host.pid.remote(), timeout=30)
    return True
  except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
    return False


class RaySandbox:
  """Client handle: the local Sandbox API, each call run by the sandbox's host actor."""

  FORWARDED = ("exec", "exec_hidden", "read_file", "write_file", "list_dir", "snapshot", "restore", "drop_snapshot",
        "start_service", "call_service", "stop_service", "ping", "pause", "resume", "info",
        "agent_op", "exec_python")

  def __init__(self, host, sandbox_id: str):
    self.host, self.id, self.closed = host, sandbox_id, False

  def __getattr__(self, name):
    if name not in RaySandbox.FORWARDED:
      raise AttributeError(name)

    def remote_call(*args, **kw):
      self._check_open(name)
      return _get(self.host.call.remote(self.id, name, args, kw))

    return remote_call

  def fork(self, n: int) -> list["RaySandbox"]:
    self._check_open("fork")
    return [RaySandbox(self.host, sid) for sid in _get(self.host.fork.remote(self.id, n))]

  @property
  def paused(self) -> bool:
    """As the local Sandbox.paused; asked from the host (another handle to the same sandbox may have paused it)."""
    self._check_open("paused")
    return self.info()["paused"]

  def close(self) -> None:
    if not self.closed:
      self.closed = True
      _get(self.host.close.remote(self.id))

  def _check_open(self, what: str):
    if self.closed:
      from moonshot_jax import agentenv

      raise agentenv.SandboxError(f"{what}() on closed Ray sandbox {self.id}")

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def __repr__(self):
    return f"RaySandbox({self.id!r}{', closed' if self.closed else ''})"
