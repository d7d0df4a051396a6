"""A pure-Python test double of the AgentEnv protocol (ENV_PROTOCOL.md), for RL tests only.

Task family "kv": the prompt names a key; `get <key>` shows its value, `answer <value>` ends the
episode (reward 1.0 if right). Extra tools that exercise failure paths:
  `crash`   the tool raises RuntimeError (an env that breaks the protocol's never-raise rule)
  anything else / an empty line: observation "error: malformed", info["error"] = "malformed".
Deterministic in (family, seed); fork copies the state. `oracle_action` solves it in 2 calls.
Selected by `--config.rl.env_module=tests.rl_doubles`.
"""
from __future__ import annotations

import dataclasses
import random

TASK_FAMILIES = ("kv", "kv_long", "parity")  # parity: one call, reward 1 iff its length is even
# (an untrained policy earns it half the time: nonzero advantages for the restart test)


@dataclasses.dataclass
class StepResult:
  observation: str
  reward: float
  done: bool
  info: dict


class KVEnv:
  def __init__(self, family: str, difficulty: int = 1, max_turns: int = 4):
    if family not in TASK_FAMILIES:
      raise ValueError(f"family: unknown {family!r}")
    self.family, self.difficulty, self.max_turns = family, difficulty, max_turns
    self.table: dict[str, str] = {}
    self.key = ""
    self.turn = 0
    self.seen = False
    self.closed = False
    self.crash_on_step = False  # tests set it: step() then raises (a tool that crashes)

  def reset(self, seed: int) -> str:
    rng = random.Random(f"{self.family}/{self.difficulty}/{seed}")
    n = 3 if self.family == "kv" else 6
    keys = rng.sample("abcdefghij", n)
    self.table = {k: str(rng.randrange(10)) for k in keys}
    self.key = keys[rng.randrange(n)]
    self.turn, self.seen = 0, False
    return f"find {self.key}"

  def step(self, action: str) -> StepResult:
    if self.closed:
      raise RuntimeError("step on a closed env")
    self.turn += 1
    last = self.turn >= self.max_turns
    parts = action.strip().split(" ")
    if self.family == "parity":
      return StepResult("ok", float(len(action) % 2 == 0), True, {})
    if parts[0] == "crash" or self.crash_on_step:
      raise RuntimeError("tool crashed")
    if parts[0] == "get" and len(parts) == 2:
      obs = self.table.get(parts[1], "none")
      self.seen = self.seen or parts[1] == self.key
      return StepResult(obs, 0.0, last, {})
    if parts[0] == "answer" and len(parts) == 2:
      return StepResult("ok", float(parts[1] == self.table[self.key]), True, {})
    return StepResult("error: malformed", 0.0, last, {"error": "malformed"})

  def fork(self, n: int) -> list["KVEnv"]:
    out = []
    for _ in range(n):
      c = KVEnv(self.family, self.difficulty, self.max_turns)
      c.table, c.key, c.turn, c.seen = dict(self.table), self.key, self.turn, self.seen
      out.append(c)
    return out

  def oracle_action(self) -> str:
    if self.family == "parity":
      return "ok"
    return f"answer {self.table[self.key]}" if self.seen else f"get {self.key}"

  def close(self) -> None:
    self.closed = True

  def __enter__(self):
    return self

  def __exit__(self, *a):
    self.close()


def make_env(family: str, *, difficulty: int = 1, max_turns: int = 8, limits=None, backend: str = "local",
             recycle: bool = False):
  del limits, backend, recycle  # (no sandboxes here)
  return KVEnv(family, difficulty, max_turns)
