"""A registered study of trainer runs in the published-run layout (`runs_dir.py`): the decisive one.

A study declares its `Spec` (the registration, the report's title, the command, the objective
fields an arm may set, the --quick sizes); the registration's design says the rest: the arms, each
with its objective fields, seeds and stopping rule (matched "steps", or a "cpu" budget in
CPU-minutes: `max_cpu_minutes`, a step ceiling no run should reach), the checkpointed steps and
two evaluations of every run ("eval": every test problem with the KL to the start at each
checkpoint; "ladder": more samples on the first problems of each level at the last step; an
equal-CPU run has its last checkpoint evaluated only).

`main(spec, doc)` runs what is missing, seed by seed, and reports:
  1. each run trained in `<runs_dir>/<run>` (resumed from its newest checkpoint),
  2. evaluated by the eval binary, each call first listed in its `evaluations.json` (what, commit,
     machine), only the checkpoints without a record; the start once, as step 0,
  3. published to `<out>/<run>/` (`published.json` last: its arm, seed, stopping rule, last step,
     CPU time and every machine its attempts and evaluations touched), its checkpoints pruned;
  4. the report from the published runs alone: statements judged as registered (paired t over
     seeds within one machine: a seed is paired only where both runs trained and were evaluated
     on the one same machine; at matched KL read off each run's measured curve at the KL both
     runs of that seed reach), the registration checked against the commit of every training
     attempt and evaluation, runs at a commit a registered restart superseded named as
     departures; `--partial` an interim report of the whole seeds so far, no verdict.

Why a layout of its own: the decisive study's committed records (experiments/results/
decisive_study) are in it, made before the run store; moving them would rewrite committed
records, so this adapter reads and writes them where they are.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from scipy import stats

from ksjax import files
from ksjax import machine
from ksjax.evaluation import preregistration
from ksjax.evaluation import results
from ksjax.evaluation import statistics
from ksjax.studies import analysis
from ksjax.studies import cli
from ksjax.studies import engines
from ksjax.studies import runs_dir as rd
from ksjax.trainer import metrics

STOPS = ("steps", "cpu")
EVALUATIONS = ("eval", "ladder")


# --quick's design: the tiny model on the embedded task, every size scaled down (never a verdict).
QUICK = {"task": "synthetic", "steps": 3, "checkpoint_steps": [1, 2, 3], "cpu_minutes": 0.002,
         "cpu_step_ceiling": 2, "test_per_level": 2,
         "eval": {"num_samples": 4, "ks": [1, 2, 4], "batch_prompts": 2, "seed": 0,
                  "kl_samples": 2},
         "ladder": {"test_per_level": 1, "num_samples": 8, "ks": [1, 2, 4, 8],
                    "batch_prompts": 2, "seed": 0}}


@dataclasses.dataclass(frozen=True)
class Spec:
  """What a declaration states; the registration's design states the rest."""
  name: str  # in error messages: "decisive_study"
  root: str  # the repository
  registration: str  # relative to root
  out: str  # the default output directory, relative to root
  runs: str  # the runs directory's name under <root>/runs
  title: str  # the report's first line
  command: str  # how a reader regenerates the report
  objective_fields: tuple[str, ...] = ("aggregator", "baseline")  # all an arm may set
  quick: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # --quick's design sizes

  def load_registration(self) -> preregistration.Preregistration:
    return preregistration.load(os.path.join(self.root, self.registration))


@dataclasses.dataclass(frozen=True)
class Design:
  """What the study runs: the pre-registration's design (or --quick's sizes)."""
  config: str                 # the trainer config, configs/<config>.py
  task: str                   # its task's field group ("arithmetic")
  steps: int                  # matched steps
  checkpoint_steps: tuple[int, ...]
  cpu_minutes: float          # the equal-CPU arms' budget
  cpu_step_ceiling: int       # num_steps of an equal-CPU run: a ceiling no run should reach
  test_per_level: int         # held out of training, every one of them evaluated
  evaluation: dict            # the eval binary's settings for every test problem
  ladder: dict                # its "test_per_level": the first problems of each level
  arms: dict                  # name -> {"objective": {...}, "seeds": [...], "stop": ...}
  seeds: tuple[int, ...]      # every seed, in the study's order
  run_fields: tuple = ()      # trainer fields of every run and evaluation (design.run_fields)
  quick: bool = False

  @property
  def checkpoint_every(self) -> int:
    return self.checkpoint_steps[0]

  def arm_seeds(self, arm: str) -> tuple[int, ...]:
    return tuple(self.arms[arm].get("seeds", self.seeds))


def design(spec: Spec, prereg: preregistration.Preregistration, quick: bool = False) -> Design:
  """The study's design from its registration; checks what the library relies on (a bad one is a
  SystemExit naming the field)."""
  try:
    return _design(spec, prereg, quick)
  except (KeyError, IndexError, TypeError, ValueError) as e:
    raise SystemExit(f"{spec.name}: {spec.registration}: design {type(e).__name__} {e}; expected "
                     "config, steps, checkpoint_steps, cpu_minutes, cpu_step_ceiling, "
                     "test_per_level, eval and ladder") from None


def _design(spec: Spec, prereg: preregistration.Preregistration, quick: bool) -> Design:
  raw = dict(prereg.design)
  if quick:
    raw.update(spec.quick, config=rd.QUICK_CONFIG)
  where, fields_allowed = f"{spec.name}: {spec.registration}", spec.objective_fields
  arms = {name: dict(arm) for name, arm in prereg.arms.items()}
  for name, arm in arms.items():
    fields = set(arm.get("objective", {}))
    if not fields or fields - set(fields_allowed) or arm.get("stop") not in STOPS:
      raise SystemExit(f"{where}: arm {name!r} sets {sorted(fields)} "
                       f"with stop={arm.get('stop')!r}; expected objective fields among "
                       f"{fields_allowed} and stop in {STOPS}")
    if not quick and arm.get("config", f"configs/{raw['config']}.py") != (
        f"configs/{raw['config']}.py"):
      raise SystemExit(f"{where}: arm {name!r} names "
                       f"{arm['config']}; expected every arm on configs/{raw['config']}.py")
    arm["seeds"] = list(prereg.arm_seeds(name))
  steps, every = int(raw["steps"]), int(raw["checkpoint_steps"][0])
  if list(raw["checkpoint_steps"]) != list(range(every, steps + 1, every)):
    raise SystemExit(f"{where}: checkpoint_steps="
                     f"{raw['checkpoint_steps']} with steps={steps}; expected every step a "
                     "multiple of the first, up to and including the last")
  held_out = int(raw["test_per_level"])
  for which in EVALUATIONS:  # a subset of the held-out problems, never a training problem
    if int(raw[which].get("test_per_level", held_out)) > held_out:
      raise SystemExit(f"{where}: {which}.test_per_level={raw[which]['test_per_level']} with "
                       f"test_per_level={held_out}; expected at most the problems held out of "
                       "training")
  run_fields = raw.get("run_fields", {})
  if not isinstance(run_fields, Mapping) or set(run_fields) & set(fields_allowed):
    raise SystemExit(f"{where}: run_fields={run_fields!r}; expected a mapping of trainer fields "
                     f"every run shares, none of the arms' {fields_allowed}")
  return Design(config=raw["config"], task=raw.get("task", "arithmetic"), steps=steps,
                checkpoint_steps=tuple(raw["checkpoint_steps"]),
                cpu_minutes=float(raw["cpu_minutes"]),
                cpu_step_ceiling=int(raw["cpu_step_ceiling"]),
                test_per_level=held_out, evaluation=dict(raw["eval"]),
                ladder=dict(raw["ladder"]), arms=arms, seeds=prereg.seeds,
                run_fields=(*run_fields.items(), *(rd.QUICK_FIELDS if quick else ())),
                quick=quick)


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------

def runs_of(d: Design, arms, seeds) -> list[tuple[str, int]]:
  """Seed-major: every arm of a seed (that runs it) before the next seed."""
  return [(arm, seed) for seed in seeds for arm in arms if seed in d.arm_seeds(arm)]


def train_overrides(d: Design, arm: str, seed: int) -> tuple[str, ...]:
  """The trainer flags of one run: the arm's objective fields, then what every run of the study
  shares but the stopping rule (the equal-CPU arms' CPU budget and step ceiling)."""
  cpu = d.arms[arm]["stop"] == "cpu"
  shared = {**dict(d.run_fields), **dict(rd.QUICK_TRAIN if d.quick else ()),
            "seed": seed, "dynamic_sampling": False,
            "num_steps": d.cpu_step_ceiling if cpu else d.steps,
            **({"max_cpu_minutes": d.cpu_minutes} if cpu else {}),
            "checkpoint_every": d.checkpoint_every,
            # Orbax also keeps the first step it saves: room for it and every checkpointed step.
            "keep_checkpoints": len(d.checkpoint_steps) + 1,
            f"{d.task}.test_per_level": d.test_per_level,
            "eval.at_start": False, "eval.at_end": False}
  return (*rd.flags(d.arms[arm]["objective"].items()),
          *rd.flags(shared.items()))


def shared_fields_text(d: Design) -> str:
  """The registration's run_fields as the report's setup names them ("" when there are none)."""
  fields = [(k, v) for k, v in d.run_fields if (k, v) not in rd.QUICK_FIELDS]
  return "; every run: " + ", ".join(f"{k}={v}" for k, v in fields) if fields else ""


def eval_dir(runs_dir: str, name: str, which: str) -> str:
  return os.path.join(runs_dir, name, which)


def records(directory: str) -> dict[int, dict]:
  return {r["step"]: r for r in results.load_records(directory)}


def needed(d: Design, arm: str, last_step: int) -> dict[str, list[int]]:
  """The checkpoints each evaluation takes of a run that ended at `last_step`."""
  if d.arms[arm]["stop"] == "cpu":
    return {"eval": [last_step]}
  return {"eval": list(d.checkpoint_steps), "ladder": [last_step]}


def eval_settings(d: Design, which: str) -> tuple[dict, tuple]:
  """The eval binary's settings and trainer fields ("eval": every test problem, or the first
  `eval.test_per_level` of each level, and the KL to the start; "ladder": the first problems of
  each level, no KL)."""
  if which == "eval":  # every held-out problem unless the design names a subset
    settings = {"kl_reference": "start", **d.evaluation}
    held_out = settings.pop("test_per_level", d.test_per_level)
  else:
    settings = {k: v for k, v in d.ladder.items() if k != "test_per_level"}
    held_out = d.ladder["test_per_level"]
  fields = {**dict(d.run_fields), f"{d.task}.test_per_level": held_out}
  return {**settings, "breakdown": ("level",)}, tuple(fields.items())


def evaluate(spec: Spec, d: Design, runs_dir: str, name: str, which: str, steps: list[int], *,
             include_start: bool) -> None:
  """The eval binary on run `name`'s checkpoints `steps` (and its start, as step 0). Each call is
  first appended to `<run>/evaluations.json` (what, the commit, the machine), so that every
  record the binary writes, even in a call that then fails, was made by a listed one."""
  settings, fields = eval_settings(d, which)
  command = rd.eval_command(os.path.join(runs_dir, name), eval_dir(runs_dir, name, which),
                             config=d.config, settings=settings,
                             steps=",".join(map(str, steps)), include_start=include_start,
                             run_fields=fields)
  path = os.path.join(runs_dir, name, "evaluations.json")
  done = json.load(open(path, encoding="utf-8")) if os.path.exists(path) else []
  files.write_json(path, done + [{"what": which, "steps": steps, "start": include_start,
                                  "commit": rd.commit(spec.root),
                                  "machine": machine.describe()}])
  print(" ".join(command[1:]), flush=True)
  subprocess.run(command, cwd=spec.root, check=True)


def start_path(out: str, which: str) -> str:
  """The start policy's record (step 0) of one evaluation, published with the run that made it."""
  return os.path.join(out, "start", f"{which}.json")


def published(out: str, name: str) -> bool:
  """Whether run `name` is in `out` (`published.json` is written last: a publication cut short
  is not taken for one)."""
  return os.path.isfile(os.path.join(out, name, "published.json"))


def run_machines(attempts, evaluations) -> list[str]:
  return sorted({a.get("machine", "unrecorded") for a in (*attempts, *evaluations)})


def publish(spec: Spec, d: Design, runs_dir: str, out: str, name: str, arm: str, seed: int) -> None:
  """Copies a finished, evaluated run's files to `<out>/<name>` (and the start's records to
  `<out>/start/` once), naming no path of this machine. The report reads nothing else."""
  target = rd.publish_run_files(spec.root, runs_dir, out, name)
  last = rd.last_step(runs_dir, name)
  evaluations = json.load(open(os.path.join(runs_dir, name, "evaluations.json"),
                               encoding="utf-8"))
  files.write_json(os.path.join(target, "evaluations.json"), evaluations)
  for which, steps in needed(d, arm, last).items():
    by_step = records(eval_dir(runs_dir, name, which))
    os.makedirs(os.path.join(target, which), exist_ok=True)
    os.makedirs(os.path.dirname(start_path(out, which)), exist_ok=True)
    if 0 in by_step and not os.path.isfile(start_path(out, which)):
      files.write_json(start_path(out, which),
                       rd.relative_checkpoint(by_step[0], runs_dir))
    for step in steps:
      results.save_step(os.path.join(target, which),
                        rd.relative_checkpoint(by_step[step], runs_dir))
  attempts = json.load(open(os.path.join(runs_dir, name, "attempts.json"), encoding="utf-8"))
  rows = metrics.read_jsonl(os.path.join(target, "metrics.jsonl"))
  files.write_json(os.path.join(target, "published.json"), {
      "arm": arm, "seed": seed, "stop": d.arms[arm]["stop"], "last_step": last,
      "cpu_seconds": max(r.get("time/cpu_seconds", 0.0) for r in rows),
      "evaluated": needed(d, arm, last), "machines": run_machines(attempts, evaluations)})


def seed_machines(out: str, d: Design, seed: int) -> set[str]:
  """The machines the published runs of `seed` ran on."""
  found = set()
  for arm in d.arms:
    name = rd.run_name(arm, seed)
    if published(out, name):
      found.update(rd.published_json(out, name, "published.json")["machines"])
  return found


def run_study(spec: Spec, d: Design, runs_dir: str, out: str, arms, seeds, *,
              engine: str | None = None, workers: int = 1,
              cluster_args: Mapping[str, Any] | None = None) -> None:
  """Phases 1 and 2: each run trained (or resumed, or skipped), evaluated, published, pruned. A
  published run is not run again, even where `runs_dir` is gone. Without an `engine`, one run
  after another in this process; with one, every run missing is a job of `engines.run` (a local
  pool of `workers` processes, or SLURM through submitit), each job `run_one`."""
  todo = [(arm, seed) for arm, seed in runs_of(d, arms, seeds)
          if not published(out, rd.run_name(arm, seed))]
  if engine is None:
    for arm, seed in todo:
      run_one(spec, d, runs_dir, out, arm, seed)
    return
  engines.run(engine, [(run_one, (spec, d, runs_dir, out, arm, seed)) for arm, seed in todo],
              lambda name: print(f"published {name}", flush=True), workers=workers,
              folder=os.path.join(runs_dir, "submitit"), cluster_args=dict(cluster_args or {}))


def run_one(spec: Spec, d: Design, runs_dir: str, out: str, arm: str, seed: int) -> str:
  """One run trained (or resumed), evaluated at the checkpoints without a record, published and
  pruned; its name. A job of any engine: its records are the same whichever ran it."""
  here = machine.describe()
  name = rd.run_name(arm, seed)
  elsewhere = seed_machines(out, d, seed) - {here}
  if elsewhere:
    print(f"warning: seed {seed}'s published runs ran on {sorted(elsewhere)}, this one runs on "
          f"{here!r}: the report leaves seed {seed} out of every statement that pairs {name} "
          "with them", flush=True)
  rd.train(spec.root, runs_dir, name, d.config, train_overrides(d, arm, seed))
  last = rd.last_step(runs_dir, name)
  if d.arms[arm]["stop"] == "steps" and last != d.steps:
    raise SystemExit(f"{spec.name}: {name} ended at step {last}, not {d.steps}")
  for which, steps in needed(d, arm, last).items():
    have = records(eval_dir(runs_dir, name, which))
    start = not os.path.isfile(start_path(out, which)) and 0 not in have
    # Only the checkpoints without a record: an evaluation stopped part-way (a session's end)
    # keeps the checkpoints it finished, each sampled with the same seed as in one call.
    missing = [step for step in steps if step not in have]
    if start or missing:
      evaluate(spec, d, runs_dir, name, which, missing or steps, include_start=start)
  publish(spec, d, runs_dir, out, name, arm, seed)
  rd.prune_checkpoints(runs_dir, name)
  return name


def finished_seeds(d: Design, out: str, arms, seeds) -> list[int]:
  """The seeds whose every run (of `arms` that run them) has been published."""
  return [s for s in seeds if all(published(out, rd.run_name(a, s))
                                  for a, _ in runs_of(d, arms, [s]))]


# ---------------------------------------------------------------------------------------------
# Analysis: pure functions of the published records
# ---------------------------------------------------------------------------------------------

def _start(out: str) -> dict[str, dict]:
  return {which: json.load(open(start_path(out, which), encoding="utf-8"))
          for which in EVALUATIONS if os.path.isfile(start_path(out, which))}


def collect(d: Design, out: str, arms, seeds) -> dict:
  """The start's values and, per published run: its curve (the start as step 0 with KL 0, then
  each evaluated checkpoint: step, held-out KL, every metric), its values at the last step
  (the ladder's as "ladder/<metric>"), its machines, commits, steps and CPU time."""
  start = {which: rd.values(record) for which, record in _start(out).items()}
  runs = {}
  for arm, seed in runs_of(d, arms, seeds):
    name = rd.run_name(arm, seed)
    if not published(out, name):
      continue
    info = rd.published_json(out, name, "published.json")
    kept = results.load_records(os.path.join(out, name, "eval"))
    evaluated = [rd.values(r) for r in kept]
    ladder = results.load_records(os.path.join(out, name, "ladder"))
    points = [start.get("eval", {})] + evaluated
    names = [m for m in evaluated[-1] if all(m in p for p in points) and m != "kl"]
    final = dict(evaluated[-1])
    if ladder:
      final.update({f"ladder/{m}": v for m, v in rd.values(ladder[-1]).items()})
    runs[name] = {
        "arm": arm, "seed": seed, "stop": info["stop"], "last_step": info["last_step"],
        "cpu_seconds": info["cpu_seconds"], "machines": info["machines"],
        "commits": list(dict.fromkeys(
            a["commit"] for a in rd.published_json(out, name, "attempts.json"))),
        "eval_commits": list(dict.fromkeys(
            e["commit"] for e in rd.published_json(out, name, "evaluations.json"))),
        "steps": [0] + [r["step"] for r in kept],
        "kl": [0.0] + [p["kl"] for p in evaluated],
        "metrics": {m: [p[m] for p in points] for m in names}, "final": final}
  return {"start": start, "runs": runs}


def paired_seeds(data: dict, a: str, b: str, seeds) -> tuple[list[int], dict[int, str]]:
  """The seeds on which arms a and b can be paired: both runs published, trained and evaluated
  on one and the same machine. Returns them, and {seed: why} for those left out of a finished
  seed's pair."""
  used, left_out = [], {}
  for seed in seeds:
    runs = [data["runs"].get(rd.run_name(arm, seed)) for arm in (a, b)]
    if None in runs:
      continue
    machines = sorted(set(runs[0]["machines"]) | set(runs[1]["machines"]))
    if len(machines) == 1:
      used.append(seed)
    else:
      left_out[seed] = ("its two runs ran on different machines: "
                        + "; ".join(f"{rd.run_name(arm, seed)} on {', '.join(r['machines'])}"
                                    for arm, r in zip((a, b), runs)))
  return used, left_out


def statement_values(prereg, data: dict) -> tuple[dict, dict, dict]:
  """{id: (a's values, b's values)}, one per paired seed in the study's order; {id: the seeds
  used}; {id: {seed: why it was left out}}.

  "last": the metric at each run's last checkpoint (the matched step for the matched-steps
  arms). "kl": the metric at the held-out KL both runs of the seed reach (the smaller of their
  final KLs), read off each run's measured curve by interpolating between the two evaluated
  points around it (`tradeoff.at_kl`), nothing extrapolated. A statement whose metric was not
  evaluated (e.g. the ladder's k in a --quick run) is left out: "not measured"."""
  at_kl = analysis.at_kl
  values, used, left_out = {}, {}, {}
  for statement in prereg.statements:
    seeds, why = paired_seeds(data, statement.a, statement.b, prereg.statement_seeds(statement))
    run = lambda arm, seed: data["runs"][rd.run_name(arm, seed)]
    if not seeds or any(statement.metric not in (run(arm, s)["final"] if statement.at == "last"
                                                 else run(arm, s)["metrics"])
                        for s in seeds for arm in (statement.a, statement.b)):
      continue
    if statement.at == "last":
      pair = tuple([run(arm, s)["final"][statement.metric] for s in seeds]
                   for arm in (statement.a, statement.b))
    else:
      target = {s: min(run(arm, s)["kl"][-1] for arm in (statement.a, statement.b))
                for s in seeds}
      pair = tuple([at_kl(run(arm, s)["kl"], run(arm, s)["metrics"][statement.metric],
                          target[s]) for s in seeds] for arm in (statement.a, statement.b))
    values[statement.id], used[statement.id], left_out[statement.id] = pair, seeds, why
  return values, used, left_out


def registration_check(spec: Spec, commits) -> dict:
  """Whether the pre-registration's commit precedes each of `commits` (every run's training
  attempts and evaluations, the first run's first): `preregistration.registration` of the first,
  with "commits", "not_preceded" (those it does not precede, or all where it was never
  committed) and "precedes_every_run" (True only when that list is empty and there are runs)."""
  checks = {c: preregistration.registration(spec.root, spec.registration, c) for c in commits}
  first = (checks[commits[0]] if commits else
           preregistration.registration(spec.root, spec.registration, None))
  late = [c for c, info in checks.items() if info["precedes"] is not True]
  return {**first, "commits": list(commits), "not_preceded": late,
          "precedes_every_run": bool(commits) and not late}


def judged(spec: Spec, prereg, data: dict, commits, *, departures, interim: bool) -> dict:
  """The statements' rows (`preregistration.judge`, with the seeds each used and left out). Every
  statement is exploratory where the registration does not precede every run or the study
  departs from it; in an interim report the verdict is "interim" whatever the numbers."""
  values, used, left_out = statement_values(prereg, data)
  order = registration_check(spec, commits)
  registered = order["precedes_every_run"] and not departures
  rows = preregistration.judge(prereg, values, registered=registered)
  for row in rows:
    row["seeds_used"] = used.get(row["id"], [])
    row["seeds_left_out"] = {str(s): why for s, why in left_out.get(row["id"], {}).items()}
    if interim and "difference" in row:
      row["verdict"] = "interim"
  return {"rows": rows, "registration": order, "registered": registered,
          "departures": list(departures)}


def _mean_interval(values) -> tuple[float, float, float]:
  """Mean over seeds and its 95% Student-t interval (nan with one seed)."""
  values = np.asarray(values, float)
  mean = float(values.mean())
  if len(values) < 2:
    return mean, float("nan"), float("nan")
  half = stats.t.ppf(0.975, len(values) - 1) * values.std(ddof=1) / np.sqrt(len(values))
  return mean, mean - half, mean + half


def by_arm(data: dict, arms) -> dict[str, list[dict]]:
  """Each arm's published runs, in seed order."""
  return {arm: [r for r in data["runs"].values() if r["arm"] == arm] for arm in arms}


def pass_at_k_table(data: dict, arms, ks, prefix: str = "") -> tuple[str, dict]:
  """Markdown: pass@k at the last step per arm, mean over seeds [95% interval]; and the numbers."""
  runs = {a: r for a, r in by_arm(data, arms).items()
          if r and all(f"{prefix}pass@{k}" in x["final"] for x in r for k in ks)}
  lines = ["| arm | seeds | " + " | ".join(f"pass@{k}" for k in ks) + " |",
           "|" + "---|" * (len(ks) + 2)]
  start = data["start"].get("ladder" if prefix else "eval", {})
  if all(f"pass@{k}" in start for k in ks):
    lines.append("| start | — | " + " | ".join(f"{start[f'pass@{k}']:.3f}" for k in ks) + " |")
  numbers = {}
  cell = lambda m, lo, hi, sign="": (f"{m:{sign}.3f} [{lo:{sign}.3f}, {hi:{sign}.3f}]"
                                     if np.isfinite(lo) else f"{m:{sign}.3f}")
  for arm, rs in runs.items():
    numbers[arm] = {k: _mean_interval([r["final"][f"{prefix}pass@{k}"] for r in rs]) for k in ks}
    lines.append(f"| {arm} | {len(rs)} | "
                 + " | ".join(cell(*v) for v in numbers[arm].values()) + " |")
  if {"pass_at_k", "mean"} <= set(runs):  # the primary pair's difference, paired by seed
    seeds, _ = paired_seeds(data, "pass_at_k", "mean", [r["seed"] for r in runs["mean"]])
    value = lambda arm, k: [data["runs"][rd.run_name(arm, s)]["final"][f"{prefix}pass@{k}"]
                            for s in seeds]
    diffs = [statistics.paired(value("pass_at_k", k), value("mean", k)) for k in ks]
    if seeds:
      lines.append(f"| pass_at_k − mean, paired | {len(seeds)} | " + " | ".join(
          cell(c.difference, c.ci_low, c.ci_high, "+") for c in diffs) + " |")
  return "\n".join(lines), numbers


def curve_table(data: dict, arms) -> str:
  """Markdown: each matched-steps arm's mean over seeds at every evaluated step."""
  lines = ["| arm | step | seeds | pass@1 | pass@4 | maj@4 | KL (k3) |",
           "|---|---|---|---|---|---|---|"]
  for arm, rs in by_arm(data, arms).items():
    if not rs or rs[0]["stop"] != "steps":
      continue
    for i, step in enumerate(rs[0]["steps"]):
      at = lambda m: np.mean([r["metrics"][m][i] if m != "kl" else r["kl"][i] for r in rs])
      lines.append(f"| {arm} | {step} | {len(rs)} | {at('pass@1'):.3f} | {at('pass@4'):.3f} | "
                   f"{at('maj@4'):.3f} | {at('kl'):.3f} |")
  return "\n".join(lines)


def figures(data: dict, arms, d: Design, out: str) -> None:
  """metrics_vs_step.png (pass@1, pass@4, KL: seed means, the band min-max over seeds),
  pass4_vs_kl.png (every run's measured points, thin, and the seed mean), pass_at_k_vs_k.png
  (the last step, with 95% intervals over seeds; the ladder on its subset beside)."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  from ksjax.evaluation import plots  # pylint: disable=g-import-not-at-top
  groups = {a: rs for a, rs in by_arm(data, arms).items() if rs}
  color = {a: f"C{i}" for i, a in enumerate(groups)}
  curves = {a: rs for a, rs in groups.items() if rs[0]["stop"] == "steps"}
  fig = Figure(figsize=(10.5, 3.2))
  for ax, metric in zip(fig.subplots(1, 3), ("pass@1", "pass@4", "kl")):
    for arm, rs in curves.items():
      y = np.asarray([r["kl"] if metric == "kl" else r["metrics"][metric] for r in rs])
      plots.metric_vs_step(ax, rs[0]["steps"], y.mean(0), arm, metric=metric, color=color[arm])
      ax.fill_between(rs[0]["steps"], y.min(0), y.max(0), color=color[arm], alpha=0.12)
  fig.axes[0].legend(fontsize="x-small")
  fig.tight_layout()
  plots.save(fig, os.path.join(out, "metrics_vs_step.png"))
  fig = Figure(figsize=(5.5, 3.8))
  ax = fig.subplots()
  for arm, rs in curves.items():
    for r in rs:
      ax.plot(r["kl"], r["metrics"]["pass@4"], color=color[arm], alpha=0.25, linewidth=0.8)
    plots.metric_vs_kl(ax, np.mean([r["kl"] for r in rs], 0),
                       np.mean([r["metrics"]["pass@4"] for r in rs], 0), arm,
                       metric="held-out pass@4", color=color[arm])
  ax.legend(fontsize="x-small")
  fig.tight_layout()
  plots.save(fig, os.path.join(out, "pass4_vs_kl.png"))
  fig = Figure(figsize=(10, 3.8))
  for ax, prefix, which in zip(fig.subplots(1, 2), ("", "ladder/"), EVALUATIONS):
    ks = d.evaluation["ks"] if which == "eval" else d.ladder["ks"]
    _, numbers = pass_at_k_table(data, groups, ks, prefix)
    for arm, by_k in numbers.items():
      m, lo, hi = (np.asarray(v) for v in zip(*by_k.values()))
      plots.pass_at_k_curve(ax, ks, m, arm, color=color[arm])
      if np.all(np.isfinite(lo)):
        ax.errorbar(ks, m, yerr=[m - lo, hi - m], color=color[arm], capsize=2, linestyle="none")
    start = data["start"].get(which, {})
    if all(f"pass@{k}" in start for k in ks):
      plots.pass_at_k_curve(ax, ks, [start[f"pass@{k}"] for k in ks], "start", color="black",
                            linestyle="--")
    ax.set_title("every test problem" if which == "eval" else "the ladder's subset",
                 fontsize="medium")
    ax.set_ylabel("pass@k at the last step")
  fig.axes[0].legend(fontsize="x-small")
  fig.tight_layout()
  plots.save(fig, os.path.join(out, "pass_at_k_vs_k.png"))


def power(prereg, rows) -> dict:
  """The registered plan's reach (the pilot's sd, the registered seeds) and the observed: the
  paired test's minimum detectable effect at the observed between-seed sd of P1's differences."""
  plan = dict(prereg.raw.get("power", {}))
  first = next((r for r in rows if r["id"] == prereg.primary[0].id and "differences" in r), None)
  if first is None or len(first["differences"]) < 2:
    return {"plan": plan}
  sd = float(np.std(first["differences"], ddof=1))
  n = len(first["differences"])
  return {"plan": plan, "statement": first["id"], "seeds": n, "sd_of_differences": sd,
          "minimum_detectable_effect": statistics.minimum_detectable_effect(sd, n)
                                       if sd > 0 else 0.0}


def _short(commits) -> str:
  return ", ".join(f"`{c[:7]}`" for c in commits) or "none recorded"


def restarts(prereg) -> list[dict]:
  """The registration's restart records, oldest first: each names the commit whose runs it
  superseded, where they are kept, when and why, and what was seen of them."""
  return list(prereg.raw.get("restarts", []))


def superseded_runs(data: dict, names, records) -> list[str]:
  """A departure for each run of `names` trained or evaluated at a commit that a restart
  superseded: its results were to be kept apart, not pooled with the restarted study's."""
  gone = [r["superseded_commit"] for r in records]
  found = []
  for n in names:
    for c in (*data["runs"][n]["commits"], *data["runs"][n]["eval_commits"]):
      if any(c.startswith(g) or g.startswith(c) for g in gone):
        found.append(f"{n} ran at `{c[:7]}`, a commit the study was restarted from")
  return found


def report(spec: Spec, d: Design, prereg, out: str, arms, seeds, *, interim: bool,
           departures) -> dict:
  """`<out>/README.md`, `summary.json`, `provenance.json` and the figures from the published
  runs of `seeds`; returns the summary."""
  data = collect(d, out, arms, seeds)
  names = [rd.run_name(a, s) for a, s in runs_of(d, arms, seeds) if rd.run_name(a, s)
           in data["runs"]]
  commits = list(dict.fromkeys(c for n in names for c in (*data["runs"][n]["commits"],
                                                          *data["runs"][n]["eval_commits"])))
  restarted = restarts(prereg)
  departures = [*departures, *superseded_runs(data, names, restarted)]
  verdicts = judged(spec, prereg, data, commits, departures=departures, interim=interim)
  reach = power(prereg, verdicts["rows"])
  order = verdicts["registration"]
  start_evals = [e for n in names for e in rd.published_json(out, n, "evaluations.json")
                 if e["start"]]
  provenance = {"runs": {n: {"attempts": rd.published_json(out, n, "attempts.json"),
                             "evaluations": rd.published_json(out, n, "evaluations.json")}
                         for n in names}}
  os.makedirs(out, exist_ok=True)
  files.write_json(os.path.join(out, "provenance.json"), provenance)
  summary = {"study": prereg.study, "interim": interim, "quick": d.quick,
             "seeds": list(seeds), "arms": list(arms), "design": dataclasses.asdict(d),
             "restarts": restarted,
             "registration": order, "registered": verdicts["registered"],
             "departures": verdicts["departures"], "statements": verdicts["rows"],
             "power": reach, "start": data["start"], "runs": data["runs"]}
  files.write_json(os.path.join(out, "summary.json"), summary)
  figures(data, arms, d, out)
  eval_table, _ = pass_at_k_table(data, arms, d.evaluation["ks"])
  ladder_table, _ = pass_at_k_table(data, arms, d.ladder["ks"], "ladder/")
  per_seed = {s: sorted({m for n in names if data["runs"][n]["seed"] == s
                         for m in data["runs"][n]["machines"]}) for s in seeds}
  flags = (" --quick" if d.quick else "") + (" --partial" if interim else "")
  objectives = "; ".join(f"{a}: " + ", ".join(f"{k}={v}" for k, v in d.arms[a]["objective"].items())
                         for a in arms)
  lines = [
      f"# {spec.title}",
      "",
      f"Produced by `{spec.command}{flags}` from the published runs in "
      "this directory (regenerate with the same command: it trains nothing when every run is "
      f"published). Pre-registration: `{spec.registration}`.", ""]
  if interim:
    done = len(names)
    lines += [f"**INTERIM REPORT** ({done} of {len(runs_of(d, arms, d.seeds))} runs, seeds "
              f"{', '.join(map(str, seeds))} finished): the numbers so far, and no verdict on "
              "any statement (each reads \"interim\"). The study's verdicts come only from the "
              "report of every registered run.", ""]
  if d.quick:
    lines += ["**Smoke run (--quick)**: the tiny model on the embedded task, not the registered "
              "study; no statement is judged as registered.", ""]
  lines += [
      "## Registration", "",
      preregistration.registration_line(order), "",
      f"Commits of every run's training attempts and evaluations ({len(commits)}): "
      f"{_short(commits)}. "
      + ("The registration precedes each of them." if order["precedes_every_run"] else
         "The registration does NOT precede "
         + (_short(order["not_preceded"]) if order["registered_at"] else "any of them")
         + ": every statement is exploratory."), ""]
  if order.get("changed_at"):
    lines += ["The registration file was amended at " + _short(order["changed_at"])
              + " (the restart records and the re-measured budget below); the check above "
              "covers every amendment.", ""]
  if verdicts["departures"]:
    lines += ["Departures from the registration (every statement is exploratory): "
              + "; ".join(verdicts["departures"]) + ".", ""]
  if restarted:
    lines += ["## Restarts", "",
              "The study was restarted, each time before any held-out result at the new commit "
              "was seen; a restart keeps every registered setting and seed, and the runs it "
              "supersedes are kept apart and not pooled with these:", ""]
    lines += [f"- {r['date']}: the runs at `{r['superseded_commit'][:7]}` superseded "
              f"(decided at `{r['decided_at'][:7]}`; kept in "
              f"{r.get('superseded_results') or 'no published run'}; seen: {r['seen']}). "
              f"Why: {r['reason']}" for r in restarted]
    lines.append("")
  lines += [
      "## Setup", "",
      f"`configs/{d.config}.py`, every arm setting only its objective ({objectives})"
      f"{shared_fields_text(d)}. "
      f"Matched-steps arms: {d.steps} steps, evaluated at steps "
      f"{', '.join(map(str, d.checkpoint_steps))}"
      + (f"; equal-CPU arms: {d.cpu_minutes:g} CPU-minutes of training, evaluated at their last "
         "step" if any(a["stop"] == "cpu" for a in d.arms.values()) else "") +
      f". Held out: {d.test_per_level} test problems per level (none trained on), "
      + (f"the first {d.evaluation['test_per_level']} of each level evaluated at every "
         "checkpoint, " if "test_per_level" in d.evaluation else "each ") +
      f"with {d.evaluation['num_samples']} samples at temperature 1 (pass@k for k = "
      f"{', '.join(map(str, d.evaluation['ks']))}; KL(policy || start), k3 per completion, on "
      f"{d.evaluation['kl_samples']} samples per problem); the ladder: the first "
      f"{d.ladder['test_per_level']} of each level with {d.ladder['num_samples']} samples, at "
      "the last step and the start. One sampling seed for every evaluation.", "",
      *cpu_steps_lines(data, names),
      "## Statements", "",
      ("Judged as registered: paired t-test over seeds, two-sided, Holm across the primary "
       f"statements, alpha {prereg.alpha:g}." if verdicts["registered"] and not interim else
       "Interim: numbers only, no verdict." if interim else
       "**Exploratory**: not judged as registered (see above)."), "",
      preregistration.table(verdicts["rows"]), "",
      "Seeds per statement (a seed is paired only where both runs trained and were evaluated "
      "on one machine):", "",
      "| id | seeds used | left out |", "|---|---|---|"]
  for row in verdicts["rows"]:
    left = "; ".join(f"seed {s}: {why}" for s, why in row["seeds_left_out"].items())
    lines.append(f"| {row['id']} | {', '.join(map(str, row['seeds_used'])) or '—'} | "
                 f"{left or '—'} |")
  lines.append("")
  plan, budget = reach["plan"], prereg.raw.get("budget", {})
  if plan:
    lines += ["## Power and budget", "", "Registered: " + " ".join(
        str(plan[k]) for k in ("pilot", "minimum_detectable_effect", "held_out") if k in plan),
              ""]
  if budget.get("cpu_hours"):
    lines += [f"Registered budget: about {budget['cpu_hours']} CPU-hours ({budget['basis']}).",
              ""]
  if "sd_of_differences" in reach:
    lines += [f"Observed: the between-seed sd of {reach['statement']}'s differences is "
              f"{reach['sd_of_differences']:.4f}; with {reach['seeds']} seeds the paired test "
              f"detects {reach['minimum_detectable_effect']:.4f} with 80% power at alpha 0.05 "
              "(`statistics.minimum_detectable_effect`).", ""]
  lines += [
      "## pass@k against k at the last step (mean over seeds [95% t-interval])", "",
      f"Every test problem ({d.evaluation['num_samples']} samples each):", "", eval_table, "",
      f"The ladder's subset ({d.ladder['num_samples']} samples each):", "", ladder_table, "",
      "## Curves (mean over seeds at each evaluated step; held-out KL)", "",
      curve_table(data, arms), "",
      "Figures: `metrics_vs_step.png` (pass@1, pass@4, KL against step), `pass4_vs_kl.png` "
      "(pass@4 against KL: the measured points of every run, nothing between them), "
      "`pass_at_k_vs_k.png`.", "",
      "## Machines and commits", "",
      "| run | steps | CPU-min | machines | trained at | evaluated at |",
      "|---|---|---|---|---|---|"]
  for n in names:
    r = data["runs"][n]
    lines.append(f"| {n} | {r['last_step']} | {r['cpu_seconds'] / 60:.1f} | "
                 f"{'; '.join(r['machines'])} | {_short(r['commits'])} | "
                 f"{_short(r['eval_commits'])} |")
  lines += ["", "Per seed: " + "; ".join(f"seed {s}: {', '.join(m) or '—'}"
                                         for s, m in per_seed.items()) + ".",
            "The start's evaluations (once, with the study's first run): " + "; ".join(
                f"{e['what']} at `{e['commit'][:7]}` on {e['machine']}" for e in start_evals)
            + ".", "",
            "Every number: `summary.json`; per run: its step log, config, attempts, evaluations "
            "and every evaluation record with per-problem counts in `<run>/`."]
  files.write_text(os.path.join(out, "README.md"), "\n".join(lines) + "\n")
  print(f"wrote {out}", flush=True)
  return summary


def cpu_steps_lines(data: dict, names) -> list[str]:
  """The steps each equal-CPU run reached, by machine, as report lines (none without such runs).

  Why: their budget is in CPU-minutes, so the steps it buys depend on the machine kind (on the
  AMX Xeon the arms reached several times the EPYC's steps), and an equal-CPU statement pairs
  seeds within a machine but pools machines whose budgets meant different step counts."""
  by_machine: dict[str, list[str]] = {}
  for name in names:
    r = data["runs"][name]
    if r["stop"] == "cpu":
      by_machine.setdefault("; ".join(r["machines"]), []).append(f"{name} {r['last_step']}")
  if not by_machine:
    return []
  return ["Steps the equal-CPU budget bought, by machine (the budget is in CPU-minutes, so its "
          "steps depend on the CPU; each seed is paired within one machine):", "",
          *(f"- {machine}: {', '.join(runs)}" for machine, runs in by_machine.items()), ""]


def status(d: Design, out: str, arms, seeds) -> str:
  """A markdown table of the runs published so far (in study order), the start's first."""
  lines = ["| run | steps | CPU-min | pass@1 | pass@4 | maj@4 | KL | machines |",
           "|---|---|---|---|---|---|---|---|"]
  start = _start(out).get("eval")
  if start:
    m = start["metrics"]
    lines.append(f"| start | 0 | 0 | {m['pass@1']:.3f} | {m['pass@4']:.3f} | {m['maj@4']:.3f} "
                 "| 0 | |")
  data = collect(d, out, arms, seeds)
  for name, r in data["runs"].items():
    f = r["final"]
    lines.append(f"| {name} | {r['last_step']} | {r['cpu_seconds'] / 60:.1f} | "
                 f"{f['pass@1']:.3f} | {f['pass@4']:.3f} | {f['maj@4']:.3f} | {f['kl']:.2f} | "
                 f"{'; '.join(r['machines'])} |")
  return "\n".join(lines)


def arguments(spec: Spec, doc: str, argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog=spec.command, description=doc.split("\n")[0])
  parser.add_argument("--out", default=os.path.join(spec.root, spec.out))
  parser.add_argument("--runs_dir", default=os.path.join(spec.root, "runs", spec.runs))
  parser.add_argument("--seeds", help="a comma-separated subset of the registered seeds")
  parser.add_argument("--arms", help="a comma-separated subset of the registered arms")
  parser.add_argument("--partial", action="store_true",
                      help="an interim report of the seeds finished so far; runs nothing")
  parser.add_argument("--status", action="store_true",
                      help="print the runs published so far; writes and runs nothing")
  parser.add_argument("--quick", action="store_true", help="the tiny model (a smoke run)")
  parser.add_argument("--carry", choices=("save", "restore", "seeds", "commit"),
                      help="carry unpublished runs to the next machine (carry_runs.py): save "
                      "their records, restore them after training again, print the seeds this "
                      "machine may run, or commit the published runs; runs nothing else")
  parser.add_argument("--carry_dir", help="where carried records go (default: <out>_carried)")
  parser.add_argument("--budget", type=int, metavar="STEPS",
                      help="measure STEPS-step runs of the matched-steps arms (--arms) and print "
                      "the projected CPU-hours (budget_runs.py); runs nothing else")
  parser.add_argument("--engine", choices=engines.ENGINES,
                      help="run the missing runs as jobs: 'local' a pool of --workers processes "
                      "on this machine, 'slurm' SLURM jobs through submitit (--slurm_partition, "
                      "--timeout_min, ...), 'submitit-local'/'submitit-debug' submitit without a "
                      "cluster; default: one run after another in this process")
  parser.add_argument("--workers", type=int, default=1)
  cli.add_cluster_arguments(parser)
  parser.add_argument("--budget_eval_per_level", type=int, default=4)
  parser.add_argument("--budget_ladder_per_level", type=int, default=1)
  return parser.parse_args(argv)


def _carry(spec: Spec, args, runs_dir: str, out: str) -> None:
  """--carry: one action of carry_runs.py; the seeds on stdout, the reasons on stderr."""
  from ksjax.studies import carry_runs  # pylint: disable=g-import-not-at-top
  carried = os.path.abspath(args.carry_dir or out.rstrip(os.sep) + "_carried")
  if args.carry == "save":
    carry_runs.save_runs(spec, runs_dir, carried, out)
  elif args.carry == "restore":
    carry_runs.restore_runs(spec, runs_dir, carried, out)
  elif args.carry == "commit":
    carry_runs.commit_published(spec, carried, out)
  else:
    allowed, why = carry_runs.seeds_to_run(spec, carried, out)
    for seed, reason in why.items():
      where = "runs here last" if seed in allowed else "is not for this machine"
      print(f"seed {seed} {where} ({machine.describe()}): {reason}", file=sys.stderr)
    print(",".join(map(str, allowed)))


def main(spec: Spec, doc: str, argv=None) -> None:
  """The study's command: run what is missing, seed by seed, then report. A registration or a
  record that cannot be read is one line and exit status 1."""
  rd.in_one_line(spec.name, _main, spec, doc, argv)


def _main(spec: Spec, doc: str, argv=None) -> None:
  args = arguments(spec, doc, argv)
  prereg = spec.load_registration()
  d = design(spec, prereg, args.quick)
  arms = args.arms.split(",") if args.arms else list(d.arms)
  try:
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else list(d.seeds)
  except ValueError:
    seeds = None
  if not seeds or set(arms) - set(d.arms) or set(seeds) - set(d.seeds):
    raise SystemExit(f"{spec.name}: --arms={args.arms!r} --seeds={args.seeds!r} are not "
                     f"accepted; expected arms among {', '.join(d.arms)} and seeds among "
                     f"{', '.join(map(str, d.seeds))}")
  departures = [f"{what} {', '.join(map(str, given))} of {', '.join(map(str, every))}"
                for what, given, every in (("arms", arms, list(d.arms)),
                                           ("seeds", seeds, list(d.seeds)))
                if set(given) != set(every)] + (["--quick: the tiny model"] if args.quick else [])
  runs_dir, out = os.path.abspath(args.runs_dir), os.path.abspath(args.out)
  if args.status:
    print(status(d, out, arms, seeds))
    return
  if args.carry:
    _carry(spec, args, runs_dir, out)
    return
  if args.budget is not None:
    from ksjax.studies import budget_runs  # pylint: disable=g-import-not-at-top
    matched = [a for a in arms if d.arms[a]["stop"] == "steps"]
    measured = budget_runs.measure(spec, d, os.path.abspath(args.runs_dir) + "_budget", matched,
                                   args.budget, args.budget_eval_per_level,
                                   args.budget_ladder_per_level)
    print(json.dumps(measured, indent=1))
    return
  if args.partial:
    done = finished_seeds(d, out, arms, seeds)
    if not done:
      raise SystemExit(f"{spec.name}: no seed has finished every arm yet; nothing to report")
    report(spec, d, prereg, out, arms, done, interim=True, departures=departures)
    return
  todo = [r for r in runs_of(d, arms, seeds) if not published(out, rd.run_name(*r))]
  if todo and not args.quick:
    if rd.dirty(spec.root):
      raise SystemExit(f"{spec.name}: the tree has uncommitted changes to tracked files; "
                       "commit them first (the results must name the commit they ran at)")
    head = rd.commit(spec.root)
    if preregistration.registration(spec.root, spec.registration, head)["precedes"] is not True:
      raise SystemExit(f"{spec.name}: {spec.registration} is not committed as it stands at "
                       "HEAD; commit the registration before the first run")
  started = time.time()
  run_study(spec, d, runs_dir, out, arms, seeds, engine=args.engine, workers=args.workers,
            cluster_args=cli.cluster_args(args))
  report(spec, d, prereg, out, arms, seeds, interim=False, departures=departures)
  print(f"study done ({(time.time() - started) / 60:.1f} min in this invocation)", flush=True)
