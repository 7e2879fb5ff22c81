"""What a study declares: its registration, its arms as overrides, its seeds, what a run is.

A declaration is a short Python file (experiments/tradeoff.py, experiments/toy_study.py) that
builds one `Study` and hands it to `ksjax.studies.cli.main`. Everything else (running, resuming,
publishing, pairing, judging, reporting) is the library's. `check` compares the declaration with
its registration before anything runs; a mismatch is one `StudyError` line.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ksjax.config_validation import ConfigError


class StudyError(ConfigError):
  """A declaration, registration or study directory the library cannot use: one line."""


class Work(Protocol):
  """What one run of a study is. Each method is resumable: called again after a stop, it does
  only what is missing. `run` is a `jobs.RunContext`."""
  kl_metric: str  # the records' metric that measures the distance to the start
  has_start: bool  # whether every run starts from one shared start that `prepare` makes

  def prepare(self, out: str, shortened: int | None = None) -> None:
    """Makes (or finishes) the shared start in <out>/runs/start and evaluates it as step 0."""

  def schedule(self, overrides: Mapping[str, Any]) -> tuple[int, int]:
    """(steps, checkpoints evaluated) of a run with these overrides."""

  def shortened(self, overrides: Mapping[str, Any], steps: int) -> dict[str, Any]:
    """The overrides of the same run cut to `steps` steps (the budget's measurement)."""

  def train(self, run) -> None:
    """Trains `run` into `run.dir` (resuming from its newest checkpoint)."""

  def evaluate(self, run) -> None:
    """Evaluates every checkpoint of `run` without a record yet."""

  def progress(self, run_dir: str) -> tuple[bool, bool]:
    """(a checkpoint is on disk, an evaluation record is on disk): where a kill can land."""

  def carried(self, run_dir: str) -> list[str]:
    """The run's evaluation records, relative to its directory: what `carry` saves."""

  def state_digest(self, run_dir: str, step: int) -> str:
    """A digest of the training state at `step`, equal between two runs that reached it alike."""

  def records(self, out: str, name: str) -> list[dict]:
    """The run's evaluation records, by step: {"step", "metrics", optionally "groups"}."""

  def start_record(self, out: str) -> dict | None:
    """The shared start's record (step 0 of every run), or None where each run has its own."""


@dataclasses.dataclass(frozen=True)
class Report:
  """How the report reads: its title, the setup paragraph, the table's columns and row labels,
  the figures' metrics, and the notes under the table and at the end."""
  title: str
  setup: str
  columns: Sequence[str]  # metrics at the last checkpoint, "level3/pass@1" for a group's
  label_columns: Sequence[str] = ("arm",)
  labels: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)  # arm -> cells
  start_label: Sequence[str] = ("start",)
  figure_metrics: Sequence[str] = ("pass@1",)
  figure_prefix: str = ""  # "PG": panel titles "PG: pass@1"
  ks_title: str = ""  # the pass@k-against-k panel's title
  table_note: str = ""
  files_note: str = ""


@dataclasses.dataclass(frozen=True)
class Study:
  """One study. `root` is the repository the paths are relative to (the declaration's)."""
  name: str
  root: str
  registration: str  # the pre-registration JSON, relative to root
  work: Work
  arms: Mapping[str, Mapping[str, Any]]  # arm -> its overrides of the work's run
  seeds: Sequence[int]
  out: str  # the output directory, relative to root
  command: str  # how a reader regenerates the report
  report: Report
  settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # as summary.json has them
  registered_fields: Sequence[str] = ()  # the settings the registration's design fixes
  prefix: str = ""  # before every run and arm key ("pg_": the trade-off study's algorithm)
  statement_fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  workers: int = 2
  # A statement "at matched KL": "all", at the KL every paired run reaches; "seed", at the KL
  # both runs of each seed reach (analysis.statement_values).
  kl_match: str = "all"

  def path(self, relative: str) -> str:
    return relative if os.path.isabs(relative) else os.path.join(self.root, relative)


@dataclasses.dataclass(frozen=True)
class Run:
  arm: str
  seed: int
  prefix: str = ""

  @property
  def name(self) -> str:
    return f"{self.prefix}{self.arm}_s{self.seed}"

  @property
  def key(self) -> str:
    return f"{self.prefix}{self.arm}"


def runs_of(study: Study, arms: Sequence[str], seeds: Sequence[int]) -> list[Run]:
  """Seed by seed (every arm of a seed before the next seed), so a stopped study has whole seeds
  and a seed's arms run close together, on one machine."""
  return [Run(arm, seed, study.prefix) for seed in seeds for arm in arms]


def check(study: Study, prereg) -> None:
  """A declaration that does not match its registration: one StudyError line."""
  missing = sorted(set(prereg.arms) - set(study.arms))
  if missing:
    raise StudyError(f"study {study.name}: the registration's arms {missing} are not declared; "
                     f"expected arms {sorted(prereg.arms)}")
  extra = sorted(set(study.arms) - set(prereg.arms))
  if extra:
    raise StudyError(f"study {study.name}: arms {extra} are not in the registration "
                     f"{study.registration}; expected arms from {sorted(prereg.arms)}")
  if study.kl_match not in ("all", "seed"):
    raise StudyError(f"study {study.name}: kl_match={study.kl_match!r}; expected 'all' (the KL "
                     "every paired run reaches) or 'seed' (the KL both runs of each seed reach)")
  for arm, overrides in study.arms.items():
    if not isinstance(overrides, Mapping):
      raise StudyError(f"study {study.name}: arm {arm!r} is {overrides!r}; expected a mapping of "
                       "config overrides")


def subset(study: Study, what: str, asked: str | None, allowed: Sequence[Any]) -> list[Any]:
  """--arms / --seeds: a comma-separated subset of the declared ones (a StudyError otherwise)."""
  if not asked:
    return list(allowed)
  cast = int if what == "seeds" else str
  try:
    chosen = [cast(x) for x in asked.split(",") if x]
  except ValueError:
    chosen = None
  if not chosen or any(x not in allowed for x in chosen):
    raise StudyError(f"study {study.name}: --{what}={asked!r}; expected a comma-separated subset "
                     f"of {list(allowed)}")
  return chosen


def load_module(path: str, prefix: str = "ksjax_study"):
  """Executes a Python file (a declaration, a configs/*.py) as a module of its own."""
  spec = importlib.util.spec_from_file_location(
      f"{prefix}_{os.path.splitext(os.path.basename(path))[0]}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load(path: str, attribute: str = "STUDY") -> Study:
  """The Study a declaration file defines (a worker process reads its study this way)."""
  study = getattr(load_module(path), attribute, None)
  if not isinstance(study, Study):
    raise StudyError(f"{path}: defines no {attribute} = Study(...); expected one")
  return study
