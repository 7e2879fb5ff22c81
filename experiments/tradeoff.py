"""The embedded task's trade-off study: every objective from one start, matched steps, paired seeds.

  python experiments/tradeoff.py                       # the pre-registered study (results/tradeoff/)
  python experiments/tradeoff.py --study.seeds=0,1,2 --study.out=/tmp/tradeoff3   # exploratory
  python experiments/tradeoff.py --study.quick=True --study.out=/tmp/smoke   # a one-minute smoke run

The study is pre-registered: `experiments/preregistration/embedded_tradeoff.json` fixes its
question, seeds, arms, design, statements and decision rule, and was committed before its first
run. A study run with other settings is reported as exploratory.

What it does, in order (each phase is skipped when its outputs exist, so an interrupted study
resumes where it stopped, whatever stopped it: run the same command again):
  1. start: one supervised warm-up of the tiny Llama on the embedded task (the trainer,
     `ksjax.trainer.loop.run`, with no RL steps); its policy `<out>/runs/start/start` is the
     common start and the KL reference of every run. It is evaluated like every checkpoint.
  2. runs: every variant x algorithm x seed, each a trainer run from that start with the same
     budget (`steps` RL steps, the same completions per step: matched steps) and its own seed
     (sampling, mini-batch order; the prompts' order comes from the data seed, shared). The
     variants are the configs in configs/; the PPO form of each takes the PPO fields of
     configs/ppo_pass_at_k.py. A run interrupted mid-way resumes from its newest checkpoint.
  3. evaluation: every checkpoint of every run (every `checkpoint_every` steps, and step 1,
     which the trainer's Orbax manager saves as a run's first checkpoint) by the eval binary's
     own runner (`ksjax.evaluation.runner.run`, what `python -m ksjax.eval` calls) on the
     held-out split: pass@k and maj@k from `eval.num_samples` samples per problem, per level
     too, with per-problem counts kept in each record, and the KL to the start on the held-out
     samples. The curves against step and against KL are these measured points.
  4. report: `<out>/table.md` (pass@k per variant, mean +- std over seeds, at the last
     checkpoint), `<out>/summary.json` (every number), the figures (`metrics_vs_step.png`,
     `metrics_vs_kl.png`, `pass_at_k_vs_k.png`) and `<out>/README.md`, which states every
     pre-registered statement with its paired difference over seeds, 95% interval, p-value and
     verdict (`ksjax.evaluation.preregistration`, `ksjax.evaluation.statistics`).

Runs are spread over `workers` processes (two on a two-core machine: the tiny model cannot
use more than one core per process well); each writes its log to `<out>/logs/`. The wall time
of every phase is kept in `<out>/timing.json` and reported.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from absl import app
import ml_collections
from ml_collections import config_flags
import numpy as np

from ksjax import files
from ksjax import machine
from ksjax.run.directory import RunDirectory

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "configs")
VARIANTS = ("mean", "pass_at_k", "biased_pass_at_k", "pkpo_pass_at_k", "majority_vote",
            "biased_majority_vote")
ALGORITHMS = ("pg", "ppo")
# The fields that make configs/ppo_pass_at_k.py PPO; applied to every variant's PPO form.
PPO_FIELDS = ("algorithm", "ppo_epochs", "num_minibatches", "clip_eps", "value_clip",
              "value_coef", "sparse_updates")
# The statements, decision rule, seeds and design, committed before the study's first run.
PREREGISTRATION = os.path.join("experiments", "preregistration", "embedded_tradeoff.json")
# The study settings the pre-registration fixes: a study run with others is exploratory.
REGISTERED_FIELDS = ("seeds", "variants", "algorithms", "levels", "warmup_steps", "modulus", "k",
                     "steps", "checkpoint_every", "learning_rate", "eval.test_per_level",
                     "eval.num_samples", "eval.ks", "eval.kl_samples")
LABELS = {"mean": "mean", "pass_at_k": "pass@k", "biased_pass_at_k": "biased pass@k",
          "pkpo_pass_at_k": "pass@k, n=2k (PKPO)", "majority_vote": "majority vote",
          "biased_majority_vote": "biased majority vote"}


def study_config() -> ml_collections.ConfigDict:
  """Every setting of the study and its default (the pre-registered one: PREREGISTRATION)."""
  c = ml_collections.ConfigDict()
  c.out = os.path.join(REPO, "experiments", "results", "tradeoff")
  c.preregistration = PREREGISTRATION
  c.seeds = tuple(range(8))
  c.variants = ("mean", "pass_at_k", "biased_pass_at_k")
  c.algorithms = ("pg",)
  c.workers = 2
  c.worker = -1  # internal: the worker index of a child process
  c.quick = False  # a smoke run: tiny budget everywhere (the test suite runs it)
  # The sparse-signal regime, chosen on TRAINING problems only before any held-out number
  # (benchmarks/calibrate_embedded_modulus.py, in the pre-registration): levels 2 and 3 of the
  # embedded task, answers modulo 50, and a 400-step warm-up leave a low pass@1 and a pass@k
  # below 1 at the largest k on the hard level, where the paper expects pass@k training to matter.
  c.levels = (2, 3)
  c.warmup_steps = 400
  c.modulus = 50
  # The RL budget, the same for every arm (matched steps): `steps` updates of 64 completions
  # (16 prompts x k), a checkpoint every `checkpoint_every`, each evaluated.
  c.k = 4
  c.steps = 200
  c.checkpoint_every = 50
  c.learning_rate = 1e-4  # the default run's (ksjax.run.config.embedded_task_config)
  c.kl_window = 10  # only for runs whose evaluations carry no held-out KL
  c.eval = ml_collections.ConfigDict()
  c.eval.test_per_level = 100
  c.eval.num_samples = 64
  c.eval.ks = (1, 2, 4, 8, 16, 32, 64)
  c.eval.kl_samples = 16  # held-out KL to the start from the first 16 samples of each problem
  c.eval.batch_prompts = 8
  return c


def quick(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The smoke-run sizes: every phase and file, seconds of compute."""
  c = ml_collections.ConfigDict(c.to_dict())
  c.seeds = (0, 1)
  c.variants = ("mean", "pass_at_k")
  c.algorithms = ("pg",)
  c.workers = 1
  c.warmup_steps = 2
  c.steps = 4
  c.checkpoint_every = 2
  c.kl_window = 2
  c.eval.test_per_level = 2
  c.eval.num_samples = 4
  c.eval.ks = (1, 2, 4)
  c.eval.kl_samples = 2
  return c


_STUDY = config_flags.DEFINE_config_dict("study", study_config())


# ---------------------------------------------------------------------------------------------
# The runs' configs
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Run:
  algorithm: str
  variant: str
  seed: int

  @property
  def name(self) -> str:
    return f"{self.algorithm}_{self.variant}_s{self.seed}"


def runs_of(study) -> list[Run]:
  return [Run(a, v, s) for a, v, s in itertools.product(study.algorithms, study.variants,
                                                        study.seeds)]


def _load_config(name: str) -> ml_collections.ConfigDict:
  path = os.path.join(CONFIGS, f"{name}.py")
  spec = importlib.util.spec_from_file_location(f"ksjax_study_config_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _common(config: ml_collections.ConfigDict, study, workdir: str) -> None:
  config.workdir = workdir
  config.synthetic.levels = tuple(study.levels)
  config.synthetic.modulus = study.modulus
  # Room for the longest solution and its EOS: two-digit running totals make solutions longer.
  from ksjax.tasks import synthetic  # pylint: disable=g-import-not-at-top
  config.max_new_tokens = max(config.max_new_tokens, synthetic.max_solution_chars(
      study.modulus, max(study.levels)) + 1)
  config.synthetic.test_per_level = study.eval.test_per_level
  config.learning_rate = study.learning_rate
  config.progress_bar = False
  config.eval.at_start = False
  config.eval.at_end = False


def start_config(study) -> ml_collections.ConfigDict:
  """The warm-up that makes the common start (no RL steps)."""
  config = _load_config("pass_at_k")
  _common(config, study, os.path.join(study.out, "runs", "start"))
  config.sft_warmup.steps = study.warmup_steps
  config.sft_warmup.target_pass_at_1 = 0.0  # the registered fixed-step warm-up, not the target
  config.num_steps = 0
  return config


def run_config(study, run: Run) -> ml_collections.ConfigDict:
  """The trainer config of one run: the variant's config file, its PPO form if asked, the
  study's task, budget and start."""
  config = _load_config(run.variant)
  samples_per_prompt = (config.n or config.k) / config.k  # PKPO samples 2k per prompt
  completions = config.batch_prompts * (config.n or config.k)
  if run.algorithm == "ppo":
    ppo = _load_config("ppo_pass_at_k")
    for field in PPO_FIELDS:
      config[field] = ppo[field]
  elif run.algorithm != "pg":
    raise ValueError(f"study.algorithms: {run.algorithm!r} is not accepted; expected pg or ppo")
  _common(config, study, os.path.join(study.out, "runs", run.name))
  config.k = study.k
  config.n = int(samples_per_prompt * study.k) if config.n else None
  config.batch_prompts = completions // (config.n or config.k)
  config.seed = run.seed
  config.init_checkpoint = RunDirectory(os.path.join(study.out, "runs", "start")).start_dir
  config.sft_warmup.steps = 0
  config.num_steps = study.steps
  config.checkpoint_every = study.checkpoint_every
  config.keep_checkpoints = study.steps // study.checkpoint_every + 1
  return config


def eval_config(study, train_config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The eval binary's config (configs/eval.py) for every checkpoint of a run."""
  config = _load_config("eval")
  config.checkpoint_dir = train_config.workdir
  config.steps = "all"
  config.num_samples = study.eval.num_samples
  config.ks = tuple(study.eval.ks)
  config.batch_prompts = study.eval.batch_prompts
  config.breakdown = ("level",)
  config.plots = False  # the study draws its own
  # The KL to the common start on the held-out samples (the trainer's logged KL is on the
  # training prompts), so that "at equal KL" reads measured held-out points.
  config.kl_reference = os.path.join(study.out, "runs", "start", "start")
  config.kl_samples = study.eval.kl_samples
  config.run = train_config
  return config


def eval_dir(study, train_config: ml_collections.ConfigDict) -> str:
  """Where the eval binary writes a run's records: named by its own settings."""
  from ksjax.evaluation import settings as settings_lib  # pylint: disable=g-import-not-at-top
  settings = settings_lib.validate(eval_config(study, train_config))
  return RunDirectory(train_config.workdir).eval_dir(settings.output_name())


# ---------------------------------------------------------------------------------------------
# Phases
# ---------------------------------------------------------------------------------------------

def _say(message: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def _record_time(study, phase: str, seconds: float) -> None:
  path = os.path.join(study.out, "timing.json")
  timing = _read_json(path, {})
  timing[phase] = timing.get(phase, 0.0) + seconds
  _write_json(path, timing)


def _read_json(path: str, default: Any = None) -> Any:
  if not os.path.exists(path):
    return default
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _write_json(path: str, data: Any) -> None:
  files.write_text(path, json.dumps(data, indent=1, sort_keys=True))


def _git(*args: str) -> str | None:
  """The output of `git <args>` in the repository; None where git or the repository is missing."""
  from ksjax.evaluation import preregistration  # pylint: disable=g-import-not-at-top
  return preregistration.git(REPO, *args)


def _record_provenance(study) -> None:
  """Records the ksjax commit the study's numbers come from: floating-point results (and so every
  number) can change with the code, so they are tied to a commit. A study directory without runs
  (a fresh study, or one whose runs were deleted to regenerate the published report) gets the
  current commit, replacing the file an earlier study left there (and its timing.json is removed,
  which the phases' times would otherwise be added to); a resumed study keeps its start
  commit and adds the current one to `resumed_at` when it differs, so a study spanning commits says
  so; the same for the machine (`resumed_on`), whose instruction set changes XLA:CPU's numbers."""
  path = os.path.join(study.out, "provenance.json")
  status = _git("status", "--porcelain", "--untracked-files=no")
  head = _git("rev-parse", "HEAD")
  fresh = not os.path.isdir(os.path.join(study.out, "runs"))
  if fresh and os.path.exists(os.path.join(study.out, "timing.json")):
    os.remove(os.path.join(study.out, "timing.json"))  # an earlier study's, not to be added to
  old = {} if fresh else _read_json(path, {})
  if not old.get("commit"):
    _write_json(path, {"commit": head, "machine": machine.describe(),
                       "uncommitted_changes": None if status is None else bool(status)})
    return
  if head != old["commit"] and head not in old.get("resumed_at", []):
    old = {**old, "resumed_at": [*old.get("resumed_at", []), head]}
  here = machine.describe()
  if here not in (old.get("machine"), *old.get("resumed_on", [])):
    old = {**old, "resumed_on": [*old.get("resumed_on", []), here]}
  _write_json(path, old)


def refuse_dirty_tree(study) -> None:
  """Exits with status 2 if tracked files have uncommitted changes: a study's numbers are tied to
  the commit in provenance.json, which would not be the code that made them. The study's own
  output directory is not looked at (a resumed study has written there), and the smoke run
  (`study.quick`) may run on a dirty tree."""
  if study.quick:
    return
  paths = ["."]
  if os.path.commonpath([os.path.abspath(study.out), REPO]) == REPO:
    paths.append(f":(exclude){os.path.relpath(os.path.abspath(study.out), REPO)}")
  status = _git("status", "--porcelain", "--untracked-files=no", "--", *paths)
  if status:
    changed = [line.split(maxsplit=1)[-1] for line in status.splitlines()]
    print(f"tradeoff: the git tree has uncommitted changes to {len(changed)} tracked file(s) "
          f"({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}); expected a clean "
          "tree, so that provenance.json's commit is the code that made the results (commit or "
          "stash them; --study.quick=True runs anyway)", file=sys.stderr)
    sys.exit(2)


# Fault injection for the test that kills a study and reruns it (tests/experiments/): with
# KSJAX_STUDY_KILL=<phase> the process kills itself with SIGKILL, as a stopped machine would,
# in that phase: "train" once a run's first step checkpoint is on disk, "eval" once its first
# evaluation record is, "publish" between the report's summary.json and README.md.
KILL_ENV = "KSJAX_STUDY_KILL"


def _maybe_stop(phase: str, when_exists: Callable[[], bool] | None = None) -> None:
  if os.environ.get(KILL_ENV) != phase:
    return
  kill = lambda: os.kill(os.getpid(), signal.SIGKILL)
  if when_exists is None:
    kill()

  def watch():
    while not when_exists():
      time.sleep(0.05)
    kill()
  threading.Thread(target=watch, daemon=True).start()


def _done_path(study, name: str) -> str:
  return os.path.join(study.out, "runs", name, "study_done.json")


def ensure_start(study) -> None:
  """Phase 1: the warm-up and the start's evaluation (step 0 of every run)."""
  from ksjax import model  # pylint: disable=g-import-not-at-top
  from ksjax.evaluation import runner  # pylint: disable=g-import-not-at-top
  from ksjax.evaluation import settings as settings_lib  # pylint: disable=g-import-not-at-top
  from ksjax.trainer import loop  # pylint: disable=g-import-not-at-top

  if os.path.exists(_done_path(study, "start")):
    return
  started = time.time()
  config = start_config(study)
  start = RunDirectory(config.workdir)
  if not os.path.isdir(start.final_dir):
    _say(f"start: supervised warm-up, {study.warmup_steps} steps")
    loop.run(config)
  # The start is a ksjax.model checkpoint, not a trainer step: the eval binary's Evaluator
  # evaluates it as loaded, with the same settings and estimators as every checkpoint.
  evaluation = eval_config(study, config)
  s = settings_lib.validate(evaluation)
  task = runner.open_task(s)
  evaluator = runner.open_evaluator(s, RunDirectory(config.workdir, start.start_dir), task,
                                    eval_dir(study, config))
  policy, _ = model.load_checkpoint(start.start_dir, evaluator.mesh)
  os.makedirs(evaluator.output_dir, exist_ok=True)
  record = evaluator.evaluate_policy(0, policy, start.start_dir)
  _say("start: " + runner.headline(record["metrics"], s.ks))
  _record_time(study, "start", time.time() - started)
  _write_json(_done_path(study, "start"), {"seconds": time.time() - started})


def run_one(study, run: Run) -> None:
  """Phase 2 and 3 for one run: train (or resume), then evaluate every checkpoint."""
  from ksjax.evaluation import runner  # pylint: disable=g-import-not-at-top
  from ksjax.trainer import loop  # pylint: disable=g-import-not-at-top

  if os.path.exists(_done_path(study, run.name)):
    return
  config = run_config(study, run)
  started = time.time()
  run_dir = RunDirectory(config.workdir)
  if not os.path.isdir(run_dir.final_dir):
    config.resume = os.path.isdir(run_dir.steps_dir)
    _maybe_stop("train", lambda: os.path.isdir(run_dir.steps_dir) and any(
        name.isdigit() for name in os.listdir(run_dir.steps_dir)))
    loop.run(config)
  trained = time.time()
  evaluated = eval_dir(study, config)
  _maybe_stop("eval", lambda: os.path.isdir(evaluated) and any(
      name.startswith("step_") for name in os.listdir(evaluated)))
  runner.run(eval_config(study, config))
  done = time.time()
  _write_json(_done_path(study, run.name),
              {"train_seconds": trained - started, "eval_seconds": done - trained})


def worker(study) -> None:
  """A child process: the runs whose index is `worker` modulo `workers`."""
  for i, run in enumerate(runs_of(study)):
    if i % study.workers == study.worker:
      _say(f"{run.name}: training and evaluating")
      run_one(study, run)
      _say(f"{run.name}: done")


def run_workers(study, argv: Sequence[str]) -> None:
  """Phases 2 and 3 over `workers` child processes; prints progress as runs finish."""
  runs = runs_of(study)
  pending = [r for r in runs if not os.path.exists(_done_path(study, r.name))]
  if not pending:
    return
  started = time.time()
  log_dir = os.path.join(study.out, "logs")
  os.makedirs(log_dir, exist_ok=True)
  env = dict(os.environ)
  # One compute thread per worker: the tiny model's matmuls gain nothing from more, and the
  # workers share the cores.
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false "
                      "intra_op_parallelism_threads=1").strip()
  children = []
  for i in range(study.workers):
    log = open(os.path.join(log_dir, f"worker{i}.log"), "a", encoding="utf-8")  # pylint: disable=consider-using-with
    children.append((subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, os.path.abspath(__file__), *argv, f"--study.worker={i}",
         f"--study.out={study.out}"], stdout=log, stderr=subprocess.STDOUT, env=env), log))
  _say(f"{len(pending)} of {len(runs)} runs to train and evaluate on {study.workers} worker(s); "
       f"logs in {log_dir}")
  reported = len(runs) - len(pending)
  try:
    while any(p.poll() is None for p, _ in children):
      time.sleep(5)
      done = sum(os.path.exists(_done_path(study, r.name)) for r in runs)
      if done != reported:
        reported = done
        elapsed = time.time() - started
        _say(f"{done}/{len(runs)} runs done ({elapsed / 60:.1f} min this session)")
  finally:
    for p, log in children:
      if p.poll() is None:
        p.terminate()
      p.wait()
      log.close()
  _record_time(study, "runs", time.time() - started)
  failed = [i for i, (p, _) in enumerate(children) if p.returncode != 0]
  if failed:
    raise RuntimeError(f"worker(s) {failed} failed; see {log_dir}/worker<i>.log, then run the "
                       "same command again to resume")


# ---------------------------------------------------------------------------------------------
# Analysis: pure functions of the evaluation records and the training logs
# ---------------------------------------------------------------------------------------------

def kl_at(metrics_rows: Sequence[Mapping[str, float]], step: int, window: int) -> float:
  """Mean logged KL (k3) over the `window` steps up to `step` (0 at step 0); steps that did not
  log it (config.kl_every > 1) are left out."""
  if step == 0:
    return 0.0
  values = [r["kl/k3"] for r in metrics_rows
            if step - window < r["step"] <= step and "kl/k3" in r]
  return float(np.mean(values)) if values else float("nan")


def run_curves(records: Sequence[Mapping[str, Any]], metrics_rows, window: int,
               start: Mapping[str, Any]) -> dict[str, Any]:
  """{"steps": [...], "kl": [...], "metrics": {name: [...]}} with the start as step 0."""
  records = [start] + sorted((r for r in records if r["step"] != 0), key=lambda r: r["step"])
  names = [m for m in start["metrics"] if not m.startswith("kl_")] + [f"level{g.split('=')[1]}/{m}" for g in start["groups"]
                                    for m in start["groups"][g] if m != "num_problems"]

  def value(record, name):
    if "/" in name:
      level, metric = name.split("/")
      return record["groups"][f"level={level[5:]}"][metric]
    return record["metrics"][name]

  # The held-out KL of the eval binary where the record has it (0 for the start itself), else
  # the trainer's logged KL on training prompts.
  kl = [0.0 if r is start else r["metrics"]["kl_k3"] if "kl_k3" in r["metrics"]
        else kl_at(metrics_rows, r["step"], window) for r in records]
  return {"steps": [r["step"] for r in records], "kl": kl,
          "metrics": {name: [value(r, name) for r in records] for name in names}}


def mean_std(values: Sequence[float]) -> tuple[float, float]:
  values = np.asarray(values, float)
  return float(values.mean()), float(values.std(ddof=1)) if len(values) > 1 else 0.0


def at_kl(kl: Sequence[float], values: Sequence[float], target: float) -> float:
  """A curve's value at KL = target, linearly interpolated between the two measured points
  around it (the step-ordered curve's first crossing); nan where the curve never reaches it, so
  nothing is extrapolated beyond a measurement."""
  for i in range(1, len(kl)):
    lo, hi = kl[i - 1], kl[i]
    if hi >= target >= lo:
      t = 0.0 if hi == lo else (target - lo) / (hi - lo)
      return float(values[i - 1] + t * (values[i] - values[i - 1]))
  return float("nan")


def statement_values(prereg, data: Mapping[str, Any], algorithm: str = "pg"
                     ) -> dict[str, tuple[list[float], list[float]]]:
  """{statement id: (arm a's values, arm b's values)}, one per seed in the study's seed order.

  "last": the metric at the last checkpoint (every arm runs the same steps, so this is the
  comparison at matched steps). "kl": the metric at the held-out KL to the start that every run
  of both arms reaches (the smallest of their final KLs), read off each run's measured curve by
  interpolating between the two checkpoints around it."""
  out = {}
  for statement in prereg.statements:
    a, b = (f"{algorithm}_{arm}" for arm in (statement.a, statement.b))
    if a not in data["final"] or b not in data["final"]:
      continue
    if statement.at == "last":
      if statement.metric not in data["final"][a]:
        continue
      out[statement.id] = (list(data["final"][a][statement.metric]),
                           list(data["final"][b][statement.metric]))
    else:
      runs = [data["curves"][a], data["curves"][b]]
      target = min(c["kl"][-1] for arm in runs for c in arm)
      out[statement.id] = tuple(
          [at_kl(c["kl"], c["metrics"][statement.metric], target) for c in arm] for arm in runs)
  return out


def collect(study) -> dict[str, Any]:
  """Every run's curves, the start, and the per-seed final values."""
  from ksjax.trainer import metrics  # pylint: disable=g-import-not-at-top
  start_records = _records(eval_dir(study, start_config(study)))
  start = start_records[0]
  curves: dict[str, list[dict]] = {}
  final: dict[str, dict[str, list[float]]] = {}
  for run in runs_of(study):
    config = run_config(study, run)
    rows = metrics.read_jsonl(RunDirectory(config.workdir).metrics_jsonl)
    curve = run_curves(_records(eval_dir(study, config)), rows, study.kl_window, start)
    key = f"{run.algorithm}_{run.variant}"
    curves.setdefault(key, []).append(curve)
    values = final.setdefault(key, {})
    for name, series in curve["metrics"].items():
      values.setdefault(name, []).append(series[-1])
    values.setdefault("kl", []).append(curve["kl"][-1])
  return {"start": start, "curves": curves, "final": final}


def _records(directory: str) -> list[dict]:
  from ksjax.evaluation import results  # pylint: disable=g-import-not-at-top
  records = results.load_records(directory)
  if not records:
    raise RuntimeError(f"no evaluation records in {directory}; run the study again to make them")
  return records


def table(study, data: Mapping[str, Any]) -> str:
  """Markdown: pass@1/10/100 and maj@k per variant, mean +- std over seeds, last checkpoint."""
  ks = list(study.eval.ks)
  shown = sorted({x for x in (1, study.k, 10, 100, max(ks)) if x in ks}) or ks
  hard = f"level{study.levels[-1]}"
  cols = [f"pass@{x}" for x in shown] + [f"maj@{study.k}"]
  # The hard level at pass@1 and at the largest evaluated k up to 10 (a k the records have).
  cols += list(dict.fromkeys([f"{hard}/pass@1", f"{hard}/pass@{max(x for x in ks if x <= 10)}"]))
  cols += ["kl"]
  head = "| method | variant | " + " | ".join(cols) + " |"
  lines = [head, "|" + "---|" * (len(cols) + 2)]
  start = data["curves"][next(iter(data["curves"]))][0]
  lines.append("| start | (warm-up only) | " + " | ".join(
      f"{start['metrics'][c][0]:.3f}" if c != "kl" else "0" for c in cols) + " |")
  for algorithm in study.algorithms:
    for variant in study.variants:
      values = data["final"][f"{algorithm}_{variant}"]
      cells = []
      for c in cols:
        m, s = mean_std(values[c])
        cells.append(f"{m:.3f} ± {s:.3f}")
      lines.append(f"| {'PPO' if algorithm == 'ppo' else 'policy gradient'} | "
                   f"{LABELS[variant]} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def figures(study, data: Mapping[str, Any]) -> list[str]:
  """metric vs step (seed means, the band min-max over seeds), metric vs KL (seed means of
  both), pass@k vs k at the last checkpoint (seed means)."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  from ksjax.evaluation import plots  # pylint: disable=g-import-not-at-top

  ks = list(study.eval.ks)
  shown = [f"pass@{x}" for x in sorted({1, study.k, max(ks)}) if x in ks] + [f"maj@{study.k}"]
  colors = dict(zip(study.variants, [f"C{i}" for i in range(len(study.variants))]))
  paths = []
  for name, draw in (("metrics_vs_step.png", plots.metric_vs_step),
                     ("metrics_vs_kl.png", plots.metric_vs_kl)):
    fig = Figure(figsize=(3.4 * len(shown), 3.0 * len(study.algorithms)))
    axes = fig.subplots(len(study.algorithms), len(shown), squeeze=False)
    for row, algorithm in enumerate(study.algorithms):
      for col, metric in enumerate(shown):
        ax = axes[row][col]
        for variant in study.variants:
          runs = data["curves"][f"{algorithm}_{variant}"]
          x = np.mean([r["steps" if draw is plots.metric_vs_step else "kl"] for r in runs], 0)
          y = np.asarray([r["metrics"][metric] for r in runs])
          draw(ax, x, y.mean(0), LABELS[variant], metric=metric, color=colors[variant])
          if draw is plots.metric_vs_step:  # against KL, x differs per seed: no band
            ax.fill_between(x, y.min(0), y.max(0), color=colors[variant], alpha=0.12)
        ax.set_title(f"{'PPO' if algorithm == 'ppo' else 'PG'}: {metric}", fontsize="medium")
    axes[0][0].legend(fontsize="x-small")
    fig.tight_layout()
    paths.append(os.path.join(study.out, name))
    plots.save(fig, paths[-1])
  fig = Figure(figsize=(5.0 * len(study.algorithms), 3.6))
  axes = fig.subplots(1, len(study.algorithms), squeeze=False)[0]
  for ax, algorithm in zip(axes, study.algorithms):
    for variant in study.variants:
      values = data["final"][f"{algorithm}_{variant}"]
      plots.pass_at_k_curve(ax, ks, [np.mean(values[f"pass@{x}"]) for x in ks], LABELS[variant],
                            color=colors[variant])
    plots.pass_at_k_curve(ax, ks, [data["start"]["metrics"][f"pass@{x}"] for x in ks], "start",
                          color="black", linestyle="--")
    ax.set_ylabel("pass@k (last checkpoint, mean over seeds)")
    ax.set_title("PPO" if algorithm == "ppo" else "policy gradient", fontsize="medium")
  axes[0].legend(fontsize="x-small")
  fig.tight_layout()
  paths.append(os.path.join(study.out, "pass_at_k_vs_k.png"))
  plots.save(fig, paths[-1])
  return paths


def registered_design(study, prereg) -> list[str]:
  """The settings where this study departs from its pre-registration (empty: none)."""
  design = dict(prereg.design)
  design.update(seeds=list(prereg.seeds))
  changed = []
  for field in REGISTERED_FIELDS:
    value = study
    for part in field.split("."):
      value = value[part]
    want = design.get(field)
    if want is None or list(np.atleast_1d(value)) != list(np.atleast_1d(want)):
      changed.append(f"{field}={value!r} (registered: {want!r})")
  return changed


def judged(study, data: Mapping[str, Any]) -> dict[str, Any]:
  """The pre-registered statements' verdicts: paired over seeds, Holm across the primary ones.
  A study that departs from its registration (other seeds, arms, budget) or whose registration
  does not precede its runs is judged as exploratory."""
  from ksjax.evaluation import preregistration  # pylint: disable=g-import-not-at-top
  from ksjax.evaluation import statistics  # pylint: disable=g-import-not-at-top
  prereg = preregistration.load(os.path.join(REPO, study.preregistration))
  provenance = _read_json(os.path.join(study.out, "provenance.json"), {})
  order = preregistration.registration(REPO, study.preregistration, provenance.get("commit"))
  departures = registered_design(study, prereg)
  registered = not departures and order["precedes"] is True
  rows = []
  for algorithm in study.algorithms:
    for row in preregistration.judge(prereg, statement_values(prereg, data, algorithm),
                                     registered=registered):
      rows.append({**row, "algorithm": algorithm})
  power = {}
  primary = [r for r in rows if r.get("kind") == "primary" and "differences" in r]
  if primary and len(primary[0]["differences"]) > 1:
    sd = float(np.std(primary[0]["differences"], ddof=1))
    power = {"statement": primary[0]["id"], "sd_of_differences": sd,
             "seeds": len(primary[0]["differences"]),
             "minimum_detectable_effect": statistics.minimum_detectable_effect(
                 sd, len(primary[0]["differences"])) if sd > 0 else 0.0}
  return {"rows": rows, "registration": order, "departures": departures,
          "registered": registered, "line": preregistration.registration_line(order),
          "table": preregistration.table(rows), "power": power}


def report(study, argv_command: str) -> None:
  """Phase 4: table.md, summary.json, the figures and README.md in `study.out`."""
  data = collect(study)
  table_text = table(study, data)
  verdicts = judged(study, data)
  timing = _read_json(os.path.join(study.out, "timing.json"), {})
  provenance = _read_json(os.path.join(study.out, "provenance.json"), {})
  done = {r.name: _read_json(_done_path(study, r.name)) for r in runs_of(study)}
  settings = study.to_dict()
  # The output directory as the command names it (relative to the repository when inside it).
  if os.path.commonpath([study.out, REPO]) == REPO:
    settings["out"] = os.path.relpath(study.out, REPO)
  summary = {"study": settings, "command": argv_command, "provenance": provenance,
             "timing": timing, "runs": done,
             "statements": verdicts["rows"], "registration": verdicts["registration"],
             "departures": verdicts["departures"], "power": verdicts["power"],
             "final": data["final"], "curves": data["curves"],
             "start": data["start"]["metrics"]}
  _maybe_stop("publish")
  _write_json(os.path.join(study.out, "summary.json"), summary)
  files.write_text(os.path.join(study.out, "table.md"), table_text + "\n")
  figures(study, data)
  power = verdicts["power"]
  lines = [
      "# Trade-off study: results",
      "",
      f"Produced by `{argv_command}` (every file in this directory; regenerate with the same "
      "command, which trains nothing when the runs' records are here)"
      + (f" at ksjax commit `{provenance['commit'][:7]}`"
         + (" with uncommitted changes" if provenance.get("uncommitted_changes") else "")
         + (f" on {provenance['machine']}" if provenance.get("machine") else "")
         + "".join(f", resumed on {m}" for m in provenance.get("resumed_on", []))
         + ("" if not provenance.get("resumed_at") else ", resumed at "
            + ", ".join(f"`{c[:7]}`" for c in provenance["resumed_at"]))
         if provenance.get("commit") else "")
      + ". Floating-point results depend on the code and the CPU, so an exact regeneration of "
      "the runs needs that commit and machine.",
      "",
      f"Setup: embedded task levels {tuple(study.levels)}, modulus {study.modulus}, "
      f"{study.eval.test_per_level} held-out "
      f"problems per level, tiny Llama; one supervised warm-up of {study.warmup_steps} steps is "
      f"the start of every run; {study.steps} RL steps per run for every arm (matched steps; 64 "
      f"completions a step, learning rate {study.learning_rate:g}, k = {study.k}); seeds "
      f"{tuple(study.seeds)}, paired: every arm of a seed shares its start, data order and "
      f"machine; every checkpoint ({study.checkpoint_every} steps apart) evaluated with "
      f"{study.eval.num_samples} samples per problem at temperature 1.",
      "",
      "## Last checkpoint (mean ± std over seeds)",
      "",
      table_text,
      "",
      f"KL: the eval binary's per-completion KL(policy || start) (k3) on the held-out samples "
      f"(the first {study.eval.kl_samples} of each problem).",
      "",
      "## Statements",
      "",
      verdicts["line"],
      "",
      ("Every statement was judged as pre-registered in "
       f"`{study.preregistration}`: paired t-test over seeds, two-sided, Holm across the "
       "primary statements." if verdicts["registered"] else
       "**Exploratory:** this study does not run as registered in "
       f"`{study.preregistration}`"
       + (f" ({'; '.join(verdicts['departures'])})" if verdicts["departures"] else "")
       + ", so no statement is called supported."),
      "",
      verdicts["table"],
      "",
  ]
  if power:
    lines += [f"Power: with {power['seeds']} seeds and the observed between-seed sd of the "
              f"{power['statement']} difference ({power['sd_of_differences']:.4f}), the paired "
              f"test detects a difference of {power['minimum_detectable_effect']:.4f} with 80% "
              "power at alpha 0.05; smaller true differences may go unseen.", ""]
  total = sum(timing.values())
  lines += ["## Time", "",
            f"Wall time {total / 60:.1f} min ("
            + ", ".join(f"{k} {v / 60:.1f} min" for k, v in sorted(timing.items())) + ") with "
            f"{study.workers} worker process(es).", "",
            "Figures: `metrics_vs_step.png`, `metrics_vs_kl.png`, `pass_at_k_vs_k.png`; every "
            "number: `summary.json`; per-checkpoint records with per-problem counts: "
            "`runs/<run>/eval/`."]
  files.write_text(os.path.join(study.out, "README.md"), "\n".join(lines) + "\n")
  _say(f"report: {os.path.join(study.out, 'README.md')}")
  print(table_text, flush=True)


def main(argv: Sequence[str]) -> None:
  from ksjax import errors  # pylint: disable=g-import-not-at-top
  errors.quiet_library_info()  # no absl/JAX INFO line before the study's own (--verbosity: back)
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  study = _STUDY.value
  bad = sorted(set(study.variants) - set(VARIANTS)) + sorted(set(study.algorithms) -
                                                             set(ALGORITHMS))
  if bad:
    print(f"tradeoff: study.variants/algorithms {bad} are not accepted; expected variants from "
          f"{VARIANTS} and algorithms from {ALGORITHMS}", file=sys.stderr)
    sys.exit(2)
  if study.steps % study.checkpoint_every:
    print(f"tradeoff: study.steps={study.steps} is not a multiple of "
          f"study.checkpoint_every={study.checkpoint_every}; expected one", file=sys.stderr)
    sys.exit(2)
  if study.quick:
    study = quick(study)
  study.out = os.path.abspath(study.out)
  if study.worker >= 0:
    worker(study)
    return
  from ksjax.config_validation import ConfigError  # pylint: disable=g-import-not-at-top
  from ksjax.evaluation import preregistration  # pylint: disable=g-import-not-at-top
  try:
    prereg = preregistration.load(os.path.join(REPO, study.preregistration))
  except ConfigError as e:
    print(f"tradeoff: {e}", file=sys.stderr)
    sys.exit(2)
  refuse_dirty_tree(study)
  if not study.quick:
    departures = registered_design(study, prereg)
    budget = prereg.raw.get("budget", {})
    _say(f"pre-registration {study.preregistration}: "
         + ("this study runs as registered" if not departures else
            "this study departs from it (" + "; ".join(departures) + "): exploratory")
         + (f"; registered budget about {budget['cpu_hours']} CPU-hours ({budget.get('basis')})"
            if "cpu_hours" in budget else ""))
  os.makedirs(study.out, exist_ok=True)
  _record_provenance(study)
  flags_given = [a for a in sys.argv[1:] if not a.startswith("--study.worker")]
  command = " ".join(["python experiments/tradeoff.py", *flags_given])
  started = time.time()
  ensure_start(study)
  run_workers(study, [a for a in sys.argv[1:] if not a.startswith(("--study.worker",
                                                                    "--study.out"))])
  report(study, command)
  _say(f"study done ({(time.time() - started) / 60:.1f} min in this invocation)")


if __name__ == "__main__":
  app.run(main)
