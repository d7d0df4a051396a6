"""The task families: procedurally generated from (difficulty, seed), verified from outside the agent's view.

Sized for a tiny byte-level LM: 2-char file names and keys, 3-char codes, prompts under ~80 characters,
2-4 turns per solved episode. Each answer has to be read from the prompt or an observation (a random code,
a file name, a formula), so a policy cannot memorise it; `difficulty` adds hops or a harder edit.

| family      | tools                         | difficulty 1 .. max                                           |
| file_lookup | ls cat answer                 | d files chained by "next <name>"; the last holds "code <c>"  |
| file_edit   | ls cat sh write submit        | 1 write a given text, 2 replace a word, 3 copy a code across |
| kv_query    | kv answer                     | d keys chained in an in-memory key-value service             |
| python_fn   | ls cat sh write submit        | 1 a*x+b, 2 a conditional, 3 linear from two examples         |
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


@register
class FileLookup(SandboxEnv):
    family, tools, max_difficulty = "file_lookup", ("ls", "cat", "answer"), 4

    def generate(self, rng):
        d = self.difficulty
        names, code = _names(rng, 2 * d), _code(rng)
        chain, decoys = names[:d], names[d:]
        files = {a: f"next {b}\n" for a, b in zip(chain, chain[1:])}
        files[chain[-1]] = f"code {code}\n"
        for name in decoys:  # decoys look like real links: only following the chain finds the code
            files[name] = rng.choice([f"next {rng.choice(decoys)}\n", f"code {_code(rng)}\n"])
        return Task(f"Start at file {chain[0]}. Follow next links; answer the code.", files, code, chain)

    def oracle(self):
        return _chain_oracle(self.task.secret, self.state.get("read", {}), "cat", f"answer {self.task.answer}")


@register
class FileEdit(SandboxEnv):
    family, tools, max_difficulty = "file_edit", ("ls", "cat", "sh", "write", "submit"), 3

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
        return Task(f"Put the code in file {src} into file {target}, then submit.",
                    {src: f"code {code}\n"}, secret=(target, code, src))

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
        if self.difficulty == 3 and extra not in self.state.get("read", {}):
            return f"cat {extra}"  # the code has to come from the file: read it first
        return f"sh echo {want} > {target}"


# The key-value service: a python3 process inside the sandbox; its data exists only in its memory (the
# file it was loaded from is deleted at start), so snapshot/fork must carry the process to keep the task.
KV_SERVER = r"""
import json, os, sys
path = sys.argv[1]
with open(path) as f:
    data = json.load(f)
os.remove(path)
for line in sys.stdin:
    op, _, rest = line.strip().partition(" ")
    key, _, val = rest.partition(" ")
    if op == "get":
        out = data.get(key, "no such key")
    elif op == "set" and key and val:
        data[key], out = val, "ok"
    else:
        out = "error: kv get <key> | kv set <key> <value>"
    sys.stdout.write(out + "\n")
    sys.stdout.flush()
"""


@register
class KvQuery(SandboxEnv):
    family, tools, max_difficulty = "kv_query", ("kv", "answer"), 4

    def generate(self, rng):
        d = self.difficulty
        keys, code = _names(rng, 2 * d), _code(rng)
        chain, decoys = keys[:d], keys[d:]
        data = {a: f"next {b}" for a, b in zip(chain, chain[1:])}
        data[chain[-1]] = f"val {code}"
        for k in decoys:
            data[k] = rng.choice([f"next {rng.choice(decoys)}", f"val {_code(rng)}"])
        return Task(f"Ask kv for key {chain[0]}. Follow next links; answer the val.", {}, code, (chain, data))

    def setup(self):
        self.sb.write_file("/srv/kv.py", KV_SERVER)
        self.sb.write_file("/srv/kv.json", json.dumps(self.task.secret[1]))
        self.start_service("python3 -u /srv/kv.py /srv/kv.json")

    def tool_kv(self, args):
        op, _, rest = args.partition(" ")
        if op not in ("get", "set") or not rest:
            return "error: kv get <key> | kv set <key> <value>", 0.0, False, "bad_args"
        out = self.service_request(f"{op} {rest}")
        if op == "get" and not out.startswith(("no such key", "error")):
            self.state.setdefault("got", {})[rest] = out
        return out, 0.0, False, None

    def oracle(self):
        return _chain_oracle(self.task.secret[0], self.state.get("got", {}), "kv get", f"answer {self.task.answer}")


@register
class PythonFn(SandboxEnv):
    family, tools, max_difficulty = "python_fn", ("ls", "cat", "sh", "write", "submit"), 3
    N_HIDDEN = 8

    def generate(self, rng):
        a, b, c = rng.randint(2, 9), rng.randint(1, 9), rng.randint(1, 9)
        if self.difficulty == 1:
            expr, spec = f"{a}*x+{b}", f"returning {a}*x+{b}"
        elif self.difficulty == 2:
            expr = f"x+{a} if x>{c} else x*{b}"
            spec = f"returning {expr}"
        else:
            expr, spec = f"{a}*x+{b}", f"with f(0)={b} f(1)={a + b}"
        hidden = rng.sample(range(-40, 41), self.N_HIDDEN)  # the hidden tests: never written into the agent's sandbox
        return Task(f"In f.py write def f(x) {spec}, then submit.", {}, secret=(expr, hidden))

    def solution(self) -> str:
        return f"def f(x): return {self.task.secret[0]}"

    def verify(self):
        """Runs the hidden tests in a fresh verifier sandbox the agent never controlled, on a copy of f.py."""
        src = self.read_file("f.py")
        if src is None:
            return False
        expr, hidden = self.task.secret
        want = [eval(expr, {"x": x}) for x in hidden]  # our own generated expression, not agent text
        runner = (
            "import json\nns = {}\n"
            f"exec(compile({src!r}, 'f.py', 'exec'), ns)\n"
            f"print('RESULT', json.dumps([ns['f'](x) for x in {hidden!r}]))\n"
        )
        verifier = self._create_sandbox()
        try:
            r = verifier.exec("python3 -", stdin=runner, timeout=5.0)
        finally:
            verifier.close()
        lines = [ln for ln in _text_lines(r.stdout) if ln.startswith("RESULT ")]
        if r.timed_out or r.exit_code != 0 or not lines:
            return False
        try:
            return json.loads(lines[-1][len("RESULT "):]) == want
        except ValueError:
            return False

    def oracle(self):
        if clip(self.read_file("f.py") or "") == self.solution():
            return "submit"
        return f"write f.py {self.solution()}"


def _text_lines(x) -> list[str]:
    if isinstance(x, bytes):
        x = x.decode("utf-8", errors="replace")
    return (x or "").splitlines()

