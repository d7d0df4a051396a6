"""Batched multi-turn rollouts on the inference engine (prefill / masked decode / extend).

Text format (byte tokens; the SFT data in rl/source.py uses the same functions):
    <bos> prompt "\n"                         environment (no loss)
    action "\n"                               policy: sampled, log-probs kept, in the loss
    "= " observation "\n"                     environment (no loss), then the next action ...
"\n" ends a tool call (the end marker), <eos> ends the episode without a call (reward 0).

One turn for all rows at once: `Sampler.sample_turn` is ONE jitted while_loop that samples up to
`max_action_tokens` per row, feeding each token through the masked decode step; a row stops at
"\n" / <eos> while the others continue (finished rows keep their cache). Then every acting row's
env.step runs in a thread pool (env latency overlaps), and the observations are appended with
`engine.extend` into the existing KDA state and MLA latent cache (no prefix recompute).

Failures never fail the batch: an env that raises becomes that rollout's observation
("error: ...") with reward 0 and the rollout ends; a row that would overflow the context ends with
reward 0 (info "context_full").

Weights: `variables` are the trainer's own device arrays (same devices: no host round trip).
For separate rollout workers the same call takes a params tree that a weight-sync step put on
their devices (e.g. jax.device_put(params, worker_sharding) per step, or a broadcast over a
shared mesh); nothing here assumes the trainer's devices.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moonshot_jax.config import ModelConfig
from moonshot_jax.inference import engine
from moonshot_jax.train.tokenizer import ByteTokenizer

NEWLINE = ord("\n")
OBS_PREFIX = "= "


# ---- text format ---------------------------------------------------------------------------------
def prompt_tokens(tok: ByteTokenizer, prompt: str) -> list[int]:
  return [tok.bos_id] + tok.encode(prompt.rstrip("\n")) + [NEWLINE]


def observation_tokens(tok: ByteTokenizer, obs: str, max_chars: int) -> list[int]:
  text = obs.rstrip("\n")
  if len(text) > max_chars:
    text = text[:max_chars]
  return tok.encode(OBS_PREFIX + text) + [NEWLINE]


def action_tokens(tok: ByteTokenizer, action: str) -> list[int]:
  if "\n" in action:
    raise ValueError(f"action: one line expected (the end marker is '\\n'), got {action!r}")
  return tok.encode(action) + [NEWLINE]


def decode_action(tok: ByteTokenizer, ids: Sequence[int]) -> str:
  """Action text of a sampled turn: bytes up to the end marker; non-byte ids (specials, padded
  vocab) are dropped."""
  return bytes(i for i in ids if i < 256 and i != NEWLINE).decode("utf-8", errors="replace")


# ---- one rollout -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Rollout:
  """One trajectory: tokens with a per-token policy flag and the sampler's log-prob."""
  family: str
  seed: int
  group: int
  tokens: list[int]
  policy: list[int]
  logp: list[float]
  env: Any = None
  actions: list[str] = dataclasses.field(default_factory=list)
  reward: float = 0.0
  done: bool = False
  turns: int = 0
  errors: list[str] = dataclasses.field(default_factory=list)
  entropy_sum: float = 0.0
  env_s: float = 0.0

  @classmethod
  def start(cls, tok, family: str, seed: int, group: int, prompt: str, env) -> "Rollout":
    ids = prompt_tokens(tok, prompt)
    return cls(family, seed, group, ids, [0] * len(ids), [0.0] * len(ids), env)

  @property
  def policy_tokens(self) -> int:
    return int(sum(self.policy))


def safe_step(env, action: str) -> tuple[str, float, bool, dict, float]:
  """env.step that never raises: an exception becomes the observation and ends the rollout."""
  t0 = time.perf_counter()
  try:
    r = env.step(action)
    out = (str(r.observation), float(r.reward), bool(r.done), dict(r.info or {}))
  except Exception as e:  # a crashed tool / sandbox: this rollout's outcome, never the batch's
    out = (f"error: {type(e).__name__}: {e}", 0.0, True, {"error": "env_exception"})
  return out + (time.perf_counter() - t0,)


# ---- the jitted pieces -----------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("cfg", "max_new", "greedy"), donate_argnames=("cache",))
def _sample_turn(variables, cache, logits_BV, key, active_B, temperature, *, cfg, max_new, greedy):
  B = active_B.shape[0]
  stop = jnp.asarray([NEWLINE, ByteTokenizer().eos_id], jnp.int32)

  def cond(s):
    return (s[0] < max_new) & jnp.any(s[2])

  def body(s):
    t, cache, active, logits, key, toks, logps, ents, n = s
    key, sub = jax.random.split(key)
    logp_BV = jax.nn.log_softmax(logits / temperature)
    tok = (jnp.argmax(logits, -1) if greedy else jax.random.categorical(sub, logp_BV)).astype(jnp.int32)
    lp = jnp.take_along_axis(logp_BV, tok[:, None], 1)[:, 0]
    ent = -jnp.sum(jnp.exp(logp_BV) * logp_BV, -1)
    toks = toks.at[:, t].set(jnp.where(active, tok, 0))
    logps = logps.at[:, t].set(jnp.where(active, lp, 0.0))
    ents = ents.at[:, t].set(jnp.where(active, ent, 0.0))
    new_logits, cache = engine.decode_body(variables, cache, tok, active, cfg=cfg)
    logits = jnp.where(active[:, None], new_logits, logits)
    n = n + active.astype(jnp.int32)
    active = active & ~jnp.isin(tok, stop)
    return t + 1, cache, active, logits, key, toks, logps, ents, n

  init = (jnp.int32(0), cache, active_B, logits_BV, key, jnp.zeros((B, max_new), jnp.int32),
          jnp.zeros((B, max_new), jnp.float32), jnp.zeros((B, max_new), jnp.float32), jnp.zeros((B,), jnp.int32))
  _, cache, _, logits, _, toks, logps, ents, n = jax.lax.while_loop(cond, body, init)
  return toks, logps, ents, n, cache, logits


@jax.jit
def _last_valid(logits_BLV, n_B, prev_BV):
  last = jnp.take_along_axis(logits_BLV, jnp.maximum(n_B - 1, 0)[:, None, None], 1)[:, 0]
  return jnp.where((n_B > 0)[:, None], last, prev_BV)


class Sampler:
  """Batched prefill / sample-a-turn / extend for one model config and context length."""

  def __init__(self, model_cfg: ModelConfig, max_len: int, max_action_tokens: int, max_obs_chars: int,
               mesh=None, strategy: str = "zero1"):
    self.cfg, self.max_len, self.mesh, self.strategy = model_cfg, int(max_len), mesh, strategy
    self.max_action_tokens, self.max_obs_chars = int(max_action_tokens), int(max_obs_chars)
    self.tok = ByteTokenizer()

  def prefill(self, variables, seqs: Sequence[Sequence[int]]):
    lengths = np.asarray([len(s) for s in seqs], np.int32)
    arr = np.full((len(seqs), int(lengths.max())), self.tok.pad_id, np.int32)
    for i, s in enumerate(seqs):
      arr[i, :len(s)] = s
    return engine.prefill(variables, self.cfg, arr, lengths=lengths, max_len=self.max_len, all_logits=False,
                          mesh=self.mesh, strategy=self.strategy)

  def sample_turn(self, variables, cache, logits_BV, key, active_B, greedy: bool, temperature: float = 1.0):
    with engine._context(self.mesh, self.strategy):
      out = _sample_turn(engine.as_variables(variables, self.cfg), cache, logits_BV, key,
                         jnp.asarray(active_B), jnp.float32(temperature), cfg=self.cfg,
                         max_new=self.max_action_tokens, greedy=greedy)
    return jax.device_get(out[:4]) + out[4:]

  def extend(self, variables, cache, seqs: Sequence[Sequence[int]], logits_BV):
    n = np.asarray([len(s) for s in seqs], np.int32)
    if n.max() == 0:
      return logits_BV, cache
    arr = np.zeros((len(seqs), int(n.max())), np.int32)
    for i, s in enumerate(seqs):
      arr[i, :len(s)] = s
    logits_BLV, cache = engine.extend(variables, self.cfg, cache, arr, n, mesh=self.mesh, strategy=self.strategy)
    return _last_valid(logits_BLV, jnp.asarray(n), logits_BV), cache


# ---- the driver ------------------------------------------------------------------------------------
def run_rollouts(sampler: Sampler, variables, rows: Sequence[Rollout], key, pool: cf.Executor, *,
                 max_turns: int = 0, greedy: bool = False, temperature: float = 1.0) -> dict[str, float]:
  """Advances every unfinished row until it is done or has taken `max_turns` more turns
  (0 = until done; partial rollouts pass a limit and continue later). Rows are modified in place.
  Returns timing / token counts for this call."""
  tok = sampler.tok
  t_start = time.perf_counter()
  env_s = 0.0
  sampled = obs_tokens = 0
  todo = [r for r in rows if not r.done]
  if not todo:
    return dict(rollout_s=0.0, env_s=0.0, sampled_tokens=0, obs_tokens=0, turns=0)
  logits, cache = sampler.prefill(variables, [r.tokens for r in todo])
  active = np.ones(len(todo), bool)
  turns = 0
  while active.any() and (max_turns <= 0 or turns < max_turns):
    for i, r in enumerate(todo):  # room for a whole action, else the episode ends here
      if active[i] and len(r.tokens) + sampler.max_action_tokens > sampler.max_len:
        r.done, active[i] = True, False
        r.errors.append("context_full")
    if not active.any():
      break
    key, sub = jax.random.split(key)
    toks, lps, ents, n, cache, logits = sampler.sample_turn(variables, cache, logits, sub, active, greedy,
                                                           temperature)
    acting = []
    for i, r in enumerate(todo):
      if not active[i]:
        continue
      ids = toks[i, :n[i]].tolist()
      sampled += len(ids)
      r.tokens += ids
      r.policy += [1] * len(ids)
      r.logp += lps[i, :n[i]].tolist()
      r.entropy_sum += float(ents[i, :n[i]].sum())
      r.turns += 1
      if ids and ids[-1] == tok.eos_id:  # the policy ended the episode without a call
        r.done, active[i] = True, False
        continue
      r.actions.append(decode_action(tok, ids))
      acting.append(i)
    t_env = time.perf_counter()
    results = list(pool.map(lambda i: safe_step(todo[i].env, todo[i].actions[-1]), acting))
    env_s += time.perf_counter() - t_env
    new = [[] for _ in todo]
    for i, (obs, reward, done, info, dt) in zip(acting, results):
      r = todo[i]
      r.env_s += dt
      if info.get("error"):
        r.errors.append(str(info["error"]))
      if done:
        r.reward, r.done, active[i] = reward, True, False
        continue
      ids = observation_tokens(tok, obs, sampler.max_obs_chars)
      if len(r.tokens) + len(ids) + sampler.max_action_tokens > sampler.max_len:
        r.done, active[i] = True, False
        r.errors.append("context_full")
        continue
      new[i] = ids
      r.tokens += ids
      r.policy += [0] * len(ids)
      r.logp += [0.0] * len(ids)
      obs_tokens += len(ids)
    logits, cache = sampler.extend(variables, cache, new, logits)
    turns += 1
  return dict(rollout_s=time.perf_counter() - t_start, env_s=env_s, sampled_tokens=sampled,
              obs_tokens=obs_tokens, turns=turns)
