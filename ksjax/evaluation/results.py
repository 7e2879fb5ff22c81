"""An evaluation's numbers and files: per-problem estimates, their summaries, JSON and CSV.

One checkpoint's evaluation is a record (a JSON-ready dict):
  step, checkpoint, sampling (the settings the numbers depend on), ks, num_problems, seconds,
  samples_per_second, metrics {"reward", "pass@k", "maj@k" for each k, "distinct_answers",
  "answer_entropy"}, groups {"level=3": {...}, "subject=Algebra": {...}} with the same metrics
  per problem metadata value, and problems: per problem its id, breakdown fields, num_correct
  and answer classes [[size, correct], ...], enough to recompute pass@k, maj@k and the diversity
  for any k <= n without sampling again (`rescore`: a record made with other ks, or before the
  diversity metrics existed, is brought up to date when it is reused).
It is written as `step_<step>.json`; `results.json` and `results.csv` (one row per step and
group) gather every record of the output directory, and `average_last<N>.json/.csv` the average
of the last N. Every file is written to a temporary name and renamed, so a reader (or a run
killed mid-write) never sees half a file.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ksjax import files
from ksjax.objectives import estimates
from ksjax.run import scoring

STEP_FILE = "step_{step:08d}.json"
RESULTS_JSON = "results.json"
RESULTS_CSV = "results.csv"
AVERAGE_STEM = "average_last{count}"
KL_METRICS = ("kl_k1", "kl_k3")  # the eval binary's KL to config.kl_reference (runner.py)


def step_record(*, step: int, checkpoint: str, sampling: Mapping[str, Any], ks: Sequence[int],
                prompt_ids: Sequence[str], metadata: Sequence[Mapping[str, Any]],
                breakdown: Sequence[str], correct_gn: np.ndarray, answer_ids_gn: np.ndarray,
                rewards_gn: np.ndarray, seconds: float,
                extra_g: Mapping[str, np.ndarray] | None = None) -> dict[str, Any]:
  """The record of one checkpoint's evaluation (see the module docstring). `extra_g`: more
  per-problem values ([G] each, e.g. the KL to a reference), averaged like the others and kept
  per problem."""
  values = {**scoring.per_problem(correct_gn, answer_ids_gn, rewards_gn, ks), **(extra_g or {})}
  groups = scoring.summarize(values, scoring.group_masks(metadata, breakdown))
  num_problems, n = correct_gn.shape
  problems: dict[str, list] = {"id": list(prompt_ids)}
  for field in breakdown:
    if any(field in m for m in metadata):
      problems[field] = [m.get(field) for m in metadata]
  problems["num_correct"] = correct_gn.sum(axis=1).tolist()
  problems["classes"] = [
      [[size, int(value)] for size, value in estimates.answer_class_profile(ids, ok)]
      for ids, ok in zip(answer_ids_gn, correct_gn)]
  for name, value_g in (extra_g or {}).items():
    problems[name] = np.asarray(value_g, np.float64).tolist()
  everyone = groups.pop(scoring.ALL)
  return {"step": int(step), "checkpoint": checkpoint, "sampling": dict(sampling),
          "ks": list(ks), "num_problems": num_problems, "num_samples": n,
          "seconds": float(seconds), "samples_per_second": num_problems * n / max(seconds, 1e-9),
          "metrics": {k: v for k, v in everyone.items() if k != "num_problems"},
          "groups": groups, "problems": problems}


def is_current(record: Mapping[str, Any], ks: Sequence[int]) -> bool:
  """Whether `record` has every metric an evaluation with `ks` writes."""
  return list(record["ks"]) == list(ks) and all(m in record["metrics"] for m in scoring.DIVERSITY)


def rescore(record: Mapping[str, Any], ks: Sequence[int]) -> dict[str, Any]:
  """`record` with pass@k and maj@k for `ks`, and the diversity, recomputed from its stored
  problems (counts and answer classes), overall and per group; no sampling. The mean reward is
  kept as recorded (the classes store correctness, not rewards, and it does not depend on k).
  """
  problems = record["problems"]
  n = int(record["num_samples"])
  if max(ks) > n:
    raise ValueError(f"ks={tuple(ks)} needs more than the record's {n} samples per problem")
  ids_gn = np.asarray([np.repeat(np.arange(len(classes)), [size for size, _ in classes])
                       for classes in problems["classes"]], np.int32).reshape(-1, n)
  correct_gn = np.asarray([np.repeat([bool(ok) for _, ok in classes],
                                     [size for size, _ in classes])
                           for classes in problems["classes"]], bool).reshape(-1, n)
  values = scoring.per_problem(correct_gn, ids_gn, np.zeros(correct_gn.shape, np.float32), ks)
  del values["reward"]
  fields = [f for f in problems if f not in ("id", "num_correct", "classes", *KL_METRICS)]
  metadata = [{f: problems[f][i] for f in fields} for i in range(len(problems["id"]))]
  groups = scoring.summarize(values, scoring.group_masks(metadata, fields))

  def merged(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """new's numbers, with old's reward and KL, in the order step_record writes them."""
    return {"num_problems": new["num_problems"],
            **({"reward": old["reward"]} if "reward" in old else {}),
            **{m: v for m, v in new.items() if m != "num_problems"},
            **{m: old[m] for m in KL_METRICS if m in old}}

  everyone = merged(record["metrics"], groups.pop(scoring.ALL))
  del everyone["num_problems"]
  return {**record, "ks": list(ks), "metrics": everyone,
          "groups": {g: merged(record["groups"].get(g, {}), v) for g, v in groups.items()}}


def common_metrics(records: Sequence[Mapping[str, Any]]) -> list[str]:
  """The metric names every record has, in the first record's order (records of other ks)."""
  return [m for m in records[0]["metrics"] if all(m in r["metrics"] for r in records)]


def average(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """The mean of the records' metrics, overall and per group (the paper's average over the
  last checkpoints); a metric some record lacks is left out."""
  names = common_metrics(records)
  groups = {}
  for group in records[0]["groups"]:
    present = [r["groups"][group] for r in records if group in r["groups"]]
    groups[group] = {"num_problems": present[0]["num_problems"],
                     **{m: float(np.mean([g[m] for g in present])) for m in names
                        if all(m in g for g in present)}}
  return {"steps": [r["step"] for r in records], "sampling": records[0]["sampling"],
          "ks": records[0]["ks"],
          "metrics": {m: float(np.mean([r["metrics"][m] for r in records])) for m in names},
          "groups": groups}


def rows(record: Mapping[str, Any], label: Any) -> list[dict[str, Any]]:
  """CSV rows of a record or an average: one for every problem, one per group."""
  out = [{"step": label, "group": scoring.ALL, "num_problems": record.get("num_problems", ""),
          **record["metrics"]}]
  for group, values in record["groups"].items():
    out.append({"step": label, "group": group, **values})
  return out


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------

def write_csv(path: str, table: Sequence[Mapping[str, Any]]) -> None:
  columns: list[str] = []
  for row in table:
    columns += [c for c in row if c not in columns]
  buffer = io.StringIO()
  writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
  writer.writeheader()
  writer.writerows(table)
  files.write_text(path, buffer.getvalue())


def load_records(output_dir: str, sampling: Mapping[str, Any] | None = None) -> list[dict]:
  """The step records in `output_dir` (those evaluated with `sampling`, if given), by step."""
  if not os.path.isdir(output_dir):
    return []
  records = []
  for name in sorted(os.listdir(output_dir)):
    if not (name.startswith("step_") and name.endswith(".json")):
      continue
    with open(os.path.join(output_dir, name), encoding="utf-8") as f:
      record = json.load(f)
    if sampling is None or record.get("sampling") == dict(sampling):
      records.append(record)
  return sorted(records, key=lambda r: r["step"])


def save_step(output_dir: str, record: Mapping[str, Any]) -> str:
  path = os.path.join(output_dir, STEP_FILE.format(step=record["step"]))
  files.write_json(path, record)
  return path


def save_summaries(output_dir: str, records: Sequence[Mapping[str, Any]],
                   averaged: Mapping[str, Any] | None = None) -> list[str]:
  """results.json/.csv over `records`, and the average's files if one is given."""
  paths = [os.path.join(output_dir, RESULTS_JSON), os.path.join(output_dir, RESULTS_CSV)]
  files.write_json(paths[0], {"records": [{k: v for k, v in r.items() if k != "problems"}
                                    for r in records]})
  write_csv(paths[1], [row for r in records for row in rows(r, r["step"])])
  if averaged is not None:
    stem = os.path.join(output_dir, AVERAGE_STEM.format(count=len(averaged["steps"])))
    files.write_json(stem + ".json", averaged)
    label = "mean of " + " ".join(map(str, averaged["steps"]))
    write_csv(stem + ".csv", rows(averaged, label))
    paths += [stem + ".json", stem + ".csv"]
  return paths
