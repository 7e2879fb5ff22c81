"""From published runs to per-seed values: curves, pairing within a machine, the statements' data.

Pure functions of the records (and the runs' marks), so that a report is regenerated from what
is committed and nothing else. Pairing: the arms of a seed share its start, data order and
sampling seed, and must share a machine (XLA:CPU's numbers depend on the CPU); a statement uses
a seed only where both of its runs were published from one and the same machine, and the report
names every seed left out and why.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ksjax.studies import store
from ksjax.studies.declaration import Run, StudyError


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


def run_curve(records: Sequence[Mapping[str, Any]], start: Mapping[str, Any] | None,
              kl_metric: str) -> dict[str, Any]:
  """{"steps", "kl", "metrics": {name: [...]}}: the start (the shared one, else the run's own
  step 0) then every checkpoint by step. A group's metric is "<group without '='>/<metric>"
  ("level3/pass@1" for the eval binary's group "level=3"); the KL at the start is 0."""
  ordered = sorted(records, key=lambda r: r["step"])
  if start is not None:
    ordered = [start] + [r for r in ordered if r["step"] != 0]
  first = ordered[0]
  groups = {g.replace("=", ""): g for g in first.get("groups", {})}
  names = [m for m in first["metrics"] if m != kl_metric and not m.startswith("kl_")] + [
      f"{g}/{m}" for g, full in groups.items() for m in first["groups"][full]
      if m != "num_problems"]

  def value(record, name):
    if "/" in name:
      group, metric = name.split("/")
      return record["groups"][groups[group]][metric]
    return record["metrics"][name]

  return {"steps": [r["step"] for r in ordered],
          "kl": [0.0 if r is start or r["step"] == 0 else r["metrics"][kl_metric]
                 for r in ordered],
          "metrics": {name: [value(r, name) for r in ordered] for name in names}}


def missing_runs(out: str, runs: Sequence[Run]) -> list[str]:
  return [r.name for r in runs if not store.is_published(out, r.name)]


def collect(study, out: str, runs: Sequence[Run]) -> dict[str, Any]:
  """Every run's curve, final values and machine, by arm key in seed order. Refuses (StudyError)
  while any run is unpublished: a verdict on part of a study is not the registered one."""
  missing = missing_runs(out, runs)
  if missing:
    raise StudyError(
        f"study {study.name}: {len(missing)} of {len(runs)} registered runs are not published "
        f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); expected every run "
        "published before a verdict: run the study again to finish them (--status lists them)")
  start = study.work.start_record(out)
  provenance = store.read_json(os.path.join(out, "provenance.json"), {})
  curves: dict[str, list[dict]] = {}
  final: dict[str, dict[str, list[float]]] = {}
  machines: dict[str, list[str | None]] = {}
  seeds: dict[str, list[int]] = {}
  for run in runs:
    curve = run_curve(study.work.records(out, run.name), start, study.work.kl_metric)
    curves.setdefault(run.key, []).append(curve)
    values = final.setdefault(run.key, {})
    for name, series in curve["metrics"].items():
      values.setdefault(name, []).append(series[-1])
    values.setdefault("kl", []).append(curve["kl"][-1])
    # Every machine the run touched where its mark lists them (a run resumed elsewhere); else
    # its one machine; runs published before marks carried the machine: the study's own.
    machines.setdefault(run.key, []).append(
        mark_machines(store.read_mark(out, run.name), provenance.get("machine")))
    seeds.setdefault(run.key, []).append(run.seed)
  if start is None:  # no shared start: the first run's own step 0 stands for it
    start = study.work.records(out, runs[0].name)[0]
  return {"start": start, "curves": curves, "final": final, "machines": machines, "seeds": seeds}


def machines_of(entry) -> set:
  """A run's machines: every machine it touched (a list), its one machine (a string), or none
  recorded (None)."""
  if entry is None:
    return set()
  return set(entry) if isinstance(entry, (list, tuple)) else {entry}


def mark_machines(mark: Mapping[str, Any], default: str | None = None):
  """What a run's mark says of its machines: every one it touched and the one that published it
  where it lists them, else the one that published it (`default` for marks from before marks
  named it)."""
  if not mark.get("machines"):
    return mark.get("machine", default)
  return sorted(set(mark["machines"]) | ({mark["machine"]} if mark.get("machine") else set()))


def one_machine(a, b) -> bool:
  """Whether two runs (their machines, as `machines_of` reads them) touched one and the same
  machine and no other."""
  return bool(machines_of(a)) and machines_of(a) == machines_of(b) and len(machines_of(a)) == 1


def named(entry) -> str:
  return "; ".join(sorted(entry)) if isinstance(entry, (list, tuple)) else str(entry)


def paired_seeds(data: Mapping[str, Any], a: str, b: str, seeds: Sequence[int]
                 ) -> tuple[list[int], dict[int, str]]:
  """The seeds both arm keys ran on one and the same machine, every machine each run touched
  included, and {seed: why} for those left out."""
  where = {arm: dict(zip(data["seeds"][arm], data["machines"][arm])) for arm in (a, b)}
  used, left_out = [], {}
  for seed in seeds:
    if seed not in where[a] or seed not in where[b]:
      left_out[seed] = "not run by both arms"
    elif not one_machine(where[a][seed], where[b][seed]):
      left_out[seed] = f"{a} ran on {named(where[a][seed])}, {b} on {named(where[b][seed])}"
    else:
      used.append(seed)
  return used, left_out


def statement_values(prereg, data: Mapping[str, Any], prefix: str = "", kl_match: str = "all"
                     ) -> tuple[dict[str, tuple[list[float], list[float]]], dict[str, dict]]:
  """({statement id: (a's values, b's values)} over its paired seeds in order, {id: left out}).

  "last": the metric at the last checkpoint (every arm runs the same steps: matched steps).
  "kl": the metric at a held-out KL to the start, read off each run's measured curve by
  interpolating: with kl_match "all" the KL every paired run of both arms reaches (the smallest
  of their final KLs), one for every seed; with "seed" the KL both runs of each seed reach (the
  smaller of the two final KLs), so a seed whose runs both move far is compared far out."""
  out, left = {}, {}
  for statement in prereg.statements:
    a, b = (f"{prefix}{arm}" for arm in (statement.a, statement.b))
    if a not in data["final"] or b not in data["final"]:
      continue
    seeds, left_out = paired_seeds(data, a, b, prereg.statement_seeds(statement))
    if left_out:
      left[statement.id] = left_out
    index = {arm: [data["seeds"][arm].index(s) for s in seeds] for arm in (a, b)}
    if statement.at == "last":
      if statement.metric not in data["final"][a]:
        continue
      out[statement.id] = tuple([data["final"][arm][statement.metric][i] for i in index[arm]]
                                for arm in (a, b))
    else:
      runs = {arm: [data["curves"][arm][i] for i in index[arm]] for arm in (a, b)}
      if kl_match == "seed":
        targets = [min(ca["kl"][-1], cb["kl"][-1]) for ca, cb in zip(runs[a], runs[b])]
      else:
        targets = [min(c["kl"][-1] for arm in runs.values() for c in arm)] * len(seeds)
      out[statement.id] = tuple(
          [at_kl(c["kl"], c["metrics"][statement.metric], t) for c, t in zip(runs[arm], targets)]
          for arm in (a, b))
  return out, left
