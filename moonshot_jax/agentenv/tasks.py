"""The task families: procedurally generated from (difficulty, seed), verified from outside the agent's view.

Sized for a tiny byte-level LM: 2-char file names and keys, 3-char codes, prompts under ~80 characters,
2-5 turns per solved episode, oracle actions <= ORACLE_ACTION_MAX characters. Each answer has to be read
from the prompt or an observation (a random code, a file name, a formula), so a policy cannot memorise
it; `difficulty` adds hops or a harder edit.

| family      | tools                         | difficulty 1 .. max                                           |
| file_lookup | ls cat answer                 | d files chained by "next <name>"; the last holds "code <c>"  |
| file_edit   | ls cat sh write submit        | 1 write a given text, 2 replace a word, 3 copy a code across, |
|             |                               | 4 the same after one "next" hop                               |
| kv_query    | kv answer                     | d keys chained in an in-memory key-value service             |
| python_fn   | ls cat sh write submit        | 1 a*x+b, 2 a conditional, 3 a*x+b from f(0) and f(1),        |
|             |                               | 4 a*x+b read from a file                                      |

Every family takes difficulty 1..4, so one `difficulty` serves a mix of families.
"""

from __future__ import annotations

import json
import random

from moonshot_jax.agentenv.envs import SandboxEnv, Task, clip, register

LETTERS = "abcdefghjkmnpqrstuvwxyz"  # no i/l/o: fewer look-alikes for a byte model
DIGITS = "23456789"
CODE_CHARS = LETTERS + DIGITS


def _names(rng: random.Random, n: int) -> list[str]:
  """n distinct 2-char names, letter + digit (never a prefix of another, never a shell word)."""
  return rng.sample([a + d for a in LETTERS for d in DIGITS], n)


def _code(rng: random.Random) -> str:
  return "".join(rng.choice(CODE_CHARS) for _ in range(3))


def _chain_oracle(chain: list[str], seen: dict, read_action: str, final: str) -> str:
  # Follow the chain from the first link not seen yet; answer once every link has been seen.
  for name in chain:
    if name not in seen:
      return f"{read_action} {name}"
  return final


def _link_chain(rng, d, leaf, end=""):
  """(chain, {name: text}, code): d names, each pointing to the next ("next <name>"), the last holding
  "<leaf> <code>"; d decoys that look like real links (pointing among themselves or holding a wrong
  code), so only following the chain finds the code."""
  names, code = _names(rng, 2 * d), _code(rng)
  chain, decoys = names[:d], names[d:]
  data = {a: f"next {b}{end}" for a, b in zip(chain, chain[1:])}
  data[chain[-1]] = f"{leaf} {code}{end}"
  for name in decoys:
    data[name] = rng.choice([f"next {rng.choice(decoys)}{end}", f"{leaf} {_code(rng)}{end}"])
  return chain, data, code


@register
class FileLookup(SandboxEnv):
  family, tools, max_difficulty = "file_lookup", ("ls", "cat", "answer"), 4

  def generate(self, rng):
    chain, files, code = _link_chain(rng, self.difficulty, "code", "\n")
    return Task(f"Start at file {chain[0]}. Follow next links; answer the code.", files, code, chain)

  def oracle(self):
    return _chain_oracle(self.task.secret, self.state.get("read", {}), "cat", f"answer {self.task.answer}")


@register
class FileEdit(SandboxEnv):
  family, tools, max_difficulty = "file_edit", ("ls", "cat", "sh", "write", "submit"), 4
  readonly_tools = SandboxEnv.readonly_tools + ("submit",)  # verify reads the target from outside
  fork_lazily = False  # solving means writing the target: every row copies the sandbox anyway

  def generate(self, rng):
    target, src = _names(rng, 2)
    code = _code(rng)
    if self.difficulty == 1:
      return Task(f"Make file {target} contain {code}, then submit.", {}, secret=(target, code, None))
    if self.difficulty == 2:
      words = rng.sample([a + b for a in LETTERS for b in LETTERS], 4)
      old, new = words[0], words[3]
      line = " ".join(rng.sample(words[:3], 3))
      return Task(f"In file {target} replace {old} with {new}, then submit.",
                  {target: line + "\n"}, secret=(target, line.replace(old, new), (old, new)))
    if self.difficulty == 3:
      return Task(f"Put the code in file {src} into file {target}, then submit.",
                  {src: f"code {code}\n"}, secret=(target, code, (src,)))
    mid = rng.choice([n for n in _names(rng, 3) if n not in (target, src)])  # a hop before the code
    return Task(f"Follow file {src} to a code; put the code into file {target}, then submit.",
                {src: f"next {mid}\n", mid: f"code {code}\n"}, secret=(target, code, (src, mid)))

  def verify(self):
    target, want, _ = self.task.secret
    got = self.read_file(target)
    return got is not None and got.strip() == want

  def oracle(self):
    target, want, extra = self.task.secret
    if self.verify():
      return "submit"
    if self.difficulty == 2:
      return f"sh sed -i s/{extra[0]}/{extra[1]}/ {target}"
    if self.difficulty >= 3:  # the code has to come from the files: read them first
      read = _chain_oracle(extra, self.state.get("read", {}), "cat", "")
      if read:
        return read
    return f"sh echo {want} > {target}"


# The key-value service: trusted environment code that the core runs as the sandbox's long-lived service
# process. The task's data is baked into the source the service compiles, so it exists nowhere in the
# sandbox's files, only in that process's memory: snapshot / restore / fork must carry the process.
KV_SERVICE = r"""
import json

DATA = json.loads(%r)


def handle(request):
  op, _, rest = request.strip().partition(" ")
  key, _, val = rest.partition(" ")
  if op == "get" and key and not val:
    return DATA.get(key, "no such key")
  if op == "set" and key and val:
    DATA[key] = val
    return "ok"
  return "error: kv get <key> | kv set <key> <value>"
"""


@register
class KvQuery(SandboxEnv):
  family, tools, max_difficulty = "kv_query", ("kv", "answer"), 4

  def generate(self, rng):
    chain, data, code = _link_chain(rng, self.difficulty, "val")
    return Task(f"Ask kv for key {chain[0]}. Follow next links; answer the val.", {}, code, (chain, data))

  def setup(self):
    self.start_service("kv", KV_SERVICE % json.dumps(self.task.secret[1]))

  def changes_sandbox(self, tool, args):
    # KV_SERVICE's get only reads DATA: a lazily forked group's gets all go to the one shared service
    return not (tool == "kv" and args.partition(" ")[0] == "get") and super().changes_sandbox(tool, args)

  def tool_kv(self, args):
    op, _, rest = args.partition(" ")
    if op not in ("get", "set") or not rest:
      return self.usage("kv")
    out = self.service_request("kv", f"{op} {rest}")
    if op == "get" and not out.startswith(("no such key", "error")):
      self.state.setdefault("got", {})[rest] = out
    return out, 0.0, False, None

  def oracle(self):
    return _chain_oracle(self.task.secret[0], self.state.get("got", {}), "kv get", f"answer {self.task.answer}")


CHECK_PATH = "/srv/check_f.py"


@register
class PythonFn(SandboxEnv):
  family, tools, max_difficulty = "python_fn", ("ls", "cat", "sh", "write", "submit"), 4
  readonly_tools = SandboxEnv.readonly_tools + ("submit",)  # verify's check runs in a private copy (exec_hidden)
  fork_lazily = False  # solving means writing f.py: every row copies the sandbox anyway
  N_HIDDEN = 8

  def generate(self, rng):
    a, b, c = rng.randint(2, 9), rng.randint(1, 9), rng.randint(1, 9)
    files = {}
    if self.difficulty == 1:
      expr = spec = f"{a}*x+{b}"
    elif self.difficulty == 2:
      expr = spec = f"x+{a} if x>{c} else x*{b}"
    elif self.difficulty == 3:  # the formula has to be inferred from two values
      expr, spec = f"{a}*x+{b}", f"with f(0)={b} f(1)={a + b}"
    else:  # the formula has to be read from a file
      src = _names(rng, 1)[0]
      expr, spec, files = f"{a}*x+{b}", f"= the formula in file {src}", {src: f"{a}*x+{b}\n"}
    hidden = rng.sample(range(-40, 41), self.N_HIDDEN)
    # The hidden test: the core keeps hidden_files out of the agent's sandbox and writes them only into
    # the private copy of its files `exec_hidden` runs in, after the agent's last action. It prints f's outputs;
    # the verdict compares them with values computed here, host-side, from our own expression.
    check = (
      "import json\nns = {}\n"
      "exec(compile(open('/home/user/f.py').read(), 'f.py', 'exec'), ns)\n"
      f"print('RESULT', json.dumps([ns['f'](x) for x in {hidden!r}]))\n"
    )
    prompt = (f"In f.py define f(x) = {spec}, then submit." if self.difficulty < 3 else
              f"In f.py define f(x) {spec}, then submit.")
    return Task(prompt, files, secret=(expr, hidden), hidden_files={CHECK_PATH: check})

  def solution(self) -> str:
    """The oracle's f: text copied from the prompt / file, never computed. At difficulty 3 the slope is written
    f(1)-f(0), e.g. (12-3)*x+3, not 9*x+3: the byte-level policy copies numbers from its context well but did not
    learn the subtraction from its SFT data (session 19: the slope digit right ~1/8 of the time, chance).
    A lambda keeps the action short (<= 32 characters at difficulty 3)."""
    expr = self.task.secret[0]
    if self.difficulty == 3:
      a, b = (int(v) for v in expr.split("*x+"))
      expr = f"({a + b}-{b})*x+{b}"
    return f"f=lambda x:{expr}"

  def verify(self):
    expr, hidden = self.task.secret
    want = [eval(expr, {"x": x}) for x in hidden]  # our own generated expression, never agent text
    try:
      # `python3 -I -S CHECK_PATH` run by a fork of the hub's pre-started check interpreter (Sandbox.exec_python):
      # the interpreter start (~30 ms of CPU, the largest env cost of an RL batch) is gone; the check needs only
      # the standard library, and so does the task's f
      r = self._call(self.sb.exec_hidden, CHECK_PATH, timeout=5.0, python=True)
    except (OSError, ValueError) as e:  # the agent's changes stop the check from being written: a failed check
      self.note = f"check not run: {type(e).__name__}"
      return False
    lines = [ln for ln in _text_lines(r.stdout) if ln.startswith("RESULT ")]
    if r.timed_out or r.exit_code != 0 or not lines:
      err = (_text_lines(r.stderr) or [""])[-1]
      self.note = "check timed out" if r.timed_out else f"check exit {r.exit_code}: {clip(err, 80)}"
      return False
    try:
      ok = json.loads(lines[-1][len("RESULT "):]) == want
    except ValueError:
      ok = False
    self.note = None if ok else "check: wrong outputs"
    return ok

  def oracle(self):
    if clip(self.read_file("f.py") or "") == self.solution():
      return "submit"
    for src in self.task.files:  # d4: read the formula's file first
      if src not in self.state.get("read", {}):
        return f"cat {src}"
    return f"write f.py {self.solution()}"


def _text_lines(x) -> list[str]:
  if isinstance(x, bytes):
    x = x.decode("utf-8", errors="replace")
  return (x or "").splitlines()

