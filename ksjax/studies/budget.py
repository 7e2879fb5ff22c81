"""A study's budget, measured before it starts: shortened runs of its own arms, projected.

Each arm's seed-0 run is made with the work's own code at this commit on this machine, shortened
to a few steps and checkpoints (`work.shortened`), into a scratch directory that is never
published; its mark's CPU and wall seconds are then scaled to the declared run (`work.schedule`:
training time with the steps, evaluation time with the checkpoints) and to every seed. A shared
start is made whole (the runs' cost depends on it) and counted once. The projection is an
estimate on this machine: another CPU, another budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ksjax.studies import jobs
from ksjax.studies import store


def measure(study, declaration: str, scratch: str, arms: Sequence[str], steps: int) -> dict:
  """Runs each arm shortened to `steps` steps in `scratch` (this process); their marks."""
  if study.work.has_start:
    jobs.prepare_job(declaration, scratch, shortened=steps)
  names = [jobs.run_job(declaration, scratch, arm, study.seeds[0], shortened=steps)
           for arm in arms]
  return {arm: store.read_mark(scratch, name) for arm, name in zip(arms, names)}


def start_seconds(study, scratch: str) -> float:
  """The shared start's seconds, as `measure` made it in `scratch` (0 without a start)."""
  if not study.work.has_start:
    return 0.0
  return float(store.read_mark(scratch, store.START).get("seconds", 0.0))


def projection(study, measured: dict[str, dict], steps: int, seeds: int,
               start: float = 0.0) -> dict[str, Any]:
  """Scales each arm's measured seconds to its declared schedule and to `seeds` seeds, plus the
  shared start's `start` seconds once."""
  arms, cpu = {}, start
  for arm, mark in measured.items():
    full_steps, full_checkpoints = study.work.schedule(study.arms[arm])
    _, short_checkpoints = study.work.schedule(study.work.shortened(study.arms[arm], steps))
    train = mark["train_seconds"] * full_steps / steps
    evaluate = mark["eval_seconds"] * full_checkpoints / short_checkpoints
    share = mark["cpu_seconds"] / max(mark["train_seconds"] + mark["eval_seconds"], 1e-9)
    arms[arm] = {"wall_seconds_per_run": train + evaluate,
                 "cpu_seconds_per_run": (train + evaluate) * share}
    cpu += arms[arm]["cpu_seconds_per_run"] * seeds
  return {"arms": arms, "seeds": seeds, "cpu_hours": cpu / 3600, "measured_steps": steps,
          "start_seconds": start}


def line(estimate: dict[str, Any], workers: int) -> str:
  return (f"budget: about {estimate['cpu_hours']:.2f} CPU-hours for {len(estimate['arms'])} arms "
          f"x {estimate['seeds']} seeds (measured on {estimate['measured_steps']}-step runs here;"
          f" about {estimate['cpu_hours'] / max(workers, 1) * 60:.1f} min of wall time on "
          f"{workers} workers"
          + (f"; the shared start, made whole and counted once: {estimate['start_seconds']:.0f} s"
             if estimate.get("start_seconds") else "") + ")")

