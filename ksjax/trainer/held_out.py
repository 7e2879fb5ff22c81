"""The held-out check inside a run: the start policy and the final one on the test split.

For each held-out prompt, n completions are sampled and scored (`ksjax.run.scoring.evaluate`, the
same loop the eval binary runs); the unbiased estimators of `ksjax.objectives.estimates` turn them
into pass@k (Chen et al.'s product form) and maj@k (the average over every k-subset of the
majority outcome, from the answer-class counts), and the mean reward; each averaged over prompts,
overall and per difficulty level when the task has levels. The two results are written to the
run directory and printed side by side.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from ksjax import distributed, files
from ksjax.run import scoring
from ksjax.run.spec import HeldOutSpec
from ksjax.tasks.base import Task


@dataclasses.dataclass(frozen=True)
class HeldOutResult:
  """Per-prompt outcomes of one evaluation and their summary.

  Attributes:
    outcomes: correct, answer classes and rewards, [G, n] each.
    levels: the difficulty level of each prompt (None where the task has none).
    metrics: name -> value, e.g. "pass@4", "maj@4", "reward", and "level3/pass@4".
  """
  outcomes: scoring.Outcomes
  levels: tuple
  metrics: dict[str, float]

  @property
  def num_samples(self) -> int:
    return self.outcomes.num_samples


def evaluate(llama, task: Task, spec: HeldOutSpec, *, seed: int, mesh=None) -> HeldOutResult:
  """Samples `spec.num_samples` completions per held-out prompt, scores and summarises them."""
  prompts = list(task.prompts(spec.split))
  if spec.num_prompts is not None:
    prompts = prompts[:spec.num_prompts]
  draw = scoring.Draw(num_samples=spec.num_samples, max_new_tokens=spec.max_new_tokens,
                      temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k)
  out = scoring.evaluate(llama, task, prompts, draw, seed=seed, batch_prompts=spec.batch_prompts,
                         mesh=mesh)
  values = scoring.per_problem(out.correct_gn, out.answer_ids_gn, out.rewards_gn, spec.ks)
  return HeldOutResult(out, tuple(p.metadata.get("level") for p in prompts),
                       scoring.flat_summary(values, prompts))


def save(path: str, result: HeldOutResult) -> None:
  """Writes the metrics and per-prompt counts as JSON (atomically; process 0 only)."""
  if not distributed.is_writer():
    return
  files.write_json(path, {"num_samples": result.num_samples, "metrics": result.metrics,
                          "levels": list(result.levels),
                          "num_correct": np.asarray(result.outcomes.correct_gn).sum(1).tolist()})


def load_metrics(path: str) -> dict[str, float]:
  with open(path, encoding="utf-8") as f:
    return json.load(f)["metrics"]


def table(start: dict[str, float] | None, end: dict[str, float], ks: Sequence[int],
          levels: Sequence[Any] = (), level_k: int | None = None) -> str:
  """A fixed-width table: one row per metric, and per level pass@1 and pass@`level_k` (default:
  the largest k); columns start / end / change."""
  names = scoring.metric_names(ks)
  level_k = max(ks) if level_k is None or level_k not in ks else level_k
  for level in levels:
    names += [f"level{level}/pass@{k}" for k in sorted({min(ks), level_k})]
  width = max(len(n) for n in names) + 2
  lines = [f"{'held-out':<{width}}{'start':>9}{'end':>9}{'change':>9}"]
  for name in names:
    if name not in end:
      continue
    s = start.get(name) if start else None
    e = end[name]
    lines.append(f"{name:<{width}}" + (f"{s:>9.3f}" if s is not None else f"{'-':>9}")
                 + f"{e:>9.3f}" + (f"{e - s:>+9.3f}" if s is not None else f"{'':>9}"))
  return "\n".join(lines)


def headline(metrics: dict[str, float], ks: Sequence[int]) -> str:
  return ", ".join(f"{name} {metrics[name]:.3f}" for name in
                   ["reward"] + [f"pass@{k}" for k in ks] if name in metrics)
