"""Training: data, optimizers, train step, loop, checkpoints, metrics.

  loop.train(cfg, workdir) -> summary   the whole run (resumes from workdir); loop.build(cfg) -> Trainer
  step.make_train_step / make_eval_step the jitted, sharded steps; step.loss_and_grads (accumulation)
  state.setup_state / create_train_state the sharded TrainState
  optim.make_optimizer                  AdamW / Muon + AdamW, schedules, weight-decay masks
  checkpoint.Checkpointer               orbax manager with corrupt-checkpoint fallback
  metrics.MetricsWriter                 metrics.jsonl + TensorBoard; peak_flops for MFU
  data.make_data                        tokenised, packed, checkpointable batches
Submodules are imported explicitly (no eager imports here: grain and orbax are slow to load).
"""
