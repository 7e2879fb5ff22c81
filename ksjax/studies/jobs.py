"""One run of a study, as an engine's job: train, evaluate every checkpoint, publish.

`run_job(declaration, out, arm, seed)` is what every engine calls, in whatever process or
machine it runs on: it reads the study from its declaration file (so a worker needs nothing but
the repository), skips a published run, and otherwise resumes the run where it stopped (the
work's train and evaluate each do only what is missing), then publishes it with its provenance.
The start every run shares is `prepare_job`.

Fault injection, for the tests that kill a study anywhere and resume it: with
KSJAX_STUDY_KILL=<phase> the process kills itself with SIGKILL, as a stopped machine would:
"train" once a run's first checkpoint is on disk, "eval" once its first evaluation record is,
"publish" after a run's evaluations and before its mark, "report" between summary.json and
README.md.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ksjax import machine
from ksjax.studies import declaration as declaration_lib
from ksjax.studies import store

KILL_ENV = "KSJAX_STUDY_KILL"
TOUCHED = "machines.json"  # in a run's directory: every machine that worked on it, in order


@dataclasses.dataclass(frozen=True)
class RunContext:
  """What the work needs to know of one run."""
  out: str
  name: str
  arm: str
  seed: int
  overrides: Mapping[str, Any]

  @property
  def dir(self) -> str:
    return store.run_dir(self.out, self.name)


def maybe_stop(phase: str, when: Callable[[], bool] | None = None) -> None:
  """SIGKILL this process in `phase` (KILL_ENV), at once or as soon as `when()` holds."""
  if os.environ.get(KILL_ENV) != phase:
    return
  kill = lambda: os.kill(os.getpid(), signal.SIGKILL)
  if when is None:
    kill()

  def watch():
    while not when():
      time.sleep(0.02)
    kill()
  threading.Thread(target=watch, daemon=True).start()


def touch(run_dir: str) -> list[str]:
  """Adds this machine to the run's TOUCHED list (a run resumed on another machine has both) and
  returns the list: the run's mark names every machine, and a seed pairs only runs that touched
  one and the same (analysis.paired_seeds)."""
  path = os.path.join(run_dir, TOUCHED)
  touched = store.read_json(path, [])
  if machine.describe() not in touched:
    touched = [*touched, machine.describe()]
    os.makedirs(run_dir, exist_ok=True)
    store.write_json(path, touched)
  return touched


def prepare_job(declaration: str, out: str, shortened: int | None = None) -> None:
  """Makes the start every run shares, where the work has one, and marks it done (`shortened`:
  a few steps of it, for the budget)."""
  study = declaration_lib.load(declaration)
  if not study.work.has_start or store.is_published(out, store.START):
    return
  started = time.time()
  study.work.prepare(out, shortened)
  store.add_time(out, "start", time.time() - started)
  store.publish(out, store.START, {"seconds": time.time() - started})


def run_job(declaration: str, out: str, arm: str, seed: int, shortened: int | None = None
            ) -> str:
  """Trains, evaluates and publishes one run; returns its name. A published run is left as it
  is. `shortened`: the run cut to that many steps (`budget`), never in a study's directory."""
  study = declaration_lib.load(declaration)
  run = declaration_lib.Run(arm, seed, study.prefix)
  if store.is_published(out, run.name):
    return run.name
  overrides = study.arms[arm]
  if shortened:
    overrides = study.work.shortened(overrides, shortened)
  context = RunContext(out, run.name, arm, seed, overrides)
  touched = touch(context.dir)
  cpu, started = store.cpu_seconds(), time.time()
  maybe_stop("train", lambda: study.work.progress(context.dir)[0])
  study.work.train(context)
  trained = time.time()
  maybe_stop("eval", lambda: study.work.progress(context.dir)[1])
  study.work.evaluate(context)
  done = time.time()
  maybe_stop("publish")
  store.publish(out, run.name, {**store.here(study.root), "machines": touched,
                                "arm": arm, "seed": seed,
                                "cpu_seconds": store.cpu_seconds() - cpu,
                                "train_seconds": trained - started, "eval_seconds": done - trained})
  return run.name
