"""The eval binary's job: checkpoints of a training run -> samples -> scores -> results files.

`run(config)` validates everything it can before writing anything: the config (settings.py),
the checkpoint directory and the steps it names, the task split, and every selected
checkpoint's parameter shapes against the model the run's config describes. Only then does it
create the output directory (`<run dir>/eval/<split>_n<n>_t<T>_p<p>` unless config.output_dir
says otherwise) and evaluate, one checkpoint at a time: restore the parameters onto the mesh,
sample n completions per problem with the draws of the run layer's evaluation loop
(`ksjax.run.scoring.evaluate`: `ksjax.sampling.generate` per chunk of batch_prompts problems,
then `Task.score`, as the trainer's own held-out evaluation), its chunks merged into large
sampler calls and the KL's reference forward run over each completion's length (`batched`),
estimate pass@k, maj@k and the mean reward
(`ksjax.objectives.estimates`), and write the step's record, the summaries and
the figures (results.py, plots.py). A checkpoint already evaluated with the same sampling
settings is read back instead of evaluated again (its pass@k, maj@k and diversity recomputed from
the stored answer classes if it was made with other ks).

Many samples per problem (e.g. 256 for pass@k up to k = 256 on a subset of problems, with
config.num_prompts): the sampler draws batch_prompts x num_samples rows per call, and
settings.py lowers batch_prompts to fit config.batch_rows.

Across hosts (`ksjax.distributed`): every process runs the binary with the same config, the
mesh spans all of them, each scores its share of the problems, and process 0 writes the files.

A LoRA run (config.run.lora.rank >= 1) saves its adapters alone (`ksjax.model.lora`): the base
is built once, as the trainer built it (config.run's starting model and seed, on the evaluation
mesh, then adapted), each checkpoint must record that base's sha256 in its config item, and each
step's adapters are restored and merged with the one frozen base; the run's start/ (adapters too)
is read onto the same base for config.include_start and config.kl_reference="start".

Told to stop (SIGTERM, SIGINT: `ksjax.stopping`), it finishes the record in progress (a second
signal drops it: every file is written whole or not at all), prints one line saying where it
stopped, and exits with 128 + the signal (143 for SIGTERM); the same command continues from
there, reading the records written back. A record, summary or figure that fails for want of space
is one line naming the file and its size (`ksjax.files.DiskFull`, exit status 74).

With config.watch the directory is polled and every checkpoint not yet evaluated is evaluated as
it lands, until config.idle_timeout_s passes without one. The trainer deletes old checkpoints
(keep_checkpoints), so one that disappears before it is read is skipped with a warning, as is one
that fails its checksums (`checkpoints.check_shapes`); outside watch mode that is bad input.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from ksjax import distributed, errors, files, machine, model, stopping
from ksjax.config_validation import ConfigError
from ksjax.evaluation import batched, plots, results
from ksjax.evaluation import settings as settings_lib
from ksjax.evaluation.settings import Settings
from ksjax.model import gguf_io, logprobs, lora
from ksjax.run import checkpoints, policy, scoring
from ksjax.run import tasks as run_tasks
from ksjax.run.directory import RunDirectory, locate
from ksjax.run.spec import LoraSpec, TrainSpec
from ksjax.tasks.base import Prompt, Task


def _say(message: str) -> None:
  if distributed.is_writer():
    print(message, flush=True)


def policy_config(run: TrainSpec, vocab_size: int) -> model.LlamaConfig:
  """The LlamaConfig of the policy the run trains: its shapes only.

  The run layer's `ksjax.run.policy.policy_config`, as the trainer's, so evaluation can never
  disagree with training about the model; its errors are re-worded to name the eval config's
  `run` fields.
  """
  try:
    return policy.policy_config(run.model, vocab_size, value_head=run.loss.value_head)
  except ConfigError as e:
    raise ConfigError(str(e).replace("config.", "config.run.", 1)) from None


def _describe(cfg: model.LlamaConfig, base: LoraBase | None = None) -> str:
  adapters = ("" if base is None else
              f"the rank-{base.spec.rank} LoRA adapters ({base.spec.targets}) of ")
  return (f"{adapters}the model of config.run ({cfg.num_layers} layers, width "
          f"{cfg.hidden_size}, vocabulary {cfg.vocab_size})")


@dataclasses.dataclass(frozen=True)
class LoraBase:
  """A LoRA run's frozen base on the evaluation mesh, adapted as the trainer adapted it
  (`policy.adapt`: the adapters as initialised, QLoRA's base quantized), and what the run's
  checkpoints must record of it (`policy.base_record`). Built once: every checkpoint's adapters,
  and the start's, are merged with its arrays, never with a copy."""
  adapted: model.Llama
  record: dict[str, str]
  spec: LoraSpec

  def frozen(self) -> Any:
    return lora.split(self.adapted)[2]

  def with_adapters(self, path: str, what: str) -> model.Llama:
    """A model on this base holding the adapters of the adapter checkpoint at `path` (`what`
    names it in errors); CheckpointInputError, one line, for adapters of another base or other
    LoRA settings, or unreadable ones."""
    try:
      spec, record = lora.read_metadata(path)
    except model.CheckpointError as e:
      raise checkpoints.CheckpointInputError(f"{what}: {errors.one_line(e)}") from None
    policy.check_base(record, self.record, what, base_is="config.run's base",
                      error=checkpoints.CheckpointInputError)
    # Dropout does not change what the model computes outside training.
    differ = [f.name for f in dataclasses.fields(LoraSpec) if f.name != "dropout"
              and getattr(spec, f.name) != getattr(self.spec, f.name)]
    if differ:
      raise checkpoints.CheckpointInputError(
          f"{what} holds adapters with LoRA settings "
          f"{', '.join(f'{n}={getattr(spec, n)!r}' for n in differ)}; expected config.run.lora's "
          f"({', '.join(f'{n}={getattr(self.spec, n)!r}' for n in differ)}), as the run had")
    graphdef, trainable, frozen = lora.split(self.adapted)
    # New variables over the initial values (tree.map makes new ones; merge would share them
    # with `adapted`), so that reading the adapters in changes this model alone.
    llama = nnx.merge(graphdef, jax.tree.map(lambda x: x, trainable), frozen)
    try:
      lora.restore(path, llama)
    except model.CheckpointError as e:
      raise checkpoints.CheckpointInputError(f"{what}: {errors.one_line(e)}") from None
    return llama


def lora_base(s: Settings, vocab_size: int, mesh: jax.sharding.Mesh) -> LoraBase | None:
  """The frozen base of a LoRA run (config.run.lora.rank >= 1), built as the trainer builds it
  (`policy.build_model` from config.run's model and seed, on the evaluation mesh), its record
  taken before adapting, as the trainer takes it; None without LoRA."""
  if not s.run.lora.enabled:
    return None
  # (config.run's model fields were checked by `policy_config` already; a weight file that
  # cannot be read is a model.CheckpointError naming it, an input error.)
  llama = policy.build_model(s.run.model, vocab_size, mesh, value_head=s.run.loss.value_head,
                             seed=s.run.run.seed)
  record = policy.base_record(s.run.model, llama)
  # QLoRA: the float base is dropped with `llama` here, as in the trainer.
  return LoraBase(policy.adapt(llama, s.run.lora, s.run.run.seed), record, s.run.lora)


@dataclasses.dataclass
class Evaluator:
  """Evaluates checkpoints of one run on one set of problems with fixed settings."""
  settings: Settings
  run: RunDirectory
  task: Task
  prompts: Sequence[Prompt]
  cfg: model.LlamaConfig
  mesh: jax.sharding.Mesh
  output_dir: str
  # config.kl_reference's policy (None: no KL).
  reference: model.Llama | None = None
  # Under LoRA (config.run.lora), the run's frozen base with its adapters (`lora_base`).
  base: LoraBase | None = None
  # Sampler rows per call, the chunks of batch_prompts problems merged into calls with their
  # own draws (`batched`), at most config.batch_rows; None: `batched.call_rows` (512 on a CPU,
  # else 0). 0: one call per chunk and the KL chunk by chunk over the full max_new_tokens, the
  # path before (benchmarks/eval_throughput.py compares the two).
  call_rows: int | None = None

  def __post_init__(self):
    self.graphdef, self.target = checkpoints.abstract_policy(
        self.cfg, self.mesh, None if self.base is None else self.base.adapted)
    self.frozen = None if self.base is None else self.base.frozen()
    self.records: dict[int, dict] = {
        r["step"]: r for r in results.load_records(self.output_dir, self.settings.sampling())}
    self.sampled = 0  # checkpoints sampled by this process (the first one compiles)
    # `fn(tokens_rt, mask_rt, prompt_len) -> logp_rn`: the reference's log-probs of the
    # completions, for `kl` (the per-chunk path).
    self.reference_logprobs = None if self.reference is None else (
        logprobs.sharded_continuation_logprobs(self.reference, self.mesh,
                                               self.settings.kl_samples))

  def check(self, step: int) -> None:
    checkpoints.check_shapes(self.run, step, self.target, _describe(self.cfg, self.base),
                             None if self.base is None else self.base.record)

  def restore(self, step: int) -> model.Llama:
    """The policy of checkpoint `step` (`check` it first), on the evaluation mesh."""
    return checkpoints.restore_policy(self.run, step, self.graphdef, self.target, self.frozen)

  def evaluate(self, step: int) -> dict[str, Any]:
    """The record of `step`: read back if evaluated before with these settings, else sampled,
    scored and written (with the summaries and figures)."""
    if step in self.records:
      _say(f"step {step}: evaluated before with these settings "
           f"({results.STEP_FILE.format(step=step)}); reusing it")
      if not results.is_current(self.records[step], self.settings.ks):
        self.records[step] = results.rescore(self.records[step], self.settings.ks)
        if distributed.is_writer():
          results.save_step(self.output_dir, self.records[step])
        self.save_summaries()
      return self.records[step]
    started = time.perf_counter()
    restored = self.restore(step)
    restore_seconds = time.perf_counter() - started
    return self.evaluate_policy(step, restored, self.run.step_dir(step),
                                restore_seconds=restore_seconds)

  def evaluate_policy(self, step: int, policy: model.Llama, checkpoint: str, *,
                      restore_seconds: float = 0.0) -> dict[str, Any]:
    """The record of an already loaded policy, labelled `step` and `checkpoint`: sampled,
    scored and written like a restored checkpoint's (e.g. a run's start policy, which is a
    ksjax.model checkpoint rather than a trainer step)."""
    if step in self.records:
      return self.records[step]
    s = self.settings
    loaded = time.perf_counter()
    rows = batched.call_rows(s.batch_rows) if self.call_rows is None else self.call_rows
    if rows:
      out = batched.evaluate(
          policy, self.task, self.prompts, s.draw(), seed=s.seed, batch_prompts=s.batch_prompts,
          mesh=self.mesh, call_rows=rows,
          measure=None if self.reference is None else functools.partial(
              batched.kl, self.reference, self.mesh, self.prompts, kl_samples=s.kl_samples))
    else:
      out = scoring.evaluate(policy, self.task, self.prompts, s.draw(), seed=s.seed,
                             batch_prompts=s.batch_prompts, mesh=self.mesh,
                             measure=None if self.reference is None else self.kl)
    seconds = time.perf_counter() - loaded
    del policy
    record = results.step_record(
        step=step, checkpoint=checkpoint,
        sampling=s.sampling(), ks=s.ks, prompt_ids=[p.id for p in self.prompts],
        metadata=[dict(p.metadata) for p in self.prompts], breakdown=s.breakdown,
        correct_gn=out.correct_gn, answer_ids_gn=out.answer_ids_gn, rewards_gn=out.rewards_gn,
        seconds=seconds, extra_g=out.extra_g)
    self.records[step] = record
    if distributed.is_writer():
      results.save_step(self.output_dir, record)
    self.save_summaries()
    self.sampled += 1
    first = ", compilation included" if self.sampled == 1 else ""
    _say(f"step {step}: {record['num_problems']} problems x {s.num_samples} samples in "
         f"{seconds:.1f}s = {record['samples_per_second']:.1f} samples/s (restore "
         f"{restore_seconds:.1f}s{first}); " + headline(record["metrics"], s.ks))
    return record

  def kl(self, scored: scoring.Scored) -> dict[str, np.ndarray]:
    """Per problem of one chunk (the per-chunk path, call_rows 0; `batched.kl` is the other),
    the mean over its first kl_samples completions of KL(policy || reference)
    (`scoring.kl_per_completion`): log pi from the sampler (temperature 1, untruncated, so the
    policy's own), log pi_ref from one forward of the reference over prompt and completion."""
    s = self.settings
    out = scored.output
    n, m = s.num_samples, s.kl_samples
    g = out.tokens.shape[0] // n
    rows = (np.arange(g)[:, None] * n + np.arange(m)[None, :]).reshape(-1)
    # Every call has the same number of problems, at least batch_prompts, each with its
    # kl_samples rows (a short last chunk repeats its first problem's), and a row count that
    # splits over the batch shards, so the forward compiles once per prompt width; the reference
    # runs each problem's prompt once for its rows (`logprobs.continuation_logprobs`).
    shards = model.sharding.batch_shards(self.mesh)
    step = shards // math.gcd(m, shards)
    padded = np.concatenate([rows, np.tile(rows[:m], -(-s.batch_prompts // step) * step - g)])
    tokens_rt, mask_rt = (np.asarray(v)[padded] for v in out.sequences())
    t = np.asarray(out.prompt_tokens).shape[1]
    ref_logp_rn = np.asarray(self.reference_logprobs(tokens_rt, mask_rt, t))[:len(rows)]
    new_tokens = np.asarray(out.tokens).shape[1]
    mask_rn = np.arange(new_tokens)[None, :] < np.asarray(out.lengths)[rows][:, None]
    k1_r, k3_r = scoring.kl_per_completion(np.asarray(out.logprobs)[rows], ref_logp_rn, mask_rn)
    return {"kl_k1": k1_r.reshape(g, m).mean(1), "kl_k3": k3_r.reshape(g, m).mean(1)}

  def save_summaries(self, averaged: dict | None = None) -> None:
    if not distributed.is_writer():
      return
    records = [self.records[step] for step in sorted(self.records)]
    results.save_summaries(self.output_dir, records, averaged)
    if self.settings.plots:
      plots.save_figures(self.output_dir, records)


def headline(metrics: dict[str, float], ks: Sequence[int]) -> str:
  """One line of the numbers; a name the metrics lack (an average over records of other ks) is
  left out."""
  names = scoring.metric_names(ks) + list(scoring.DIVERSITY) + list(results.KL_METRICS)
  return ", ".join(f"{name} {metrics[name]:.3f}" for name in names if name in metrics)


def select_prompts(task: Task, s: Settings) -> list[Prompt]:
  try:
    prompts = list(task.prompts(s.split))
  except (KeyError, ValueError) as e:
    raise ConfigError(f"config.split={s.split!r}: the task has no such split ({e})") from None
  if not prompts:
    raise ConfigError(f"config.split={s.split!r}: the task's split has no problems")
  return prompts[:s.num_prompts] if s.num_prompts else prompts


def open_evaluator(s: Settings, run_dir: RunDirectory, task: Task,
                   output_dir: str | None = None) -> Evaluator:
  """The Evaluator of `s` over `task`'s problems for the checkpoints in `run_dir`, writing to
  `output_dir` (default: the run directory's folder for these settings)."""
  prompts = select_prompts(task, s)
  mesh = model.make_mesh(s.run.run.mesh)
  cfg = policy_config(s.run, task.tokenizer.vocab_size)
  output_dir = output_dir or s.output_dir or run_dir.eval_dir(s.output_name())
  base = lora_base(s, task.tokenizer.vocab_size, mesh)
  gguf_io.forget_parsed()  # the task's tokenizer and a LoRA base are read: no more reads
  return Evaluator(s, run_dir, task, prompts, cfg, mesh, output_dir,
                   reference=reference_policy(s, run_dir, cfg, mesh, base), base=base)


def reference_policy(s: Settings, run_dir: RunDirectory, cfg: model.LlamaConfig,
                     mesh: jax.sharding.Mesh, base: LoraBase | None = None
                     ) -> model.Llama | None:
  """The policy of config.kl_reference, computing as the policy does (its matmul_dtype), or
  None when no KL is asked for. A reference that is missing, unreadable or of
  another shape than the run's model is a CheckpointInputError (nothing written yet). Under LoRA
  an adapter checkpoint (the run's start/) is read onto the run's base (`load_policy`)."""
  if s.kl_reference is None:
    return None
  if jax.process_count() > 1:
    raise ConfigError(f"config.kl_reference={s.kl_reference!r} is not accepted across "
                      f"{jax.process_count()} processes yet; expected a single-process evaluation")
  path = run_dir.start_dir if s.kl_reference == "start" else s.kl_reference
  what = (f"config.kl_reference={s.kl_reference!r}"
          + (f" (the run's start policy, {path})" if s.kl_reference == "start" else ""))
  return load_policy(path, what, cfg, mesh, base)


def load_policy(path: str, what: str, cfg: model.LlamaConfig, mesh: jax.sharding.Mesh,
                base: LoraBase | None = None) -> model.Llama:
  """The ksjax.model checkpoint at `path` (`what` names it in errors) on `mesh`, computing as the
  run's policy does (cfg's matmul_dtype). Missing, unreadable or of another shape than `cfg`:
  a CheckpointInputError. Under LoRA (`base`), an adapter checkpoint (a LoRA run's start/ and
  final/, `lora.save`) gives its adapters on `base`, whose sha256 it must record; a whole model
  is read as without LoRA."""
  if base is not None and lora.is_adapter_checkpoint(path):
    return base.with_adapters(path, what)
  if not os.path.isdir(path):
    raise checkpoints.CheckpointInputError(
        f"{what} is not a directory; expected a ksjax.model checkpoint directory (a run's "
        "start/ or final/)")
  try:
    policy_, stored = model.load_checkpoint(path, mesh)
  except model.CheckpointError as e:
    raise checkpoints.CheckpointInputError(f"{what}: {e}") from None
  shape = lambda c: (c.vocab_size, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads,
                     c.head_dim, c.intermediate_size)
  if shape(stored) != shape(cfg):
    raise checkpoints.CheckpointInputError(
        f"{what} holds a model of (vocabulary, layers, width, heads, KV heads, head size, "
        f"intermediate) {shape(stored)}; expected {_describe(cfg)}, {shape(cfg)}")
  return model.with_config(policy_, matmul_dtype=cfg.matmul_dtype)


def open_task(s: Settings) -> Task:
  """The run's task, scoring spread over the processes."""
  return distributed.ShardedScoring(run_tasks.make_task(s.run.task, s.run.model, s.split))


def run(config: Any) -> None:
  """Evaluates the checkpoints `config` names (see configs/eval.py for every field)."""
  distributed.initialize()  # joins the other hosts' processes, if any: before any computation
  s = settings_lib.validate(config)
  run_dir = locate(s.checkpoint_dir)
  if run_dir is None:
    raise checkpoints.CheckpointInputError(
        f"config.checkpoint_dir={os.path.abspath(s.checkpoint_dir)!r} does not exist or is not a "
        "directory; expected a training run's workdir or its checkpoints/ directory")
  available = checkpoints.steps(run_dir)
  if not available and not s.watch:
    raise checkpoints.CheckpointInputError(
        f"config.checkpoint_dir={s.checkpoint_dir!r} holds no checkpoints (no finished step "
        f"directory in {run_dir.steps_dir}); expected a run that has saved at least one")
  # Watch mode takes every checkpoint there is and every one to come.
  selected = (available if s.watch else
              settings_lib.select_steps(s.steps, available, run_dir.steps_dir))
  task = open_task(s)
  try:
    evaluator = open_evaluator(s, run_dir, task)
    for step in selected:  # every selected checkpoint fits before anything is written
      evaluator.check(step)
    start = (load_policy(run_dir.start_dir, f"config.include_start: the run's start policy "
                         f"{run_dir.start_dir!r}", evaluator.cfg, evaluator.mesh, evaluator.base)
             if s.include_start else None)
    if distributed.is_writer():
      os.makedirs(evaluator.output_dir, exist_ok=True)
    _say(f"evaluating {run_dir.steps_dir}: {len(evaluator.prompts)} {s.split} problems x "
         f"{s.num_samples} samples (temperature {s.temperature}, top-p {s.top_p}; "
         f"{s.batch_prompts} problems per sampler call; pass@k for k = "
         f"{', '.join(map(str, s.ks))}), "
         f"{evaluator.cfg.num_params:,} parameters on mesh {dict(evaluator.mesh.shape)}; results "
         f"in {evaluator.output_dir}")
    note = machine.bfloat16_operand_note(evaluator.cfg.operand_dtype, jax.devices()[0].platform)
    if note:
      _say(note)
    stop = stopping.Signals("ksjax.eval", second="the record in progress")
    with stop, _resumable():
      after = _stop_after(stop, evaluator)
      if start is not None:
        evaluator.evaluate_policy(0, start, run_dir.start_dir)
        del start
        after(0)
      if s.watch:
        follow(evaluator, s, done=set(), after=after)
      else:
        evaluate_steps(evaluator, selected,
                       average=settings_lib.parse_steps(s.steps)[0] == "last", after=after)
  finally:
    close = getattr(task, "close", None)
    if close is not None:
      close()


@contextlib.contextmanager
def _resumable() -> Iterator[None]:
  """A write that failed for want of space says that the records before it are whole."""
  try:
    yield
  except files.DiskFull as e:
    raise files.DiskFull(f"{e}; the records written before it are whole, and the same command "
                          "continues from them once space is freed") from None


def _stop_after(stop: stopping.Signals,
                evaluator: Evaluator) -> Callable[[int | None], None]:
  """`after(step)`, called once each record is written (on every process, in the same order),
  and with None while watch mode waits: raises `stopping.Stopped` when told to stop
  (`stop.reached`, on several processes JAX's sync point, counted in calls), after one line
  saying where the evaluation stopped."""
  count = itertools.count(1)

  def after(step: int | None) -> None:
    if not stop.reached(next(count)):
      return
    where = ("while waiting for a checkpoint" if step is None else
             f"after the record of step {step}")
    message = (f"stopped by {stopping.signal_name(stop.signum)} {where}: "
               f"{len(evaluator.records)} records in {evaluator.output_dir}; the same command "
               "continues from there (records already written are read back, not sampled again)")
    _say(message)
    raise stopping.Stopped(stop.signum or signal.SIGTERM, message)

  return after


def evaluate_steps(evaluator: Evaluator, steps: Sequence[int], *, average: bool,
                   after: Callable[[int | None], None] = lambda step: None) -> None:
  """Evaluates `steps` in order, calling `after(step)` once each record is written."""
  records = []
  for step in steps:
    records.append(evaluator.evaluate(step))
    after(step)
  if average and records:
    averaged = results.average(records)
    evaluator.save_summaries(averaged)
    _say(f"average of steps {', '.join(map(str, averaged['steps']))}: "
         + headline(averaged["metrics"], evaluator.settings.ks))


def follow(evaluator: Evaluator, s: Settings, *, done: set[int],
           clock: Callable[[], float] = time.monotonic,
           sleep: Callable[[float], None] = time.sleep,
           after: Callable[[int | None], None] = lambda step: None) -> None:
  """Evaluates every checkpoint not evaluated yet as it lands, until s.idle_timeout_s passes
  without a new one (forever if None), calling `after(step)` once each record is written."""
  last_new = clock()
  while True:
    pending = [step for step in checkpoints.steps(evaluator.run) if step not in done]
    for step in pending:
      done.add(step)
      try:
        evaluator.check(step)
        evaluator.evaluate(step)
      except checkpoints.ChecksumError as e:
        # Damaged after it was written: the run's other checkpoints are still worth following.
        print(f"warning: {e}; skipped", file=sys.stderr, flush=True)
      except (checkpoints.CheckpointInputError, OSError) as e:
        if os.path.isdir(evaluator.run.step_dir(step)):
          raise
        # Deleted by the trainer's keep policy between listing and reading.
        print(f"warning: checkpoint {step} was removed before it could be read ({e}); skipped",
              file=sys.stderr, flush=True)
        continue
      after(step)
    if pending:
      last_new = clock()
    elif s.idle_timeout_s is not None and clock() - last_new >= s.idle_timeout_s:
      _say(f"no new checkpoint for {s.idle_timeout_s:g}s; stopping")
      return
    else:
      after(None)  # told to stop while waiting for a checkpoint
      sleep(s.poll_interval_s)
