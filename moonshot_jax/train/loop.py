"""The training loop: `train(cfg, workdir) -> summary`, resumable from WORKDIR by re-running it.

Per run: validate the config (ConfigError names the key), build the mesh, the data pipeline, the
model and the sharded state; restore the newest good checkpoint of WORKDIR (state, iterator
position, step) if there is one; then for each step: next batch -> jitted train step -> metrics
(JSON lines, TensorBoard, tqdm) -> periodic eval and checkpoint. Everything that decides a loss
value (params, optimizer state, balancing biases, data order, RNG) is in the checkpoint, so a run
killed at any point and restarted with the same command logs the same losses as one that was not.

A non-finite step is skipped inside the jitted step (state unchanged) and logged with the names
of the non-finite gradient / parameter leaves; after train.max_bad_steps consecutive ones the run
stops without saving, leaving the last good checkpoint as the newest.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from moonshot_jax import experiment
from moonshot_jax import flops as flops_lib
from moonshot_jax.config import ModelConfig
from moonshot_jax.parallel import expert as ep_lib
from moonshot_jax.parallel.mesh import make_mesh, mesh_sizes
from moonshot_jax.parallel.parallel_model import ParallelModel
from moonshot_jax.train import optim
from moonshot_jax.train import state as state_lib
from moonshot_jax.train import step as step_lib
from moonshot_jax.train.checkpoint import Checkpointer
from moonshot_jax.train.metrics import MetricsWriter, model_flops_utilization
from moonshot_jax.train.peak_flops import peak_flops


@dataclasses.dataclass
class Hooks:
  """Test / notebook hooks; each is optional and runs on the host between steps."""
  on_batch: Callable[[int, dict], dict] | None = None  # (step, numpy batch) -> batch
  before_step: Callable[[int, Any], Any] | None = None  # (step, TrainState) -> TrainState
  after_step: Callable[[int, dict], None] | None = None  # (step, host metrics)


@dataclasses.dataclass
class Trainer:
  """The pieces of one run (built by `build`), reusable from notebooks and benchmarks."""
  cfg: Any
  model_cfg: ModelConfig
  mesh: Any
  model: ParallelModel
  setup: state_lib.StateSetup
  init_fn: Callable
  train_step: Callable
  eval_step: Callable
  vision: Any = None  # VisionConfig of a vision-language run (model is then a vision.joint.VLModel)
  model_inputs: tuple[str, ...] = ()  # whole-batch fields passed to the model (vision inputs), replicated
  extra_fields: tuple[str, ...] = ()  # per-row [B, T] fields the loss reads (RL), sharded like the batch


def build(cfg: Any, devices=None) -> Trainer:
  """Validates `cfg` against the devices and builds model, mesh, sharded-state setup and steps.
  The model is parallel_model.ParallelModel: the Transformer with expert dispatch over "expert"
  and GPipe stages over "pipeline" when those axes are > 1, same init / apply contract."""
  devices = list(jax.devices() if devices is None else devices)
  mcfg = experiment.validate(cfg, len(devices))
  mesh = make_mesh(cfg, devices)
  model = ParallelModel.from_experiment(cfg, mesh)
  vcfg, extra = experiment.vision_config(cfg), ()
  if vcfg is not None and "vl" in cfg:  # a VL run (a bare vision section, e.g. K3's, only sizes the tower for plan.py)
    from moonshot_jax.vision import data as vl_data, joint  # noqa: PLC0415
    vl_data.check_vl_config(cfg, vcfg)
    model, extra = joint.VLModel(model, vcfg, int(cfg.vl.image_token_id)), vl_data.VISION_FIELDS
  init_fn = lambda rng: model.init(rng, jnp.zeros((1, int(cfg.data.seq_len)), jnp.int32))
  steps = int(cfg.train.steps)
  setup = state_lib.setup_state(init_fn, lambda bp: optim.make_optimizer(cfg.optimizer, bp, steps), mesh,
                                str(cfg.mesh.strategy))
  step_kw = {}
  if "rl" in cfg:  # RL / agent SFT: the same step with rl/grpo.py's loss and its extra batch fields
    from moonshot_jax.rl import source as rl_source  # local: training without RL never imports it
    step_kw = rl_source.step_options(cfg)
  train_step = step_lib.make_train_step(model.apply, mcfg, setup, int(cfg.train.microbatches),
                                        model_inputs=extra, **step_kw)
  eval_step = step_lib.make_eval_step(model.apply, mcfg, setup, model_inputs=extra)
  return Trainer(cfg, mcfg, mesh, model, setup, init_fn, train_step, eval_step, vcfg, extra,
                 tuple(step_kw.get("extra_fields", ())))


def to_global(batch: dict, mesh, model_inputs: tuple[str, ...] = (), extra_fields: tuple[str, ...] = ()) -> dict:
  """Process-local numpy rows -> global jax arrays: BATCH_FIELDS and `extra_fields` (RL's per-row
  advantages / log-probs) sharded over the batch axes; `model_inputs` (whole-batch arrays such as
  packed images; single-process) replicated. Other keys (host-side metadata) are left out."""
  sh = step_lib.batch_sharding(mesh)
  out = {k: jax.make_array_from_process_local_data(sh, np.asarray(batch[k]))
         for k in step_lib.BATCH_FIELDS + tuple(extra_fields)}
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  out.update({k: jax.device_put(np.asarray(batch[k]), rep) for k in model_inputs})
  return out


def random_batch(trainer: Trainer, seed: int = 0) -> dict:
  """One global batch of uniform random tokens at the config's batch and sequence length, one
  document per row, every position in the loss (benchmarks and profiles: no corpus needed)."""
  b, t = int(trainer.cfg.data.batch_size), int(trainer.cfg.data.seq_len)
  tok = np.random.default_rng(seed).integers(3, trainer.model_cfg.vocab_size, (b, t + 1), dtype=np.int32)
  return to_global(dict(tokens=tok[:, :-1], targets=tok[:, 1:], segment_ids=np.ones((b, t), np.int32),
                        positions=np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
                        loss_mask=np.ones((b, t), np.int32)), trainer.mesh)


def evaluate(trainer: Trainer, state: state_lib.TrainState, data) -> float:
  total, count = 0.0, 0.0
  for b in data.eval_batches():
    s, n = jax.device_get(trainer.eval_step(state.params, state.moe_state,
                                            to_global(b, trainer.mesh, trainer.model_inputs)))
    total += float(s)
    count += float(n)
  return total / max(count, 1.0)


def train_flops_per_token(mcfg: ModelConfig, seq_len: int) -> float:
  """3 x the analytic forward FLOPs per token (forward + backward), from moonshot_jax.flops."""
  return float(flops_lib.train_flops_per_token(mcfg, seq_len))


def moe_dispatch_line(trainer: Trainer) -> str:
  """How routed tokens reach the experts on this mesh, and whether capacity can drop any: from the
  config and the mesh (tokens per rank as each MoE layer sees them: the train microbatch, cut
  again into pipeline microbatches, split over data x expert)."""
  cfg, mcfg, sizes = trainer.cfg, trainer.model_cfg, mesh_sizes(trainer.mesh)
  if mcfg.num_experts == 0:
    return "no MoE layers"
  ep = sizes["expert"]
  if ep == 1:
    return "MoE dropless (no expert axis: every device runs all experts on its own tokens)"
  if str(cfg.mesh.ep_dispatch) == "ragged":
    return f"MoE ragged all_to_all over expert={ep} (dropless)"
  rows = int(cfg.data.batch_size) // int(cfg.train.microbatches)
  if trainer.model.stages > 1:
    rows //= trainer.model.num_microbatches
  tokens = rows * int(cfg.data.seq_len) // (sizes["data"] * ep)
  slots = mcfg.num_experts + int(cfg.mesh.redundant_experts)
  cf = float(cfg.mesh.capacity_factor)
  lim = ep_lib.dispatch_limits(tokens, mcfg.num_experts_per_tok, slots, cf)
  verdict = (f"CAN DROP tokens (losses then differ from one device; dropless from "
             f"mesh.capacity_factor={lim['dropless_factor']:g})" if lim["can_drop"] else "cannot drop")
  return (f"MoE dense all_to_all over expert={ep}: capacity {lim['capacity']} copies per (rank, expert "
          f"slot) for {tokens} tokens per rank (mesh.capacity_factor={cf:g}): {verdict}")


def _nonfinite_names(names: list[str], flags: np.ndarray) -> list[str]:
  return [n for n, ok in zip(names, np.asarray(flags).tolist()) if not ok]


def _scalar_metrics(m: dict) -> dict:
  out = {}
  for k in ("loss", "ce", "z_loss", "aux_loss", "accuracy", "grad_norm", "lr", "num_tokens", "ep_drop_fraction",
            "pg_loss", "kl", "clip_fraction", "logp_mismatch", "train_logp"):
    if k in m:
      out[k] = float(m[k])
  for k in ("load_max_over_mean", "load_min_over_mean", "load_entropy", "dead_experts", "router_logit_std",
            "router_logit_offset", "input_cos", "router_input_cos", "sigmoid_saturation",
            "stored_load_max_over_mean", "router_weight_norm", "router_grad_norm", "bias_range", "bias_std",
            "bias_update_rms"):
    if k in m:
      v = np.asarray(m[k], np.float64)
      out[f"moe/{k}"] = v.tolist()
      out[f"moe/{k}_max"] = float(v.max()) if v.size else float("nan")
  return out


def _corpus_name(cfg: Any) -> str:
  if str(cfg.data.corpus) == "files":
    return "data.paths " + ",".join(experiment.split_paths(cfg.data.paths))
  return f"data.corpus={cfg.data.corpus}"


def train(cfg: Any, workdir: str | os.PathLike, *, hooks: Hooks | None = None,
          devices=None) -> dict[str, Any]:
  """Trains (or resumes) the experiment `cfg` in `workdir`; returns a summary dict."""
  from moonshot_jax.train.data import make_data  # local: grain import is slow

  hooks = hooks or Hooks()
  workdir = Path(workdir).absolute()
  workdir.mkdir(parents=True, exist_ok=True)
  trainer = build(cfg, devices)
  mesh, setup, mcfg = trainer.mesh, trainer.setup, trainer.model_cfg
  tcfg, ccfg = cfg.train, cfg.checkpoint
  total_steps = int(tcfg.steps)
  if trainer.vision is not None:
    from moonshot_jax.vision.data import make_vl_data  # noqa: PLC0415
    data = make_vl_data(cfg, trainer.vision, workdir)
  elif "rl" in cfg:  # batches come from environments (rollouts / oracle trajectories), not a corpus
    from moonshot_jax.rl import source as rl_source
    data = rl_source.make_source(cfg, workdir, trainer)
  else:
    data = make_data(cfg, workdir)
  if data.stats.vocab_size > mcfg.vocab_size:
    raise experiment.ConfigError(f"model.vocab_size: {mcfg.vocab_size} < tokenizer vocab {data.stats.vocab_size}")
  it = data.train_iter()

  ckpt = Checkpointer(workdir / "checkpoints", keep=int(ccfg.keep), keep_best=int(ccfg.keep_best),
                      async_save=bool(ccfg.async_save))
  restored = ckpt.restore_latest(setup.abstract)
  if restored is None:
    start, state, eval_loss = 0, state_lib.create_train_state(setup, trainer.init_fn, int(tcfg.seed)), None
  else:
    start, state, data_state, meta = restored
    if data_state:  # an imported checkpoint (launch/import_checkpoint.py) has no data position yet
      it.set_state(data_state)
    eval_loss = meta.get("eval_loss")
    print(f"[train] resumed from step {start} ({workdir / 'checkpoints' / str(start)})", flush=True)
  if hasattr(data, "prepare"):  # RL: initial weights from rl.init_workdir, the frozen reference
    state = data.prepare(state, resumed=restored is not None)

  is_main = jax.process_index() == 0
  writer = MetricsWriter(workdir, resume_step=start, tensorboard=bool(cfg.logging.tensorboard), enabled=is_main)
  names = step_lib.leaf_names(state.params)  # order of the step's per-leaf finiteness flags
  peak, peak_src = peak_flops(list(mesh.devices.flat), mcfg.dtype)
  fpt = train_flops_per_token(mcfg, int(cfg.data.seq_len))
  tokens_per_step = int(cfg.data.batch_size) * int(cfg.data.seq_len)
  if is_main and start == 0:
    print(f"[train] {total_steps} steps x {tokens_per_step} tokens, mesh {dict(mesh.shape)}, "
          f"peak {peak / 1e12:.3f} TFLOP/s ({peak_src}), {fpt / 1e6:.2f} train MFLOP/token; "
          f"{moe_dispatch_line(trainer)}", flush=True)
    st = data.stats
    print(f"[train] data: {st.train_docs} train / {st.eval_docs} eval documents "
          f"({st.train_tokens} / {st.eval_tokens} tokens) from {_corpus_name(cfg)}, tokenizer {st.tokenizer}",
          flush=True)
    if trainer.vision is not None:
      print(f"[train] vision: {st.train_batches} train / {st.eval_batches} eval batches per epoch, "
            f"{st.train_images} train images, {st.mean_patches_per_batch:.0f} of {int(cfg.vl.patch_budget)} "
            f"patches per batch on average", flush=True)
  if is_main:
    for w in experiment.warnings(cfg):
      print(f"[train] warning: {w}", flush=True)

  bar = None
  if is_main and bool(cfg.logging.progress_bar):
    from tqdm.auto import tqdm
    bar = tqdm(total=total_steps, initial=start, desc="train", dynamic_ncols=True)

  summary: dict[str, Any] = {"workdir": str(workdir), "start_step": start, "stopped": None}
  last_saved = start if restored is not None else -1
  window_s, window_steps, first_timed = 0.0, 0, True  # train-step wall time (no eval / saves)
  last_loss, step = float("nan"), start
  compile_s = None
  try:
    for step in range(start + 1, total_steps + 1):
      t_fetch = time.perf_counter()
      # an RL source samples its batch with the current weights (the state's own device arrays)
      batch = it.next_batch(state) if hasattr(it, "next_batch") else next(it)
      source_row = batch.pop("_metrics", {})
      if hooks.on_batch is not None:
        batch = hooks.on_batch(step, batch)
      if step == start + 1:
        step_lib.check_batch(batch, data.local_batch_size, int(cfg.data.seq_len))
      if hooks.before_step is not None:
        state = hooks.before_step(step, state)
      t0 = time.perf_counter()
      state, m = trainer.train_step(state, to_global(batch, mesh, trainer.model_inputs, trainer.extra_fields))
      m = jax.device_get(m)
      t1 = time.perf_counter()
      if first_timed:  # the first step of a run compiles: reported apart, not in throughput
        compile_s, first_timed = t1 - t0, False
      else:
        window_s += t1 - t_fetch
        window_steps += 1
      ok = bool(m["ok"])
      row = _scalar_metrics(m)
      row.update(source_row)
      if "env_s" in source_row:  # share of this step's wall time spent inside environments
        row["env_time_fraction"] = source_row["env_s"] / max(t1 - t_fetch, 1e-9)
      last_loss = row["loss"]
      poisoned = not ok and bool(m["applied"])  # finite gradients, non-finite updated params
      if not ok:
        bad = {"nonfinite_grads": _nonfinite_names(names, m["grad_finite"]),
               "nonfinite_params": _nonfinite_names(names, m["param_finite"])}
        row.update(bad, bad_step=True, bad_steps=int(m["bad_steps"]), update_applied=poisoned)
        what = ("the update made parameters non-finite" if poisoned else
                "non-finite loss/gradients, update skipped")
        print(f"[train] step {step}: {what} ({int(m['bad_steps'])}/{int(tcfg.max_bad_steps)} "
              f"consecutive); loss={row['loss']} grads: {bad['nonfinite_grads'][:8]} "
              f"params: {bad['nonfinite_params'][:8]}", flush=True)
      do_eval = int(tcfg.eval_every) > 0 and (step % int(tcfg.eval_every) == 0 or step == total_steps)
      if do_eval and ok and trainer.vision is not None:
        from moonshot_jax.vision.joint import vl_evaluate  # noqa: PLC0415
        row.update(vl_evaluate(trainer, state, data))  # eval_loss, text / caption loss, QA exact match
        eval_loss = row["eval_loss"]
      elif do_eval and ok:
        eval_loss = evaluate(trainer, state, data)
        row["eval_loss"] = eval_loss
      if step % int(tcfg.log_every) == 0 or not ok or "eval_loss" in row or step == total_steps:
        if window_steps > 0:
          dt = window_s / window_steps
          tps = tokens_per_step / dt
          row.update(step_time_s=dt, tokens_per_s=tps, mfu=model_flops_utilization(tps, fpt, peak))
        if compile_s is not None:
          row["first_step_s"] = compile_s
          compile_s = None
        writer.write(step, row)
        window_s, window_steps = 0.0, 0
      if bar is not None:
        bar.update(1)
        post = {"loss": f"{row['loss']:.3f}"}
        if eval_loss:
          post["eval"] = f"{eval_loss:.3f}"
        if row.get("ep_drop_fraction", 0.0) > 0:  # capacity overflow: see the start-up line
          post["ep_drop"] = f"{row['ep_drop_fraction']:.2%}"
        bar.set_postfix(post)
      if poisoned or int(m["bad_steps"]) >= int(tcfg.max_bad_steps):
        summary["stopped"] = (f"non-finite parameters after the update of step {step}" if poisoned else
                              f"{int(m['bad_steps'])} consecutive non-finite steps (train.max_bad_steps)")
        print(f"[train] stopping at step {step}: {summary['stopped']}; last good checkpoint: "
              f"{last_saved if last_saved >= 0 else 'none'}", flush=True)
        break
      if ok and int(m["bad_steps"]) == 0 and (step % int(ccfg.every_steps) == 0 or step == total_steps):
        ckpt.save(step, state, it.get_state(), eval_loss=row.get("eval_loss"))
        last_saved = step
      if hooks.after_step is not None:  # the step is fully done: logged and (maybe) saved
        hooks.after_step(step, dict(m, **row))
  finally:
    if bar is not None:
      bar.close()
    ckpt.close()
    writer.close()
    if hasattr(it, "close"):
      it.close()
  summary.update(final_step=step, final_loss=last_loss, eval_loss=eval_loss, last_checkpoint=last_saved,
                 peak_flops=peak, train_flops_per_token=fpt)
  summary["state"] = state
  summary["tokenizer"] = data.tokenizer
  summary["trainer"] = trainer
  if bool(tcfg.sample_after) and summary["stopped"] is None and is_main:
    text = sample_text(trainer, state, data.tokenizer, str(tcfg.sample_prompt), int(tcfg.sample_tokens))
    print(f"[sample] {text}", flush=True)
    summary["sample"] = text
  return summary


# ---- sampling --------------------------------------------------------------------------------
def sample_text(trainer: Trainer, state: state_lib.TrainState, tokenizer, prompt: str, num_tokens: int,
                temperature: float = 0.8, seed: int = 0, repetition_penalty: float = 1.0,
                no_repeat_ngram_size: int = 0) -> str:
  """Prompt continuation by full re-forward per token (no cache): simple and exact, O(L^2).
  Temperature 0 is greedy; repetition_penalty / no_repeat_ngram_size as in inference/sampling.py
  (over prompt + generated tokens). The single place that turns a trained state into text."""
  from moonshot_jax.inference import sampling  # local: inference is optional for training
  params = sampling.SamplingParams(repetition_penalty=repetition_penalty,
                                   no_repeat_ngram_size=no_repeat_ngram_size, vocab_limit=tokenizer.vocab_size)
  mcfg = trainer.model_cfg
  ids = [tokenizer.bos_id] + list(tokenizer.encode(prompt))
  length = min(mcfg.max_seq_len, len(ids) + num_tokens)
  length = -(-length // 16) * 16  # KDA chunking wants a multiple of its small chunk sizes
  length = min(length, mcfg.max_seq_len)
  if len(ids) >= length:
    ids = ids[-(length - 1):]
  # one row: no expert dispatch, no pipeline (the Transformer on the model-layout params)
  lm_params = {k: v for k, v in state.params.items() if k != "vision"}  # a VL run's tower: unused here
  variables = trainer.model.to_model_layout({"params": lm_params, "moe_state": state.moe_state})
  model = trainer.model.model(with_experts=False)

  @jax.jit
  def next_logits(variables, tokens_1L, pos):
    seg = jnp.ones_like(tokens_1L)
    positions = jnp.arange(tokens_1L.shape[1], dtype=jnp.int32)[None]
    logits, _ = model.apply(variables, tokens_1L, seg, positions)
    logits_1V = jax.lax.dynamic_index_in_dim(logits[0], pos, keepdims=True)
    # the history is the buffer itself: tokens [0, pos] are prompt + generated so far
    return sampling.penalized_logits(logits_1V, params, tokens_1L, (pos + 1)[None])[0]

  buf = np.full((1, length), tokenizer.pad_id, np.int32)
  buf[0, :len(ids)] = ids
  rng = np.random.default_rng(seed)
  cur = len(ids)
  out = []
  with jax.set_mesh(trainer.mesh):
    while cur < length and len(out) < num_tokens:
      logits = np.asarray(jax.device_get(next_logits(variables, jnp.asarray(buf), jnp.int32(cur - 1))),
                          np.float64)
      logits = logits[:tokenizer.vocab_size]
      if temperature <= 0:
        nxt = int(np.argmax(logits))
      else:
        p = np.exp((logits - logits.max()) / temperature)
        nxt = int(rng.choice(len(p), p=p / p.sum()))
      if nxt == tokenizer.eos_id:
        break
      buf[0, cur] = nxt
      out.append(nxt)
      cur += 1
  return prompt + tokenizer.decode(out)
