"""CodeContests and TACO as a `Task`: rewards from running the generated program in the sandbox.

Scoring a group of n completions (one prompt):
1. Extract each completion's program (`extract_program`): the last ```python fenced block, or
   the last fenced block of any language when there is none; a block still open at the end of the
   completion runs to its end. No block, an empty one or one longer than `max_program_chars` is
   no program: the failure reward, in the class of completions without an answer.
2. Run each distinct program of the batch once (identical texts of one prompt share the run) in
   the sandbox's worker pool, all groups of the call at once (`ksjax.tasks.sandbox`). A program is
   correct iff it passes every test of its problem; the first failing test ends its run.
3. Answer classes for majority voting. Code has no canonical answer, so the vote is by behaviour
   on the problem's tests: all correct programs form one class (each matched the expected output
   of every test), and wrong programs share a class when they printed the same outputs
   (whitespace-token normalised, case-folded, as the checker in `ksjax.tasks.code_judge` reads
   them) on the tests that ran and ended the same way on the first failing one
   (`sandbox.Result.behaviour`). Two programs that fail identically on test 3 vote together even
   if they would differ on test 7, which was never run. Within a class all rewards are equal by
   construction.

Prompts ask for a Python 3 program in a ```python block that reads stdin and writes stdout, or,
for call-based TACO problems, for the function `fn_name` completing the starter code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ksjax.tasks.base import DataError, GroupScore, Prompt, answer_classes
from ksjax.tasks.code_data import read_code_contests, read_taco
from ksjax.tasks.record_task import RecordTask, Source
from ksjax.tasks.sandbox import Job, Sandbox, SandboxConfig
from ksjax.tokenization import Tokenizer

STDIO_TEMPLATE = (
    "Solve the following competitive programming problem in Python 3.\n\n"
    "{problem}\n\n"
    "Write a complete program that reads the input from standard input and prints the answer to "
    "standard output. Give the whole program in a single ```python code block.")

CALL_TEMPLATE = (
    "Solve the following programming problem in Python 3.\n\n"
    "{problem}\n\n"
    "Complete the following code. The function `{fn_name}` is called with each test's arguments "
    "and its return value is checked; it must not read input or print its answer.\n"
    "```python\n{starter_code}\n```\n"
    "Give the whole code in a single ```python code block.")

_PYTHON_TAGS = ("python", "python3", "py", "py3")
_FENCE = "```"


def extract_program(completion: str) -> str | None:
  """The last ```python block of `completion` (else its last fenced block), or None.

  A line opens a block when it starts, after indentation, with ``` and a language tag (or
  none); the next line that is ``` alone closes it. Linear time, never raises.
  """
  if not isinstance(completion, str):
    return None
  blocks: list[tuple[str, list[str]]] = []  # (language, lines)
  current: list[str] | None = None
  for line in completion.split("\n"):
    stripped = line.strip()
    if current is None:
      if stripped.startswith(_FENCE):
        tag = stripped[len(_FENCE):].strip().lower()
        if _FENCE not in tag and " " not in tag:
          current = []
          blocks.append((tag, current))
    elif stripped == _FENCE:
      current = None
    else:
      current.append(line)
  python = [lines for tag, lines in blocks if tag in _PYTHON_TAGS]
  chosen = python[-1] if python else (blocks[-1][1] if blocks else None)
  if chosen is None:
    return None
  program = "\n".join(chosen).strip("\n")
  return program if program.strip() else None


def _number_or_none(value: Any) -> bool:
  return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                           and value > 0)


class CodeTask(RecordTask):
  """Prompts from CodeContests/TACO records, scored by running programs in the sandbox.

  Args (splits, tokenizer, rewards and name as in `RecordTask`):
    splits: records as yielded by `ksjax.tasks.code_data` readers, or paths.
    fmt: reader for the splits given as paths: "code_contests" or "taco".
    max_tests: run at most this many tests per problem (public tests first); None: all.
    max_program_chars: a longer program counts as no program.
    sandbox: a sandbox to share (the task then does not close it); else the task makes one from
      `sandbox_config`.
  """

  READERS = {"code_contests": read_code_contests, "taco": read_taco}

  def __init__(self, splits: Mapping[str, Source], tokenizer: Tokenizer, *,
               fmt: str | None = None, correct_reward: float = 1.0, wrong_reward: float = -1.0,
               max_tests: int | None = None, max_program_chars: int = 1 << 16,
               sandbox: Sandbox | None = None, sandbox_config: SandboxConfig | None = None,
               name: str = "code"):
    if max_tests is not None and max_tests < 1:
      raise ValueError(f"max_tests={max_tests!r} is not accepted; expected None or >= 1")
    self.max_tests = max_tests
    self.max_program_chars = max_program_chars
    super().__init__(splits, tokenizer, fmt=fmt, correct_reward=correct_reward,
                     wrong_reward=wrong_reward, name=name)
    self.sandbox = sandbox or self._own(Sandbox(sandbox_config))

  @staticmethod
  def _validated(where: str, record: Mapping[str, Any]) -> dict[str, Any]:
    expected = ("expected records as yielded by ksjax.tasks.code_data readers: string id and "
                "problem, tests [{input, output}] (non-empty; strings, or an argument list and a "
                "value when fn_name is set), fn_name None or a string, time_limit_s and "
                "memory_limit_bytes None or positive")
    if not isinstance(record, Mapping):
      raise DataError(f"{where}: a {type(record).__name__}, not a record; {expected}")
    tests = record.get("tests")
    problems = [key for key in ("id", "problem")
                if not isinstance(record.get(key), str) or not record[key].strip()]
    call_based = isinstance(record.get("fn_name"), str)
    if not (isinstance(tests, list) and tests and all(
        isinstance(t, Mapping) and "input" in t and "output" in t and (
            isinstance(t["input"], list) if call_based
            else isinstance(t["input"], str) and isinstance(t["output"], str))
        for t in tests)):
      problems.append("tests")
    if not (record.get("fn_name") is None or isinstance(record["fn_name"], str)):
      problems.append("fn_name")
    problems += [key for key in ("time_limit_s", "memory_limit_bytes")
                 if not _number_or_none(record.get(key))]
    if problems:
      raise DataError(f"{where}: field(s) {', '.join(problems)} malformed; {expected}")
    return dict(record)

  def isolation_report(self) -> dict[str, Any]:
    """The sandbox's isolation in force on this host, for the run's log."""
    return self.sandbox.isolation_report()

  def levels(self) -> Sequence[Any]:
    return sorted({str(r.get("difficulty")) for rs in self._records.values() for r in rs
                   if r.get("difficulty") is not None})

  def _prompt(self, record: Mapping[str, Any]) -> Prompt:
    fn_name = record.get("fn_name")
    if fn_name:
      text = CALL_TEMPLATE.format(problem=record["problem"].strip(), fn_name=fn_name,
                                  starter_code=(record.get("starter_code") or "").rstrip())
    else:
      text = STDIO_TEMPLATE.format(problem=record["problem"].strip())
    tests = record["tests"][:self.max_tests] if self.max_tests else record["tests"]
    reference = {"tests": tests, "fn_name": fn_name or None,
                 "time_limit_s": record.get("time_limit_s"),
                 "memory_limit_bytes": record.get("memory_limit_bytes")}
    metadata = {"level": str(record.get("difficulty")), "num_tests": len(tests),
                "call_based": int(bool(fn_name))}
    metadata.update({k: record[k] for k in ("dataset", "source", "name")
                     if isinstance(record.get(k), str)})
    solutions = record.get("solutions") or []
    solution = f"```python\n{solutions[0].strip()}\n```" if solutions else None
    return Prompt(id=record["id"], text=text, tokens=tuple(self.tokenizer.encode(text)),
                  metadata=metadata, reference=reference, solution=solution)

  def score(self, prompts: Sequence[Prompt], completions: Sequence[Sequence[str]]) -> list[GroupScore]:
    if len(prompts) != len(completions):
      raise ValueError(f"{len(prompts)} prompts but {len(completions)} completion groups")
    programs = [[self._program(c) for c in group] for group in completions]  # [G][n]
    distinct = list(dict.fromkeys((g, p) for g, group in enumerate(programs) for p in group
                                  if p is not None))
    jobs = []
    for g, program in distinct:
      reference = prompts[g].reference
      jobs.append(Job(program=program, tests=reference["tests"], fn_name=reference["fn_name"],
                      time_limit_s=reference["time_limit_s"],
                      memory_limit_bytes=reference["memory_limit_bytes"]))
    results = dict(zip(distinct, self.sandbox.run_many(jobs)))
    scores = []
    for g, group in enumerate(programs):
      ran = [None if p is None else results[(g, p)] for p in group]
      correct = np.array([r is not None and r.passed for r in ran], dtype=bool)  # [n]
      keys = [None if r is None else ("passed",) if r.passed else ("failed", r.behaviour)
              for r in ran]
      rewards = np.where(correct, self.correct_reward, self.wrong_reward).astype(np.float32)  # [n]
      scores.append(GroupScore(rewards=rewards, correct=correct, answers=tuple(group),
                               answer_ids=answer_classes(keys)))
    return scores

  def _program(self, completion: str) -> str | None:
    program = extract_program(completion)
    return program if program is not None and len(program) <= self.max_program_chars else None
