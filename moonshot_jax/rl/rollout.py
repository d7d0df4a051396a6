"""Batched multi-turn rollouts on the inference engine (prefill / a per-row masked decode loop).

Text format (byte tokens; the SFT data in rl/source.py uses the same functions):
    <bos> prompt "\n"                         environment (no loss)
    action "\n"                               policy: sampled, log-probs kept, in the loss
    "= " observation "\n"                     environment (no loss), then the next action ...
"\n" ends a tool call (the end marker), <eos> ends the episode without a call (reward 0).

Rows run independently (no per-turn barrier): `_advance` is ONE jitted while_loop of the masked
decode step over the busy rows (idle ones are left out: on CPU a step costs in proportion to its
rows), each row in its own mode: SAMPLE (sample its next action token), FEED
(append the next token of its observation into the existing KDA state and MLA latent cache: no prefix
recompute) or IDLE (waiting for its env step, or done). It returns to the host once a share of the
busy rows have ended an action ("\n" / <eos> / the token budget); their env steps start in a thread
pool and the loop goes on decoding the other rows while those run (env latency overlaps decoding);
finished env steps hand their observation to the next call. The host only waits for an env step when
no row has anything to decode.

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
from moonshot_jax.rl import threefry
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
# Row modes of the decode loop: IDLE waits for the host (its action ended, its env step runs, or it is
# done), SAMPLE samples its next action token, FEED appends the next token of its observation.
IDLE, SAMPLE, FEED = 0, 1, 2


def bucket_rows(n_busy: int, B: int) -> int:
  """Rows the decode loop computes for n_busy busy rows of a B-row batch: the next power of two (capped
  at B). A decode step's cost is linear in its rows on CPU, so idle rows are left out; powers of two
  bound the compilations at log2(B) + 1."""
  if not 0 < n_busy <= B:
    raise ValueError(f"bucket_rows: need 0 < n_busy={n_busy} <= B={B}")
  return min(B, 1 << (n_busy - 1).bit_length())


def batch_rows(n: int) -> int:
  """Rows a batch of n rollouts is computed with: n up to 8, else n rounded up to a multiple of 16 with inert rows
  (DAPO's extra rounds and partial rollouts then reuse a few compilations instead of one per row count)."""
  return n if n <= 8 else -(-n // 16) * 16


def _first_argmax(x_BV):
  """jnp.argmax over the last axis as two plain reductions: XLA:CPU's variadic argmax reduce cost
  ~1 ms per [64, 512] step, 5x the Gumbel noise itself (session 14 profile)."""
  V = x_BV.shape[-1]
  hit = x_BV == jnp.max(x_BV, -1, keepdims=True)
  return jnp.minimum(jnp.min(jnp.where(hit, jnp.arange(V, dtype=jnp.int32), V), -1), V - 1)


def _sample(logits_BV, keys_B, pos_B, temperature, greedy):
  """Token, its log-prob and the entropy per row. Each row's draw uses its own key folded with the
  token's position: a row's samples do not depend on which rows share its batch or decode call.
  Sampling is Gumbel-max, the same draw as jax.random.categorical(fold_in(key, pos), logp) (noise from
  rl/threefry.py: jax.random's bits without its rolled CPU loop)."""
  logp_BV = jax.nn.log_softmax(logits_BV / temperature)
  if greedy:
    tok = _first_argmax(logits_BV)
  else:
    if str(jax.random.key_impl(keys_B)) == "threefry2x32":  # rl/threefry.py writes out only that hash
      step_keys = threefry.fold_in(jax.random.key_data(keys_B), pos_B)
      gumbel_BV = threefry.gumbel(step_keys, logp_BV.shape[1]).astype(logp_BV.dtype)
    else:  # another PRNG implementation (e.g. jax_default_prng_impl=rbg): its own draws
      step_keys = jax.vmap(jax.random.fold_in)(keys_B, pos_B)
      gumbel_BV = jax.vmap(lambda k: jax.random.gumbel(k, logp_BV.shape[1:], logp_BV.dtype))(step_keys)
    tok = _first_argmax(logp_BV + gumbel_BV)
  tok = tok.astype(jnp.int32)
  lp = jnp.take_along_axis(logp_BV, tok[:, None], 1)[:, 0]
  return tok, lp, -jnp.sum(jnp.exp(logp_BV) * logp_BV, -1)


@jax.jit
def _take(cache, logits_BV, idx_b):
  """Rows idx_b of the cache and logits (the decode loop's working set)."""
  return jax.tree.map(lambda x: x[idx_b], cache), logits_BV[idx_b]


@functools.partial(jax.jit, donate_argnames=("cache", "logits_BV"))
def _put(cache, logits_BV, idx_b, sub, logits_bV):
  """Writes the working set back into rows idx_b (distinct indices)."""
  return jax.tree.map(lambda full, part: full.at[idx_b].set(part), cache, sub), logits_BV.at[idx_b].set(logits_bV)


@functools.partial(jax.jit, static_argnames=("cfg", "max_new", "greedy"), donate_argnames=("sub", "logits_bV"))
def _advance(variables, sub, logits_bV, keys_b, rows_state, obs_bL, obs_n_b, min_stops, max_steps, temperature, *,
             cfg, max_new, greedy):
  """Runs the masked decode step over a working set of b rows (the busy ones, padded with idle rows to a
  bucket size; `_take` / `_put` move them out of and back into the batch's cache, so this compiles
  once per bucket, whatever the batch) until `min_stops` of them have ended an action, none is busy, or
  `max_steps` steps have run (the host then looks for finished env steps). Every step feeds one token
  per busy row: SAMPLE rows their sampled token, FEED rows their next observation token; a FEED row
  turns SAMPLE after its last one, a SAMPLE row IDLE after "\n" / <eos> / max_new tokens.
  Observations thus enter the KDA state / MLA cache in the same steps that sample the other rows'
  actions (no per-turn barrier, no padded extend).
  rows_state = (mode_b, obs_ptr_b, toks_bN, logps_bN, ents_bN, n_b): those rows' state, carried across
  calls (an action or an observation may span several), returned updated; keys_b: their sampling keys."""
  b = obs_n_b.shape[0]
  stop = jnp.asarray([NEWLINE, ByteTokenizer().eos_id], jnp.int32)
  rows = jnp.arange(b)
  keys_b = jax.random.wrap_key_data(keys_b)

  def cond(s):
    return jnp.any(s[2] != IDLE) & (s[8] < min_stops) & (s[9] < max_steps)

  def body(s):
    sub, logits, mode, obs_ptr, toks, logps, ents, n, stops, t = s
    sampled, lp, ent = _sample(logits, keys_b, sub.lengths, temperature, greedy)
    samp, feed = mode == SAMPLE, mode == FEED
    tok = jnp.where(feed, obs_bL[rows, jnp.minimum(obs_ptr, obs_bL.shape[1] - 1)], sampled)
    at = jnp.where(samp, n, max_new)  # non-sampling rows write out of bounds: dropped
    toks = toks.at[rows, at].set(sampled, mode="drop")
    logps = logps.at[rows, at].set(lp, mode="drop")
    ents = ents.at[rows, at].set(ent, mode="drop")
    n = n + samp.astype(jnp.int32)
    obs_ptr = obs_ptr + feed.astype(jnp.int32)
    busy = mode != IDLE
    new_logits, sub = engine.decode_body(variables, sub, tok, busy, cfg=cfg)
    logits = jnp.where(busy[:, None], new_logits, logits)
    ended = samp & (jnp.isin(sampled, stop) | (n >= max_new))
    mode = jnp.where(ended, IDLE, jnp.where(feed & (obs_ptr >= obs_n_b), SAMPLE, mode))
    return sub, logits, mode, obs_ptr, toks, logps, ents, n, stops + jnp.sum(ended), t + 1

  mode, obs_ptr, toks, logps, ents, n = rows_state
  init = (sub, logits_bV, mode, obs_ptr, toks, logps, ents, n, jnp.int32(0), jnp.int32(0))
  sub, logits, mode, obs_ptr, toks, logps, ents, n, _, steps = jax.lax.while_loop(cond, body, init)
  return (mode, obs_ptr, toks, logps, ents, n), steps, sub, logits


class Sampler:
  """Batched prefill and the per-row decode loop for one model config and context length."""

  def __init__(self, model_cfg: ModelConfig, max_len: int, max_action_tokens: int, max_obs_chars: int,
               mesh=None, strategy: str = "zero1", rows: int = 0, prefill_rows: int = 0):
    """rows > 0: every call with at most `rows` rollouts runs in a batch of exactly `rows` rows (else
    `batch_rows`), and prefill_rows > 0: prefills of at most that many distinct sequences run on exactly that
    many rows. A trainer whose rollout rounds vary in size (DAPO's extra rounds, evaluation) then reuses one
    set of compiled shapes instead of compiling new ones mid-run (15-30 s a step on the 2-core CPU, session
    18); inert rows cost no decode work (the loop computes only busy rows)."""
    self.cfg, self.max_len, self.mesh, self.strategy = model_cfg, int(max_len), mesh, strategy
    self.max_action_tokens, self.max_obs_chars = int(max_action_tokens), int(max_obs_chars)
    self.max_obs_tokens = len(OBS_PREFIX) + self.max_obs_chars * 4 + 1  # utf-8: <= 4 bytes per char
    if rows < 0 or prefill_rows < 0:
      raise ValueError(f"Sampler: rows={rows} and prefill_rows={prefill_rows} must be >= 0 (0 = by batch size)")
    self.rows, self.prefill_rows = int(rows), int(prefill_rows)
    self.warmed: set[tuple[int, bool]] = set()  # (batch rows, greedy) whose decode buckets are compiled
    self.tok = ByteTokenizer()

  def batch_size(self, n: int) -> int:
    """Rows a call with n rollouts runs in."""
    return self.rows if 0 < n <= self.rows else batch_rows(n)

  def prefill(self, variables, seqs: Sequence[Sequence[int]]):
    """(logits at each row's last token, cache) of the right-padded rows. Identical rows (a GRPO group's G
    rollouts start from one forked env: the same prompt) are computed once and copied: prefill work scales
    with the distinct rows (padded to prefill_rows, else as `batch_rows`), not the batch."""
    first: dict[tuple, int] = {}
    inv = np.asarray([first.setdefault(tuple(s), len(first)) for s in seqs], np.int32)
    n = self.prefill_rows if len(first) <= self.prefill_rows else batch_rows(len(first))
    if len(first) == len(seqs) == n:
      return self._prefill(variables, seqs)
    uniq = [list(s) for s in first]
    logits, cache = self._prefill(variables, uniq + [[self.tok.bos_id]] * (n - len(uniq)))
    with engine._context(self.mesh, self.strategy):
      cache, logits = _take(cache, logits, jnp.asarray(inv))
    return logits, cache

  def _prefill(self, variables, seqs: Sequence[Sequence[int]]):
    lengths = np.asarray([len(s) for s in seqs], np.int32)
    arr = np.full((len(seqs), int(lengths.max())), self.tok.pad_id, np.int32)
    for i, s in enumerate(seqs):
      arr[i, :len(s)] = s
    return engine.prefill(variables, self.cfg, arr, lengths=lengths, max_len=self.max_len, all_logits=False,
                          mesh=self.mesh, strategy=self.strategy)

  def advance(self, variables, cache, logits_BV, idx_b, keys_b, rows_state, obs_bL, obs_n_b, min_stops: int,
              max_steps: int, greedy: bool, temperature: float = 1.0):
    """One `_advance` call over rows idx_b; returns those rows' state as host arrays (mode, observation
    pointer, the current actions' tokens / log-probs / entropies / counts), the steps run, the cache and
    the logits (both stay on the device)."""
    with engine._context(self.mesh, self.strategy):
      idx_b = jnp.asarray(idx_b, jnp.int32)
      sub, logits_bV = _take(cache, logits_BV, idx_b)
      out, steps, sub, logits_bV = _advance(
          engine.as_variables(variables, self.cfg), sub, logits_bV, jnp.asarray(keys_b),
          tuple(jnp.asarray(x) for x in rows_state), jnp.asarray(obs_bL), jnp.asarray(obs_n_b), jnp.int32(min_stops),
          jnp.int32(max_steps), jnp.float32(temperature), cfg=self.cfg, max_new=self.max_action_tokens, greedy=greedy)
      cache, logits = _put(cache, logits_BV, idx_b, sub, logits_bV)
    out, steps = jax.device_get((out, steps))
    return [np.array(x) for x in out], int(steps), cache, logits

  def compile_buckets(self, variables, B: int, greedy: bool = False) -> None:
    """Compiles the decode loop for every row bucket of a B-row batch: a timed run then pays no compilation when
    its busy rows shrink."""
    logits, cache = self.prefill(variables, [[self.tok.bos_id]] * B)
    self.warm(variables, cache, logits, greedy)

  def warm(self, variables, cache, logits_BV, greedy: bool):
    """Zero-step decode calls (they change nothing) for every row bucket of this batch size not compiled yet; returns
    (cache, logits). Which buckets a rollout visits depends on the order its env steps finish in, so without
    this a bucket's first visit (a compilation) could fall into any later step."""
    B = logits_BV.shape[0]
    N, L = self.max_action_tokens, self.max_obs_tokens
    for b in sorted({bucket_rows(k, B) for k in range(1, B + 1)}):
      zi, zf = np.zeros(b, np.int32), np.zeros((b, N), np.float32)
      _, _, cache, logits_BV = self.advance(variables, cache, logits_BV, np.arange(b), np.zeros((b, 2), np.uint32),
                                            (zi, zi, np.zeros((b, N), np.int32), zf, zf, zi),
                                            np.zeros((b, L), np.int32), zi, 1, 0, greedy)
    self.warmed.add((B, greedy))
    return cache, logits_BV


# ---- the driver ------------------------------------------------------------------------------------
def run_rollouts(sampler: Sampler, variables, rows: Sequence[Rollout], key, pool: cf.Executor, *,
                 max_turns: int = 0, greedy: bool = False, temperature: float = 1.0,
                 stop_fraction: float = 0.25, poll_steps: int = 8) -> dict[str, float]:
  """Advances every unfinished row until it is done or has taken `max_turns` more turns
  (0 = until done; partial rollouts pass a limit and continue later). Rows are modified in place.

  `key`: one key (row j of `rows` samples with fold_in(key, j)) or one key per row of `rows`; a
  row's draws depend only on its key and token positions, not on the batch it shares (a batch of
  one row given its key samples what it would in the full batch).

  Rows run independently: the decode loop computes only the busy rows (bucketed, `bucket_rows`) and
  returns to the host once a quarter (`stop_fraction`) of them have ended an action (or, while env
  steps run, every `poll_steps` steps); their env
  steps start in `pool` and the loop continues with the other rows while those run; a finished env
  step's observation is handed to the next call, which feeds it token by token alongside the
  sampling rows. Returns timing / token counts; env_s is
  the time the driver waited for environments with no row left to decode (the env time on the
  critical path), env_busy_s the summed latency of all env steps."""
  tok = sampler.tok
  t_start = time.perf_counter()
  env_s = 0.0
  sampled = obs_tokens = 0
  todo = [r for r in rows if not r.done]
  if not todo:
    return dict(rollout_s=0.0, env_s=0.0, env_busy_s=0.0, sampled_tokens=0, obs_tokens=0, turns=0, env_steps=0,
                decode_calls=0, decode_steps=0, row_steps=0)
  row_keys = _row_keys(key, len(rows))[[j for j, r in enumerate(rows) if not r.done]]
  busy0 = sum(r.env_s for r in todo)
  B = sampler.batch_size(len(todo))
  # the extra rows are inert (never busy); copies of a real row add no distinct sequence to the prefill
  seqs = [r.tokens for r in todo]
  logits, cache = sampler.prefill(variables, seqs + [seqs[0]] * (B - len(todo)))
  if sampler.rows and (B, greedy) not in sampler.warmed:  # a fixed batch: compile all its buckets now
    cache, logits = sampler.warm(variables, cache, logits, greedy)
  N = sampler.max_action_tokens
  mode, obs_ptr, n = np.full(B, IDLE, np.int32), np.zeros(B, np.int32), np.zeros(B, np.int32)
  toks, lps, ents = np.zeros((B, N), np.int32), np.zeros((B, N), np.float32), np.zeros((B, N), np.float32)
  obs = np.zeros((B, sampler.max_obs_tokens), np.int32)
  obs_n = np.zeros(B, np.int32)
  keys = np.zeros((B, 2), np.uint32)
  keys[:len(todo)] = row_keys
  turns = np.zeros(B, np.int32)
  live = np.arange(B) < len(todo)  # still advancing in this call
  futures: dict[int, cf.Future] = {}

  def start_action(i: int) -> None:
    """Row i samples its next action if it has room for a whole one, else its episode ends here."""
    r = todo[i]
    if len(r.tokens) + sampler.max_action_tokens > sampler.max_len:
      r.done, live[i] = True, False
      r.errors.append("context_full")
    else:
      mode[i] = SAMPLE

  for i in range(len(todo)):
    start_action(i)
  calls = env_steps = steps = row_steps = 0
  while live.any():
    busy_rows = np.flatnonzero(mode != IDLE)
    busy = len(busy_rows)
    if busy:
      min_stops = max(1, int(np.ceil(stop_fraction * busy)))
      max_steps = poll_steps if futures else 1 << 30
      # busy rows first, then distinct idle rows up to the bucket (never busy: left unchanged)
      idx = np.concatenate([busy_rows, np.flatnonzero(mode == IDLE)[:bucket_rows(busy, B) - busy]])
      state = tuple(a[idx] for a in (mode, obs_ptr, toks, lps, ents, n))
      out, k, cache, logits = sampler.advance(variables, cache, logits, idx, keys[idx], state, obs[idx], obs_n[idx],
                                              min_stops, max_steps, greedy, temperature)
      calls, steps, row_steps = calls + 1, steps + k, row_steps + k * len(idx)
      mode_d = mode.copy()
      for a, o in zip((mode_d, obs_ptr, toks, lps, ents, n), out):
        a[idx] = o
      ended = np.flatnonzero((mode != IDLE) & (mode_d == IDLE))  # rows whose action ended
      mode = mode_d
      for i in ended:
        r = todo[i]
        ids = toks[i, :n[i]].tolist()
        sampled += len(ids)
        r.tokens += ids
        r.policy += [1] * len(ids)
        r.logp += lps[i, :n[i]].tolist()
        r.entropy_sum += float(ents[i, :n[i]].sum())
        r.turns += 1
        turns[i] += 1
        n[i] = 0
        if ids and ids[-1] == tok.eos_id:  # the policy ended the episode without a call
          r.done, live[i] = True, False
          continue
        r.actions.append(decode_action(tok, ids))
        futures[i] = pool.submit(safe_step, r.env, r.actions[-1])
        env_steps += 1
    if not futures:
      if live.any() and not (mode != IDLE).any():
        raise RuntimeError("run_rollouts: live rows with nothing to decode and no env step running")
      continue
    if (mode != IDLE).any():  # others can decode: take only the env steps already finished
      ready = [i for i, f in futures.items() if f.done()]
    else:  # nothing to decode: wait for the first env step (env time on the critical path)
      t_env = time.perf_counter()
      cf.wait(futures.values(), return_when=cf.FIRST_COMPLETED)
      env_s += time.perf_counter() - t_env
      ready = [i for i, f in futures.items() if f.done()]
    for i in ready:
      o, reward, done, info, dt = futures.pop(i).result()
      r = todo[i]
      r.env_s += dt
      if info.get("error"):
        r.errors.append(str(info["error"]))
      if done:
        r.reward, r.done, live[i] = reward, True, False
        continue
      ids = observation_tokens(tok, o, sampler.max_obs_chars)
      if len(r.tokens) + len(ids) + sampler.max_action_tokens > sampler.max_len:
        r.done, live[i] = True, False
        r.errors.append("context_full")
        continue
      r.tokens += ids
      r.policy += [0] * len(ids)
      r.logp += [0.0] * len(ids)
      obs_tokens += len(ids)
      if max_turns > 0 and turns[i] >= max_turns:  # partial rollout: continue next call (re-prefilled)
        live[i] = False
        continue
      obs[i, :len(ids)], obs_n[i], obs_ptr[i], mode[i] = ids, len(ids), 0, FEED
  return dict(rollout_s=time.perf_counter() - t_start, env_s=env_s,
              env_busy_s=sum(r.env_s for r in todo) - busy0, sampled_tokens=sampled, obs_tokens=obs_tokens,
              turns=int(turns.max()), env_steps=env_steps, decode_calls=calls, decode_steps=steps, row_steps=row_steps)


def _row_keys(key, n: int) -> np.ndarray:
  """[n, 2] uint32 key data: fold_in(key, j) per row, or the given per-row keys."""
  key = jnp.asarray(key)
  if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    raise ValueError(f"key: expected a typed key (jax.random.key), got {key.dtype}{key.shape}")
  if key.shape == (n,):
    keys = key
  elif key.shape == ():  # for a power of two of rows (a row's key depends on j only): few shapes to compile
    keys = jax.vmap(lambda j: jax.random.fold_in(key, j))(jnp.arange(1 << (n - 1).bit_length()))[:n]
  else:
    raise ValueError(f"key: expected one key or one per row ({n},), got shape {key.shape}")
  data = np.asarray(jax.random.key_data(keys))
  if data.shape != (n, 2) or data.dtype != np.uint32:
    raise ValueError(f"key: expected the default (threefry) key implementation, got key data {data.dtype}{data.shape}")
  return data
