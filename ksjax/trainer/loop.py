"""The online trainer: `run(config)`, what `python -m ksjax.main --config=configs/<file>.py` calls.

The paper's Algorithm 1, step by step:
  (i)   B prompts from the training stream (a grain iterator, whose position is checkpointed);
  (ii)  n completions per prompt from the current policy (`ksjax.sampling`), scored by the task;
        the rewards [B, n] become k-sample weights with `ksjax.objectives.k_sample_advantages`
        (aggregator, baseline, k, p, beta, scale from the config);
  (iii) optimizer steps on those completions (`learner.learn`: plain PG, PPO, GRPO, Dr. GRPO).

Around it: the model comes from a preset, a Hugging Face directory or an Orbax checkpoint; an
optional supervised warm-up on reference solutions makes the start policy, which is saved as
`<workdir>/start` and is the frozen reference of the KL metrics and penalty; a held-out evaluation
runs at that start and at the end and prints a table of the two; every step's metrics go to
TensorBoard and `<workdir>/metrics.jsonl`; checkpoints go to `<workdir>/checkpoints`, and
`--config.resume=True` continues from the newest readable one exactly (the sampling seed and the
mini-batch order come from the checkpointed random key, the prompts from the checkpointed data
iterator).

Workdir layout: config.json, tokenizer/ (the task's tokenizer), start/ (the start policy),
checkpoints/<step>/, metrics.jsonl, tensorboard/, eval_start.json, eval_end.json, eval_table.txt,
final/ (the last policy, as a ksjax.model checkpoint).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging
from flax import nnx

from ksjax import distributed, model, planning
from ksjax.config_validation import ConfigError
from ksjax.trainer import checkpointing, evaluation, learner, metrics, policy, rollout, sparse
from ksjax.trainer import tasks
from ksjax.trainer import config as config_lib
from ksjax.trainer import update as update_lib
from ksjax.trainer import warmup


def _say(message: str) -> None:
  if jax.process_index() == 0:
    print(message, flush=True)


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Timer:
  """Wall-clock seconds per phase of a step."""
  seconds: dict[str, float] = dataclasses.field(default_factory=dict)
  _last: float = dataclasses.field(default_factory=time.perf_counter)

  def lap(self, phase: str) -> None:
    now = time.perf_counter()
    self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
    self._last = now


def _has_checkpoints(directory: str) -> bool:
  return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def _eval(config, derived, llama, task, mesh, seed: int) -> evaluation.EvalResult:
  prompts = list(task.prompts(config.eval.split))
  if config.eval.num_prompts is not None:
    prompts = prompts[:config.eval.num_prompts]
  return evaluation.evaluate(
      llama, task, prompts, num_samples=config.eval.num_samples, ks=tuple(config.eval.ks),
      max_new_tokens=derived.eval_max_new_tokens, temperature=config.eval.temperature,
      top_p=config.eval.top_p, top_k=config.eval.top_k, seed=seed,
      batch_prompts=config.eval.batch_prompts, mesh=mesh)


def run(config: Any) -> None:
  """Trains as `config` says (see `ksjax.trainer.defaults` for every field)."""
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save, jax its backends, at INFO
  distributed.initialize()  # joins the other hosts' processes, if any: before any computation
  derived = config_lib.validate(config)
  workdir = os.path.abspath(config.workdir)
  checkpoint_dir = os.path.join(workdir, "checkpoints")
  if _has_checkpoints(checkpoint_dir) and not config.resume:
    raise ConfigError(f"config.workdir={config.workdir!r} already holds a run (checkpoints in "
                      f"{checkpoint_dir}); expected config.resume=True to continue it, or a new "
                      "config.workdir")
  start_time = time.time()
  task = distributed.ShardedScoring(tasks.make_task(config))
  try:
    _train(config, derived, task, workdir, checkpoint_dir, start_time)
  finally:
    close = getattr(task, "close", None)
    if close is not None:
      close()


def _train(config, derived, task, workdir: str, checkpoint_dir: str, start_time: float) -> None:
  tokenizer = task.tokenizer
  mesh = model.make_mesh(tuple(config.mesh))
  batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
  config_lib.check_mesh(derived, batch_shards)
  planning.check_fits(config, vocab_size=tokenizer.vocab_size)  # before allocating (not on CPU)
  llama = policy.build_model(config, tokenizer.vocab_size, mesh)
  _say(f"model: {llama.cfg.num_params:,} parameters, {llama.cfg.num_layers} layers, width "
       f"{llama.cfg.hidden_size}; mesh {dict(mesh.shape)} on {jax.device_count()} "
       f"{jax.devices()[0].platform} device(s)")

  loss_cfg = update_lib.LossConfig(
      algorithm=config.algorithm, clip_eps=config.clip_eps, value_clip=config.value_clip,
      value_coef=config.value_coef, is_cap=config.is_cap, kl_coef=config.kl_coef,
      kl_estimator=config.kl_estimator, temperature=config.temperature)
  schedule = update_lib.learning_rate_schedule(config.learning_rate, config.lr_warmup_steps)
  optimizer = update_lib.make_optimizer(
      learning_rate=config.learning_rate, warmup_steps=config.lr_warmup_steps,
      weight_decay=config.weight_decay, max_grad_norm=config.max_grad_norm, b1=config.adam_b1,
      b2=config.adam_b2, eps=config.adam_eps)
  graphdef, _ = nnx.split(llama)
  updater = update_lib.Updater(graphdef, optimizer, loss_cfg, mesh)
  use_sparse = config.sparse_updates and not sparse.needs_every_row(config.algorithm,
                                                                     config.kl_coef)
  learn_cfg = learner.LearnConfig(
      algorithm=config.algorithm, aggregation=config.loss_aggregation,
      loss_constant=derived.loss_constant, ppo_epochs=config.ppo_epochs,
      num_minibatches=config.num_minibatches, micro_batch_size=derived.micro_batch_size,
      sparse=use_sparse, batch_shards=batch_shards)
  data_iterator = tasks.train_iterator(config, task)
  checkpointer = checkpointing.Checkpointer(
      checkpoint_dir, save_every=config.checkpoint_every, keep=config.keep_checkpoints,
      use_async=config.async_checkpoints)
  config_json = checkpointing.config_json(config)
  step, state, ref_params, resumed = _start_or_resume(
      config, derived, task, llama, updater, data_iterator, checkpointer, config_json, mesh,
      workdir)
  del llama

  _say(f"training: {config.num_steps} steps of {config.batch_prompts} prompts x {derived.n} "
       f"completions, {config.algorithm} with {config.aggregator}/{config.baseline} "
       f"(k={config.k}), sparse updates {'on' if use_sparse else 'off'}")
  writer = metrics.MetricsWriter(workdir, resume_step=step if resumed else None)
  bar = metrics.ProgressBar(config.num_steps, step, enabled=config.progress_bar)
  try:
    while step < config.num_steps:
      timer = Timer()
      prompts = distributed.gather_list(next(data_iterator))  # every host's share, in order
      rng, sample_key, order_key = jax.random.split(state.rng, 3)
      state = dataclasses.replace(state, rng=jax.device_put(rng, state.rng.sharding))
      timer.lap("time/other")
      out = rollout.sample(nnx.merge(graphdef, state.params), prompts, num_samples=derived.n,
                           max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                           top_p=config.top_p, top_k=config.top_k,
                           seed=int(jax.random.randint(sample_key, (), 0, 2**31 - 1)),
                           eos_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id, mesh=mesh)
      out = distributed.to_host(out)
      timer.lap("time/sampling")
      batch = rollout.score(task, prompts, out)
      timer.lap("time/reward")
      advantage_bn = rollout.advantages(batch, aggregator=config.aggregator,
                                        baseline=config.baseline, k=config.k, p=config.p,
                                        beta=config.beta, scale=config.scale)
      ref_logp_rt = learner.forward_rows(updater, ref_params, batch, np.arange(derived.rows),
                                         derived.micro_batch_size)["logp"]
      timer.lap("time/reference")
      state, update_metrics = learner.learn(updater, state, batch, advantage_bn.reshape(-1),
                                            learn_cfg, np.asarray(order_key), ref_logp_rt)
      jax.block_until_ready(state.step)
      timer.lap("time/update")
      step += 1
      scalars = _step_scalars(config, batch, advantage_bn, ref_logp_rt, update_metrics, timer)
      scalars["optim/skipped_total"] = float(state.skipped)
      scalars["optim/learning_rate"] = float(schedule(int(state.step) - 1))
      if step % config.log_every == 0 or step == config.num_steps:
        writer.write(step, scalars)
      bar.update(scalars)
      checkpointer.save(step, state, data_iterator, config_json, force=step == config.num_steps)
  finally:
    bar.close()
    writer.close()
    checkpointer.close()

  if int(state.skipped):
    _say(f"{int(state.skipped)} update(s) had a non-finite loss or gradient and were skipped")
  final = nnx.merge(graphdef, state.params)
  final_dir = os.path.join(workdir, "final")
  if not os.path.isdir(final_dir):
    model.save_checkpoint(final_dir, final)
  if config.eval.at_end:
    _final_eval(config, derived, final, task, mesh, workdir)
  _say(f"done in {time.time() - start_time:.0f}s; outputs in {workdir}")


def _start_or_resume(config, derived, task, llama, updater, data_iterator, checkpointer,
                     config_json, mesh, workdir: str):
  """(step, state, reference parameters, resumed): the newest readable checkpoint
  (config.resume), or a fresh start at step 0: the warm-up, the start policy saved as
  <workdir>/start, its evaluation."""
  start_dir = os.path.join(workdir, "start")
  _, params = nnx.split(llama)
  restored = None
  if config.resume:
    restored = checkpointer.restore_latest(updater.abstract_state(params), data_iterator)
  if restored is not None:
    step, state, saved_config = restored
    _say(f"resumed from step {step} in {checkpointer.directory}")
    changed = sorted(k for k in set(saved_config) | set(config_json)
                     if saved_config.get(k) != config_json.get(k) and k != "resume")
    if changed:
      _say(f"warning: config differs from the checkpoint's in {', '.join(changed)}")
    if not os.path.isdir(start_dir):
      raise ConfigError(f"config.resume=True: {start_dir} (the start policy) is missing")
    reference, _ = model.load_checkpoint(start_dir, mesh)
    return step, state, nnx.state(reference), True

  os.makedirs(workdir, exist_ok=True)
  if distributed.is_writer():
    with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
      json.dump(config_json, f, indent=1, sort_keys=True)
    task.tokenizer.save(os.path.join(workdir, "tokenizer"))
  if config.sft_warmup.steps:
    w = config.sft_warmup
    _say(f"supervised warm-up: {w.steps} steps of {w.batch_size} reference solutions")
    params, summary = warmup.warm_up(
        llama, task, steps=w.steps, batch_size=w.batch_size, learning_rate=w.learning_rate,
        lr_warmup_steps=w.lr_warmup_steps, weight_decay=w.weight_decay, seed=config.seed,
        mesh=mesh, log=_say, log_every=max(1, w.steps // 4))
    _say(f"warm-up done in {summary['seconds']:.0f}s, loss {summary['loss']:.3f}")
  if os.path.isdir(start_dir):  # a previous attempt died before its first checkpoint
    shutil.rmtree(start_dir)
  model.save_checkpoint(start_dir, llama)
  if config.eval.at_start:
    _say(f"held-out evaluation of the start policy ({config.eval.num_samples} samples per "
         "prompt)...")
    t0 = time.time()
    result = _eval(config, derived, llama, task, mesh, seed=config.seed + 1)
    evaluation.save(os.path.join(workdir, "eval_start.json"), result)
    _say(f"start: {_headline(result.metrics, config.eval.ks)} ({time.time() - t0:.0f}s)")
  ref_params = jax.tree.map(jnp.copy, params)
  return 0, updater.init_state(params, jax.random.PRNGKey(config.seed)), ref_params, False


def _step_scalars(config, batch: rollout.Rollout, advantage_bn: np.ndarray,
                  ref_logp_rt: np.ndarray, update_metrics: dict[str, float],
                  timer: Timer) -> dict[str, float]:
  """Everything one step logs: the batch's scores, the update, KL and entropy, time, speed."""
  scalars = {**rollout.batch_metrics(batch, config.k), **update_metrics,
             **_kl_metrics(batch, ref_logp_rt), **timer.seconds}
  scalars["advantage/nonzero_fraction"] = float(np.mean(advantage_bn != 0))
  scalars["advantage/abs_mean"] = float(np.mean(np.abs(advantage_bn)))
  total = sum(timer.seconds.values())
  generated = float(batch.completion_mask_rt.sum())
  scalars["time/step"] = total
  scalars["throughput/tokens_per_s"] = generated / max(total, 1e-9)
  scalars["throughput/sample_tokens_per_s"] = generated / max(timer.seconds["time/sampling"], 1e-9)
  trained = float(batch.attention_mask_rt.sum()) * update_metrics["update/rows_fraction"]
  scalars["throughput/update_tokens_per_s"] = trained / max(timer.seconds["time/update"], 1e-9)
  return scalars


def _kl_metrics(batch: rollout.Rollout, ref_logp_rt: np.ndarray) -> dict[str, float]:
  """KL(pi, pi_ref) of the sampling policy, per completion (summed over its tokens) and averaged
  over completions, from the sampled tokens: k1 and k3 estimators with the sampler's log-probs as
  log pi (the learner's own before this step's update; with top-p/top-k, of the truncated
  distribution that sampled); and the per-token entropy estimate -mean log pi(y_t)."""
  mask_rt = batch.completion_mask_rt
  logp_rt = batch.behaviour_logp_rt
  log_ratio_rt = np.where(mask_rt, ref_logp_rt - logp_rt, 0.0)
  k1_r = (-log_ratio_rt).sum(1)
  k3_r = np.where(mask_rt, np.expm1(log_ratio_rt) - log_ratio_rt, 0.0).sum(1)
  return {"kl/k1": float(k1_r.mean()), "kl/k3": float(k3_r.mean()),
          "entropy/per_token": float(-logp_rt[mask_rt].mean()) if mask_rt.any() else 0.0}


def _final_eval(config, derived, final, task, mesh, workdir: str) -> None:
  """Evaluates the final policy and prints (and writes) the table against the start."""
  _say("held-out evaluation of the final policy...")
  result = _eval(config, derived, final, task, mesh, seed=config.seed + 1)
  evaluation.save(os.path.join(workdir, "eval_end.json"), result)
  start_path = os.path.join(workdir, "eval_start.json")
  start = evaluation.load_metrics(start_path) if os.path.exists(start_path) else None
  text = evaluation.table(start, result.metrics, tuple(config.eval.ks), task.levels(),
                          level_k=config.k)
  header = (f"held-out {config.eval.split}: {len(result.levels)} prompts x "
            f"{result.num_samples} samples, temperature {config.eval.temperature}, top-p "
            f"{config.eval.top_p}")
  if distributed.is_writer():
    with open(os.path.join(workdir, "eval_table.txt"), "w", encoding="utf-8") as f:
      f.write(header + "\n" + text + "\n")
  _say(header + "\n" + text)


def _headline(m: dict[str, float], ks) -> str:
  return ", ".join(f"{name} {m[name]:.3f}" for name in
                   ["reward"] + [f"pass@{k}" for k in ks] if name in m)
