"""Env protocol and task families on real AgentEnv sandboxes (moonshot_jax/agentenv/envs.py, tasks.py)."""

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys

import pytest

from moonshot_jax import agentenv
from moonshot_jax.agentenv import envs
from tests.agentenv_testutil import require_namespaces

FAMILIES = ("file_lookup", "file_edit", "kv_query", "python_fn")


@pytest.fixture
def sandboxes():
  require_namespaces()  # skips, with the reason, on a machine without root + user/mount/pid/net namespaces


@pytest.mark.usefixtures("sandboxes")
def test_registry_and_bad_input():
  assert set(FAMILIES) <= set(envs.TASK_FAMILIES)
  with pytest.raises(ValueError, match="nosuch"):
    envs.make_env("nosuch")
  with pytest.raises(ValueError, match="difficulty"):
    envs.make_env("file_lookup", difficulty=envs.max_difficulty("file_lookup") + 1)
  with pytest.raises(ValueError, match="max_turns"):
    envs.make_env("file_edit", max_turns=0)
  with pytest.raises(ValueError, match="backend"):
    envs.make_env("file_edit", backend="k8s")
  with pytest.raises(ValueError, match="k8s"):
    agentenv.create("python", backend="k8s")
  env = envs.make_env("file_lookup")
  with pytest.raises(RuntimeError, match="before reset"):
    env.step("ls")
  with pytest.raises(ValueError, match="seed"):
    env.reset(-1)
  assert isinstance(env, envs.Env)
  lim = agentenv.Limits(memory_mb=128, pids=32)
  with envs.make_env("file_lookup", limits=lim) as env:
    env.reset(0)
    assert env.sb.limits == lim  # the env's sandboxes get the caller's limits


_GEN = """
import json, sys
from moonshot_jax import agentenv
from moonshot_jax.agentenv import envs
from tests.agentenv_testutil import require_namespaces
out = {}
for fam in envs.TASK_FAMILIES:
  for d in range(1, envs.max_difficulty(fam) + 1):
    env = envs.make_env(fam, difficulty=d)
    for seed in (0, 1, 2, 1_000_003):
      t = env.generate(envs.task_rng(fam, d, seed))
      out[f"{fam}/{d}/{seed}"] = [t.prompt, t.files, t.answer, repr(t.secret)]
print(json.dumps(out))
"""


def test_same_seed_same_task_across_processes():
  here = json.loads(subprocess.run([sys.executable, "-c", _GEN], capture_output=True, text=True, check=True).stdout)
  there = json.loads(subprocess.run([sys.executable, "-c", _GEN], capture_output=True, text=True, check=True).stdout)
  assert here == there and len(here) == 4 * sum(envs.max_difficulty(f) for f in envs.TASK_FAMILIES)
  for fam in envs.TASK_FAMILIES:  # different seeds -> different tasks
    tasks_d1 = [json.dumps(here[f"{fam}/1/{s}"]) for s in (0, 1, 2, 1_000_003)]
    assert len(set(tasks_d1)) == 4, fam
    assert all(len(here[f"{fam}/1/{s}"][0]) <= 80 for s in (0, 1, 2)), "prompts stay short for a tiny LM"


@pytest.mark.usefixtures("sandboxes")
@pytest.mark.parametrize("family", FAMILIES)
def test_oracle_solves_and_wrong_answer_scores_zero(family):
  for d in range(1, envs.max_difficulty(family) + 1):
    with envs.make_env(family, difficulty=d) as env:
      for seed in (0, envs.HELD_OUT_SEED + 5):
        prompt, steps = envs.rollout_oracle(env, seed)
        assert steps[-1][1].reward == 1.0, (family, d, seed, prompt, steps)
        assert len(steps) <= d + 2 and all(r.reward == 0 for _, r in steps[:-1])
        assert all(len(a) <= envs.ORACLE_ACTION_MAX and "\n" not in a for a, _ in steps)
        assert all(len(r.observation) <= envs.OBS_MAX and r.observation.isascii() for _, r in steps)
      # a wrong final action scores 0 and ends the episode
      env.reset(7)
      wrong = "answer zzz" if "answer" in env.tools else "submit"
      if family == "python_fn":
        assert not env.step("write f.py def f(x): return x").done
      r = env.step(wrong)
      assert (r.reward, r.done) == (0.0, True), (family, d, r)
      if family == "python_fn":
        assert r.info["verify"] == "check: wrong outputs", r
        env.reset(7)
        env.step("write f.py def f(x): return y")
        assert env.step("submit").info["verify"].startswith("check exit 1: NameError")
      with pytest.raises(RuntimeError, match="ended"):
        env.step("submit")


@pytest.mark.usefixtures("sandboxes")
@pytest.mark.parametrize("family", FAMILIES)
def test_forked_group_same_start_then_own_outcomes(family):
  with envs.make_env(family, difficulty=2) as env:
    prompt = env.reset(21)
    files = lambda e: e.exec("ls -la; cat * 2>&1").stdout  # the sandbox's working directory, contents included
    before = files(env)
    kids = env.fork(3)
    try:
      first = [k.oracle_action() for k in kids]
      results = [k.step(a) for k, a in zip(kids, first)]
      assert len(set(first)) == 1 and all(r == results[0] for r in results), (family, results)
      while True:  # kid 0 solves, kid 1 gives up wrong, kid 2 is left mid-episode
        r = kids[0].step(kids[0].oracle_action())
        if r.done:
          break
      assert r.reward == 1.0, (family, prompt, r)
      wrong = {"file_edit": [f"sh echo nope > {env.task.secret[0]}", "submit"],  # undo the shared first edit
               "python_fn": ["write f.py f=lambda x: 0", "submit"]}.get(family, ["answer zzz"])
      assert [kids[1].step(a).reward for a in wrong][-1] == 0.0 and kids[1].done and not kids[2].done
      assert (env.turn, env.done, env.oracle_action()) == (0, False, first[0]), "the parent stays at fork time"
      assert files(env) == before and (family in ("file_lookup", "kv_query") or files(kids[1]) != before)
    finally:
      for k in kids:
        k.close()


@pytest.mark.usefixtures("sandboxes")
def test_fork_group_identical_start_then_diverges():
  with envs.make_env("file_edit", difficulty=3) as env:
    prompt = env.reset(11)
    kids = env.fork(3)
    try:
      firsts = [k.oracle_action() for k in kids]
      obs = [k.step(a).observation for k, a in zip(kids, firsts)]
      assert len(set(firsts)) == 1 and len(set(obs)) == 1 and obs[0].startswith("code ")
      assert env.oracle_action() == firsts[0], "the children's steps leaked into the parent's episode state"
      target, code, _ = env.task.secret
      kids[0].step(f"sh echo {code} > {target}")
      kids[1].step(f"sh echo nope > {target}")
      assert [k.step("submit").reward for k in kids] == [1.0, 0.0, 0.0]
      assert env.read_file(target) is None and env.turn == 0, "the parent stays at fork time"
      assert prompt == env.task.prompt
    finally:
      for k in kids:
        k.close()


@pytest.mark.usefixtures("sandboxes")
def test_lazy_fork_copies_a_sandbox_only_for_a_row_that_changes_it(monkeypatch):
  """fork(lazy=True) shares the parent's sandbox: reads and submits run on it, a row's first write first gives that
  row a copy, the last row still sharing takes the original over, and every observation equals an eager fork's. A
  failed copy is the row's observation; the row keeps sharing."""
  live = lambda: agentenv.hub_stats()["sandboxes"]
  with envs.make_env("file_edit", difficulty=3) as env:
    env.reset(11)
    n0 = live()
    with pytest.raises(ValueError, match="lazy='yes'"):
      env.fork(1, lazy="yes")
    lazy, eager = env.fork(3, lazy=True), env.fork(3)  # (file_edit's default is eager: fork_lazily = False)
    shared = env.sb
    try:
      assert live() == n0 + 3 and all(k.sb is shared for k in lazy)
      a = env.oracle_action()  # a cat of the chain's first file
      assert a.startswith("cat ") and [k.step(a) for k in lazy] == [k.step(a) for k in eager]
      assert live() == n0 + 3, "reads copied a sandbox"
      target, code, _ = env.task.secret

      def broken(n):
        raise agentenv.SandboxError("no room")

      monkeypatch.setattr(shared, "fork", broken)
      r = lazy[0].step(f"sh echo {code} > {target}")
      assert r.info["error"] == "sandbox_crash" and "no room" in r.observation and lazy[0].sb is shared
      monkeypatch.undo()
      for rows in (lazy, eager):
        rows[0].step(f"sh echo {code} > {target}")
        rows[1].step(f"write {target} nope")
      assert live() == n0 + 5 and len({lazy[0].sb.id, lazy[1].sb.id, shared.id}) == 3
      assert lazy[2].step("submit") == eager[2].step("submit") and lazy[2].sb is shared, "a submit only reads"
      assert [k.step("submit").reward for k in lazy[:2]] == [1.0, 0.0]
      assert env.read_file(target) is None and env.sb is shared, "the rows' writes reached the parent"
      sid = env.snapshot()  # (a restore would write: the snapshot is of a copy of its own)
      assert env.sb is not shared and live() == n0 + 6
      env.step(f"write {target} parent")
      env.restore(sid)
      assert env.read_file(target) is None
    finally:
      for k in lazy + eager:
        k.close()
  assert live() == n0 - 1 and shared.closed, "a sandbox outlived its last user"


@pytest.mark.usefixtures("sandboxes")
def test_the_last_row_sharing_a_sandbox_takes_it_over():
  live = lambda: agentenv.hub_stats()["sandboxes"]
  with envs.make_env("python_fn", difficulty=1) as env:
    env.reset(3)
    n0 = live()
    kids = env.fork(2, lazy=True)
    shared = env.sb
    env.close()  # the parent leaves first: its sandbox stays for the rows still reading it
    assert not shared.closed and live() == n0
    kids[0].step("write f.py f=lambda x: 0")
    assert live() == n0 + 1 and kids[1].sb is shared
    kids[1].step(kids[1].oracle_action())  # the solution, written into the original: nobody else reads it now
    assert live() == n0 + 1 and kids[1].sb is shared
    assert [k.step("submit").reward for k in kids] == [0.0, 1.0]
    for k in kids:
      k.close()
  assert live() == n0 - 1 and shared.closed


@pytest.mark.usefixtures("sandboxes")
def test_lazy_fork_rows_stepping_at_once_each_end_on_their_own_sandbox():
  """The RL driver steps a group's rows from a thread pool: reads at once share the sandbox, first writes at once
  each make exactly one copy (7 forks; the last writer takes the original over)."""
  live = lambda: agentenv.hub_stats()["sandboxes"]
  with envs.make_env("file_edit", difficulty=1) as env:
    env.reset(4)
    n0 = live()
    rows = [env] + env.fork(7, lazy=True)
    listing = env.step("ls").observation

    def play(i):
      r = rows[i]
      seen = r.step("ls").observation
      r.step(f"write mine.txt row{i}")
      return seen, r.read_file("mine.txt")

    with cf.ThreadPoolExecutor(8) as ex:
      got = list(ex.map(play, range(8)))
    assert got == [(listing, f"row{i}\n") for i in range(8)]
    assert live() == n0 + 7 and len({r.sb.id for r in rows}) == 8
    for r in rows[1:]:
      r.close()
  assert live() == n0 - 1


def _files_containing(env, needle: str) -> list[str]:
  """Every readable file in the agent's sandbox holding `needle` (the probe runs as the agent does, and
  builds the needle from hex at run time so that its own command line and stdin cannot match). The host's
  read-only userland (/usr, /lib*, /bin, /sbin: nothing of ours can be written there) is skipped for time."""
  probe = (
    "import os\nn = bytes.fromhex(%r)\nhits = []\n"
    "for d, sub, files in os.walk('/'):\n"
    "    if d.startswith(('/proc', '/sys', '/dev', '/usr', '/lib', '/bin', '/sbin')): sub[:] = []; continue\n"
    "    for f in files:\n"
    "        try:\n"
    "            if n in open(os.path.join(d, f), 'rb').read(): hits.append(os.path.join(d, f))\n"
    "        except OSError: pass\n"
    "print('hits', hits)\n" % needle.encode().hex()
  )
  r = env.sb.exec("python3 -", stdin=probe, timeout=20)
  out = r.stdout.decode() if isinstance(r.stdout, bytes) else r.stdout
  assert r.exit_code == 0 and out.startswith("hits "), r
  return eval(out[len("hits "):])


@pytest.mark.usefixtures("sandboxes")
def test_kv_service_state_lives_in_memory_and_survives_fork():
  with envs.make_env("kv_query", difficulty=2) as env:
    env.reset(5)
    chain, data = env.task.secret
    assert env.step("kv get " + chain[0]).observation == data[chain[0]]
    r = env.step("kv set zz9 mine")  # in-memory state written before the fork
    assert r.observation == "ok"
    kids = env.fork(2)
    try:
      assert kids[0].step("kv get zz9").observation == "mine"
      kids[0].step("kv set zz9 kid0")
      assert kids[1].step("kv get zz9").observation == "mine", "a child's write leaked into its sibling"
      assert kids[0].step("kv get zz9").observation == "kid0"
      assert env.step("kv get zz9").observation == "mine", "a child's write leaked into the parent"
      # the task's data is in no file of the sandbox: only the service's memory holds it
      assert _files_containing(kids[1], "val " + env.task.answer) == []
      assert kids[1].step("kv get " + chain[1]).observation == "val " + env.task.answer
      assert kids[1].step("answer " + env.task.answer).reward == 1.0
    finally:
      for k in kids:
        k.close()


@pytest.mark.usefixtures("sandboxes")
def test_service_timeout_is_an_observation(monkeypatch):
  from moonshot_jax.agentenv import tasks

  slow = tasks.KV_SERVICE.replace("def handle(request):", "def handle(request):\n  if 'zz9' in request:\n"
                                  "    __import__('time').sleep(1.0)")
  monkeypatch.setattr(tasks, "KV_SERVICE", slow)
  monkeypatch.setattr(envs, "EXEC_TIMEOUT_S", 0.3)
  with envs.make_env("kv_query", difficulty=1) as env:
    env.reset(0)
    r = env.step("kv get zz9")
    assert (r.info.get("error"), r.reward, r.done) == ("timeout", 0.0, False), r
    monkeypatch.setattr(envs, "EXEC_TIMEOUT_S", 5.0)
    assert env.step("kv get " + env.task.secret[0][0]).observation.startswith("val ")


@pytest.mark.usefixtures("sandboxes")
def test_snapshot_restore_rolls_back_an_episode():
  with envs.make_env("kv_query", difficulty=2) as env:
    env.reset(9)
    chain, _ = env.task.secret
    env.step("kv set zz9 before")
    sid = env.snapshot()
    env.step("kv set zz9 after")
    r = env.step("answer zzz")
    assert r.done and r.reward == 0.0
    env.restore(sid)  # back to turn 1: not done, service memory as it was
    assert (env.turn, env.done) == (1, False)
    assert env.step("kv get zz9").observation == "before"
    assert env.oracle_action() == "kv get " + chain[0]
    while not (r := env.step(env.oracle_action())).done:
      pass
    assert r.reward == 1.0
    with pytest.raises(ValueError, match="unknown snapshot"):
      env.restore("nope")
  with envs.make_env("file_edit", difficulty=1) as env:
    env.reset(4)
    sid = env.snapshot()
    target, code, _ = env.task.secret
    env.step(f"sh echo {code} > {target}")
    env.restore(sid)
    assert env.read_file(target) is None and env.step("submit").reward == 0.0  # the file write was rolled back


@pytest.mark.usefixtures("sandboxes")
def test_bad_actions_become_observations(monkeypatch):
  with envs.make_env("file_edit", difficulty=1, max_turns=20) as env:
    env.reset(3)
    cases = [
      ("", "malformed"),
      ("cat a\ncat b", "malformed"),
      ("x" * (envs.ACTION_MAX + 1), "malformed"),
      ("rm -rf /", "unknown_tool"),
      ("kv get a", "unknown_tool"),  # not a tool of this family
      ("cat", "bad_args"),
      ("submit now", "bad_args"),
      ("cat nosuchfile", "exit_code"),
    ]
    for action, err in cases:
      r = env.step(action)
      assert (r.info.get("error"), r.reward, r.done) == (err, 0.0, False), (action, r)
    r = env.step("sh seq 1000")
    assert len(r.observation) == envs.OBS_MAX and r.observation.endswith("...")
    r = env.step("sh printf 'a\\377\\001b'")
    assert r.observation == "a??b"
    monkeypatch.setattr(envs, "EXEC_TIMEOUT_S", 0.5)
    r = env.step("sh sleep 30")
    assert (r.info.get("error"), r.done) == ("timeout", False)
    assert env.step("sh echo alive").observation == "alive", "the sandbox survives a timed-out command"
    env.sb.close()  # the sandbox dies under the agent
    r = env.step("sh echo hi")
    assert (r.info.get("error"), r.reward, r.done) == ("sandbox_crash", 0.0, False)
    assert env.step("submit").reward == 0.0


def _our_sandbox_inits() -> set:
  """pids of the sandbox init processes under THIS process's hub (never another user's sandboxes)."""
  from moonshot_jax.agentenv import sandbox

  hub, out = sandbox._Hub.get().proc.pid, set()
  for p in filter(str.isdigit, os.listdir("/proc")):
    try:
      if open(f"/proc/{p}/comm").read().strip() != "agentenv-init":
        continue
      q = int(p)
      while q > 1 and q != hub:  # walk up the parents to our hub
        q = int(next(ln for ln in open(f"/proc/{q}/status") if ln.startswith("PPid:")).split()[1])
      if q == hub:
        out.add(int(p))
    except (OSError, StopIteration):
      pass
  return out


@pytest.mark.usefixtures("sandboxes")
def test_sandbox_killed_under_the_agent_is_an_observation():
  with envs.make_env("file_lookup", difficulty=1) as env:
    env.reset(0)
    before = _our_sandbox_inits()
    env.reset(0)  # a new sandbox: its init is the one new process under our hub
    (init,) = _our_sandbox_inits() - before
    os.kill(init, signal.SIGKILL)
    for action in ("cat " + env.task.secret[0], "ls"):
      r = env.step(action)
      assert (r.info.get("error"), r.reward, r.done) == ("sandbox_crash", 0.0, False), r
      assert r.observation.startswith("error: sandbox failed")
    assert envs.rollout_oracle(env, 1)[1][-1][1].reward == 1.0  # reset brings a fresh sandbox


@pytest.mark.usefixtures("sandboxes")
def test_max_turns_ends_episode():
  with envs.make_env("file_lookup", difficulty=2, max_turns=2) as env:
    env.reset(0)
    assert not env.step("ls").done
    r = env.step("ls")
    assert r.done and r.reward == 0.0 and r.info.get("max_turns")


@pytest.mark.usefixtures("sandboxes")
def test_hidden_tests_unreadable_inside_sandbox():
  with envs.make_env("python_fn", difficulty=1, max_turns=20) as env:
    env.reset(2)
    hidden = env.task.secret[1]
    needle = ", ".join(map(str, hidden[:3]))  # how the hidden inputs appear in any list/repr/json of them
    assert needle not in env.task.prompt
    assert _files_containing(env, needle) == []  # python open() of every file
    skip = " ".join(f"--exclude-dir={d}" for d in ("proc", "sys", "dev", "usr", "lib", "lib64", "bin", "sbin"))
    r = env.step(f"sh grep -rlsF -e '{needle}' / {skip}")
    assert r.observation in ("exit 1", "exit 2"), r  # grep listed no file (2: some were unreadable)
    r = env.step("sh find / -xdev -name 'check*' 2>/dev/null | grep -v -e ^/usr -e ^/proc")
    assert r.observation == "exit 1", r
    r = env.step("cat /srv/check_f.py")
    assert r.info.get("error") == "exit_code" and "No such file" in r.observation, r
    assert env.step("write f.py def f(x): return " + env.task.secret[0]).observation == "ok"
    assert _files_containing(env, needle) == [], "still hidden after a solution is written"
    assert env.step("submit").reward == 1.0


@pytest.mark.usefixtures("sandboxes")
@pytest.mark.slow
def test_oracle_solves_every_seed_and_episodes_stay_short():
  """50 seeds (half held-out) per family x difficulty: the scripted solver must solve all of them (it is the
  SFT data), in the expected number of turns, and whole episodes stay short for a byte-level policy."""
  turns = {"file_lookup": lambda d: d + 1, "kv_query": lambda d: d + 1,
           "file_edit": lambda d: (2, 2, 3, 4)[d - 1], "python_fn": lambda d: (2, 2, 2, 3)[d - 1]}
  for family in envs.TASK_FAMILIES:
    for d in range(1, envs.max_difficulty(family) + 1):
      with envs.make_env(family, difficulty=d) as env:
        for i in range(50):
          seed = envs.HELD_OUT_SEED + i if i % 2 else i
          prompt, steps = envs.rollout_oracle(env, seed)
          assert steps[-1][1].reward == 1.0, (family, d, seed, prompt, steps, steps[-1][1].info)
          assert len(steps) == turns[family](d), (family, d, seed, steps)
          # the rollout text (prompt, then per turn "action\n= observation\n") fits well inside 384 bytes
          assert len(prompt) + sum(len(a) + len(r.observation) + 4 for a, r in steps) < 200, (family, d, seed)


@pytest.mark.usefixtures("sandboxes")
def test_file_tools_answered_without_a_process_equal_the_commands(monkeypatch):
  """`cat` / `ls` / `write` of plain files are answered by the sandbox's init (Sandbox.agent_op, no process):
  the observation must be the command's byte for byte, and whatever the command alone gets right (the
  agent's permissions, /proc, errors, stdin) must still go to the command."""
  with envs.make_env("python_fn", difficulty=4, max_turns=100) as env:
    env.reset(3)
    names = ["b", "Ab", "a_", "B", "zz9", "m", "C0", "k", "a", "Z"]  # C.UTF-8 order differs from creation order
    setup = "; ".join(f"printf 'x{i}\\n' > d/{n}" for i, n in enumerate(names))
    r = env.sb.exec(f"mkdir d && {setup} && printf '' > d/empty && touch d/.hid && echo secret > s && chmod 000 s && "
                    "ln -s d/k lnk && ln -s nowhere dang && mkdir own && chmod 000 own")
    assert r.exit_code == 0, r
    ran = []
    real_exec = env.sb.exec
    monkeypatch.setattr(env.sb, "exec", lambda cmd, **kw: ran.append(cmd) or real_exec(cmd, **kw))

    def command_obs(cmd, stdin=None, join_lines=False):
      return env._shell_obs(real_exec(cmd, stdin=stdin), join_lines)[0]

    fast = [("ls d", "ls -1 -- d", True), ("ls", "ls -1 -- .", True), ("cat d/b", "cat -- d/b", False),
            ("cat d/empty", "cat -- d/empty", False), ("cat /home/user/d/Ab", "cat -- /home/user/d/Ab", False),
            # missing plain names: the message the command prints, with the name as the agent wrote it
            ("cat nope", "cat -- nope", False), ("cat d/x_y.z-1", "cat -- d/x_y.z-1", False),
            ("cat ./d//gone", "cat -- ./d//gone", False), ("cat /home/user/zz", "cat -- /home/user/zz", False),
            ("ls nope", "ls -1 -- nope", True), ("ls d/none/", "ls -1 -- d/none/", True)]
    for action, cmd, join in fast:
      assert env.step(action).observation == command_obs(cmd, join_lines=join), action
    for name in ("nope", "d/x_y.z-1", "/home/user/zz"):  # the whole result, exit code included
      assert env.sb.agent_op("read", name) == real_exec("cat -- " + name), name
      assert env.sb.agent_op("list", name) == real_exec("ls -1 -- " + name), name
    assert env.step("ls d").observation == " ".join(sorted(names + ["empty"]))
    assert env.step("write d/new two words").observation == "ok"
    assert real_exec("stat -c '%U %a' d/new; cat d/new").stdout == b"user 644\ntwo words\n"
    assert ran == [], f"ran commands for calls the init answers: {ran}"
    slow = {"cat s": "cat: s: Permission denied",  # only init's own rights could read it
            "write s x": "Permission denied",
            "cat d": "cat: d: Is a directory",
            "cat :9": "cat: ':9': No such file or directory",  # a name the message quotes
            "cat dang": "cat: dang: No such file or directory",  # a dangling symlink: its target is the command's
            "cat no/such": "cat: no/such: No such file or directory",  # a missing directory on the way
            "cat own/x": "cat: own/x: Permission denied",  # a directory the agent cannot search
            "cat d/b/": "Not a directory", "cat -": "ok",  # "-" is cat's stdin (/dev/null)
            "cat /proc/self/status": "Name:?cat",  # the command's /proc (tab -> ?)
            "cat /usr/bin/true": "",  # off the overlay (a host bind): same bytes, but left to the command
            "write lnk y": "ok"}  # a symlink: init never writes through one (O_NOFOLLOW), `cat >` follows it
    for i, (action, want) in enumerate(slow.items()):
      assert want in env.step(action).observation, action
      assert len(ran) == i + 1, (action, ran)
    assert real_exec("cat d/b").stdout == b"x0\n"  # the refused write left nothing behind
    assert real_exec("cat d/k").stdout == b"y\n"


@pytest.mark.usefixtures("sandboxes")
def test_python_fn_check_runs_without_site_packages():
  """The hidden check's interpreter starts with -I -S (the site-packages scan was most of an RL batch's env
  time): an f that only works there passes, so the flag is what the verifier runs."""
  with envs.make_env("python_fn", difficulty=1, max_turns=20) as env:
    env.reset(5)
    expr = env.task.secret[0]
    assert env.step(f"write f.py import sys; f=lambda x: ({expr}) if sys.flags.no_site and sys.flags.isolated else 0"
                    ).observation == "ok"
    assert env.step("submit").reward == 1.0


@pytest.mark.usefixtures("sandboxes")
def test_recycling_envs_run_episodes_on_pooled_inits():
  """make_env(recycle=True): a closed episode's sandboxes (a group's parent and its forks) go back to the hub's pool
  and the next episodes run on them, oracle-solved as on new ones; the default stays off."""
  lim = agentenv.Limits(memory_mb=333)
  with envs.make_env("python_fn", limits=lim) as env:
    env.reset(0)
  st = agentenv.hub_stats()
  env = envs.make_env("python_fn", limits=lim, recycle=True)
  env.reset(1)
  kids = env.fork(2, lazy=False)  # three sandboxes to pool
  env.close()
  for k in kids:
    k.close()
  mid = agentenv.hub_stats()
  assert mid["pooled"] == st["pooled"] + 3 and mid["recycled"] == st["recycled"], (st, mid)
  try:
    for seed in (2, 3, 4):
      with envs.make_env("python_fn", limits=lim, recycle=True) as env:
        prompt, steps = envs.rollout_oracle(env, seed)
        assert steps[-1][1].reward == 1.0, (seed, prompt, steps)
    end = agentenv.hub_stats()
    assert end["recycled"] == mid["recycled"] + 3 and end["pooled"] == mid["pooled"], (mid, end)
  finally:
    agentenv.drop_recycled()  # (the hub is shared with the other test files of this process)
  with pytest.raises(ValueError, match="recycle"):
    envs.make_env("python_fn", recycle="yes")
