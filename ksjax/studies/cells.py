"""A map of cells: one paired comparison (arm a minus arm b) in each of several settings.

A `Map` declares a study whose design is a list of cells, each a setting of the factors (its
overrides of both arms' runs) where the same two arms are compared, paired by seed. It expands to
an ordinary `Study` (`study(map)`: arms "<cell>__<arm>", so the registration, the run store,
publication, resume and the engines are the library's own), and adds what a map needs:

  order      runs go cell by cell in the declared order (a stopped map has whole cells, the
             first ones first), and within a cell seed by seed (a seed's two runs together);
  mirror     `--mirror=DIR`: a runner working in a clone of the repository (at the map's
             fixed commit) copies each published run's small files (records, logs, marks;
             never checkpoints) into DIR, the main checkout's copy of the output directory, and
             with `--commit` commits only those paths in DIR's repository, so that results
             reach the main history while the runner keeps going (with one worker each run as
             it finishes, with more each pair); runs already in DIR are copied back into the
             clone first and never run again;
  report     `maps.publish`: per cell and checkpoint the paired gap with its interval, heat maps
             and small multiples, exploratory and without a verdict, from whatever cells are
             published (a cell short of its seeds says so and is not read).

`main(map, declaration, argv)` is the command: `python <declaration>.py [--mirror=DIR --commit]
[--report] [--status] [--workers=N]`; `--budget`, `--status` and `--carry` are the library's
(`cli.main`) on the expanded study.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ksjax import files
from ksjax.config_validation import ConfigError
from ksjax.evaluation import preregistration
from ksjax.studies import cli
from ksjax.studies import declaration as declaration_lib
from ksjax.studies import store

SEP = "__"  # between a cell's name and an arm's: "k8__pass_at_k"
# What a mirror never copies, of a run's directory: its checkpoints, its final and starting
# policies, event files and tokenizer (rebuilt by training again). The shared start's policy
# (<out>/runs/start/start, every run's init) is the exception: a checkout that has it can train
# any missing run from the same start.
NOT_MIRRORED = ("checkpoints", "final", "start", "tensorboard", "tokenizer")
# Files a mirror copies gzipped (<name>.gz, byte for byte the same for the same file): a run's
# step log is about 1.8 kB a step, 3.7 MB for 2,000 steps, a tenth of that compressed.
COMPRESSED = ("metrics.jsonl",)


@dataclasses.dataclass(frozen=True)
class Cell:
  """One setting of the factors. `factor` names the factor this cell moves away from the
  centre ("centre" for the centre itself), `value` its value there, as the report labels it;
  `metrics` maps a gap's label ("pass@k") to the record's metric in this cell ("pass@8")."""
  name: str
  factor: str
  value: str
  overrides: Mapping[str, Any]
  metrics: Mapping[str, str]
  rank: float = 0.0  # where the cell sits on its factor's axis in the small multiples


@dataclasses.dataclass(frozen=True)
class Map:
  """A map: `a` minus `b` (arm names of `arms`) in every cell, over `seeds`."""
  name: str
  root: str
  registration: str
  work: Any  # a declaration.Work
  arms: Mapping[str, Mapping[str, Any]]  # the two arms' overrides, under every cell's
  a: str
  b: str
  cells: Sequence[Cell]  # in the order they run
  seeds: Sequence[int]
  out: str
  command: str
  title: str
  setup: str
  centre: str = "centre"  # the cell every other cell is compared with in the small multiples
  centre_at: Mapping[str, tuple[str, float]] = dataclasses.field(
      default_factory=dict)  # factor -> the centre's value and rank on its axis
  workers: int = 1
  # Per-step training logs for the gap along training, by run directory: {step: {metric: v}}.
  log: Callable[[str], Mapping[int, Mapping[str, float]]] | None = None
  log_metrics: Sequence[str] = ()
  log_steps: Sequence[int] = ()
  notes: str = ""

  def path(self, relative: str) -> str:
    return relative if os.path.isabs(relative) else os.path.join(self.root, relative)

  def arm(self, cell: Cell, arm: str) -> str:
    return f"{cell.name}{SEP}{arm}"


def study(m: Map) -> declaration_lib.Study:
  """The map as an ordinary study: one arm per cell and arm, the cell's overrides over the
  arm's."""
  names = [c.name for c in m.cells]
  if len(set(names)) != len(names) or any(SEP in n for n in names):
    raise declaration_lib.StudyError(f"map {m.name}: cell names {names}; expected distinct names "
                                     f"without {SEP!r}")
  if {m.a, m.b} != set(m.arms):
    raise declaration_lib.StudyError(f"map {m.name}: compares {m.a!r} with {m.b!r}; expected the "
                                     f"two declared arms {sorted(m.arms)}")
  arms = {m.arm(c, arm): {**overrides, **c.overrides} for c in m.cells
          for arm, overrides in m.arms.items()}
  return declaration_lib.Study(
      name=m.name, root=m.root, registration=m.registration, work=m.work, arms=arms,
      seeds=tuple(m.seeds), out=m.out, command=m.command, workers=m.workers,
      report=declaration_lib.Report(title=m.title, setup=m.setup, columns=()))


def pairs(m: Map) -> list[tuple[Cell, int]]:
  """(cell, seed) in the order they run: cell by cell, then seed by seed."""
  return [(c, s) for c in m.cells for s in m.seeds]


OUT_PLACEHOLDER = "<out>"


def _copy_naming_no_path(path: str, to: str, out: str) -> None:
  """A JSON record with the runner's output directory (absolute: the eval binary records the
  checkpoint it read and the KL reference) written as OUT_PLACEHOLDER, so that a mirrored record
  names no path of the machine that made it."""
  with open(path, encoding="utf-8") as f:
    text = f.read()
  files.write_text(to, text.replace(json.dumps(os.path.abspath(out))[1:-1], OUT_PLACEHOLDER))


def _copy_run(source: str, target: str, keep: Sequence[str] = (), out: str = "") -> None:
  """A run directory's files but NOT_MIRRORED (less `keep`) at its top, the mark last (so a
  copy cut short is not published); JSON records name `out` as OUT_PLACEHOLDER."""
  mark = None
  for dirpath, dirnames, filenames in os.walk(source):
    if dirpath == source:
      dirnames[:] = sorted(d for d in dirnames if d not in NOT_MIRRORED or d in keep)
    for name in sorted(filenames):
      path = os.path.join(dirpath, name)
      if name == store.MARK and dirpath == source:
        mark = path
        continue
      to = os.path.join(target, os.path.relpath(path, source))
      os.makedirs(os.path.dirname(to), exist_ok=True)
      if name in COMPRESSED:
        with open(path, "rb") as f, open(to + ".gz", "wb") as raw, gzip.GzipFile(
            fileobj=raw, mode="wb", filename="", mtime=0) as packed:
          shutil.copyfileobj(f, packed)
      elif name.endswith(".json") and out:
        _copy_naming_no_path(path, to, out)
      else:
        shutil.copy2(path, to)
  if mark:
    shutil.copy2(mark, os.path.join(target, store.MARK))


def mirror(out: str, into: str, names: Sequence[str]) -> list[str]:
  """Copies each published run of `names` (and the start, and the study's provenance and
  timing) from `out` to `into` where `into` lacks it; the paths written."""
  written = []
  for name in names:
    if store.is_published(out, name) and not store.is_published(into, name):
      shutil.rmtree(store.run_dir(into, name), ignore_errors=True)
      _copy_run(store.run_dir(out, name), store.run_dir(into, name),
                keep=("start",) if name == store.START else (), out=out)
      written.append(store.run_dir(into, name))
  for name in ("provenance.json", "timing.json"):
    if os.path.exists(os.path.join(out, name)):
      os.makedirs(into, exist_ok=True)
      shutil.copy2(os.path.join(out, name), os.path.join(into, name))
      written.append(os.path.join(into, name))
  return written


def commit(into: str, paths: Sequence[str], message: str) -> bool:
  """Commits exactly `paths` in the repository that holds `into` (whatever else is staged
  there), retrying while another process holds the index; False when git refused (a path that
  .gitignore excludes is named)."""
  repo = store.git(into, "rev-parse", "--show-toplevel")
  if not repo or not paths:
    return False
  ignored = [p for p in paths if store.git(repo, "check-ignore", "-q", p) is not None]
  if ignored:
    _say(f"{', '.join(ignored)}: ignored by a .gitignore of {repo}; expected an exception there "
         "(!/<dir>/runs/) for the records to be committed")
    return False
  for _ in range(20):
    if store.git(repo, "add", "--all", "--", *paths) is not None and store.git(
        repo, "commit", "-q", "-m", message, "--", *paths) is not None:
      return True
    if not os.path.exists(os.path.join(repo, ".git", "index.lock")):
      # nothing to commit (the paths are committed already) is not a failure
      return not store.git(repo, "status", "--porcelain", "--", *paths)
    time.sleep(3)
  return False


def _say(message: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def _parser(m: Map) -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog=m.command, description=f"The {m.name} map (exploratory).")
  p.add_argument("--out", help=f"output directory (default: {m.out})")
  p.add_argument("--mirror", help="the main checkout's output directory: each published run "
                 "is copied there (and committed there with --commit); its runs are not rerun")
  p.add_argument("--commit", action="store_true", help="git-commit each mirrored run")
  p.add_argument("--cells", help="a comma-separated subset of the cells (in declared order)")
  p.add_argument("--workers", type=int, default=m.workers)
  p.add_argument("--engine", default="local")
  p.add_argument("--report", action="store_true", help="the report only; run nothing")
  p.add_argument("--allow_dirty", action="store_true")
  return p


def main(m: Map, declaration: str, argv: Sequence[str] | None = None) -> None:
  """The map's command (module docstring)."""
  from ksjax.studies import maps  # pylint: disable=g-import-not-at-top
  argv = list(sys.argv[1:] if argv is None else argv)
  s = study(m)
  if any(a.split("=")[0] in ("--budget", "--status", "--carry") for a in argv):
    cli.main(s, declaration, argv)  # the library's own, on the expanded study
    return
  args = _parser(m).parse_args(argv)
  try:
    prereg = preregistration.load(s.path(s.registration))
    declaration_lib.check(s, prereg)
    out = os.path.abspath(args.out) if args.out else s.path(s.out)
    cells = declaration_lib.subset(s, "cells", args.cells, [c.name for c in m.cells])
    mirror_dir = os.path.abspath(args.mirror) if args.mirror else None
    if not args.report:
      _run(m, s, os.path.abspath(declaration), args, out, prereg, cells, mirror_dir)
    table = maps.publish(m, out)
    if mirror_dir and not args.report:
      _report(m, mirror_dir, args.commit, "the runner's end")
  except ConfigError as e:
    print(e, file=sys.stderr)
    sys.exit(2)
  _say(f"report: {os.path.join(out, 'README.md')}")
  print(table, flush=True)


def _run(m: Map, s, declaration: str, args, out: str, prereg, cells: Sequence[str],
         mirror_dir: str | None) -> None:
  names = [store.START] + [r.name for r in declaration_lib.runs_of(s, list(s.arms), s.seeds)]
  if mirror_dir:  # what the main checkout has is never run again here
    mirror(mirror_dir, out, names)
  # The library's own flags, with its defaults, for its runner (the mirror commits, not it).
  run_args = cli.parser(s).parse_args(["--engine", args.engine, "--workers", str(args.workers)]
                                      + (["--allow_dirty"] if args.allow_dirty else []))
  for cell, seed in pairs(m):
    if cell.name not in cells:
      continue
    arms = [m.arm(cell, arm) for arm in (m.b, m.a)]
    # One worker: each run on its own, mirrored and committed as it finishes; more: the pair.
    for batch in ([[a] for a in arms] if args.workers == 1 else [arms]):
      cli.run_study(s, declaration, run_args, out, prereg, batch, [seed])
      if mirror_dir:
        _mirror_and_commit(m, out, mirror_dir, names, args.commit)
    if mirror_dir and seed == m.seeds[-1]:  # a cell is whole: the report says so at once
      _report(m, mirror_dir, args.commit, f"cell {cell.name} is whole")


def _mirror_and_commit(m: Map, out: str, into: str, names: Sequence[str], commit_it: bool
                       ) -> None:
  """Mirrors what is newly published, then commits every published run of the mirror that is
  not committed yet (a commit refused earlier is made now)."""
  mirror(out, into, names)
  if not commit_it:
    return
  paths = [store.run_dir(into, n) for n in names if store.is_published(into, n)] + [
      p for p in (os.path.join(into, "provenance.json"), os.path.join(into, "timing.json"))
      if os.path.exists(p)]
  pending = [p for p in paths if store.git(into, "status", "--porcelain", "--ignored",
                                           "--untracked-files=all", "--", p)]
  runs = [os.path.basename(p) for p in pending if os.path.dirname(p).endswith("runs")]
  if not runs:
    return
  mark = store.read_mark(into, runs[-1])
  done = sum(store.is_published(into, n) for n in names[1:])
  message = (f"{m.name} (#65): {', '.join(runs)} published at {str(mark.get('commit'))[:7]} "
             f"on {mark.get('machine')} ({done} of {len(names) - 1} runs), committed as it "
             "finished")
  if not commit(into, pending, message):
    _say(f"git commit in {into} failed; the next run's commit retries {', '.join(runs)}")


def _report(m: Map, into: str, commit_it: bool, why: str) -> None:
  from ksjax.studies import maps  # pylint: disable=g-import-not-at-top
  maps.publish(m, into)
  if commit_it:
    commit(into, [os.path.join(into, f) for f in maps.REPORT_FILES],
           f"{m.name} (#65): the report regenerated from the runs published so far ({why})")
