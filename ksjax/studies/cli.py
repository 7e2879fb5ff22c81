"""The command line every study declaration gets: `python <declaration>.py [flags]`.

  (no flag)              run what is missing on this machine's pool of workers, then report
  --engine=slurm         the same runs as SLURM jobs through submitit (--slurm_partition,
                         --slurm_constraint, --timeout_min, --cpus_per_task, --mem_gb); also
                         submitit-local, submitit-debug
  --seeds=0,1 --arms=a,b a subset: exploratory, never a verdict
  --status               which runs are published, from which machine; runs nothing
  --report               the report from the published runs; runs nothing (refused, one line,
                         while a registered run is unpublished)
  --commit               commit each run to git as it is published (a session's machine may go
                         at any time; the next one continues from what was committed)
  --out=DIR              another output directory (default: the declaration's)
  --budget=STEPS         measure each arm on a STEPS-step run here (a scratch directory, nothing
                         published) and print the projected CPU-hours; runs nothing else
  --carry=save|restore   before a machine goes: save the unpublished runs' evaluation records to
                         --carry_dir (default <out>_carried, to commit); on the next machine:
                         restore them where this machine retrains the runs to the same states

With every registered run published, the command trains nothing and writes nothing but the
report, byte for byte the same from the same records; provenance.json and timing.json change
only when this session runs something. Bad input (a registration, a declaration, a flag) is one
line on stderr and exit status 2, before anything is written.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence

from ksjax.config_validation import ConfigError
from ksjax.evaluation import preregistration
from ksjax.studies import analysis
from ksjax.studies import budget
from ksjax.studies import carry
from ksjax.studies import declaration as declaration_lib
from ksjax.studies import engines
from ksjax.studies import jobs
from ksjax.studies import report
from ksjax.studies import store
from ksjax.studies import verdicts


def _say(message: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def parser(study) -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog=study.command, description=f"The {study.name} study.")
  p.add_argument("--out", help=f"output directory (default: {study.out})")
  p.add_argument("--seeds", help="a comma-separated subset of the seeds (exploratory)")
  p.add_argument("--arms", help="a comma-separated subset of the arms (exploratory)")
  p.add_argument("--engine", default="local", choices=engines.ENGINES)
  p.add_argument("--workers", type=int, default=study.workers, help="local pool size")
  p.add_argument("--status", action="store_true", help="list the runs; run nothing")
  p.add_argument("--report", action="store_true",
                 help="report from the published runs; run nothing (no verdict on a partial study)")
  p.add_argument("--commit", action="store_true", help="git-commit each run as it is published")
  p.add_argument("--budget", type=int, metavar="STEPS",
                 help="measure shortened runs and print the projected budget; run nothing else")
  p.add_argument("--carry", choices=("save", "restore"),
                 help="carry unpublished runs' records to the next machine")
  p.add_argument("--carry_dir", help="where carried records go (default: <out>_carried)")
  p.add_argument("--allow_dirty", action="store_true",
                 help="run from a tree with uncommitted changes (provenance says so)")
  add_cluster_arguments(p)
  return p


CLUSTER_ARGUMENTS = (("slurm_partition", str), ("slurm_constraint", str), ("timeout_min", int),
                     ("cpus_per_task", int), ("mem_gb", int))


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
  for name, kind in CLUSTER_ARGUMENTS:
    p.add_argument(f"--{name}", type=kind, help="submitit/SLURM job parameter")


def cluster_args(args: argparse.Namespace) -> dict:
  """The submitit parameters the command line gives."""
  return {k: getattr(args, k) for k, _ in CLUSTER_ARGUMENTS if getattr(args, k) is not None}


def status(out: str, runs) -> str:
  lines = ["| run | published | machine |", "|---|---|---|"]
  for run in runs:
    mark = store.read_mark(out, run.name)
    lines.append(f"| {run.name} | {'yes' if mark else 'no'} | {mark.get('machine', '')} |")
  return "\n".join(lines)


def _commit(study, out: str, name: str, count: str) -> None:
  """Commits a just-published run, so that the next machine continues from it."""
  mark = store.read_mark(out, name)
  path = store.run_dir(out, name)
  store.git(study.root, "add", "--", path)
  message = (f"{study.name}: {name} published at {str(mark.get('commit'))[:7]} on "
             f"{mark.get('machine')} ({count}), committed as it finished")
  if store.git(study.root, "commit", "-q", "-m", message, "--", path) is None:
    _say(f"{name}: git commit failed; commit {path} by hand")


def run_study(study, declaration: str, args, out: str, prereg, arms, seeds) -> None:
  """Makes every missing run of `arms` x `seeds` (and the start) on the chosen engine."""
  runs = declaration_lib.runs_of(study, arms, seeds)
  pending = analysis.missing_runs(out, runs)
  start = study.work.has_start and not store.is_published(out, store.START)
  if args.commit:  # runs a stopped session published but did not get to commit
    for name in [store.START] + [r.name for r in runs]:
      if store.is_published(out, name) and store.git(study.root, "status", "--porcelain", "--",
                                                     store.run_dir(out, name)):
        _commit(study, out, name, "published by an earlier session")
  if not pending and not start:
    return
  check = getattr(study.work, "check", None)  # each arm's run, before anything is written
  for arm in (arms if check else ()):
    try:
      check(out, arm, study.arms[arm])
    except ConfigError as e:
      raise declaration_lib.StudyError(f"study {study.name}: arm {arm!r}: {e}") from None
  if not args.allow_dirty:
    store.refuse_dirty_tree(study.root, out, study.name)
  departed = verdicts.departures(study, prereg, arms, seeds)
  budget = prereg.raw.get("budget", {})
  _say(f"pre-registration {study.registration}: "
       + ("this study runs as registered" if not departed else
          "this study departs from it (" + "; ".join(departed) + "): exploratory")
       + (f"; registered budget about {budget['cpu_hours']} CPU-hours ({budget.get('basis')})"
          if "cpu_hours" in budget else ""))
  os.makedirs(os.path.join(out, "runs"), exist_ok=True)
  # Cluster jobs run elsewhere: this host is not their machine (each run's mark names its own).
  store.record_provenance(out, study.root, None if args.engine == "slurm" else "here")
  cluster = cluster_args(args)
  folder = os.path.join(out, "logs", "submitit")
  if start:
    _say("start: making the start every run shares")
    engines.run(args.engine, [(jobs.prepare_job, (declaration, out))], lambda _: None,
                workers=1, folder=folder, cluster_args=cluster)
    if args.commit:
      _commit(study, out, store.START, "the start every run shares")
  started, finished = time.time(), [len(runs) - len(pending)]

  def done(name: str) -> None:
    finished[0] += 1
    _say(f"{name}: published ({finished[0]}/{len(runs)} runs)")
    if args.commit:
      _commit(study, out, name, f"{finished[0]} of {len(runs)} runs")

  by_name = {r.name: r for r in runs}
  _say(f"{len(pending)} of {len(runs)} runs to train and evaluate on engine {args.engine}")
  try:
    engines.run(args.engine, [(jobs.run_job, (declaration, out, by_name[n].arm, by_name[n].seed))
                              for n in pending], done, workers=args.workers, folder=folder,
                cluster_args=cluster)
  finally:
    store.add_time(out, "runs", time.time() - started)


def _budget(study, declaration: str, args, prereg, arms, seeds) -> None:
  """Prints the projected budget from shortened runs in a scratch directory (then removed)."""
  with tempfile.TemporaryDirectory(prefix=f"{study.name}_budget_") as scratch:
    measured = budget.measure(study, os.path.abspath(declaration), scratch, arms, args.budget)
    start = budget.start_seconds(study, scratch)
  estimate = budget.projection(study, measured, args.budget, len(seeds), start)
  registered = prereg.raw.get("budget", {}).get("cpu_hours")
  _say(budget.line(estimate, args.workers)
       + (f"; the registration says about {registered} CPU-hours" if registered else ""))


def main(study, declaration: str, argv: Sequence[str] | None = None) -> None:
  """The study's command: run what is missing, then report; exit 2 on bad input."""
  args = parser(study).parse_args(argv)
  try:
    prereg = preregistration.load(study.path(study.registration))
    declaration_lib.check(study, prereg)
    arms = declaration_lib.subset(study, "arms", args.arms, list(study.arms))
    seeds = declaration_lib.subset(study, "seeds", args.seeds, list(study.seeds))
    out = os.path.abspath(args.out) if args.out else study.path(study.out)
    runs = declaration_lib.runs_of(study, arms, seeds)
    if args.status:
      print(status(out, runs))
      return
    if args.budget:
      _budget(study, declaration, args, prereg, arms, seeds)
      return
    if args.carry:
      carried = args.carry_dir or out.rstrip(os.sep) + "_carried"
      done = (carry.save(study, out, carried, runs) if args.carry == "save" else
              carry.restore(study, out, carried, runs))
      _say(f"carry {args.carry}: {done or 'nothing to carry'} ({carried})")
      if args.carry == "save":
        return
    if not args.report:
      run_study(study, os.path.abspath(declaration), args, out, prereg, arms, seeds)
    data = analysis.collect(study, out, runs)
    judged = verdicts.judged(study, prereg, data, out, arms, seeds)
    ks = sorted(int(m[5:]) for m in data["start"]["metrics"] if m.startswith("pass@"))
    table = report.publish(study, out, runs, arms, seeds, data, judged, ks, study.workers)
  except ConfigError as e:
    print(e, file=sys.stderr)
    sys.exit(2)
  _say(f"report: {os.path.join(out, 'README.md')}")
  print(table, flush=True)
