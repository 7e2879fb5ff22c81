"""The online trainer: `run(config)`, what `python -m ksjax.main --config=configs/<file>.py` calls.

The paper's Algorithm 1, step by step:
  (i)   B prompts from the training stream (a grain iterator, whose position is checkpointed);
  (ii)  n completions per prompt from the current policy (`ksjax.sampling`), scored by the task;
        the rewards [B, n] become k-sample weights with `ksjax.objectives.k_sample_advantages`
        (aggregator, baseline, k, p, beta, scale from the config);
  (iii) optimizer steps on those completions (`learner.learn`: plain PG, PPO, GRPO, Dr. GRPO).
With config.dynamic_sampling, (i)-(ii) repeat in rounds until B groups (prompts) with a non-zero
k-sample weight are held or config.dynamic_max_rounds is reached, and only those groups go on to
the reference forward and (iii) (`ksjax.trainer.draw`, which says what is logged and why).

Around it: the model comes from a preset, a Hugging Face directory or an Orbax checkpoint; an
optional supervised warm-up on reference solutions makes the start policy, which is saved as
`<workdir>/start` and is the frozen reference of the KL metrics and penalty; a held-out evaluation
runs at that start and at the end and prints a table of the two; every step's metrics go to
TensorBoard and `<workdir>/metrics.jsonl`; checkpoints go to `<workdir>/checkpoints`, and
`--config.resume=True` continues from the newest readable one exactly (the sampling seed and the
mini-batch order come from the checkpointed random key, the prompts from the checkpointed data
iterator).

A CPU budget (config.max_cpu_minutes) ends the steps early: the run stops after the first step at
whose end the training loop has used that much CPU time, and then checkpoints, saves the final
policy and evaluates it as at num_steps. What counts is `cpu_seconds()` spent inside the loop
(sampling, scoring, the reference forward, updates, logging, checkpoint saves), not the start-up,
the warm-up or the held-out evaluations, which are the same work for every run of a comparison
whatever its objective. CPU time rather than wall time, because the machine may be shared. Every
step logs the cumulative figure, `time/cpu_seconds` (a step that is checkpointed is logged
whatever log_every says, after its save starts), and a resumed run takes it from the step log at
its checkpoint's step, so its budget continues rather than restarts.

Told to stop (SIGTERM, a preemption notice, or SIGINT; `ksjax.stopping`), the loop finishes the
step in progress, saves it (with the rollouts sampled ahead), prints one line naming the step and
how to resume, and exits with 143 (SIGTERM) or 130 (SIGINT); on several processes all of them
stop after the same step, JAX's preemption sync point. A write that fails for want of space is
one line naming it and the checkpoint a resume continues from (`ksjax.files.DiskFull`).

The ConfigDict is read once, by `ksjax.run.spec.from_config`; everything here reads the typed
`TrainSpec`. The work directory's layout is `ksjax.run.directory.RunDirectory`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import shutil
import signal
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from absl import flags, logging
from flax import nnx

from ksjax import allocator, distributed, errors, files, machine, model, stopping
from ksjax.model import gguf_io, lora
from ksjax.config_validation import ConfigError
from ksjax.run import checkpoints, policy, scoring, spec as spec_lib
from ksjax.run import tasks as run_tasks
from ksjax.run.directory import LORA_BASE_KEY, RunDirectory
from ksjax.run.spec import TrainSpec
from ksjax.trainer import async_rollouts, held_out, learner, memory_plan, metrics
from ksjax.trainer import draw as draw_lib
from ksjax.trainer import probe, rollout, warmup
from ksjax.trainer import update as update_lib


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


def cpu_seconds() -> float:
  """CPU seconds (user + system) of this process, every thread, plus those of its child processes
  that have ended and been waited for (a pool of reward workers that lives through the run is not
  seen until it ends; the embedded task scores in this process)."""
  own = resource.getrusage(resource.RUSAGE_SELF)
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@dataclasses.dataclass
class CpuBudget:
  """The training loop's CPU time, carried over from before a resume, and its budget.

  On several hosts the budget is decided by process 0's figure, sent to every process, so that
  all of them stop after the same step."""
  limit: float | None      # CPU-seconds; None: no budget
  before: float = 0.0      # CPU-seconds the loop used before this process (a resumed run)
  _since: float = dataclasses.field(default_factory=lambda: cpu_seconds())

  def used(self) -> float:
    return self.before + cpu_seconds() - self._since

  def spent(self, used: float) -> bool:
    if self.limit is None:
      return False
    return bool(distributed.gather(used >= self.limit)[0])


def run(config: Any) -> None:
  """Trains as `config` says (see `ksjax.run.config` for every field)."""
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save, jax its backends, at INFO
  distributed.initialize()  # joins the other hosts' processes, if any: before any computation
  train(spec_lib.from_config(config))


def train(spec: TrainSpec) -> None:
  """Trains as `spec` says: Algorithm 1 with its start, checkpoints and held-out evaluation."""
  run_dir = RunDirectory(spec.run.workdir)
  if run_dir.has_checkpoints() and not spec.run.resume:
    raise ConfigError(f"config.workdir={spec.run.workdir!r} already holds a run (checkpoints in "
                      f"{run_dir.steps_dir}); expected config.resume=True to continue it, or a "
                      "new config.workdir")
  start_time = time.time()
  task = distributed.ShardedScoring(
      run_tasks.make_task(spec.task, spec.model, spec.eval.split))
  try:
    _train(spec, task, run_dir, start_time)
  finally:
    close = getattr(task, "close", None)
    if close is not None:
      close()


def _train(spec: TrainSpec, task, run_dir: RunDirectory, start_time: float) -> None:
  compiled = metrics.CompileCounter()  # the whole run's, for its last lines
  tokenizer = task.tokenizer
  mesh, sampler_mesh = async_rollouts.meshes(spec)  # the sampler's own sub-mesh, if any
  batch_shards = model.sharding.batch_shards(mesh)
  spec.check_mesh(batch_shards)
  memory_plan.check_fits(spec, vocab_size=tokenizer.vocab_size,  # before allocating (not on CPU)
                         **({"devices": list(mesh.devices.flat)} if sampler_mesh else {}))
  llama = policy.build_model(spec.model, tokenizer.vocab_size, mesh,
                             value_head=spec.loss.value_head, seed=spec.run.seed)
  gguf_io.forget_parsed()  # the task's tokenizer and the weights are read: no more reads
  if sampler_mesh is not None:
    model.sharding.check_divisible(llama.cfg, sampler_mesh)
  _say(f"model: {llama.cfg.num_params:,} parameters, {llama.cfg.num_layers} layers, width "
       f"{llama.cfg.hidden_size}; mesh {dict(mesh.shape)} on {jax.device_count()} "
       f"{jax.devices()[0].platform} device(s)")
  note = machine.bfloat16_operand_note(llama.cfg.operand_dtype, jax.devices()[0].platform)
  if note:
    _say(note)

  schedule = spec.optimizer.schedule()
  lora_base = None  # under LoRA, what the checkpoints record of the base
  frozen = None
  if spec.lora.enabled:
    lora_base = policy.base_record(spec.model, llama)
    llama = policy.adapt(llama, spec.lora, spec.run.seed)  # QLoRA: the float base is dropped
    graphdef, _, frozen = lora.split(llama)
    _say(f"LoRA: rank {spec.lora.rank} on {spec.lora.targets} weights "
         f"({_count(nnx.state(llama, lora.trainable_filter(llama))):,} trainable parameters), "
         f"frozen base {lora_base['name']} ({lora.base_format(spec.lora, llama.cfg)})")
  else:
    # The structure alone: a name bound to the loaded parameters would keep them alive beside
    # the train state's copy for the whole run.
    graphdef = nnx.graphdef(llama)
  updater = update_lib.build_updater(spec, graphdef, mesh, frozen)
  del frozen
  data_iterator = run_tasks.train_iterator(spec.task, task, batch_prompts=spec.sampling.batch_prompts,
                                           seed=spec.run.seed)
  checkpointer = checkpoints.Checkpointer(
      run_dir.steps_dir, save_every=spec.run.checkpoint_every, keep=spec.run.keep_checkpoints,
      use_async=spec.run.async_checkpoints)
  step, state, ref_params, resumed = _start_or_resume(
      spec, task, llama, updater, data_iterator, checkpointer, mesh, run_dir, lora_base)
  del llama
  saved_config = spec.config_json if lora_base is None else {**spec.config_json,
                                                              LORA_BASE_KEY: lora_base}

  s, e = spec.sampling, spec.estimator
  mixture = "" if e.k_mixture == "none" else f", mixture {e.k_mixture} over k <= {e.k}"
  _say(f"training: {spec.run.num_steps} steps of {s.batch_prompts} prompts x {s.n} "
       f"completions, {spec.loss.algorithm} with {e.aggregator}/{e.baseline} (k={e.k}{mixture})"
       + (", rewarded by agreement without labels" if s.label_free else "")
       + f", sparse updates {'on' if spec.loss.use_sparse else 'off'}"
       + (f", dynamic sampling (at most {s.dynamic_max_rounds} rounds)"
          if s.dynamic_sampling else ""))
  writer = metrics.MetricsWriter(run_dir, resume_step=step if resumed else None)
  budget = CpuBudget(spec.run.cpu_budget_seconds,
                     _cpu_before(run_dir, step) if resumed and step else 0.0)
  over = budget.spent(budget.before)
  if over:
    _say(f"the CPU budget ({spec.run.max_cpu_minutes} CPU-minutes) was spent by step {step}: "
         "no more steps")
  bar = metrics.ProgressBar(spec.run.num_steps, step, enabled=spec.run.progress_bar)
  compiles = metrics.CompileCounter()
  # Dynamic sampling pads the kept groups to whole mini-batches over the batch shards.
  sampler = StepSampler(spec, task, data_iterator,
                        draw_lib.group_multiple(s.n, spec.loss.num_minibatches * batch_shards))
  first_step = step
  ahead = None  # lockstep; with config.max_lag, the rollouts sampled ahead (`async_rollouts`)
  if s.max_lag:
    ahead = _rollouts_ahead(spec, sampler, _sampler_policy(updater, sampler_mesh),
                            sampler_mesh or mesh, state, step, run_dir, resumed)
  stop = stopping.Signals("ksjax")  # SIGTERM and SIGINT: stop after the step in progress
  stopped = False  # by a signal, or on several processes by a preemption notice
  with stop, _resumable(run_dir):
    try:
      while step < spec.run.num_steps and not over:
        allocator.release_free_memory()  # the last phase's freed pages, before sampling's
        timer = Timer()
        rng, sample_key, order_key = jax.random.split(state.rng, 3)
        worker_seconds = None
        if ahead is None:
          state = dataclasses.replace(state, rng=jax.device_put(rng, state.rng.sharding))
          drawn = sampler.draw(step, updater.policy(state.params), sample_key, mesh, timer)
        else:
          ahead.push(step, state.params)  # before the update donates them
          state = dataclasses.replace(state, rng=jax.device_put(rng, state.rng.sharding))
          drawn, worker_seconds, lag = ahead.take(step)
          timer.lap("time/rollout_wait")
        batch = drawn.update
        ref_logp_rt = None  # the start policy's log-probs: the KL penalty's, or the KL metrics'
        if len(drawn.kept) and spec.loss.reference_at(step + 1, spec.run.num_steps):
          ref_logp_rt = learner.reference_rows(updater, ref_params, batch,
                                               spec.loss.micro_batch_size)
        timer.lap("time/reference")
        # No group with signal (dynamic sampling at its cap): no optimizer step at all.
        update_metrics = {"optim/steps": 0.0, "update/rows_fraction": 0.0,
                          "update/shared_prompts": 0.0}
        allocator.release_free_memory()  # sampling's and the reference's, before the update's
        if len(drawn.kept):
          state, update_metrics = learner.learn(updater, state, batch, drawn.update_advantage_r,
                                                np.asarray(order_key), ref_logp_rt)
        jax.block_until_ready(state.step)
        timer.lap("time/update")
        step += 1
        scalars = _step_scalars(spec, drawn, ref_logp_rt, update_metrics, timer, worker_seconds)
        scalars.update(task.metrics())  # e.g. how the task read the step's answers
        if ahead is not None:
          scalars["async/lag"] = float(lag)
          scalars.update({f"async/{name.split('/')[-1]}_seconds": value
                          for name, value in worker_seconds.items()})
        scalars["optim/skipped_total"] = float(state.skipped)
        scalars["optim/learning_rate"] = float(schedule(int(state.step) - 1))
        if spec.eval.probe_at(step):  # held out and labelled, like the evaluations: not budgeted
          probe_cpu, probe_wall = cpu_seconds(), time.perf_counter()
          scalars.update(probe.evaluate(updater.policy(state.params), task, spec.eval,
                                        seed=spec.run.seed + 2, mesh=mesh))
          scalars["time/probe"] = time.perf_counter() - probe_wall
          budget.before -= cpu_seconds() - probe_cpu
        scalars.update(compiles.take())
        scalars["objective/k"] = float(drawn.k)  # the k its weights used
        scalars["memory/peak_rss_gib"] = allocator.peak_resident_gib()
        scalars["time/cpu_seconds"] = used = budget.used()
        over = budget.spent(used)
        # Every process asks at every step: JAX's preemption sync point (`ksjax.stopping`).
        stopped = stop.reached(step)
        last = step == spec.run.num_steps or over or stopped
        logged = step % spec.run.log_every == 0 or last
        if logged:
          writer.write(step, scalars)
        bar.update(scalars)
        if ahead is not None and checkpointer.due(step, force=last):
          # Before Orbax saves the data iterator: the worker is idle once these are done.
          async_rollouts.save_pending(run_dir.workdir, step, ahead.settle(),
                                      min(checkpointer.steps(), default=None))
        saved = checkpointer.save(step, state, data_iterator, saved_config, force=last)
        if saved and not logged:  # a resumed run reads its CPU time from the checkpoint's step
          writer.write(step, scalars)
        if over:
          _say(f"CPU budget spent: {used / 60:.2f} of {spec.run.max_cpu_minutes} CPU-minutes "
               f"after step {step}; stopping")
        if stopped:
          break
    finally:
      if ahead is not None:
        ahead.close()
      bar.close()
      writer.close()
      checkpointer.close()
  # A signal that came while the last step's save was finishing: one process stops there too (on
  # several, the others go on to the final evaluation, so this one does as well).
  if stopped or (stop.signum is not None and jax.process_count() == 1):
    message = (f"stopped by {stopping.signal_name(stop.signum)} after step {step}: checkpoint "
               f"{step} is saved in {checkpointer.directory}; the same command with "
               "--config.resume=True continues from it")
    _say(message)
    raise stopping.Stopped(stop.signum or signal.SIGTERM, message)

  if int(state.skipped):
    _say(f"{int(state.skipped)} update(s) had a non-finite loss or gradient and were skipped")
  final = updater.policy(state.params)
  if step > first_step:
    # Resumed past an earlier end (a larger num_steps or CPU budget), a final policy is stale:
    # one process removes it while the others wait.
    if distributed.is_writer() and os.path.isdir(run_dir.final_dir):
      shutil.rmtree(run_dir.final_dir)
    distributed.gather(None)
  if not os.path.isdir(run_dir.final_dir):
    _save_policy(run_dir.final_dir, final, spec, lora_base)
  if spec.eval.at_end:
    _final_eval(spec, final, task, mesh, run_dir)
  _say(compiled.summary())
  _say(f"done in {time.time() - start_time:.0f}s; outputs in {run_dir.workdir}")


@contextlib.contextmanager
def _resumable(run_dir: RunDirectory) -> Iterator[None]:
  """A write of the loop that failed for want of space (the step log, the rollouts sampled
  ahead) says which checkpoint a resume continues from; a checkpoint's own says so already."""
  try:
    yield
  except files.DiskFull as e:
    if isinstance(e, checkpoints.CheckpointDiskFull):
      raise
    raise files.DiskFull(f"{e}; {checkpoints.resume_note(run_dir.steps_dir)}") from None


def _cpu_before(run_dir: RunDirectory, step: int) -> float:
  """The training loop's CPU seconds up to `step`, from the step log (process 0's, sent to all)."""
  used = None
  if distributed.is_writer():
    used = metrics.logged_value(run_dir.metrics_jsonl, step, "time/cpu_seconds")
  used = distributed.gather(used)[0]
  if used is None:
    # A run from before the budget existed, or a step log that was lost: counted from here.
    _say(f"warning: the step log has no time/cpu_seconds at step {step}; the CPU budget "
         "counts from this resume")
    return 0.0
  return used


def _count(state: nnx.State) -> int:
  return sum(x.size for x in jax.tree.leaves(state))


def _save_policy(path: str, llama, spec: TrainSpec, lora_base: dict | None) -> None:
  """A run's start or final policy: a ksjax.model checkpoint, or under LoRA the adapters alone,
  naming their base (`lora.save`; `python -m ksjax.tools.merge_lora` makes a whole model)."""
  if lora_base is None:
    model.save_checkpoint(path, llama)
  else:  # every process: Orbax's save is collective, as in model.save_checkpoint
    lora.save(path, llama, spec.lora, lora_base)


def _sampler_policy(updater: update_lib.Updater, sampler_mesh):
  """params -> the model the asynchronous sampler runs: `updater.policy`, or on a sampler mesh of
  its own under LoRA, the graph with a copy of the frozen base placed there once."""
  if sampler_mesh is None or updater.frozen is None:
    return updater.policy
  frozen = jax.device_put(updater.frozen, jax.tree.map(
      lambda x: jax.sharding.NamedSharding(sampler_mesh, x.sharding.spec), updater.frozen))
  return lambda params: lora.join(updater.graphdef, params, frozen)


def _start_or_resume(spec: TrainSpec, task, llama, updater, data_iterator, checkpointer, mesh,
                     run_dir: RunDirectory, lora_base: dict | None = None):
  """(step, state, reference parameters, resumed): the newest readable checkpoint
  (config.resume), or a fresh start at step 0: the warm-up, the start policy saved in the run
  directory, its evaluation. Under LoRA the parameters are the adapters (`lora.split`) and the
  reference is the start's adapters on the same frozen base: without warm-up B = 0, the base
  itself, bit for bit, so no second copy of the base is ever held."""
  start_dir = run_dir.start_dir
  params = (nnx.state(llama) if lora_base is None
            else nnx.state(llama, lora.trainable_filter(llama)))
  restored = None
  if spec.run.resume:
    restored = checkpointer.restore_latest(updater.abstract_state(params), data_iterator)
    if restored is None:
      # Starting fresh is what a resubmitted job wants on its first attempt, but not silently:
      # a mistyped workdir would otherwise look like a resumed run.
      _say(f"resume=True: {run_dir.workdir} holds no checkpoint; starting a fresh run")
  # The inputs are read: library log lines are no longer held back (`ksjax.errors`; imported
  # here to keep this change within this function).
  from ksjax import errors  # pylint: disable=g-import-not-at-top
  errors.inputs_read()
  if restored is not None:
    step, state, saved_config = restored
    _say(f"resumed from step {step} in {checkpointer.directory}")
    config_json = spec.config_json
    if lora_base is not None:
      policy.check_base(saved_config.get(LORA_BASE_KEY), lora_base,
                        f"config.resume=True: checkpoint {step} in {checkpointer.directory}")
    changed = sorted(k for k in set(saved_config) | set(config_json)
                     if saved_config.get(k) != config_json.get(k)
                     and k not in ("resume", LORA_BASE_KEY))
    if changed:
      _say(f"warning: config differs from the checkpoint's in {', '.join(changed)}")
    if not os.path.isdir(start_dir):
      raise ConfigError(f"config.resume=True: {start_dir} (the start policy) is missing")
    if lora_base is not None:  # the start's adapters, read into the model built for this run
      lora.restore(start_dir, llama)
      return step, state, nnx.state(llama, lora.trainable_filter(llama)), True
    reference, _ = model.load_checkpoint(start_dir, mesh)
    return step, state, lora.frozen_operands(nnx.state(reference), llama.cfg), True

  os.makedirs(run_dir.workdir, exist_ok=True)
  if distributed.is_writer():
    files.write_json(run_dir.config_json, spec.config_json, sort_keys=True)
    task.tokenizer.save(run_dir.tokenizer_dir)
  if spec.sft_warmup.steps:
    w = spec.sft_warmup
    until = (f" (at most; until calibration pass@1 >= {w.target_pass_at_1:g})"
             if w.targeted else "")
    _say(f"supervised warm-up: {w.steps} steps{until} of {w.batch_size} reference solutions")
    params, summary = warmup.warm_up(llama, task, w, seed=spec.run.seed, mesh=mesh, log=_say,
                                     log_every=max(1, w.steps // 4),
                                     max_new_tokens=spec.eval.max_new_tokens)
    _say(f"warm-up done in {summary['seconds']:.0f}s after {summary['steps']} steps, loss "
         f"{summary['loss']:.3f}")
  if os.path.isdir(start_dir):  # a previous attempt died before its first checkpoint
    shutil.rmtree(start_dir)
  _save_policy(start_dir, llama, spec, lora_base)
  if spec.eval.at_start:
    _say(f"held-out evaluation of the start policy ({spec.eval.num_samples} samples per "
         "prompt)...")
    t0 = time.time()
    result = held_out.evaluate(llama, task, spec.eval, seed=spec.run.seed + 1, mesh=mesh)
    held_out.save(run_dir.held_out_json("start"), result)
    _say(f"start: {held_out.headline(result.metrics, spec.eval.ks)} "
         f"({time.time() - t0:.0f}s)")
  ref_params = lora.frozen_operands(params, llama.cfg)  # read only by the reference forward
  return 0, updater.init_state(params, jax.random.PRNGKey(spec.run.seed)), ref_params, False


def _rollouts_ahead(spec: TrainSpec, sampler: StepSampler, sampler_policy, sampler_mesh, state,
                    step: int, run_dir: RunDirectory, resumed: bool) -> async_rollouts.Rollouts:
  """The worker sampling config.max_lag steps ahead through `sampler`, the lockstep loop's own
  draw, with the rollouts the checkpoint saved."""
  restored = async_rollouts.load_pending(run_dir.workdir, step) if resumed else None
  if resumed and restored is None:
    _say(f"warning: checkpoint {step} saved no rollouts sampled ahead; the next "
         f"{spec.sampling.max_lag} steps sample with the parameters of step {step}")

  def draw(s: int, policy, sample_key, mesh):
    timer = Timer()
    drawn = sampler.draw(s, policy, sample_key, mesh, timer)
    return drawn, timer.seconds

  return async_rollouts.Rollouts(draw, sampler_policy, max_lag=spec.sampling.max_lag,
                                 mesh=sampler_mesh,
                                 rng=state.rng, step=step, restored=restored or [])


@dataclasses.dataclass(frozen=True)
class StepSampler:
  """How a step is sampled: prompts from the data stream, completions scored by the task, their
  k-sample weights. The lockstep loop and the asynchronous worker (`async_rollouts.Rollouts`)
  both draw through `draw`, so a step's prompts, seeds and k do not depend on which drew it.

  Attributes:
    spec: the run's spec (its sampling and estimator).
    task: scores completions.
    data_iterator: the checkpointed prompt stream, read in step order.
    group_multiple: the group multiple of a padded dynamic-sampling batch
      (`draw_lib.group_multiple`).
  """
  spec: TrainSpec
  task: Any
  data_iterator: Any
  group_multiple: int

  def draw(self, step: int, policy, sample_key: jax.Array, mesh, timer: Timer) -> draw_lib.Drawn:
    """Step `step`'s completions from `policy` (on `mesh`), scored, with their k-sample weights
    for the step's k, which the `Drawn` carries. Dynamic sampling off: one round, every group;
    on: rounds until B groups with signal (`trainer.draw`)."""
    s, estimator = self.spec.sampling, self.spec.estimator
    k = estimator.k_at(step)  # config.k_schedule: the k this step optimises

    def sample_round(round_index: int):
      """B prompts from the stream, n completions of each with the round's seed
      (`draw_lib.round_seed`), and their k-sample weights [B, n]."""
      prompts = distributed.gather_list(next(self.data_iterator))  # every host's share, in order
      timer.lap("time/other")
      batch = rollout.collect(policy, self.task, prompts, s,
                              seed=draw_lib.round_seed(sample_key, round_index), mesh=mesh,
                              sampled=lambda: timer.lap("time/sampling"))
      timer.lap("time/reward")
      return batch, estimator.advantages(batch.rewards_bn, batch.answer_ids_bn, k=k)

    return draw_lib.draw_step(sample_round, k=k, target=s.batch_prompts,
                              enabled=s.dynamic_sampling, max_rounds=s.dynamic_max_rounds,
                              multiple=self.group_multiple)


def _step_scalars(spec: TrainSpec, drawn: draw_lib.Drawn, ref_logp_rt: np.ndarray | None,
                  update_metrics: dict[str, float], timer: Timer,
                  worker_seconds: dict[str, float] | None = None) -> dict[str, float]:
  """Everything one step logs: the batch's scores, the update, KL and entropy, time, speed.

  The batch's scores, advantages, entropy and generated tokens are those of every sampled group
  (what the policy does); with dynamic sampling the KL (from the reference forward) and the update
  describe the kept groups only, and dynamic/* says how many rounds it took to find them."""
  sampled, advantage_bn = drawn.sampled, drawn.advantage_bn
  if ref_logp_rt is not None:
    ref_logp_rt = ref_logp_rt[:drawn.kept_rows]  # the kept rows lead; padding rows follow
  scalars = {**rollout.batch_metrics(sampled, spec.estimator.k), **update_metrics,
             **_kl_metrics(sampled, drawn.update, ref_logp_rt), **timer.seconds}
  if spec.sampling.dynamic_sampling:
    scalars.update(drawn.metrics())
  scalars["advantage/nonzero_fraction"] = float(np.mean(advantage_bn != 0))
  scalars["advantage/abs_mean"] = float(np.mean(np.abs(advantage_bn)))
  scalars.update(metrics.weight_noise(advantage_bn))
  total = sum(timer.seconds.values())
  generated = float(sampled.completion_mask_rt.sum())
  scalars["time/step"] = total
  scalars["throughput/tokens_per_s"] = generated / max(total, 1e-9)
  sampling = (worker_seconds or timer.seconds)["time/sampling"]  # the worker's, sampling ahead
  scalars["throughput/sample_tokens_per_s"] = generated / max(sampling, 1e-9)
  trained = float(drawn.update.attention_mask_rt.sum()) * update_metrics["update/rows_fraction"]
  scalars["throughput/update_tokens_per_s"] = trained / max(timer.seconds["time/update"], 1e-9)
  return scalars


def _kl_metrics(batch: rollout.Rollout, referenced: rollout.Rollout,
                ref_logp_rt: np.ndarray | None) -> dict[str, float]:
  """KL(pi, pi_ref) of the sampling policy, per completion (summed over its tokens) and averaged
  over completions, from the sampled tokens: k1 and k3 estimators with the sampler's log-probs as
  log pi (the learner's own before this step's update; with top-p/top-k, of the truncated
  distribution that sampled), on the steps that ran the reference (`LossSpec.reference_at`), over
  the first len(ref_logp_rt) rows of `referenced` (the completions the reference read: `batch`'s
  without dynamic sampling, the kept groups' with it); and, every step, the per-token entropy
  estimate -mean log pi(y_t) over all of `batch`."""
  mask_rt = batch.completion_mask_rt
  logp_rt = batch.behaviour_logp_rt
  entropy = {"entropy/per_token": float(-logp_rt[mask_rt].mean()) if mask_rt.any() else 0.0}
  if ref_logp_rt is None:
    return entropy
  mask_rt = referenced.completion_mask_rt[:len(ref_logp_rt)]
  logp_rt = referenced.behaviour_logp_rt[:len(ref_logp_rt)]
  k1_r, k3_r = scoring.kl_per_completion(logp_rt, ref_logp_rt, mask_rt)
  return {"kl/k1": float(k1_r.mean()), "kl/k3": float(k3_r.mean()), **entropy}


def _final_eval(spec: TrainSpec, final, task, mesh, run_dir: RunDirectory) -> None:
  """Evaluates the final policy and prints (and writes) the table against the start."""
  h = spec.eval
  _say("held-out evaluation of the final policy...")
  result = held_out.evaluate(final, task, h, seed=spec.run.seed + 1, mesh=mesh)
  held_out.save(run_dir.held_out_json("end"), result)
  start_path = run_dir.held_out_json("start")
  start = held_out.load_metrics(start_path) if os.path.exists(start_path) else None
  text = held_out.table(start, result.metrics, h.ks, task.levels(), level_k=spec.estimator.k)
  header = (f"held-out {h.split}: {len(result.levels)} prompts x {result.num_samples} samples, "
            f"temperature {h.temperature}, top-p {h.top_p}")
  if distributed.is_writer():
    files.write_text(run_dir.held_out_table, header + "\n" + text + "\n")
  _say(header + "\n" + text)
