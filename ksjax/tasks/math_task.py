"""MATH and HARP as a `Task`: the paper's prompt, rewards from the hardened answer checker.

Scoring a group of n completions (one prompt):
1. Extract each completion's final answer (`math_answer.extract_answer`, in this process: a linear
   string scan).
2. Check each distinct answer against the gold in the checker's worker pool, all groups of the
   call in one parallel batch; only Verdict.EQUAL is correct. A timed-out, crashed or unparsable
   check is wrong: it earns `reward_wrong`, never an exception.
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

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ksjax.tasks.base import DataError, GroupScore, Prompt, Task, answer_classes
from ksjax.tasks.math_answer import canonical, clean_answer, extract_answer
from ksjax.tasks.math_checker import POISONED, AnswerChecker, CheckerConfig, Verdict
from ksjax.tasks.math_data import read_records
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


class MathTask(Task):
  """Prompts from MATH/MATH-500/HARP records, scored by math-verify in a hardened worker pool.

  Args:
    splits: split name -> records (dicts as yielded by `ksjax.tasks.math_data` readers) or a path
      read with the reader `fmt`. May be {} when prompts come from the data pipeline
      (`prompt_from_record`).
    tokenizer: encodes the prompt text.
    fmt: reader for the splits given as paths: "math_dir", "math500_jsonl" or "harp_jsonl".
    template: prompt text with a "{problem}" field.
    reward_correct, reward_wrong: rewards of a correct and of any other completion.
    timeout_s, workers, memory_limit_bytes: limits of the checker pool (see `CheckerConfig`).
    checker: an already started pool to share (then the limits above are ignored and the task
      does not close it).
    name: the task's name in logs.
  """

  def __init__(self, splits: Mapping[str, Iterable[Mapping[str, Any]] | str | os.PathLike],
               tokenizer: Tokenizer, *, fmt: str | None = None, template: str = DEFAULT_TEMPLATE,
               reward_correct: float = 1.0, reward_wrong: float = -1.0, timeout_s: float = 5.0,
               workers: int = 2, memory_limit_bytes: int = 2 << 30,
               checker: AnswerChecker | None = None, name: str = "math"):
    if "{problem}" not in template:
      raise ValueError(f"template must contain a {{problem}} field; got {template[:80]!r}")
    self.name = name
    self.tokenizer = tokenizer
    self.template = template
    self.reward_correct = float(reward_correct)
    self.reward_wrong = float(reward_wrong)
    self._records: dict[str, list[dict[str, Any]]] = {}
    for split, source in splits.items():
      if isinstance(source, (str, os.PathLike)):
        if fmt is None:
          raise ValueError(f"split {split!r} is a path; pass fmt= (math_dir, math500_jsonl or "
                           "harp_jsonl) to say how to read it")
        source = read_records(os.fspath(source), fmt)
      self._records[split] = [self._validated(f"split {split!r}, record {i}", r)
                              for i, r in enumerate(source)]
    self._prompts: dict[str, list[Prompt]] = {}
    self._own_checker = checker is None
    self.checker = checker or AnswerChecker(CheckerConfig(
        workers=workers, timeout_s=timeout_s, memory_limit_bytes=memory_limit_bytes))

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

  def close(self) -> None:
    """Stops the checker's worker processes (if this task started them)."""
    if self._own_checker:
      self.checker.close()

  def __enter__(self) -> "MathTask":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def prompts(self, split: str) -> Sequence[Prompt]:
    if split not in self._records:
      raise ValueError(f"split {split!r} is not accepted; task {self.name!r} has "
                       f"{sorted(self._records)}")
    if split not in self._prompts:
      self._prompts[split] = [self._prompt(r) for r in self._records[split]]
    return self._prompts[split]

  def prompt_from_record(self, record: Mapping[str, Any]) -> Prompt:
    """The prompt of one record as the data pipeline stores it (a reader's record)."""
    ident = record.get("id") if isinstance(record, Mapping) else None
    return self._prompt(self._validated(f"record {ident!r}", record))

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
    keys = [[None if a is None else canonical(a) for a in group] for group in answers]
    golds = [canonical(p.reference) for p in prompts]

    # 1. Each distinct (gold, answer) once, all groups in one batch.
    gold_checks = {(g, k) for g, group in zip(golds, keys) for k in group if k is not None}
    verdicts = self._check(gold_checks)

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
      pair_verdicts = self._check({(r, k) for k, rs in zip(current, reps) if k is not None
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
      rewards = np.where(correct, self.reward_correct, self.reward_wrong).astype(np.float32)  # [n]
      scores.append(GroupScore(rewards=rewards, correct=correct, answers=tuple(answers[g]),
                               answer_ids=answer_classes(class_keys)))
    return scores

  def _check(self, pairs: set[tuple[str, str]]) -> dict[tuple[str, str], Verdict]:
    """Verdicts of (reference, answer) pairs; identical texts are equal without a worker."""
    pairs = sorted(pairs)
    todo = [p for p in pairs if p[0] != p[1]]
    verdicts = dict(zip(todo, self.checker.check(todo)))
    verdicts.update({p: Verdict.EQUAL for p in pairs if p[0] == p[1]})
    return verdicts
