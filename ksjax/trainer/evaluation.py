"""Held-out evaluation at the start and the end of a run: pass@k and maj@k from n samples.

For each test prompt, n completions are sampled and scored; the unbiased estimators of
`ksjax.evaluation.estimators` turn them into pass@k (Chen et al.'s product form) and maj@k (the
average over every k-subset of the majority outcome, from the answer-class counts), and the mean
reward; each averaged over prompts, overall and per difficulty level when the task has levels.
The same `evaluate` serves the eval binary (`ksjax.evaluation.runner`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ksjax import distributed, sampling
from ksjax.evaluation import estimators
from ksjax.tasks.base import Prompt, Task


@dataclasses.dataclass(frozen=True)
class EvalResult:
  """Per-prompt outcomes of one evaluation and their summary.

  Attributes:
    num_samples: n per prompt.
    levels: the difficulty level of each prompt (None where the task has none).
    correct: bool [G, n]; answer_ids: int32 [G, n]; rewards: float32 [G, n].
    metrics: name -> value, e.g. "pass@4", "maj@4", "reward", and "level3/pass@4".
  """
  num_samples: int
  levels: tuple
  correct: np.ndarray
  answer_ids: np.ndarray
  rewards: np.ndarray
  metrics: dict[str, float]


def summarize(correct_gn: np.ndarray, answer_ids_gn: np.ndarray, rewards_gn: np.ndarray,
              levels: Sequence[Any], ks: Sequence[int]) -> dict[str, float]:
  """pass@k and maj@k for every k, and the mean reward: overall and per level."""
  n = correct_gn.shape[1]
  groups = {"": np.ones(len(levels), bool)}
  for level in sorted({lv for lv in levels if lv is not None}):
    groups[f"level{level}/"] = np.asarray([lv == level for lv in levels])
  out = {}
  per_prompt = {"reward": rewards_gn.mean(1)}
  for k in ks:
    per_prompt[f"pass@{k}"] = estimators.pass_at_k(correct_gn.sum(1), n, k)
    per_prompt[f"maj@{k}"] = estimators.maj_at_k(answer_ids_gn, correct_gn, k)
  for prefix, select in groups.items():
    for name, values in per_prompt.items():
      out[prefix + name] = float(values[select].mean())
  return out


def evaluate(llama, task: Task, prompts: Sequence[Prompt], *, num_samples: int, ks: Sequence[int],
             max_new_tokens: int, temperature: float, top_p: float, top_k: int, seed: int,
             batch_prompts: int, mesh=None) -> EvalResult:
  """Samples `num_samples` completions per prompt (`batch_prompts` prompts per sampler call) and
  scores them with the task."""
  tokenizer = task.tokenizer
  correct, answer_ids, rewards = [], [], []
  for start in range(0, len(prompts), batch_prompts):
    chunk = list(prompts[start:start + batch_prompts])
    out = sampling.generate(llama, [list(p.tokens) for p in chunk], num_samples=num_samples,
                            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=seed + start, eos_id=tokenizer.eos_ids, mesh=mesh,
                            pad_id=tokenizer.pad_id)
    tokens_rn = distributed.to_host(out.tokens)
    texts = [tokenizer.decode(row) for row in tokens_rn]
    scores = task.score(chunk, [texts[g * num_samples:(g + 1) * num_samples]
                                for g in range(len(chunk))])
    correct += [s.correct for s in scores]
    answer_ids += [s.answer_ids for s in scores]
    rewards += [s.rewards for s in scores]
  correct_gn = np.stack(correct).astype(bool)
  answer_ids_gn = np.stack(answer_ids).astype(np.int32)
  rewards_gn = np.stack(rewards).astype(np.float32)
  levels = tuple(p.metadata.get("level") for p in prompts)
  metrics = summarize(correct_gn, answer_ids_gn, rewards_gn, levels, ks)
  return EvalResult(num_samples, levels, correct_gn, answer_ids_gn, rewards_gn, metrics)


def save(path: str, result: EvalResult) -> None:
  """Writes the metrics and per-prompt counts as JSON (atomically; process 0 only)."""
  if not distributed.is_writer():
    return
  data = {"num_samples": result.num_samples, "metrics": result.metrics,
          "levels": list(result.levels), "num_correct": result.correct.sum(1).tolist()}
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(data, f, indent=1)
  os.replace(tmp, path)


def load_metrics(path: str) -> dict[str, float]:
  with open(path, encoding="utf-8") as f:
    return json.load(f)["metrics"]


def table(start: dict[str, float] | None, end: dict[str, float], ks: Sequence[int],
          levels: Sequence[Any] = (), level_k: int | None = None) -> str:
  """A fixed-width table: one row per metric, and per level pass@1 and pass@`level_k` (default:
  the largest k); columns start / end / change."""
  names = ["reward"] + [f"pass@{k}" for k in ks] + [f"maj@{k}" for k in ks]
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
