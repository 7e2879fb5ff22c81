"""Where a study's runs go: a local pool of worker processes, or a cluster through submitit.

The runs of a study are independent, so an engine only has to run `jobs.run_job` for each of
them and say when each finishes. Two engines, one interface (`run(jobs, on_done)`):

  local      concurrent.futures' process pool on this machine (the default): `workers` processes,
             each started fresh (spawn: JAX does not survive a fork), one compute thread each.
  submitit   submitit's executors (https://github.com/facebookincubator/submitit): "slurm" submits
             every run as a SLURM job from the login node; "submitit-local" runs each job as a
             local subprocess and "submitit-debug" in this process, the same code path without
             a cluster (the test suite runs both). submitit pickles the job function and its
             arguments into its own folder (<out>/logs/submitit); the study's records are the
             JSON the jobs write, the same whichever engine ran them.

submitit over Ray: it is pure Python with no runtime of its own, and SLURM is what most academic
clusters run; Ray would bring its own scheduler and processes to every machine.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
from collections.abc import Callable, Sequence
from typing import Any

from ksjax.studies.declaration import StudyError

ENGINES = ("local", "slurm", "submitit-local", "submitit-debug")
Job = tuple[Callable[..., Any], tuple[Any, ...]]


def _one_thread() -> None:
  """A pool worker's XLA:CPU uses one compute thread: the workers share the cores."""
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen="
                             "false intra_op_parallelism_threads=1").strip()


def run(engine: str, jobs: Sequence[Job], on_done: Callable[[Any], None], *, workers: int,
        folder: str, cluster_args: dict[str, Any] | None = None) -> None:
  """Runs every job, calling on_done(result) in this process as each finishes; a failed job is
  reported once all have stopped (a RuntimeError naming how many failed)."""
  if engine not in ENGINES:
    raise StudyError(f"--engine={engine!r}; expected one of {ENGINES}")
  if not jobs:
    return
  if engine == "local":
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context,
                                                initializer=_one_thread) as pool:
      futures = [pool.submit(fn, *args) for fn, args in jobs]
      _finish(concurrent.futures.as_completed(futures), on_done, len(jobs))
  else:
    import submitit  # pylint: disable=g-import-not-at-top
    cluster = {"slurm": "slurm", "submitit-local": "local", "submitit-debug": "debug"}[engine]
    executor = submitit.AutoExecutor(folder=folder, cluster=cluster)
    executor.update_parameters(**(cluster_args or {}))
    submitted = [executor.submit(fn, *args) for fn, args in jobs]
    # SLURM's accounting is asked every 30 s (submitit's own default is 10); a local job's
    # state is a file, read every half second.
    poll = 30.0 if engine == "slurm" else 0.5
    _finish(submitit.helpers.as_completed(submitted, poll_frequency=poll), on_done, len(jobs))


def _finish(finished, on_done: Callable[[Any], None], count: int) -> None:
  """on_done(result) for each job as it finishes (a future or a submitit job: `.result()`);
  then one RuntimeError for the failed ones."""
  failures = []
  for job in finished:
    try:
      on_done(job.result())
    except Exception as e:  # pylint: disable=broad-except
      failures.append(e)
  if failures:
    first = str(failures[0]).splitlines()[0] if str(failures[0]) else repr(failures[0])
    raise RuntimeError(f"{len(failures)} of {count} job(s) failed (first: {first}); run the same "
                       "command again to resume")
