"""Per-sandbox cgroups for the hub: v1 memory / pids hierarchies where the host has them, the unified (v2)
hierarchy for the rest, rlimits (recorded, never silent) where neither offers a controller.

Layout, H = the hub's pid:
  v1   <memory mount>/agentenv-H/sb-N[/agent]   <pids mount>/agentenv-H/sb-N   <freezer mount>/agentenv-H/sb-N
  v2   <parent>/agentenv-H/sb-N/{sys,agent}     parent: AGENTENV_CGROUP_PARENT, else the hub's own cgroup
v2's no-internal-processes rule: a cgroup that hands a controller to its children holds no processes, so init,
services and images live in sb-N/sys and commands in sb-N/agent (only made when v2 owns memory: the agent's
tighter memory.max). sb-N itself carries memory.max / pids.max / memory.swap.max, cgroup.freeze and cgroup.kill.

v1 stays the path where it offers a controller (AGENTENV_CGROUPS=v2 forces v2): joining a v1 cgroup is a
write of "0" to its `tasks` file, which moves only the caller and skips the kernel's global threadgroup lock,
while any v2 join is a cgroup.procs write that takes it (5-18 ms after an idle spell, measured in session 13
unless the hierarchy is mounted with favordynmods). A v2 cgroup is therefore made only when v2 owns a limit
or is forced. `pause()` uses the sandbox's v2 cgroup where it has one, else the v1 freezer (made for every
sandbox without a v2 cgroup: a `tasks` write per join, no global lock).
"""
import errno
import os
import select
import signal
import time

from . import _sys as S

CONTROLLERS = ("memory", "pids")  # the limits
V1_SUBSYSTEMS = CONTROLLERS + ("freezer",)  # v1 hierarchies this uses: the freezer is for pause() only
MODES = ("0", "1", "auto", "v1", "v2")


class CgroupError(Exception):
  pass


def mounts(mountinfo="/proc/self/mountinfo"):
  """({subsystem: v1 mount point} for V1_SUBSYSTEMS, (v2 mount point, mount root) or None), as this process
  sees them: a later mount on or above an earlier one's mount point hides it (e.g. cgroup2 mounted over a v1
  layout at /sys/fs/cgroup)."""
  seen = []  # (mount point, fstype, mount root, super options), in mount order
  with open(mountinfo) as f:
    for line in f:
      pre, _, post = line.partition(" - ")
      fields, tail = pre.split(), post.split()
      if len(fields) < 5 or len(tail) < 3:
        continue
      point = fields[4].replace("\\040", " ")
      seen = [m for m in seen if m[0] != point and not m[0].startswith(point.rstrip("/") + "/")]
      seen.append((point, tail[0], fields[3], tail[2]))
  v1, v2 = {}, None
  for point, fstype, root, opts in seen:
    if fstype == "cgroup":
      for c in set(opts.split(",")) & set(V1_SUBSYSTEMS):
        v1.setdefault(c, point)
    elif fstype == "cgroup2" and v2 is None:
      v2 = (point, root)
  return v1, v2


def v2_parent(v2):
  """The directory under which the hub makes agentenv-H: AGENTENV_CGROUP_PARENT or the hub's own cgroup."""
  env = os.environ.get("AGENTENV_CGROUP_PARENT")
  if env:
    return env.rstrip("/") or "/"
  point, root = v2
  with open("/proc/self/cgroup") as f:
    own = next((ln.split(":", 2)[2].strip() for ln in f if ln.startswith("0::")), None)
  if own is None or not (own + "/").startswith(root.rstrip("/") + "/"):
    return None  # our cgroup is outside that mount's view
  rel = own[len(root.rstrip("/")):]
  return (point.rstrip("/") + rel).rstrip("/") or "/"


def write(d, name, value, missing_ok=False):
  try:
    with open(f"{d}/{name}", "w") as f:
      f.write(str(value))
  except FileNotFoundError:
    if not missing_ok:
      raise


def read(d, name):
  with open(f"{d}/{name}") as f:
    return f.read()


def _enable(d, wanted, why):
  """Enable `wanted` controllers for d's children; returns those that took, noting why the others did not."""
  have = set(read(d, "cgroup.controllers").split())
  ok = []
  for c in wanted:
    if c not in have:
      why[c] = f"cgroup v2: {c} is not in {d}/cgroup.controllers (bound to a v1 hierarchy, or not delegated)"
      continue
    try:
      write(d, "cgroup.subtree_control", f"+{c}")
      ok.append(c)
    except OSError as e:
      hint = " (it holds processes: set AGENTENV_CGROUP_PARENT to an empty delegated cgroup)" \
        if e.errno == errno.EBUSY else ""
      why[c] = f"cgroup v2: cannot enable {c} in {d}/cgroup.subtree_control: {e.strerror}{hint}"
  return ok


class Cgroups:
  """The hub's cgroups. Per-sandbox paths are plain dicts ({"memory": v1 dir, "pids": v1 dir, "v2": dir}) so
  forked helpers can use them without this object."""

  def __init__(self, hub_pid, mode=None):
    mode = os.environ.get("AGENTENV_CGROUPS", "1") if mode is None else mode
    if mode not in MODES:
      raise CgroupError(f"AGENTENV_CGROUPS={mode!r}; expected one of {', '.join(MODES)}")
    self.hub_pid = hub_pid
    self.v1 = {}          # controller -> this hub's v1 dir
    self.v2 = None        # this hub's v2 dir
    self.v2_ctrl = []     # controllers that v2 enforces
    self.fallback = {}    # controller -> why rlimits stand in for it
    self.freezer = None   # this hub's v1 freezer dir (pause() of sandboxes without a v2 cgroup)
    self.bases = []       # where agentenv-<pid> dirs of this and dead hubs live
    if mode == "0":
      self.fallback = {c: "cgroups off (AGENTENV_CGROUPS=0)" for c in CONTROLLERS}
      return
    v1m, v2m = mounts()
    parent = v2_parent(v2m) if v2m else None
    self.bases = [v1m[c] for c in V1_SUBSYSTEMS if c in v1m] + ([parent] if parent else [])
    sweep(self.bases, None)  # directories left by hubs that died
    why = {}
    if mode != "v2":
      for c in CONTROLLERS:
        if c not in v1m:
          why[c] = "no cgroup v1 hierarchy has it"
          continue
        try:
          os.mkdir(f"{v1m[c]}/agentenv-{hub_pid}")
          self.v1[c] = f"{v1m[c]}/agentenv-{hub_pid}"
        except OSError as e:
          why[c] = f"cgroup v1: cannot make {v1m[c]}/agentenv-{hub_pid}: {e.strerror}"
    want = [c for c in CONTROLLERS if c not in self.v1]
    if mode != "v1" and (want or mode == "v2"):
      if parent is None:
        for c in want:
          why[c] = why.get(c, "cgroup v2 forced") + "; no cgroup2 mount shows this process's cgroup"
      else:
        self._setup_v2(parent, want, why)
    if mode != "v2" and self.v2 is None and "freezer" in v1m:
      try:
        os.mkdir(f"{v1m['freezer']}/agentenv-{hub_pid}")
        self.freezer = f"{v1m['freezer']}/agentenv-{hub_pid}"
      except OSError:
        pass  # pause() then names the missing freezer
    self.fallback = {c: why[c] for c in CONTROLLERS if c not in self.v1 and c not in self.v2_ctrl}

  def _setup_v2(self, parent, want, why):
    try:
      got = _enable(parent, want, why) if want else []
      d = f"{parent}/agentenv-{self.hub_pid}"
      os.mkdir(d)
    except OSError as e:
      for c in want:
        why[c] = f"cgroup v2: cannot use {parent}: {e.strerror}"
      return
    self.v2 = d
    self.v2_ctrl = _enable(d, got, why)

  # ---- per sandbox ------------------------------------------------------------------------------------
  def limited(self):
    """Controllers enforced by a cgroup (the rest fall back to rlimits)."""
    return sorted(set(self.v1) | set(self.v2_ctrl))

  def make(self, sid, limits):
    mem, pids = (2 * limits["memory_mb"] + 64) << 20, limits["pids"]
    paths = {}
    try:
      for c, root in self.v1.items():
        p = paths[c] = f"{root}/{sid}"
        os.mkdir(p)
        if c == "memory":
          # Two levels: the sandbox (init + services, with headroom) and "agent" (every exec'd command, the
          # user's limit). Files written are charged to the writer, so an agent that fills its memory with files
          # only starves its own commands; init survives and the host can still restore / close the sandbox.
          os.mkdir(f"{p}/agent")
          write(p, "memory.limit_in_bytes", mem)
          write(f"{p}/agent", "memory.limit_in_bytes", limits["memory_mb"] << 20)
          for d in (p, f"{p}/agent"):
            write(d, "memory.swappiness", 0, missing_ok=True)
        elif c == "pids":
          write(p, "pids.max", pids)
      if self.freezer:
        paths["freezer"] = f"{self.freezer}/{sid}"
        os.mkdir(paths["freezer"])
      if self.v2:
        p = paths["v2"] = f"{self.v2}/{sid}"
        os.mkdir(p)
        os.mkdir(f"{p}/sys")
        if "memory" in self.v2_ctrl:
          write(p, "memory.max", mem)
          write(p, "memory.swap.max", 0, missing_ok=True)
          write(p, "cgroup.subtree_control", "+memory")
          os.mkdir(f"{p}/agent")
          write(f"{p}/agent", "memory.max", limits["memory_mb"] << 20)
          write(f"{p}/agent", "memory.swap.max", 0, missing_ok=True)
        if "pids" in self.v2_ctrl:
          write(p, "pids.max", pids)
    except BaseException:
      for d in dirs(paths):
        try:
          os.rmdir(d)
        except OSError:
          pass
      raise
    return paths

  def info(self, paths):
    out = {c: f"v1 {paths[c]}" for c in self.v1 if c in paths}
    out.update({c: f"v2 {paths['v2']}" for c in self.v2_ctrl if "v2" in paths})
    freezer = f"v2 {paths['v2']}" if "v2" in paths else f"v1 {paths['freezer']}" if "freezer" in paths else None
    return dict(cgroups=out, cgroup_v2=paths.get("v2"), freezer=freezer,
                rlimit_fallback={c: why for c, why in self.fallback.items()})

  def teardown(self):
    for d in list(self.v1.values()) + [d for d in (self.v2, self.freezer) if d]:
      try:
        os.rmdir(d)
      except OSError:
        pass


def join_files(paths):
  """Files a process writes "0" to in order to join the sandbox `paths` (v1 `tasks` move the caller alone)."""
  out = [f"{p}/tasks" for c, p in paths.items() if c != "v2"]
  if "v2" in paths:
    out.append(f"{paths['v2']}/sys/cgroup.procs")
  return out


def join(paths):
  """Move the calling process, which must be single-threaded, into the cgroups `paths`."""
  for p in join_files(paths):
    fd = os.open(p, os.O_WRONLY)
    try:
      S.cg_join_self(fd)
    finally:
      os.close(fd)


def agent_file(paths):
  """The file a command writes "0" to, to join the agent memory cgroup; None where there is none."""
  if "memory" in paths:
    return f"{paths['memory']}/agent/tasks"
  if "v2" in paths and os.path.isdir(f"{paths['v2']}/agent"):
    return f"{paths['v2']}/agent/cgroup.procs"
  return None


def dirs(paths):
  """Leaf-first list of a sandbox's cgroup directories."""
  out = []
  for c, p in paths.items():
    out += [f"{p}/{leaf}" for leaf in (("agent", "sys") if c == "v2" else ("agent",) if c == "memory" else ())]
    out.append(p)
  return out


def _kill_listed(d):
  """SIGKILL each pid in d/cgroup.procs, then thaw d if it is a v1 freezer cgroup: a frozen v1 task dies only
  once thawed, and being killed first it runs no code of its own on the way out."""
  try:
    pids = read(d, "cgroup.procs").split()
  except OSError:
    pids = []
  for p in pids:
    try:
      os.kill(int(p), signal.SIGKILL)
    except ProcessLookupError:
      pass
  if os.path.exists(f"{d}/freezer.state"):
    write(d, "freezer.state", "THAWED")


def kill(d, walk=True):
  """SIGKILL every process in cgroup d and below: cgroup.kill on v2 (Linux >= 5.14; frozen ones included), each
  listed pid on v1 (a process forked meanwhile is caught by the next call: the collector retries while rmdir
  finds the cgroup busy; it passes walk=False, as it retries each dir on its own). Takes what no other kill
  reaches, e.g. a detached child of a service."""
  if os.path.exists(f"{d}/cgroup.kill"):
    write(d, "cgroup.kill", 1)
    return
  for sub in (s for s, _, _ in os.walk(d)) if walk else (d,):
    _kill_listed(sub)


def kill_sandbox(paths):
  """kill() for a whole sandbox, cheaply: its v2 cgroup if it has one; on v1 its pids cgroup alone, which holds
  every process of the sandbox and has no children to walk (the walk of every dir cost close() 0.4 ms)."""
  if "v2" in paths:
    kill(paths["v2"])
  elif "pids" in paths:
    _kill_listed(paths["pids"])
  else:
    for c, p in paths.items():
      if c != "freezer":
        kill(p)
  if "freezer" in paths:
    write(paths["freezer"], "freezer.state", "THAWED")


def members(paths):
  """Host pids (thread-group ids) of every process of a sandbox, from ONE of its cgroup trees that holds all of them
  (every sandbox process joins each of its cgroups, see join_files): the v1 pids or freezer cgroup (flat, and only
  host root can move a process out), else the v2 tree (sys + agent; a v2 process's threads share one cgroup), else
  the v1 memory tree (its agent `tasks` file is in-sandbox root's: a thread may move there, its leader is listed
  where it is). A process that is exiting with no live thread left is not listed. None: the sandbox has no
  cgroup, so nothing lists the processes that live outside its init's PID namespace (services and theirs)."""
  c = next((c for c in ("pids", "freezer", "v2", "memory") if c in paths), None)
  if c is None:
    return None
  root, out = paths[c], set()
  for d in (root,) if c in ("pids", "freezer") else (root, f"{root}/sys", f"{root}/agent"):
    try:
      out.update(int(p) for p in read(d, "cgroup.procs").split())
    except FileNotFoundError:
      if d == root:
        raise
  return out


def _kill_and_wait(pidfds, deadline, what):
  """SIGKILL the processes of `pidfds` and wait until each has exited (its pidfd readable: memory, files and sockets
  released), or raise CgroupError naming `what` at `deadline`."""
  poller, left = select.poll(), 0
  for fd in pidfds:
    try:
      signal.pidfd_send_signal(fd, signal.SIGKILL)
    except ProcessLookupError:
      continue
    poller.register(fd, select.POLLIN)
    left += 1
  while left:
    wait = deadline - time.monotonic()
    if wait <= 0:
      raise CgroupError(f"{what} still exist after SIGKILL")
    for fd, _ in poller.poll(wait * 1000):
      poller.unregister(fd)
      left -= 1


def kill_members(paths, keep, pidfds=(), timeout=2.0):
  """SIGKILL every process of the sandbox `paths` but pid `keep` (its init) and wait until each has exited; repeat
  until the cgroups list `keep` alone, so what a process forked meanwhile goes too. `pidfds`: processes of the
  sandbox the caller knows (its services), killed and waited for first: where they were all, one listing confirms.
  A pid listed both before and after its pidfd was opened is the process the pidfd names (a live process holds its
  pid), so a pid reused by a stranger in between is never signalled. Raises CgroupError if something is still there
  after `timeout` s (e.g. stuck in the kernel) or the sandbox has no cgroup; OSError if its cgroups are unreadable."""
  if not any(c in paths for c in ("pids", "freezer", "v2", "memory")):  # (members() would answer None)
    raise CgroupError("the sandbox has no cgroup: nothing lists its processes outside its init's PID namespace")
  deadline = time.monotonic() + timeout
  _kill_and_wait(pidfds, deadline, "known processes of the sandbox")
  while True:
    listed = members(paths) - {keep}
    if not listed:
      return
    what = f"processes {sorted(listed)[:8]} of {paths}"
    if time.monotonic() > deadline:
      raise CgroupError(f"{what} still exist after SIGKILL")
    fds = {}
    try:
      for p in listed:
        try:
          fds[p] = os.pidfd_open(p)
        except ProcessLookupError:
          pass
      again = members(paths)  # gone meanwhile (or the pid was reused by a stranger before the open): next listing
      _kill_and_wait([fd for p, fd in fds.items() if p in again], deadline, what)
    finally:
      for fd in fds.values():
        os.close(fd)


def set_frozen(paths, frozen, timeout=5.0):
  """Freeze / thaw a sandbox (its v2 cgroup, else its v1 freezer) and wait until every task has stopped / may
  run again (the kernel stops each at its next return to user space)."""
  if "v2" in paths:
    _set_frozen_v2(paths["v2"], frozen, timeout)
    return
  d, want = paths["freezer"], "FROZEN" if frozen else "THAWED"
  write(d, "freezer.state", want)
  deadline, delay = time.monotonic() + timeout, 1e-4
  while read(d, "freezer.state").strip() != want:  # FREEZING until the last task stops; v1 offers no poll
    if time.monotonic() > deadline:
      write(d, "freezer.state", "THAWED")  # not left half frozen: the sandbox stays usable
      raise CgroupError(f"{d} did not report {want} within {timeout} s")
    time.sleep(delay)
    delay = min(2 * delay, 0.01)


def _set_frozen_v2(d, frozen, timeout):
  write(d, "cgroup.freeze", int(frozen))
  want = f"frozen {int(frozen)}"
  fd = os.open(f"{d}/cgroup.events", os.O_RDONLY)
  try:
    poller = select.poll()
    poller.register(fd, select.POLLPRI)
    deadline = time.monotonic() + timeout
    while want not in os.pread(fd, 4096, 0).decode().splitlines():
      left = deadline - time.monotonic()
      if left <= 0:
        raise CgroupError(f"{d} did not report {want!r} within {timeout} s")
      poller.poll(left * 1000)  # cgroup.events signals every change (POLLPRI)
  finally:
    os.close(fd)


def sweep(bases, hub_pid):
  """rmdir agentenv-<pid> cgroups under `bases` of hub_pid (None: of every hub no longer alive), killing what
  is left in v2 ones first. True if some remain."""
  left = False
  for base in bases:
    try:
      names = os.listdir(base)
    except OSError:
      continue
    for name in names:
      if not name.startswith("agentenv-"):
        continue
      try:
        owner = int(name.split("-", 1)[1])
      except ValueError:
        continue
      if hub_pid is None:
        try:
          os.kill(owner, 0)
          continue  # that hub is alive
        except ProcessLookupError:
          pass
        except PermissionError:
          continue
      elif owner != hub_pid:
        continue
      d = f"{base}/{name}"
      try:
        kill(d)
      except OSError:
        pass
      try:
        subs = os.listdir(d)
      except OSError:
        continue
      for sub in subs:
        for leaf in (f"{d}/{sub}/agent", f"{d}/{sub}/sys", f"{d}/{sub}"):
          if os.path.isdir(leaf):
            try:
              os.rmdir(leaf)
            except OSError:
              left = True
      try:
        os.rmdir(d)
      except FileNotFoundError:
        pass
      except OSError:
        left = True
  return left
