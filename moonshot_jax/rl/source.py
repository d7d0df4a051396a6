"""The batch source of agent training runs: launch/train.py's loop with an `rl` config section.

  rl.algorithm = "sft"   rows are scripted-solver trajectories (env.oracle_action() until done) in
                         the rollout text format; loss = next-token CE on the action tokens only.
  rl.algorithm = "grpo"  rows are policy rollouts, data.batch_size // rl.group_size groups of G
                         rollouts, each group one reset env and G - 1 forks of it; loss = rl/grpo.py's.

Both keep the loop's contract: `next_batch(state)` gives the [B, T] batch (sampled with the state's
current weights: the rollout engine reads the trainer's device arrays directly), `get_state()` /
`set_state()` round-trip through the checkpoint as JSON, so a killed run restarts exactly: task
index, and the partial rollouts in flight (tokens, log-probs, actions; their sandboxes are rebuilt
by reset(seed) + fork + replaying the actions, which the envs guarantee to be deterministic).
Sampling keys derive from the TrainState's checkpointed RNG.

Several updates per rollout batch (PPO-style, as verl / Tunix do): a rollout collects
rl.minibatches x (data.batch_size / G) groups; the loop's next rl.ppo_epochs x rl.minibatches steps
each train one minibatch of data.batch_size of its rows (rows reshuffled per epoch). old_logp stays
the sampler's, so from the second update on the ratio moves and the clip acts. The unconsumed rows
are checkpoint state (JSON), so a restart resumes mid-batch exactly.

Dynamic sampling (DAPO, rl.dynamic_sampling): finished groups whose G rewards are all equal carry
no advantage; they are dropped and fresh groups are rolled out in their place, at most
rl.max_sample_rounds rounds per batch (slots still empty after that train nothing).

Exploration (rl.temperature != 1): training rollouts sample at that temperature, but the trained
policy is the T=1 one: after a batch is rolled out, its policy tokens' old_logp are recomputed at
T=1 under the sampling weights (one forward pass), so the PPO ratio compares T=1 policies and the
temperature only changes which trajectories are tried (an off-policy exploration distribution, not
importance-corrected). Not combined with partial rollouts (validated).

Partial rollouts (rl.turns_per_iteration > 0): a group still running after that many turns is kept
and continued next step (history re-prefilled under the new weights; its earlier tokens keep the
log-probs of the policy that sampled them, so the PPO ratio importance-corrects them). A group
trains once all its G rollouts are done; unfinished groups' batch rows are empty (mask 0).
"""
from __future__ import annotations

import concurrent.futures as cf
import importlib
import time
import types
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from moonshot_jax.config import ConfigError
from moonshot_jax.rl import grpo
from moonshot_jax.rl import rollout as ro
from moonshot_jax.train.tokenizer import ByteTokenizer

ALGORITHMS = ("sft", "grpo")
HELDOUT_SEED = 1_000_000  # seeds >= this are held out (the envs' split)


def rl_section(**overrides) -> ml_collections.ConfigDict:
  d = dict(
      algorithm="grpo",
      env_module="moonshot_jax.agentenv.envs",  # module with make_env(family, ...) and TASK_FAMILIES
      families="",  # comma-separated subset of TASK_FAMILIES; "" = all
      difficulty=1,
      # training tasks (SFT and GRPO), round-robin: "" = `families` at `difficulty`; else comma-separated
      # `family` / `family@difficulty` entries (a curriculum). Held-out evaluation stays on `families` at
      # `difficulty`, so runs that train on different mixes are scored on the same tasks.
      train_mix="",
      max_turns=6,
      env_backend="local",
      # sandboxes of rollouts come from / go back to the hub's pool of recycled inits (agentenv.create(recycle=True)):
      # the env module's make_env then gets recycle=True (only then: modules without the keyword work with False)
      sandbox_recycle=True,
      env_workers=8,  # threads stepping environments concurrently
      group_size=8,  # G rollouts per task
      adv_norm="std",  # "std" (GRPO) | "none" (Dr.GRPO)
      clip_low=0.2,
      clip_high=0.28,  # > clip_low: DAPO clip-higher
      kl_coef=0.0,
      max_action_tokens=48,
      max_obs_chars=200,
      turns_per_iteration=0,  # > 0: partial rollouts, cut after this many turns per step
      ppo_epochs=1,  # updates on each rollout batch (> 1: the PPO clip becomes active)
      minibatches=1,  # a rollout batch is this many train batches (data.batch_size rows each)
      dynamic_sampling=False,  # DAPO: drop groups without reward spread, roll out new ones
      max_sample_rounds=3,  # rollout rounds per batch at most when dynamic_sampling is on
      # GRPO training rollouts sample at this temperature (> 1: explore a near-deterministic start);
      # the trained policy stays the T=1 one: old_logp is recomputed at T=1 (see _collect). Held-out
      # evaluation is unaffected (greedy, or T=1 with launch.eval_agent --sample).
      temperature=1.0,
      shuffle_rewards=False,  # control run: rewards permuted across the batch's episodes
      init_workdir="",  # GRPO: start from this run's checkpoint (params + balancing biases)
      # which of init_workdir's checkpoints: 0 = the newest; N = step N (e.g. an SFT run's earlier,
      # less peaked checkpoint, so the start keeps sampling spread for GRPO to work on)
      init_step=0,
      seed_offset=0,  # training task seeds are seed_offset + task index (< HELDOUT_SEED)
      eval_every=0,  # > 0: held-out greedy success every this many steps (metrics "heldout_success")
      eval_episodes=32,
  )
  d.update(overrides)
  return ml_collections.ConfigDict(d)


def validate(cfg) -> None:
  rc = cfg.rl

  def need(ok, key, msg):
    if not ok:
      raise ConfigError(f"rl.{key}: {msg} (got {rc[key]!r})")

  need(rc.algorithm in ALGORITHMS, "algorithm", f"must be one of {ALGORITHMS}")
  need(rc.adv_norm in grpo.ADV_NORMS, "adv_norm", f"must be one of {grpo.ADV_NORMS}")
  need(rc.group_size >= 2 or rc.algorithm == "sft", "group_size", "GRPO needs >= 2 rollouts per group")
  need(int(cfg.data.batch_size) % max(int(rc.group_size), 1) == 0, "group_size",
       f"must divide data.batch_size={cfg.data.batch_size}")
  need(rc.max_turns >= 1, "max_turns", "must be >= 1")
  need(rc.env_workers >= 1, "env_workers", "must be >= 1")
  need(1 <= rc.max_action_tokens < int(cfg.data.seq_len), "max_action_tokens", "must be in [1, data.seq_len)")
  need(rc.max_obs_chars >= 1, "max_obs_chars", "must be >= 1")
  need(rc.turns_per_iteration >= 0, "turns_per_iteration", "must be >= 0 (0 = run episodes to the end)")
  need(rc.ppo_epochs >= 1, "ppo_epochs", "must be >= 1")
  need(rc.minibatches >= 1, "minibatches", "must be >= 1")
  need(rc.max_sample_rounds >= 1, "max_sample_rounds", "must be >= 1")
  need(isinstance(rc.temperature, (int, float)) and 0.1 <= rc.temperature <= 4.0, "temperature",
       "must be a number in [0.1, 4]")
  need(rc.temperature == 1.0 or rc.turns_per_iteration == 0, "temperature",
       "!= 1 needs turns_per_iteration=0 (partial rollouts keep earlier turns' sampler log-probs)")
  need(0 <= rc.seed_offset < HELDOUT_SEED, "seed_offset", f"training seeds must stay below {HELDOUT_SEED}")
  need(rc.eval_every >= 0 and rc.eval_episodes >= 1, "eval_every", "eval_every >= 0, eval_episodes >= 1")
  for e in _mix_entries(rc.train_mix):
    fam, at, d = e.partition("@")
    need(fam and (not at or (d.isdigit() and int(d) >= 1)), "train_mix",
         f"entry {e!r}: expected family or family@difficulty (difficulty an int >= 1)")
  if cfg.data.tokenizer != "byte":
    raise ConfigError(f'data.tokenizer: agent runs use "byte" (the rollout text format), got {cfg.data.tokenizer!r}')
  grpo.GRPOConfig(float(rc.clip_low), float(rc.clip_high), float(rc.kl_coef))
  if rc.init_workdir and not (Path(rc.init_workdir).expanduser() / "checkpoints").is_dir():
    raise ConfigError(f"rl.init_workdir: no checkpoints/ under {rc.init_workdir!r} (run the SFT config first)")
  need(isinstance(rc.init_step, int) and rc.init_step >= 0, "init_step", "must be an int >= 0 (0 = newest)")
  if rc.init_workdir and rc.init_step:  # (init_step without init_workdir: an error when a run starts, init_checkpoint;
    checkpoint_step(Path(rc.init_workdir).expanduser() / "checkpoints", int(rc.init_step))  # a preset may set it)


def step_options(cfg) -> dict:
  """make_train_step keyword arguments for this config (the loop's `build` passes them through)."""
  validate(cfg)
  if cfg.rl.algorithm == "sft":
    return {}
  gc = grpo.GRPOConfig(float(cfg.rl.clip_low), float(cfg.rl.clip_high), float(cfg.rl.kl_coef),
                       float(cfg.model.z_loss_coef))
  return {"loss_fn": grpo.rl_objective(gc), "extra_fields": grpo.RL_FIELDS}


def families(cfg) -> tuple[str, ...]:
  mod = importlib.import_module(cfg.rl.env_module)
  known = tuple(mod.TASK_FAMILIES)
  want = tuple(f.strip() for f in str(cfg.rl.families).split(",") if f.strip()) or known
  bad = [f for f in want if f not in known]
  if bad:
    raise ConfigError(f"rl.families: unknown {bad}; {cfg.rl.env_module} has {known}")
  return want


def _mix_entries(mix) -> list[str]:
  return [e.strip() for e in str(mix).split(",") if e.strip()]


def train_tasks(cfg) -> tuple[str, ...]:
  """The training runs' task entries (families round-robin over them): rl.train_mix, or families(cfg).
  An entry is a family, or `family@difficulty` for that family at another difficulty than rl.difficulty."""
  mix = _mix_entries(cfg.rl.train_mix)
  if not mix:
    return families(cfg)
  mod = importlib.import_module(cfg.rl.env_module)
  for e in mix:
    fam, at, d = e.partition("@")
    if fam not in mod.TASK_FAMILIES:
      raise ConfigError(f"rl.train_mix: unknown family in {e!r}; {cfg.rl.env_module} has {tuple(mod.TASK_FAMILIES)}")
    top = mod.max_difficulty(fam) if hasattr(mod, "max_difficulty") else None
    if at and top is not None and not 1 <= int(d) <= top:
      raise ConfigError(f"rl.train_mix: {e!r}: {fam} has difficulties 1..{top}")
  return tuple(mix)


def make_env(cfg, family: str):
  """An env of a task entry: `family` (at rl.difficulty) or `family@difficulty`."""
  mod = importlib.import_module(cfg.rl.env_module)
  fam, at, d = family.partition("@")
  kw = dict(recycle=True) if bool(cfg.rl.sandbox_recycle) else {}
  return mod.make_env(fam, difficulty=int(d) if at else int(cfg.rl.difficulty), max_turns=int(cfg.rl.max_turns),
                      backend=str(cfg.rl.env_backend), **kw)


def task(cfg, fams: Sequence[str], index: int, seed_base: int) -> tuple[str, int]:
  """Task `index` of a run: families round-robin, seed seed_base + index."""
  return fams[index % len(fams)], seed_base + index


def make_sampler(cfg, trainer, fixed_shapes: bool = False) -> ro.Sampler:
  """fixed_shapes: the training run's sampler. Every rollout round (the first, DAPO's extra rounds with however
  many groups were dropped, held-out evaluation up to that size) then runs in one batch of a rollout batch's rows,
  and prefills the distinct prompts on one rollout batch's group count of rows, so the decode loop's shapes are
  compiled once, in the first step (ro.Sampler)."""
  kw = {}
  if fixed_shapes:
    rows = int(cfg.data.batch_size) * int(cfg.rl.minibatches)
    kw = dict(rows=rows, prefill_rows=rows // int(cfg.rl.group_size))
  return ro.Sampler(trainer.model_cfg, int(cfg.data.seq_len) + 1, int(cfg.rl.max_action_tokens),
                    int(cfg.rl.max_obs_chars), mesh=trainer.mesh, strategy=str(cfg.mesh.strategy), **kw)


def policy_variables(trainer, state) -> dict:
  """The rollout engine's weights: the trainer's device arrays in the plain Transformer layout."""
  return trainer.model.to_model_layout({"params": state.params, "moe_state": state.moe_state})


# ---- batches -------------------------------------------------------------------------------------
def pack_rows(rows: Sequence[ro.Rollout | None], B: int, T: int, adv: Sequence[float] | None = None) -> dict:
  """Rollouts -> the [B, T] batch (tokens / targets shifted by one; loss on policy tokens only).
  None entries become empty rows."""
  tokens = np.zeros((B, T), np.int32)
  targets = np.zeros((B, T), np.int32)
  seg = np.zeros((B, T), np.int32)
  mask = np.zeros((B, T), np.int32)
  old = np.zeros((B, T), np.float32)
  a_BT = np.zeros((B, T), np.float32)
  for b, r in enumerate(rows):
    if r is None:
      continue
    L = min(len(r.tokens), T + 1)
    if L < 2:
      continue
    tokens[b, :L - 1] = r.tokens[:L - 1]
    targets[b, :L - 1] = r.tokens[1:L]
    seg[b, :L - 1] = 1
    mask[b, :L - 1] = r.policy[1:L]
    old[b, :L - 1] = r.logp[1:L]
    if adv is not None:
      a_BT[b, :L - 1] = adv[b] * np.asarray(r.policy[1:L], np.float32)
  out = dict(tokens=tokens, targets=targets, segment_ids=seg, loss_mask=mask,
             positions=np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy())
  if adv is not None:
    out.update(advantages=a_BT, old_logp=old, ref_logp=old.copy())
  return out


def set_policy_logp(rows: Sequence[ro.Rollout], B: int, T: int, logp_fn) -> None:
  """Overwrites each row's policy-token log-probs with logp_fn's ([B, T] batch -> [B, T] log-probs of
  its targets), packing rows B at a time; prompt / observation entries are left as they are."""
  for lo in range(0, len(rows), B):
    chunk = list(rows[lo:lo + B])
    lp = np.asarray(logp_fn(pack_rows(chunk + [None] * (B - len(chunk)), B, T)), np.float32)
    for b, r in enumerate(chunk):
      L = min(len(r.tokens), T + 1)
      r.logp = [float(lp[b, t - 1]) if t >= 1 and t < L and r.policy[t] else v for t, v in enumerate(r.logp)]


def update_schedule(n_rows: int, n_slots: int, B: int, epochs: int, rng: np.random.Generator) -> list[list[int]]:
  """The minibatches of one rollout batch: per epoch its rows 0..n_rows-1, padded with -1 (empty rows)
  to n_slots (a multiple of B), in a fresh random order, cut into minibatches of B row indices. A
  single minibatch keeps the rollout order in its first epoch."""
  if not (0 <= n_rows <= n_slots and B >= 1 and n_slots % B == 0 and epochs >= 1):
    raise ValueError(f"update_schedule: need 0 <= n_rows={n_rows} <= n_slots={n_slots}, n_slots a multiple of "
                     f"B={B}, epochs={epochs} >= 1")
  slots = np.concatenate([np.arange(n_rows), -np.ones(n_slots - n_rows, np.int64)])
  order = []
  for epoch in range(epochs):
    perm = slots if (epoch == 0 and n_slots == B) else rng.permutation(slots)
    order += [[int(i) for i in perm[j:j + B]] for j in range(0, n_slots, B)]
  return order


def oracle_rollout(cfg, family: str, seed: int, tok) -> ro.Rollout:
  """The scripted solver's trajectory in the rollout format (policy flag on its action tokens)."""
  env = make_env(cfg, family)
  try:
    r = ro.Rollout.start(tok, family, seed, -1, env.reset(seed), None)
    for _ in range(int(cfg.rl.max_turns)):
      action = env.oracle_action()
      ids = ro.action_tokens(tok, action)
      r.tokens += ids
      r.policy += [1] * len(ids)
      r.logp += [0.0] * len(ids)
      r.actions.append(action)
      obs, reward, done, info, _ = ro.safe_step(env, action)
      if done:
        r.reward, r.done = reward, True
        break
      ids = ro.observation_tokens(tok, obs, int(cfg.rl.max_obs_chars))
      r.tokens += ids
      r.policy += [0] * len(ids)
      r.logp += [0.0] * len(ids)
    return r
  finally:
    env.close()


def start_group(cfg, family: str, seed: int, group: int, tok) -> list[ro.Rollout]:
  """G rollouts of one task: the reset env and G - 1 forks of it (fork copies the exact state: all G start
  identical and evolve independently). fork(G) followed by closing the parent, as before session 25, made and
  closed one sandbox more per group (its services too). The forks are lazy where the family says so (SandboxEnv.fork,
  fork_lazily: file_lookup, kv_query): the rows share the reset sandbox until each one's first action that changes
  it, so rows that only read (ls / cat / kv get / answer) cost no sandbox of their own."""
  env = make_env(cfg, family)
  G = int(cfg.rl.group_size)
  try:
    prompt = env.reset(seed)
    envs = [env] + (env.fork(G - 1) if G > 1 else [])
  except BaseException:
    env.close()
    raise
  return [ro.Rollout.start(tok, family, seed, group, prompt, e) for e in envs]


def rounds_ahead(rc) -> int:
  """Sampling rounds of new tasks that _collect starts (reset + fork) while the batch trains."""
  return 2 if rc.dynamic_sampling and int(rc.max_sample_rounds) > 1 else 1


def sandboxes_in_flight(cfg) -> int:
  """The most rollout sandboxes alive at once (fewer where rows only read: lazy forks): a batch's sampling rounds
  (groups of G: a reset sandbox and G - 1 forks of it, start_group) closing while the next rounds' groups start.
  With rl.sandbox_recycle the hub's pool must be able to hold this many (AGENTENV_RECYCLE_MAX), or part of every
  batch starts new inits (session 24: env share of a GRPO step's CPU 35% with a pool of 64 vs 24% with 256, default
  recipe)."""
  rc, G = cfg.rl, int(cfg.rl.group_size)
  groups = int(cfg.data.batch_size) * int(rc.minibatches) // G
  rounds = int(rc.max_sample_rounds) if rc.dynamic_sampling else 1
  return G * groups * (rounds + rounds_ahead(rc))


def _close_envs(envs) -> None:
  for env in envs:
    env.close()


def _jsonable_row(r: ro.Rollout) -> dict:
  return dict(tokens=r.tokens, policy=r.policy, logp=[float(x) for x in r.logp], actions=r.actions,
              reward=r.reward, done=r.done, turns=r.turns, errors=r.errors, entropy_sum=r.entropy_sum)


def _row_from_json(d: dict) -> ro.Rollout:
  r = ro.Rollout("", 0, -1, [], [], [])
  for k, v in d.items():
    setattr(r, k, list(v) if isinstance(v, list) else v)
  return r


def _rebuild_group(cfg, g: dict, tok) -> list[ro.Rollout]:
  rows = start_group(cfg, g["family"], g["seed"], g["group"], tok)
  for r, saved in zip(rows, g["rows"]):
    for a in saved["actions"]:  # the envs are deterministic: replaying gives the saved state
      ro.safe_step(r.env, a)
    for k, v in saved.items():
      setattr(r, k, list(v) if isinstance(v, list) else v)
    if r.done:
      r.env.close()
  return rows


def _checkpoints(directory: Path):
  """The project's Checkpointer over another run's checkpoints/ (read-only use: steps, restore_subset).
  A missing directory is a ConfigError here: the Checkpointer would create it."""
  from moonshot_jax.train.checkpoint import Checkpointer
  if not Path(directory).is_dir():
    raise ConfigError(f"rl.init_workdir: no checkpoint steps under {directory} (run the SFT config first)")
  return Checkpointer(directory, async_save=False)


def _pick_step(steps: Sequence[int], directory: Path, step: int) -> int:
  if not steps:
    raise ConfigError(f"rl.init_workdir: no checkpoint steps under {directory}")
  if step and step not in steps:
    raise ConfigError(f"rl.init_step: no checkpoint step {step} under {directory} (it has {list(steps)})")
  return step or steps[-1]


def checkpoint_step(directory: Path, step: int = 0) -> int:
  """The checkpoint step to read under `directory`: the newest (step 0) or `step`, which must exist;
  the steps are Checkpointer.steps()'s (completed saves, numerically sorted)."""
  ck = _checkpoints(directory)
  try:
    return _pick_step(ck.steps(), directory, step)
  finally:
    ck.close()


def init_checkpoint(rc) -> tuple[Path, int] | None:
  """(checkpoints dir, step) a run starts from, None without rl.init_workdir. Checked here, at the run's
  start, not in validate(): a preset sets init_step before the command line gives init_workdir."""
  if not rc.init_workdir:
    if rc.init_step:
      raise ConfigError(f"rl.init_step: {rc.init_step} needs rl.init_workdir (the run whose checkpoint it picks)")
    return None
  directory = Path(rc.init_workdir).expanduser() / "checkpoints"
  return directory, checkpoint_step(directory, int(rc.init_step))


def restore_params(directory: Path, abstract_state, step: int = 0) -> dict:
  """{"params", "moe_state"} of checkpoint `step` (0 = the newest) under `directory`, another run's
  checkpoints (nothing there is modified), through Checkpointer.restore_subset: each leaf is checked
  against its saved shape / dtype and fingerprint, so a checkpoint of another model or with damaged
  files is a ConfigError naming the step and the leaf (exact=True: also a leaf the checkpoint has and this
  model lacks). Only these two are read: the other run's optimizer may differ. The saved fingerprints follow
  its state's leaf order (step, params, opt_state, moe_state, rng, bad_steps), so `abstract_state` is given
  that run's optimizer leaf count."""
  from moonshot_jax.train.checkpoint import CheckpointMismatch, CorruptCheckpoint
  subset = {"params": abstract_state.params, "moe_state": abstract_state.moe_state}
  ck = _checkpoints(directory)
  try:
    step = _pick_step(ck.steps(), directory, step)

    def layout(saved):  # (from the metadata restore_subset reads anyway: read once)
      n_opt = sum(k[0] == "opt_state" for k in saved)
      return abstract_state.replace(opt_state=[jax.ShapeDtypeStruct((), jnp.int32)] * n_opt)
    out = ck.restore_subset(step, subset, layout, exact=True)  # exact: another model's extra leaves too
  except (CheckpointMismatch, CorruptCheckpoint) as e:
    raise ConfigError(f"rl.init_workdir: {e}") from e
  finally:
    ck.close()
  print(f"[rl] initial weights: step {step} of {directory}", flush=True)
  return {"params": out["params"], "moe_state": out["moe_state"]}


class AgentSource:
  """Data-pipeline stand-in for agent runs (see the module docstring)."""

  def __init__(self, cfg, workdir, trainer):
    validate(cfg)
    self.cfg, self.trainer, self.workdir = cfg, trainer, Path(workdir)
    self.rc = cfg.rl
    self.tokenizer = ByteTokenizer()
    self.fams = train_tasks(cfg)
    self.B, self.T = int(cfg.data.batch_size), int(cfg.data.seq_len)
    self.local_batch_size = self.B
    self.G = int(self.rc.group_size)
    self.pool = cf.ThreadPoolExecutor(int(self.rc.env_workers))
    self.sampler = make_sampler(cfg, trainer, fixed_shapes=self.rc.algorithm == "grpo")
    self.pos = 0
    self.pending: list[list[ro.Rollout]] = []
    # the rollout batch being trained on: rows, their advantages, the minibatches still to train
    self.buffer: dict[str, Any] = {"rows": [], "adv": [], "order": [], "metrics": {}}
    self._prefetch: dict[int, cf.Future] = {}
    self.ref_params = None
    self.step_count = 0
    self.stats = types.SimpleNamespace(vocab_size=self.tokenizer.vocab_size, tokenizer=self.tokenizer.name,
                                       train_docs=0, eval_docs=0, train_tokens=0, eval_tokens=0)
    self._logp_jit = None

  # -- the data-pipeline interface the loop uses ----------------------------------------------------
  def train_iter(self):
    return self

  def eval_batches(self):
    return iter(())

  def get_state(self) -> dict:
    buf = self.buffer
    return {"pos": self.pos, "step_count": self.step_count,
            "pending": [{"family": g[0].family, "seed": g[0].seed, "group": g[0].group,
                         "rows": [_jsonable_row(r) for r in g]} for g in self.pending],
            "buffer": {"rows": [_jsonable_row(r) for r in buf["rows"]], "adv": [float(a) for a in buf["adv"]],
                       "order": buf["order"], "metrics": buf["metrics"]}}

  def set_state(self, st: dict) -> None:
    self.close_pending()
    self.pos, self.step_count = int(st["pos"]), int(st.get("step_count", 0))
    self.pending = [_rebuild_group(self.cfg, g, self.tokenizer) for g in st.get("pending", [])]
    buf = st.get("buffer") or {"rows": [], "adv": [], "order": [], "metrics": {}}
    self.buffer = {"rows": [_row_from_json(d) for d in buf["rows"]], "adv": list(buf["adv"]),
                   "order": [list(o) for o in buf["order"]], "metrics": dict(buf["metrics"])}

  def close_pending(self) -> None:
    for f in self._prefetch.values():  # prefetched groups are not state: a restart rebuilds them
      for r in f.result():
        r.env.close()
    self._prefetch = {}
    for g in self.pending:
      for r in g:
        if r.env is not None:
          r.env.close()
    self.pending = []

  def close(self) -> None:
    self.close_pending()
    self.pool.shutdown(wait=True)

  def prepare(self, state, resumed: bool):
    """Fresh runs start from rl.init_workdir's checkpoint rl.init_step (0 = newest); the KL reference
    is those weights."""
    init = None
    start = init_checkpoint(self.rc)
    if start is not None:
      init = restore_params(start[0], self.trainer.setup.abstract, start[1])
    if init is not None and not resumed:
      state = state.replace(params=init["params"], moe_state=init["moe_state"])
    if self.rc.algorithm == "grpo":
      if init is None:  # the reference is the seed's initial weights
        from moonshot_jax.train import state as state_lib
        src = state if not resumed else state_lib.create_train_state(
            self.trainer.setup, self.trainer.init_fn, int(self.cfg.train.seed))
        init = {"params": src.params, "moe_state": src.moe_state}
      self.ref_params = jax.tree.map(jnp.copy, init)
    return state

  # -- batches --------------------------------------------------------------------------------------
  def next_batch(self, state) -> dict:
    self.step_count += 1
    if self.rc.algorithm == "sft":
      return self._sft_batch()
    return self._grpo_batch(state)

  def _sft_batch(self) -> dict:
    t0 = time.perf_counter()
    idx = range(self.pos, self.pos + self.B)
    self.pos += self.B
    rows = list(self.pool.map(
        lambda i: oracle_rollout(self.cfg, *task(self.cfg, self.fams, i, int(self.rc.seed_offset)),
                                 self.tokenizer), idx))
    batch = pack_rows(rows, self.B, self.T)
    batch["_metrics"] = {"oracle_reward": float(np.mean([r.reward for r in rows])),
                         "response_tokens": float(np.mean([r.policy_tokens for r in rows])),
                         "tool_calls": float(np.mean([len(r.actions) for r in rows])),
                         "truncated_rows": float(np.mean([len(r.tokens) > self.T + 1 for r in rows])),
                         "env_s": time.perf_counter() - t0}
    return batch

  def _grpo_batch(self, state) -> dict:
    """The next minibatch of the current rollout batch; a new rollout batch when it is used up."""
    m = {}
    if not self.buffer["order"]:
      m = self._collect(state)
    idx = self.buffer["order"].pop(0)
    rows = [self.buffer["rows"][i] if i >= 0 else None for i in idx]
    adv = [self.buffer["adv"][i] if i >= 0 else 0.0 for i in idx]
    batch = pack_rows(rows, self.B, self.T, adv)
    batch["ref_logp"] = self.reference_logp(batch)
    m["ppo_update"] = self.buffer["metrics"]["updates"] - len(self.buffer["order"])  # 1 = fresh batch
    if int(self.rc.eval_every) > 0 and self.step_count % int(self.rc.eval_every) == 0:
      m["heldout_success"] = evaluate_policy(self.cfg, self.trainer, policy_variables(self.trainer, state),
                                             int(self.rc.eval_episodes), seed=0, pool=self.pool,
                                             sampler=self.sampler)["success_rate"]
    batch["_metrics"] = m
    return batch

  def _rollout_groups(self, groups, variables, key) -> dict:
    rows = [r for g in groups for r in g]
    return ro.run_rollouts(self.sampler, variables, rows, key, self.pool, max_turns=int(self.rc.turns_per_iteration),
                           temperature=float(self.rc.temperature))

  def _collect(self, state) -> dict:
    """Rolls out one batch (rl.minibatches x B rows), computes advantages, schedules the updates."""
    t0 = time.perf_counter()
    need = self.B * int(self.rc.minibatches) // self.G
    groups = list(self.pending)
    new = list(range(self.pos, self.pos + need - len(groups)))
    self.pos += len(new)
    futures = [self._start(k) for k in new]
    groups += [f.result() for f in futures]
    reset_s = time.perf_counter() - t0  # only the part not hidden behind the previous train step
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), 1)
    variables = policy_variables(self.trainer, state)
    info = self._rollout_groups(groups, variables, key)
    kept, finished_all, dropped, rounds, rolled = [], [], 0, 1, list(groups)
    self.pending = []
    while True:
      finished = [g for g in groups if all(r.done for r in g)]
      self.pending += [g for g in groups if not all(r.done for r in g)]
      finished_all += finished
      signal = [g for g in finished if np.ptp([r.reward for r in g]) > 0]
      if self.rc.dynamic_sampling:
        dropped += len(finished) - len(signal)
        kept += signal
      else:
        kept += finished
      short = need - len(kept) - len(self.pending)
      if not (self.rc.dynamic_sampling and short > 0 and rounds < int(self.rc.max_sample_rounds)):
        break
      rounds += 1  # DAPO dynamic sampling: fresh tasks for the groups without signal
      t1 = time.perf_counter()
      new = list(range(self.pos, self.pos + short))
      self.pos += len(new)
      groups = [self._start(k).result() for k in new]
      rolled += groups
      reset_s += time.perf_counter() - t1
      more = self._rollout_groups(groups, variables, jax.random.fold_in(key, rounds))
      info = {k: info[k] + more[k] for k in info}
    # their envs close in the pool while the batch trains: not on this step's path, and not beside a second round's
    # env steps either (closes hold the hub, which that round's hidden checks need)
    self._retire(finished_all)
    done_rows = [r for g in kept for r in g]
    all_rows = [r for g in finished_all for r in g]
    if float(self.rc.temperature) != 1.0:  # the ratio's old_logp: the T=1 policy that is trained
      set_policy_logp(done_rows, self.B, self.T,
                      lambda b: self._logp({"params": state.params, "moe_state": state.moe_state}, b))
    rewards = np.asarray([r.reward for r in done_rows], np.float64)
    train_rewards = rewards
    if self.rc.shuffle_rewards and len(rewards):  # control: break the reward-behaviour link
      perm = np.random.default_rng([int(self.cfg.train.seed), self.step_count]).permutation(len(rewards))
      train_rewards = rewards[perm]
    adv = grpo.group_advantages(train_rewards, self.G, str(self.rc.adv_norm)) if len(rewards) else np.zeros(0)
    # deterministic in (seed, step): a resumed run trains the same minibatches
    order = update_schedule(len(done_rows), need * self.G, self.B, int(self.rc.ppo_epochs),
                            np.random.default_rng([int(self.cfg.train.seed), self.step_count, 7]))
    self.buffer = {"rows": done_rows, "adv": [float(a) for a in adv], "order": order,
                   "metrics": {"updates": len(order)}}
    all_rewards = np.asarray([r.reward for r in all_rows], np.float64)
    pol = sum(r.policy_tokens for r in all_rows)
    n_steps = sum(len(r.actions) for g in rolled for r in g)
    m = {"reward": float(all_rewards.mean()) if len(all_rows) else float("nan"),
         "success_rate": float((all_rewards > 0).mean()) if len(all_rows) else float("nan"),
         "episodes": len(all_rows), "trained_episodes": len(done_rows), "pending_groups": len(self.pending),
         "dropped_groups": dropped, "sample_rounds": rounds,
         "response_tokens": pol / max(len(all_rows), 1),
         "tool_calls": float(np.mean([len(r.actions) for r in all_rows])) if all_rows else float("nan"),
         "env_errors": float(np.mean([len(r.errors) > 0 for r in all_rows])) if all_rows else 0.0,
         "entropy": sum(r.entropy_sum for r in all_rows) / max(pol, 1),
         "groups_with_signal": float(np.mean([np.ptp([r.reward for r in g]) > 0 for g in finished_all]))
                               if finished_all else 0.0,
         **{f"success/{f}": float(np.mean([r.reward > 0 for r in all_rows if r.family == f]))
            for f in sorted({r.family for r in all_rows})},
         "rollout_s": info["rollout_s"], "env_s": info["env_s"] + reset_s,
         "env_latency_ms": 1e3 * info["env_busy_s"] / max(info["env_steps"], 1),
         "rollout_tokens_per_s": info["sampled_tokens"] / max(info["rollout_s"], 1e-9),
         "rollout_all_tokens_per_s": (info["sampled_tokens"] + info["obs_tokens"]) / max(info["rollout_s"], 1e-9),
         "env_steps": n_steps}
    # the next batch's new tasks: reset + fork in the pool while this batch trains (off the critical path); with
    # dynamic sampling a second round's worth too, which its extra round would otherwise start on the critical
    # path (0.5-1 s on the 2-core box). Tasks are taken in index order either way: what that round leaves is the
    # next batch's first round.
    for k in range(self.pos, self.pos + rounds_ahead(self.rc) * need - len(self.pending)):
      self._start(k)
    m["reset_s"] = reset_s
    return m

  def _retire(self, groups) -> None:
    """Detaches the envs of finished groups and closes them in the pool, off the step's critical path (a hub round
    trip each: ~0.15 s per 64 envs on the 2-core box, which the step used to wait for); close() waits for them."""
    envs = [r.env for g in groups for r in g if r.env is not None]
    for g in groups:
      for r in g:
        r.env = None
    if envs:
      self.pool.submit(_close_envs, envs)

  def _start(self, k: int) -> cf.Future:
    """The (possibly already prefetched) future of task k's group."""
    if k not in self._prefetch:
      fam, seed = task(self.cfg, self.fams, k, int(self.rc.seed_offset))
      self._prefetch[k] = self.pool.submit(start_group, self.cfg, fam, seed, k, self.tokenizer)
    return self._prefetch.pop(k) if k < self.pos else self._prefetch[k]

  def reference_logp(self, batch: dict) -> np.ndarray:
    """log-probs of the batch's targets under the frozen reference (the RL start) for the KL term."""
    out = self._logp(self.ref_params, batch)
    return np.where(batch["loss_mask"] > 0, out, batch["old_logp"])

  def _logp(self, params: dict, batch: dict) -> np.ndarray:
    """[B, T] log-probs of the batch's targets under `params` ({"params", "moe_state"}), at T=1."""
    if self._logp_jit is None:
      model = self.trainer.model

      @jax.jit
      def f(variables, tokens, seg, pos, targets):
        stats, _ = model.apply(variables, tokens, seg, pos, targets_BT=targets)
        return stats["target_logit"] - stats["lse"]

      self._logp_jit = f
    from moonshot_jax.train.step import step_context
    with step_context(self.trainer.setup):
      out = self._logp_jit(params, batch["tokens"], batch["segment_ids"], batch["positions"], batch["targets"])
    return np.asarray(out, np.float32)


def make_source(cfg, workdir, trainer) -> AgentSource:
  return AgentSource(cfg, workdir, trainer)


# ---- held-out evaluation ---------------------------------------------------------------------------
def evaluate_policy(cfg, trainer, variables, episodes: int, seed: int = 0, pool=None, sampler=None,
                    batch: int = 0, greedy: bool = True) -> dict[str, Any]:
  """Success rate on held-out tasks: family round-robin, seeds HELDOUT_SEED + 100_000 * seed + i,
  one rollout per task, greedy. Same (config task mix, episodes, seed) -> same tasks."""
  fams = families(cfg)
  tok = ByteTokenizer()
  sampler = sampler or make_sampler(cfg, trainer)
  own_pool = pool is None
  pool = pool or cf.ThreadPoolExecutor(int(cfg.rl.env_workers))
  batch = batch or int(cfg.data.batch_size)
  base = HELDOUT_SEED + 100_000 * int(seed)
  rewards, turns, errors, per_family = [], [], 0, {}
  t0 = time.perf_counter()
  try:
    for lo in range(0, episodes, batch):
      rows = []
      for i in range(lo, min(lo + batch, episodes)):
        fam, s = task(cfg, fams, i, base)
        env = make_env(cfg, fam)
        rows.append(ro.Rollout.start(tok, fam, s, i, env.reset(s), env))
      key = jax.random.key(int(seed) * 1_000_003 + lo)
      ro.run_rollouts(sampler, variables, rows, key, pool, greedy=greedy)
      for r in rows:
        r.env.close()
        rewards.append(r.reward)
        turns.append(len(r.actions))
        errors += bool(r.errors)
        per_family.setdefault(r.family, []).append(r.reward)
  finally:
    if own_pool:
      pool.shutdown(wait=True)
  rw = np.asarray(rewards)
  return {"success_rate": float((rw > 0).mean()), "episodes": len(rewards), "mean_reward": float(rw.mean()),
          "tool_calls": float(np.mean(turns)), "episodes_with_errors": errors,
          "per_family": {f: float((np.asarray(v) > 0).mean()) for f, v in per_family.items()},
          "seconds": time.perf_counter() - t0}
