"""Agent environments on AgentEnv sandboxes: the `Env` protocol, the shared step loop, the family registry.

The contract with the RL side (moonshot_jax/rl; agreed in session 12, see WORKSPACE_NOTES.md):

    env = make_env("file_lookup", difficulty=2, max_turns=8)   # families: TASK_FAMILIES
    prompt = env.reset(seed)            # same (family, difficulty, seed) -> same task; seeds >= HELD_OUT_SEED:
                                        # the held-out split
    r = env.step("cat k3")              # StepResult(observation, reward, done, info); never raises on a bad action
    kids = env.fork(4)                  # sandbox fork: the children start from this exact state (lazy for
                                        # read-mostly families: one shared sandbox until a row changes it)
    env.oracle_action()                 # a scripted solver's next action from the current state (SFT data)
    sid = env.snapshot(); env.restore(sid)  # roll back (files, service memory, turn) -- beyond the protocol

An action is ONE line `<tool> <args>`. The tools a family offers come from a small shared set (TOOL_HELP).
Malformed calls, unknown tools, timed-out commands and dead sandboxes become observations with reward 0 and
`info["error"]` set; the episode ends on `answer`/`submit` (reward 1.0 iff verified) or at `max_turns`.
Observations are printable ASCII, at most OBS_MAX characters, so a byte-level model reads them directly.
`info` holds "turn" and "tool", "error" (malformed | unknown_tool | bad_args | exit_code | timeout |
sandbox_crash) when the action failed, "verify" (why a hidden check failed, e.g. "check exit 1: NameError:
..."), and "max_turns" when the turn limit ended the episode.
`rollout_oracle(env, seed)` plays one scripted episode (SFT data). Calling step() before reset() or after
the episode ended is a programming error and raises RuntimeError.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import shlex
import threading
from typing import Any, Callable, Protocol, runtime_checkable

OBS_MAX = 256  # characters per observation (and per prompt)
ACTION_MAX = 512  # characters per action; longer is "malformed"
ORACLE_ACTION_MAX = 44  # the scripted solver's actions stay this short (a tiny LM samples ~48 tokens per turn)
HELD_OUT_SEED = 1_000_000  # seeds >= this are the held-out split; training draws seeds below it
EXEC_TIMEOUT_S = 2.0  # wall clock per agent command: tasks need milliseconds; a stuck command must not stall RL

TOOL_HELP = {
  "ls": "ls [dir]: list a directory",
  "cat": "cat <path>: print a file",
  "sh": "sh <command>: run a shell command",
  "write": "write <path> <text>: make the file contain <text> and a newline",
  "kv": "kv get <key> | kv set <key> <value>: talk to the key-value service",
  "answer": "answer <text>: final answer, ends the episode",
  "submit": "submit (no arguments): ask for verification, ends the episode",
}


@dataclasses.dataclass(frozen=True)
class StepResult:
  observation: str
  reward: float
  done: bool
  info: dict


@runtime_checkable
class Env(Protocol):
  family: str

  def reset(self, seed: int) -> str: ...

  def step(self, action: str) -> StepResult: ...

  def fork(self, n: int) -> list["Env"]: ...

  def oracle_action(self) -> str: ...

  def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class Task:
  """One generated task: the prompt, the files the agent starts with, and what the verifier knows."""

  prompt: str
  files: dict  # path -> text: the sandbox's task layer (relative paths are under the working directory)
  answer: str | None = None  # for `answer`-terminated families
  secret: Any = None  # verifier-only data, kept host-side
  hidden_files: dict = dataclasses.field(default_factory=dict)  # the core keeps these out of the sandbox;
  # only `exec_hidden` (a private copy of the sandbox's files, after the agent's last action) sees them


class SandboxError(Exception):
  """Raised by a family's sandbox call when the sandbox itself failed (dead, closed, crashed)."""


def clip(text: str | bytes, limit: int = OBS_MAX) -> str:
  """Printable ASCII (newlines kept), at most `limit` characters; a cut ends in '...'."""
  if isinstance(text, bytes):
    text = text.decode("ascii", errors="replace")
  text = "".join(c if (" " <= c <= "~" or c == "\n") else "?" for c in text).strip()
  return text if len(text) <= limit else text[: limit - 3] + "..."


def task_rng(family: str, difficulty: int, seed: int) -> random.Random:
  # str seeds hash through sha512: stable across processes and Python runs (unlike hash()).
  return random.Random(f"{family}|{difficulty}|{seed}")


class _Shared:
  """One sandbox that the envs of a lazy fork (SandboxEnv.fork) all read until each changes it: `holders` of them
  still use it; the last one left owns it."""

  def __init__(self, sb, holders: int):
    self.sb, self.holders, self.lock = sb, holders, threading.Lock()


class SandboxEnv:
  """Shared machinery: sandbox life cycle, action parsing, the shared tools, turn limit, fork.

  A family subclass sets `family`, `tools`, `max_difficulty` and implements `generate(rng) -> Task`,
  `oracle() -> str`, and, where it has them, `setup()` (after the files are written), `verify()`
  (for `submit`) and extra `tool_<name>(args)` handlers. Per-episode mutable state lives in
  `self.state` (a dict, deep-copied on fork).
  """

  family: str = ""
  tools: tuple[str, ...] = ()
  max_difficulty: int = 1
  template: str = "python"
  # ls / cat read files (init's file ops, or the ls / cat commands); answer compares text. A family whose verifier
  # only reads adds "submit" (its exec calls then run on the shared sandbox too).
  readonly_tools: tuple[str, ...] = ("ls", "cat", "answer")
  # fork()'s default: lazy copies. A family whose every solving episode writes sets False: the copies then cost the
  # same CPU, made at fork time (a GRPO group's start, ahead of its rollout) instead of one by one mid-rollout.
  fork_lazily: bool = True

  def __init__(self, *, difficulty: int = 1, max_turns: int = 8, limits=None, backend: str = "local",
               recycle: bool = False):
    if not isinstance(difficulty, int) or not 1 <= difficulty <= self.max_difficulty:
      raise ValueError(f"{self.family}: difficulty={difficulty!r}; expected an int in 1..{self.max_difficulty}")
    if not isinstance(max_turns, int) or max_turns < 1:
      raise ValueError(f"{self.family}: max_turns={max_turns!r}; expected an int >= 1")
    if backend not in ("local", "ray"):
      raise ValueError(f"{self.family}: backend={backend!r}; expected 'local' or 'ray'")
    if not isinstance(recycle, bool):
      raise ValueError(f"{self.family}: recycle={recycle!r}; expected a bool")
    self.difficulty, self.max_turns, self.limits, self.backend = difficulty, max_turns, limits, backend
    self.recycle = recycle  # sandboxes from / back to the hub's pool of recycled inits (agentenv.create)
    self.sb = None  # the agent's sandbox (after a lazy fork: shared with the other envs of self._shared)
    self._shared: _Shared | None = None
    self._reading = False  # inside a tool call: step() already decided (changes_sandbox) whether to copy first
    self.task: Task | None = None
    self.seed: int | None = None
    self.turn = 0
    self.done = False
    self.state: dict = {}
    self._snaps: dict = {}  # snapshot id -> (turn, done, state) of this episode
    self.note: str | None = None  # set by a verifier that failed: why (info["verify"])
    self.closed = False

  # ------------------------------------------------------------------ Env API
  def reset(self, seed: int) -> str:
    if self.closed:
      raise RuntimeError(f"{self.family}: reset() after close()")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
      raise ValueError(f"{self.family}: seed={seed!r}; expected an int >= 0")
    self.task = self.generate(task_rng(self.family, self.difficulty, seed))
    self.seed, self.turn, self.done, self.state, self._snaps = seed, 0, False, {}, {}
    self._close_sandbox()  # a fresh sandbox per episode: nothing of the last episode can leak in
    self.sb = self._create_sandbox(files=self.task.files, hidden_files=self.task.hidden_files)
    self.setup()
    return clip(self.task.prompt)

  def step(self, action: str) -> StepResult:
    if self.task is None:
      raise RuntimeError(f"{self.family}: step() before reset()")
    if self.done:
      raise RuntimeError(f"{self.family}: step() after the episode ended; call reset()")
    if isinstance(action, bytes):
      action = action.decode("ascii", errors="replace")
    if not isinstance(action, str):
      raise TypeError(f"{self.family}: action must be str, got {type(action).__name__}")
    self.turn += 1
    action = action.strip()
    tool, _, args = action.partition(" ")
    args = args.strip()
    info: dict = {"turn": self.turn, "tool": tool}
    reward, done, self.note = 0.0, False, None
    if not action or "\n" in action or len(action) > ACTION_MAX:
      obs, info["error"] = "error: one line <tool> <args>", "malformed"
    elif tool not in self.tools:
      obs, info["error"] = f"error: unknown tool; tools: {' '.join(self.tools)}", "unknown_tool"
    else:
      try:
        if self._shared is not None and self.changes_sandbox(tool, args):
          self._own()
        self._reading = True
        try:
          obs, reward, done, err = getattr(self, f"tool_{tool}")(args)
        finally:
          self._reading = False
      except SandboxError as e:  # the sandbox died under the agent: an observation, not a failed step
        obs, reward, done, err = f"error: sandbox failed ({clip(str(e), 80)})", 0.0, False, "sandbox_crash"
      except TimeoutError:  # a service call that did not answer in time
        obs, reward, done, err = "error: timed out", 0.0, False, "timeout"
      if err:
        info["error"] = err
      if self.note:  # the verifier's reason for a failed check (not shown to the agent)
        info["verify"] = self.note
    if not done and self.turn >= self.max_turns:
      done, info["max_turns"] = True, True
    self.done = done
    return StepResult(clip(obs), float(reward), done, info)

  def fork(self, n: int, *, lazy: bool | None = None) -> list["SandboxEnv"]:
    """n envs that start from this env's exact state (sandbox, turn, episode state) and then evolve independently.

    lazy=True: no sandbox is copied yet. This env and the n children share its sandbox, and each of them gets a copy
    of its own (a sandbox fork of the shared one) just before its first action that can change it (a tool not in
    `readonly_tools`, per `changes_sandbox`; snapshot, restore, or an exec / service call outside a read-only tool);
    the last env still sharing it takes the shared one over. Nobody changes a sandbox that others share, so every
    observation is what an eager fork gives, and envs that only read (most of a GRPO group's file_lookup / kv_query
    rows) never copy one. lazy=False copies n sandboxes now. None: the family's `fork_lazily`."""
    if self.task is None or self.sb is None:
      raise RuntimeError(f"{self.family}: fork() before reset()")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
      raise ValueError(f"{self.family}: fork(n={n!r}); expected an int >= 1")
    if lazy is None:
      lazy = self.fork_lazily
    if not isinstance(lazy, bool):
      raise ValueError(f"{self.family}: fork(lazy={lazy!r}); expected True, False or None")
    if lazy:
      if self._shared is None:
        self._shared = _Shared(self.sb, 1)
      with self._shared.lock:
        self._shared.holders += n
      sandboxes = [self.sb] * n
    else:
      sandboxes = self._call(self.sb.fork, n)
    children = []
    for sb in sandboxes:
      child = copy.copy(self)
      child.sb, child.state, child._snaps = sb, copy.deepcopy(self.state), dict(self._snaps)
      child._shared = self._shared if lazy else None
      children.append(child)
    return children

  def changes_sandbox(self, tool: str, args: str) -> bool:
    """Whether `tool args` can change the sandbox (files, processes, service memory): it then runs on a sandbox of
    this env's own after a lazy fork. A family's read-only tool arguments (kv get) override this."""
    del args
    return tool not in self.readonly_tools

  def _own(self) -> None:
    """After a lazy fork: give this env a sandbox of its own (a fork of the shared one; the last sharer keeps it).
    A failed fork raises SandboxError and leaves this env sharing, as before."""
    shared = self._shared
    if shared is None:
      return
    with shared.lock:
      if shared.holders > 1:
        (self.sb,) = self._call(shared.sb.fork, 1)
      shared.holders -= 1
      self._shared = None

  def _writing(self) -> None:
    """Before a sandbox call that may change it: own the sandbox unless a read-only tool is running."""
    if not self._reading:
      self._own()

  def snapshot(self) -> str:
    """Saves this episode's exact state (sandbox files + service memory + turn, done, episode state) and
    returns its id; `restore(id)` rolls back to it, e.g. to retry after a bad action. Not part of Env."""
    if self.task is None or self.sb is None:
      raise RuntimeError(f"{self.family}: snapshot() before reset()")
    self._own()  # (its restore would change the sandbox: the snapshot must be of this env's own)
    sid = self._call(self.sb.snapshot)
    self._snaps[sid] = (self.turn, self.done, copy.deepcopy(self.state))
    return sid

  def restore(self, snapshot_id: str) -> None:
    if snapshot_id not in self._snaps:
      raise ValueError(f"{self.family}: unknown snapshot id {snapshot_id!r} (taken in another episode?)")
    self._own()
    self._call(self.sb.restore, snapshot_id)
    turn, done, state = self._snaps[snapshot_id]
    self.turn, self.done, self.state = turn, done, copy.deepcopy(state)

  def oracle_action(self) -> str:
    if self.task is None or self.done:
      raise RuntimeError(f"{self.family}: oracle_action() needs a running episode (reset first)")
    return self.oracle()

  def close(self) -> None:
    self._close_sandbox()
    self.closed = True

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # ------------------------------------------------------------------ family hooks
  def generate(self, rng: random.Random) -> Task:
    raise NotImplementedError

  def oracle(self) -> str:
    raise NotImplementedError

  def setup(self) -> None:
    """Runs once the task's sandbox exists (e.g. starts a service)."""

  def verify(self) -> bool:
    raise NotImplementedError(f"{self.family} has no submit verifier")

  # ------------------------------------------------------------------ shared tools
  # Each returns (observation, reward, done, error-or-None).
  def tool_ls(self, args):
    r = self._agent_op("list", args or ".") or self.exec("ls -1 -- " + (shlex.quote(args) if args else "."))
    return self._shell_obs(r, join_lines=True)

  def tool_cat(self, args):
    if not args:
      return self.usage("cat")
    r = self._agent_op("read", args) or self.exec("cat -- " + shlex.quote(args))
    if r.exit_code == 0 and not r.timed_out:
      self.state.setdefault("read", {})[args] = r.stdout
    return self._shell_obs(r)

  def tool_sh(self, args):
    if not args:
      return self.usage("sh")
    return self._shell_obs(self.exec(args))

  def tool_write(self, args):
    path, _, text = args.partition(" ")
    if not path:
      return self.usage("write")
    r = self._agent_op("write", path, text + "\n") or self.exec("cat > " + shlex.quote(path), stdin=text + "\n")
    return self._shell_obs(r)

  def tool_answer(self, args):
    ok = self.task.answer is not None and args == self.task.answer
    return ("correct" if ok else "wrong"), float(ok), True, None

  def tool_submit(self, args):
    if args:
      return self.usage("submit")
    ok = self.verify()
    return ("passed" if ok else "failed"), float(ok), True, None

  def usage(self, tool: str):
    return "error: usage: " + TOOL_HELP[tool], 0.0, False, "bad_args"

  # ------------------------------------------------------------------ sandbox helpers
  def start_service(self, name: str, source: str) -> None:
    """Starts the sandbox's long-lived service `name` (python source defining handle(request) -> str and
    optionally init()); its memory rides along on snapshot / restore / fork."""
    self._writing()
    self._call(self.sb.start_service, name, source)

  def service_request(self, name: str, request: str) -> str:
    """One request to the service, its reply (as the agent's observation)."""
    self._writing()
    return _text(self._call(self.sb.call_service, name, request, timeout=EXEC_TIMEOUT_S)).strip()

  def exec(self, cmd: str, *, stdin: str | None = None):
    self._writing()
    return self._call(self.sb.exec, cmd, stdin=stdin, timeout=EXEC_TIMEOUT_S)

  def _agent_op(self, op: str, path: str, data: str | None = None):
    """The command's ExecResult answered without a process (Sandbox.agent_op), or None: run the command."""
    if op == "write":
      self._writing()
    fn = getattr(self.sb, "agent_op", None)  # a sandbox backend without it: always the command
    return None if fn is None else self._call(fn, op, path, data)

  def read_file(self, path: str) -> str | None:
    """The verifier's view of a file in the agent's sandbox (read from outside); None if missing."""
    try:
      data = self._call(self.sb.read_file, path)
    except (OSError, ValueError):  # missing, a directory, or a path the sandbox refuses: nothing to verify
      return None
    return data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data

  def _shell_obs(self, r, join_lines: bool = False):
    if r.timed_out:
      return "error: timed out", 0.0, False, "timeout"
    out = _text(r.stdout) + (("\n" + _text(r.stderr)) if r.exit_code else "")
    out = out.strip()
    if join_lines:
      out = " ".join(out.split("\n"))
    if r.exit_code:
      return (out or f"exit {r.exit_code}"), 0.0, False, "exit_code"
    return (out or "ok"), 0.0, False, None

  def _create_sandbox(self, **kw):
    from moonshot_jax import agentenv  # the sandbox core; imported late so the protocol module stays light

    if self.limits is not None:
      kw["limits"] = self.limits
    if self.backend != "local":
      kw["backend"] = self.backend
    if self.recycle:
      kw["recycle"] = True
    return agentenv.create(self.template, **{k: v for k, v in kw.items() if v})

  def _call(self, fn: Callable, *args, **kw):
    """A sandbox call; the sandbox failing under it (dead, closed, broken channel) becomes SandboxError."""
    from moonshot_jax import agentenv

    try:
      return fn(*args, **kw)
    except (agentenv.SandboxError, EOFError, ConnectionError) as e:
      raise SandboxError(f"{type(e).__name__}: {e}") from e

  def _close_sandbox(self):
    sb, shared = self.sb, self._shared
    self.sb, self._shared = None, None
    if shared is not None:
      with shared.lock:
        shared.holders -= 1
        if shared.holders > 0:  # others still read it: theirs to close
          return
    if sb is not None:
      try:
        sb.close()
      except Exception:  # closing a crashed sandbox may fail; it is being discarded either way
        pass


def _text(x) -> str:
  return x.decode("utf-8", errors="replace") if isinstance(x, bytes) else (x or "")


# ---------------------------------------------------------------------- registry
_REGISTRY: dict[str, type[SandboxEnv]] = {}


def register(cls: type[SandboxEnv]) -> type[SandboxEnv]:
  if not cls.family or cls.family in _REGISTRY:
    raise ValueError(f"bad or duplicate family name {cls.family!r}")
  _REGISTRY[cls.family] = cls
  return cls


def make_env(family: str, *, difficulty: int = 1, max_turns: int = 8, limits=None, backend: str = "local",
             recycle: bool = False) -> Env:
  """A task family's environment (not yet reset). Families: TASK_FAMILIES. recycle=True: its sandboxes may be
  recycled inits and go back to the hub's pool when closed (agentenv.create(recycle=True); the RL path's choice:
  a rollout's sandbox life cycle then costs ~2-3 ms of CPU instead of ~12-18)."""
  if family not in _REGISTRY:
    raise ValueError(f"unknown task family {family!r}; known: {', '.join(TASK_FAMILIES)}")
  return _REGISTRY[family](difficulty=difficulty, max_turns=max_turns, limits=limits, backend=backend, recycle=recycle)


def rollout_oracle(env: Env, seed: int) -> tuple[str, list[tuple[str, StepResult]]]:
  """One episode of the scripted solver: (prompt, [(action, result), ...]); the SFT data's unit."""
  prompt, steps = env.reset(seed), []
  while not steps or not steps[-1][1].done:
    action = env.oracle_action()
    steps.append((action, env.step(action)))
  return prompt, steps


def max_difficulty(family: str) -> int:
  if family not in _REGISTRY:
    raise ValueError(f"unknown task family {family!r}; known: {', '.join(TASK_FAMILIES)}")
  return _REGISTRY[family].max_difficulty


from moonshot_jax.agentenv import tasks as _tasks  # noqa: E402  (registers the families)

TASK_FAMILIES: tuple[str, ...] = tuple(_REGISTRY)
del _tasks
