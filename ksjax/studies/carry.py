"""Carries a study's unpublished runs from a machine that is going to the next one.

A session's machine may go with the run it was in; its checkpoints are too large to commit, but
its evaluation records are small and took most of the run's time. `save` copies the records of
every unpublished run that has any into a carry directory (to be committed), with carried.json:
the commit and machine they were made at and a digest of each evaluated checkpoint's training
state (`work.state_digest`). `restore`, on the next machine, takes a run's records back only
where this is the same commit and machine description, and the run trained again here (the
work's own train) reaches the very same states at those steps: the records then describe these
checkpoints. Otherwise it says why and the run is evaluated afresh. Every outcome is appended to
<carry>/restores.jsonl, which outlives the carried files.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence

from ksjax import files
from ksjax.studies import jobs
from ksjax.studies import store

CARRIED = "carried.json"
RESTORES = "restores.jsonl"


def save(study, out: str, carry: str, runs: Sequence) -> list[str]:
  """Copies every unpublished run's evaluation records into `carry`; the runs' names."""
  saved = []
  for run in runs:
    directory = store.run_dir(out, run.name)
    records = study.work.carried(directory)
    if store.is_published(out, run.name) or not records:
      continue
    target = os.path.join(carry, run.name)
    shutil.rmtree(target, ignore_errors=True)
    for relative in records:
      os.makedirs(os.path.dirname(os.path.join(target, relative)), exist_ok=True)
      shutil.copy2(os.path.join(directory, relative), os.path.join(target, relative))
    steps = sorted(r["step"] for r in study.work.records(out, run.name))
    store.write_json(os.path.join(target, CARRIED), {
        **store.here(study.root), "records": records,
        "digests": {str(s): study.work.state_digest(directory, s) for s in steps}})
    saved.append(run.name)
  return saved


def restore(study, out: str, carry: str, runs: Sequence) -> dict[str, str]:
  """Trains each carried, unpublished run again and takes its records back where the states
  match; {run: outcome}, each also appended to <carry>/restores.jsonl."""
  outcomes = {}
  now = store.here(study.root)
  for run in runs:
    info = store.read_json(os.path.join(carry, run.name, CARRIED))
    if info is None or store.is_published(out, run.name):
      continue
    if (info["machine"], info["commit"]) != (now["machine"], now["commit"]):
      outcome = (f"carried from {info['machine']!r} at {str(info['commit'])[:7]}, this is "
                 f"{now['machine']!r} at {str(now['commit'])[:7]}: evaluated afresh")
    else:
      context = jobs.RunContext(out, run.name, run.arm, run.seed, study.arms[run.arm])
      study.work.train(context)
      differ = [s for s, digest in info["digests"].items()
                if study.work.state_digest(context.dir, int(s)) != digest]
      if differ:
        outcome = f"trained again, the state differs at steps {differ}: evaluated afresh"
      else:
        for relative in info["records"]:
          target = os.path.join(context.dir, relative)
          if not os.path.exists(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(os.path.join(carry, run.name, relative), target)
        outcome = (f"trained again with the same state at steps {sorted(map(int, info['digests']))}"
                   f": {len(info['records'])} records restored")
    outcomes[run.name] = outcome
    line = json.dumps({"run": run.name, "outcome": outcome, **now, "carried": info})
    path = os.path.join(carry, RESTORES)
    previous = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
    files.write_text(path, previous + line + "\n")
  return outcomes
