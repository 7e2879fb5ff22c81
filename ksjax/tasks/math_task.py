"""MATH and HARP as a `Task`: the paper's prompt, rewards from the hardened answer checker.

Scoring a group of n completions (one prompt):
1. Extract each completion's final answer (`math_answer.extract_answer`, in this process: a linear
   string scan).
2. Check each distinct answer against the gold in the checker's worker pool, all groups of the
   call in one parallel batch; only Verdict.EQUAL is correct. A timed-out, crashed or unparsable
   check is wrong: it earns `wrong_reward`, never an exception.
3. Answer classes for majority voting: every correct answer is in one class (each equals the gold);
   completions without an answer share one class; wrong answers are grouped by pairwise
   `verify(representative, answer)`, each new answer compared with one representative per existing
   class (at most d(d-1)/2 checks for d distinct wrong answers, all groups advancing in lock-step so
   each round is one parallel batch). Answers that timed out, crashed or did not parse against the
   gold, and both answers of a pairwise check that timed out or crashed, are not compared again:
   each forms a class of its textually identical answers (a missed merge costs a vote, never a
   reward). Within a class all rewards are equal by construction.

The prompt follows the paper (appendix): an instruction asking for a step-by-step solution that
concludes with "The final answer is ...", the convention of Llama's MATH prompts. Reference
solutions (for supervised warm-up) end with the same sentence, so the checker accepts them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ksjax.tasks import math_data
from ksjax.tasks.base import DataError, GroupScore, Prompt, answer_classes
from ksjax.tasks.math_answer import canonical, clean_answer, extract_answer
from ksjax.tasks.math_checker import POISONED, AnswerChecker, CheckerConfig, Verdict
from ksjax.tasks.record_task import RecordTask, Source
from ksjax.tokenization import Tokenizer

DEFAULT_TEMPLATE = (
    "Solve the following math problem step by step. Explain each step briefly and show your "
    "calculations. Conclude with a last line of the form \"The final answer is $ANSWER$.\", where "
    "ANSWER is the final number or expression in LaTeX.\n\n"
    "Problem: {problem}\n\n"
    "Solution:")

_FINAL_SENTENCE = "The final answer is ${answer}$."

_REQUIRED = {"id": str, "problem": str, "answer": str}


def _reference_solution(record: Mapping[str, Any]) -> str | None:
  solution = record.get("solution")
  if not solution:
    return None
  return f"{solution.rstrip()}\n{_FINAL_SENTENCE.format(answer=record['answer'])}"


class MathTask(RecordTask):
  """Prompts from MATH/MATH-500/HARP records, scored by math-verify in a hardened worker pool.

  Args (splits, tokenizer, rewards and name as in `RecordTask`):
    splits: records as yielded by `ksjax.tasks.math_data` readers, or paths.
    fmt: reader for the splits given as paths: "math_dir", "math500_jsonl" or "harp_jsonl".
    template: prompt text with a "{problem}" field.
    timeout_s, workers, memory_limit_bytes: limits of the checker pool (see `CheckerConfig`).
    checker: an already started pool to share (then the limits above are ignored and the task
      does not close it).
  """

  READERS = math_data.READERS

  def __init__(self, splits: Mapping[str, Source], tokenizer: Tokenizer, *,
               fmt: str | None = None, template: str = DEFAULT_TEMPLATE,
               correct_reward: float = 1.0, wrong_reward: float = -1.0, timeout_s: float = 5.0,
               workers: int = 2, memory_limit_bytes: int = 2 << 30,
               checker: AnswerChecker | None = None, name: str = "math"):
    if "{problem}" not in template:
      raise ValueError(f"template must contain a {{problem}} field; got {template[:80]!r}")
    self.template = template
    super().__init__(splits, tokenizer, fmt=fmt, correct_reward=correct_reward,
                     wrong_reward=wrong_reward, name=name)
    self.checker = checker or self._own(AnswerChecker(CheckerConfig(
        workers=workers, timeout_s=timeout_s, memory_limit_bytes=memory_limit_bytes)))

  @staticmethod
  def _validated(where: str, record: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(record, Mapping):
      raise DataError(f"{where}: a {type(record).__name__}, not a record; expected a dict")
    for key, kind in _REQUIRED.items():
      if not isinstance(record.get(key), kind) or not record[key].strip():
        raise DataError(f"{where}: field {key!r} is {record.get(key)!r}; expected records with "
                        "non-empty string fields id, problem and answer (as yielded by "
                        "ksjax.tasks.math_data readers)")
    return {**record, "answer": clean_answer(record["answer"])}

  def _prompt(self, record: Mapping[str, Any]) -> Prompt:
    text = self.template.replace("{problem}", record["problem"])  # LaTeX braces stay as they are
    metadata = {k: v for k, v in record.items()
                if k not in ("id", "problem", "answer", "solution") and isinstance(v, (str, int, float))}
    return Prompt(id=record["id"], text=text, tokens=tuple(self.tokenizer.encode(text)),
                  metadata=metadata, reference=record["answer"], solution=_reference_solution(record))

  def levels(self) -> Sequence[Any]:
    return sorted({r["level"] for rs in self._records.values() for r in rs
                   if isinstance(r.get("level"), int)})

  def score(self, prompts: Sequence[Prompt], completions: Sequence[Sequence[str]]) -> list[GroupScore]:
    if len(prompts) != len(completions):
      raise ValueError(f"{len(prompts)} prompts but {len(completions)} completion groups")
    answers = [[extract_answer(c) for c in group] for group in completions]  # [G][n]
    return score_answers(self.checker, [p.reference for p in prompts], answers,
                         correct_reward=self.correct_reward, wrong_reward=self.wrong_reward)


def score_answers(checker: AnswerChecker, golds: Sequence[str],
                  answers: Sequence[Sequence[str | None]], *, correct_reward: float,
                  wrong_reward: float) -> list[GroupScore]:
  """Steps 2 and 3 of the module docstring for already extracted answers: `answers[g]` (n
  answers, None where a completion states none) against `golds[g]`, for every group g.

  Shared with the tasks that extract answers their own way (`ksjax.tasks.arithmetic`), so that
  every math-verify scored task gets the same checks, rewards and answer classes.
  """
  if len(golds) != len(answers):
    raise ValueError(f"{len(golds)} gold answers but {len(answers)} answer groups")
  keys = [[None if a is None else canonical(a) for a in group] for group in answers]
  golds = [canonical(g) for g in golds]

  # 1. Each distinct (gold, answer) once, all groups in one batch.
  gold_checks = {(g, k) for g, group in zip(golds, keys) for k in group if k is not None}
  verdicts = _check(checker, gold_checks)

  # 2. Classes of wrong answers, built by rounds of pairwise checks.
  wrong_class: list[dict[str, int]] = []  # per group: answer key -> class index
  pending: list[list[str]] = []  # per group: wrong answers still to place, in order
  reps: list[list[str]] = []  # per group: representative of each comparable class
  for g, group in enumerate(keys):
    wrong_class.append({})
    pending.append([])
    reps.append([])
    for k in dict.fromkeys(k for k in group if k is not None):
      verdict = verdicts[(golds[g], k)]
      if verdict in POISONED:
        wrong_class[g][k] = len(wrong_class[g])  # its own class, never compared
      elif verdict != Verdict.EQUAL:
        pending[g].append(k)
  while any(pending):
    current = [p.pop(0) if p else None for p in pending]  # [G]: the answer placed this round
    pair_verdicts = _check(checker, {(r, k) for k, rs in zip(current, reps) if k is not None
                                     for r in rs})
    for g, k in enumerate(current):
      if k is None:
        continue
      results = [(r, pair_verdicts[(r, k)]) for r in reps[g]]
      match = next((r for r, v in results if v == Verdict.EQUAL), None)
      # A pair that timed out or crashed takes both answers out of later comparisons, so that
      # one hostile answer costs O(1) timeouts per group rather than one per other answer.
      failed = {r for r, v in results if v in (Verdict.TIMEOUT, Verdict.CRASHED)}
      reps[g] = [r for r in reps[g] if r not in failed]
      if match is not None:
        wrong_class[g][k] = wrong_class[g][match]
      else:
        wrong_class[g][k] = len(wrong_class[g])
        if not failed:
          reps[g].append(k)

  scores = []
  for g, group in enumerate(keys):
    correct = np.array([k is not None and verdicts[(golds[g], k)] == Verdict.EQUAL
                        for k in group], dtype=bool)  # [n]
    class_keys = [("none",) if k is None else ("correct",) if ok else ("wrong", wrong_class[g][k])
                  for k, ok in zip(group, correct)]
    rewards = np.where(correct, correct_reward, wrong_reward).astype(np.float32)  # [n]
    scores.append(GroupScore(rewards=rewards, correct=correct, answers=tuple(answers[g]),
                             answer_ids=answer_classes(class_keys)))
  return scores


def _check(checker: AnswerChecker, pairs: set[tuple[str, str]]) -> dict[tuple[str, str], Verdict]:
  """Verdicts of (reference, answer) pairs; identical texts are equal without a worker."""
  pairs = sorted(pairs)
  todo = [p for p in pairs if p[0] != p[1]]
  verdicts = dict(zip(todo, checker.check(todo)))
  verdicts.update({p: Verdict.EQUAL for p in pairs if p[0] == p[1]})
  return verdicts
