"""The study directory: where each run lives, when it is published, and what it came from.

  <out>/runs/<run>/                  the run's own directory (trainer, checkpoints, evaluations)
  <out>/runs/<run>/study_done.json   its publication mark, written last and atomically: present,
                                     the run is published and is never run or written again
  <out>/runs/start/                  the shared start, where the study has one
  <out>/provenance.json              the commit and machine the study's runs came from
  <out>/timing.json                  wall time per phase, added to by every session that runs

A run's mark holds its provenance: the commit, the machine (XLA:CPU's numbers depend on the CPU,
so runs are paired only within a machine), the CPU seconds and the wall time of each phase.
Everything here is JSON: data, never code.
"""

from __future__ import annotations

import json
import os
import resource
from typing import Any

from ksjax import files
from ksjax import machine
from ksjax.evaluation.preregistration import git
from ksjax.studies.declaration import StudyError

MARK = "study_done.json"
START = "start"


def run_dir(out: str, name: str) -> str:
  return os.path.join(out, "runs", name)


def mark_path(out: str, name: str) -> str:
  return os.path.join(run_dir(out, name), MARK)


def is_published(out: str, name: str) -> bool:
  return os.path.exists(mark_path(out, name))


def read_json(path: str, default: Any = None) -> Any:
  if not os.path.exists(path):
    return default
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def write_json(path: str, data: Any) -> None:
  """The studies' JSON format: indent 1, sorted keys, atomic."""
  files.write_text(path, json.dumps(data, indent=1, sort_keys=True))


def read_mark(out: str, name: str) -> dict:
  return read_json(mark_path(out, name), {})


def publish(out: str, name: str, mark: dict[str, Any]) -> None:
  """Publishes a run: its mark, atomically. A published run is never overwritten (StudyError)."""
  path = mark_path(out, name)
  if os.path.exists(path):
    raise StudyError(f"run {name} is already published ({path}); a published run is never "
                     "overwritten: delete its directory to run it again")
  write_json(path, mark)


def cpu_seconds() -> float:
  """CPU time of this process and its finished children (user + system)."""
  own, children = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                    resource.RUSAGE_CHILDREN))
  return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def here(root: str) -> dict[str, Any]:
  """The commit and machine a run is made at."""
  status = git(root, "status", "--porcelain", "--untracked-files=no")
  return {"commit": git(root, "rev-parse", "HEAD"), "machine": machine.describe(),
          "uncommitted_changes": None if status is None else bool(status)}


SLURM_MACHINE = "SLURM jobs (each run's study_done.json names its machine)"


def record_provenance(out: str, root: str, machine_here: str | None = "here") -> None:
  """Called only when this session runs something (a regeneration that trains nothing leaves the
  file as it is). A study without runs yet gets the current commit and machine; a resumed one
  keeps its first and lists the others in `resumed_at` / `resumed_on`, so a study spanning
  commits or machines says so. `machine_here` None: the runs go to cluster jobs, not this
  machine (SLURM_MACHINE is recorded)."""
  path = os.path.join(out, "provenance.json")
  now = here(root)
  if machine_here is None:
    now["machine"] = SLURM_MACHINE
  fresh = not os.path.isdir(os.path.join(out, "runs"))
  if fresh and os.path.exists(os.path.join(out, "timing.json")):
    os.remove(os.path.join(out, "timing.json"))  # an earlier study's, not to be added to
  old = {} if fresh else read_json(path, {})
  if not old.get("commit"):
    write_json(path, now)
    return
  if now["commit"] != old["commit"] and now["commit"] not in old.get("resumed_at", []):
    old = {**old, "resumed_at": [*old.get("resumed_at", []), now["commit"]]}
  if now["machine"] not in (old.get("machine"), *old.get("resumed_on", [])):
    old = {**old, "resumed_on": [*old.get("resumed_on", []), now["machine"]]}
  write_json(path, old)


def add_time(out: str, phase: str, seconds: float) -> None:
  path = os.path.join(out, "timing.json")
  timing = read_json(path, {})
  timing[phase] = timing.get(phase, 0.0) + seconds
  write_json(path, timing)


def refuse_dirty_tree(root: str, out: str, name: str) -> None:
  """A session that runs something from a tree with uncommitted changes to tracked files would
  record a commit that is not the code that made its numbers: StudyError. The study's own output
  directory is not looked at (a resumed study has written there)."""
  paths = ["."]
  if os.path.commonpath([os.path.abspath(out), root]) == root:
    paths.append(f":(exclude){os.path.relpath(os.path.abspath(out), root)}")
  status = git(root, "status", "--porcelain", "--untracked-files=no", "--", *paths)
  if status:
    changed = [line.split(maxsplit=1)[-1] for line in status.splitlines()]
    raise StudyError(
        f"{name}: the git tree has uncommitted changes to {len(changed)} tracked file(s) "
        f"({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}); expected a clean "
        "tree, so that provenance.json's commit is the code that made the results (commit or "
        "stash them; --allow_dirty runs anyway)")
