"""The embedded default task: signed digit chains modulo M (10 by default), solved step by step.

A problem is a chain of L operations on digits, e.g. `7+3-5+2 mod 10`, and the model answers
with a running total, one operation per step, ending in the MATH-style sentence:

  7+3-5+2 mod 10
  7-5=2, 2+2=4, 4+3=7. The final answer is 7.

Why this task. It needs no download, a tiny character-level model learns it on CPU in
minutes, its answers are verifiable exactly, and it has what k-sample objectives need:

* Several valid routes. The terms may be added in any order that starts from an added term (a
  route starting from `-5` would need a negative running total), so a problem with p added
  terms among L + 1 has p * L! routes: at most 2 at level 1, up to 720 at level 5. Reference
  solutions show several routes, so a warmed-up model samples diverse chains of thought and
  pass@k differs from pass@1.
* A difficulty ladder set by the carried state, not by new skills. Every step is one lookup in
  the same table (running total, sign, digit) -> total, 200 entries at M = 10, which every
  training problem of level L shows L times; level 1 is that lookup alone. What grows with the
  level is the bookkeeping: copy the running total, pick a term not used yet (with its sign)
  among up to six, and stop after exactly L steps. A step that reuses or skips a term yields a
  plausible but wrong total, and errors compound: with a per-step success q, level L succeeds
  with about q^L.
* M possible answers (0..M-1), so wrong answers split over several classes and majority
  voting is a real choice.

The modulus (`modulus`, config.synthetic.modulus: 2 to 100, default 10) sets the answer space;
with ten answers, any policy that keeps some randomness finds the right one among 100 samples,
so pass@100 cannot move. Terms stay digits 0-9 for every M: M sets the range of the running
totals and of the answers, 0..M-1. A level-L sum lies in [-9L, 9L + 9] before it is reduced,
18L + 10 values, so at M = 100 levels 1..5 have 28, 46, 64, 82 and 100 possible answers (at
M = 20, all twenty at every level). Why digit terms rather than terms in 0..M-1: a seed gives
the same problems for every M (only the suffix, the totals and the answers change), a step still
adds or subtracts one digit (a table of 20 M entries, not 2 M^2), and sequences grow by at most
one character per total (two-digit totals). Above 100 a modulus would only relabel negative
sums, and totals would need three digits. With M = 10 the task is exactly the original one.
The trade-off study (experiments/tradeoff.py) uses M = 50, chosen from its warmed-up start on
training problems (benchmarks/calibrate_embedded_modulus.py).

What a tiny model makes of it (docs/results.md has the figures, measured once with a stand-in
model before ksjax's trainer existed): the training loss sits on a plateau until the table is
learnt, and the errors left after it are bookkeeping ones, which grow with the level. So the
warm-up length places the start: a short warm-up starts RL in the 10-50% pass@1 regime where
training for pass@k and for the mean differ, and `levels` can drop the easy levels. Level 1
trailed level 2 in the stand-in: its training split is small (below) and its prompts are the
shortest, the positions learnt absolute embeddings see least (whether Llama's RoPE closes the
gap is not measured).

Sequences stay short for CPU speed: at level 5 the prompt has 19 characters and a solution 57
(at 10 < M <= 100, up to 20 and 67: `max_prompt_chars`, `max_solution_chars`).

The splits are generated deterministically from a seed. For every level the test problems are
drawn first and the training problems after, skipping any problem that is a reordering of a
test problem (same multiset of signed terms, hence the same routes and the same answer for
every M), so train and test never share a problem even up to commutativity, and the test split
does not change when the training split's size does. Level 1 has only 155 distinct problems
(for every M: terms are digits), so its training split is smaller.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
import string
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from ksjax import config_fields as cf
from ksjax import config_validation as cv
from ksjax.tasks.base import DataError, GroupScore, Prompt, Task, exact_answer_scores
from ksjax.tokenization import Tokenizer

DEFAULT_MODULUS = 10
# The largest modulus: running totals keep at most two digits, and at level 5 the sums before
# reduction span exactly 100 values (see the module docstring).
MAX_MODULUS = 100
LEVELS = (1, 2, 3, 4, 5)
SPLITS = ("train", "test")
MAX_TEST_PER_LEVEL = 155  # level 1's distinct problems (module docstring)

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# Printable ASCII and newline: every character of the task, and of most garbage a model can emit.
CHARACTERS = tuple(c for c in string.printable if c not in "\t\r\x0b\x0c")

_ANSWER_TEMPLATE = ". The final answer is {}."
_STEP_SEPARATOR = ", "
_PROMPT_RE = re.compile(
    rf"([0-9](?:[+-][0-9]){{{LEVELS[0]},{LEVELS[-1]}}}) mod ([1-9][0-9]{{0,2}})\n", re.ASCII)
# The phrase that introduces the answer; the last occurrence in a completion counts.
_PHRASE_RE = re.compile(r"final answer is", re.IGNORECASE)
# What may follow the phrase: optional ":", "$" or "\boxed{", then an integer written in ASCII
# digits that does not continue into a decimal, a letter or another digit ("7.5", "7x" are no
# answer). Linear time: no nested quantifiers.
_ANSWER_RE = re.compile(r"[ :]*\$?(?:\\boxed\{)?([+-]?[0-9]+)(?!\.?[0-9A-Za-z_])", re.ASCII)


def check_modulus(modulus: Any) -> int:
  """`modulus` if the task accepts it (an integer from 2 to MAX_MODULUS), else ValueError."""
  if isinstance(modulus, bool) or not isinstance(modulus, int) or not (
      2 <= modulus <= MAX_MODULUS):
    raise ValueError(f"modulus={modulus!r} is not accepted; expected an integer from 2 to "
                     f"{MAX_MODULUS}")
  return modulus


@dataclasses.dataclass(frozen=True)
class SyntheticOptions(cf.Spec, path="synthetic"):
  """The task's options in a run's config (config.synthetic); also `SyntheticTask`'s defaults."""
  seed: int = cf.field(0, "fixes the train and test problems (independent of the run's seed)",
                       lo=0, hi=2**32 - 1)
  levels: tuple[int, ...] = cf.field(LEVELS, "the levels (operations per problem) in both splits",
                                     check=lambda c, name: cv.distinct_levels(c, name, LEVELS))
  train_per_level: int = cf.field(800, "training problems per level (level 1 has fewer)", lo=1)
  test_per_level: int = cf.field(60, "test problems per level", lo=1, hi=MAX_TEST_PER_LEVEL)
  num_solutions: int = cf.field(4, "reference solutions (routes) per problem for the warm-up",
                                lo=1)
  modulus: int = cf.field(DEFAULT_MODULUS, "the answers are 0..modulus-1; the problems do not "
                          "change", lo=2, hi=MAX_MODULUS)


def _prompt_suffix(modulus: int) -> str:
  return f" mod {modulus}\n"


def _total_width(modulus: int) -> int:
  """The most digits a running total has: a first term (0-9) or a total in 0..modulus-1."""
  return len(str(max(modulus - 1, 9)))


@dataclasses.dataclass(frozen=True)
class Problem:
  """`digits[0] ops[0] digits[1] ops[1] ... digits[L]` modulo `modulus`, with L = len(ops) =
  level."""
  digits: tuple[int, ...]
  ops: tuple[str, ...]
  modulus: int = DEFAULT_MODULUS

  def __post_init__(self):
    check_modulus(self.modulus)
    if len(self.digits) != len(self.ops) + 1 or not LEVELS[0] <= len(self.ops) <= LEVELS[-1]:
      raise ValueError(f"a problem has 1 + L digits and L operations with L in {LEVELS}; "
                       f"got digits={self.digits}, ops={self.ops}")
    if any(not 0 <= d <= 9 for d in self.digits) or any(op not in "+-" for op in self.ops):
      raise ValueError(f"digits must be 0-9 and operations '+' or '-'; got {self}")

  @property
  def level(self) -> int:
    return len(self.ops)

  @property
  def signs(self) -> tuple[str, ...]:
    """The sign of every term; the first term is added."""
    return ("+",) + self.ops

  @property
  def expression(self) -> str:
    return str(self.digits[0]) + "".join(f"{op}{d}" for op, d in zip(self.ops, self.digits[1:]))

  @property
  def text(self) -> str:
    """The prompt given to the model."""
    return self.expression + _prompt_suffix(self.modulus)

  @property
  def answer(self) -> int:
    return sum(d if s == "+" else -d for s, d in zip(self.signs, self.digits)) % self.modulus

  @property
  def key(self) -> tuple[tuple[str, int], ...]:
    """The multiset of signed terms: problems with equal keys are reorderings of each other."""
    return tuple(sorted(zip(self.signs, self.digits)))


def parse_problem(text: str) -> Problem:
  """Inverse of `Problem.text`; raises DataError for any other string."""
  match = _PROMPT_RE.fullmatch(text)
  if match is None:
    raise DataError(f"not a synthetic-task prompt: {text[:80]!r}; expected digits joined by '+' "
                    f"or '-' with 1 to 5 operations, followed by ' mod M' and a newline")
  expression, modulus = match.group(1), int(match.group(2))
  try:
    check_modulus(modulus)
  except ValueError as e:
    raise DataError(f"synthetic-task prompt {text[:80]!r}: {e}") from None
  return Problem(digits=tuple(int(c) for c in expression[0::2]), ops=tuple(expression[1::2]),
                 modulus=modulus)


def is_route(problem: Problem, order: Sequence[int]) -> bool:
  """Whether `order`, a permutation of term indices, is a route: it starts with an added term."""
  return sorted(order) == list(range(problem.level + 1)) and problem.signs[order[0]] == "+"


def solution(problem: Problem, order: Sequence[int]) -> str:
  """The step-by-step solution that accumulates the terms in `order`."""
  if not is_route(problem, order):
    raise ValueError(f"{list(order)} is not a route for {problem.expression}: expected a "
                     "permutation of the term indices starting with an added term")
  total = problem.digits[order[0]]
  steps = []
  for i in order[1:]:
    sign, digit = problem.signs[i], problem.digits[i]
    new_total = (total + digit if sign == "+" else total - digit) % problem.modulus
    steps.append(f"{total}{sign}{digit}={new_total}")
    total = new_total
  return _STEP_SEPARATOR.join(steps) + _ANSWER_TEMPLATE.format(total)


def num_routes(problem: Problem) -> int:
  return problem.signs.count("+") * math.factorial(problem.level)


def reference_solutions(problem: Problem, count: int = 4) -> tuple[str, ...]:
  """Up to `count` distinct solutions along different routes, left to right first, the others
  drawn with a seed derived from the problem so they are the same in every process and run.
  (Fewer when repeated digits make routes read alike, e.g. `1+1+1`.)"""
  left_to_right = tuple(range(problem.level + 1))
  solutions = [solution(problem, left_to_right)]
  rng = np.random.default_rng(zlib.crc32(problem.expression.encode()))
  starts = [i for i, s in enumerate(problem.signs) if s == "+"]
  target = min(count, num_routes(problem))
  # Bounded: collecting `target` of at least as many routes takes far fewer draws.
  for _ in range(50 * count):
    if len(solutions) >= target:
      break
    start = int(rng.choice(starts))
    rest = [i for i in left_to_right if i != start]
    text = solution(problem, (start, *(int(i) for i in rng.permutation(rest))))
    if text not in solutions:
      solutions.append(text)
  return tuple(solutions)


def max_prompt_chars(modulus: int = DEFAULT_MODULUS, level: int = LEVELS[-1]) -> int:
  """Length of the longest prompt at `level`; every prompt up to that level is at most this long."""
  return 2 * level + 1 + len(_prompt_suffix(modulus))


def max_solution_chars(modulus: int = DEFAULT_MODULUS, level: int = LEVELS[-1]) -> int:
  """Length of the longest solution at `level`; every solution up to that level is at most this
  long. A step is `a±d=r`: the first step's `a` is a term (one digit), every other `a` and every
  `r` a running total (`_total_width` digits)."""
  width = _total_width(modulus)
  return ((3 + 1 + width) + (level - 1) * (width + 3 + width)
          + (level - 1) * len(_STEP_SEPARATOR) + len(_ANSWER_TEMPLATE.format("0" * width)))


def extract_answer(completion: str) -> str | None:
  """The integer after the last "final answer is" in `completion`, canonically written (no
  leading zeros or plus sign, "-0" is "0"), or None. Never raises, linear time."""
  if not isinstance(completion, str):
    return None
  phrase_ends = [m.end() for m in _PHRASE_RE.finditer(completion)]
  if not phrase_ends:
    return None
  match = _ANSWER_RE.match(completion, phrase_ends[-1])
  if match is None:
    return None
  number = match.group(1)
  sign = "-" if number[0] == "-" else ""
  digits = number.lstrip("+-").lstrip("0") or "0"
  # Canonical text instead of int(): exact for any length (int() refuses > 4300 digits).
  return digits if digits == "0" else sign + digits


def _enumerate_level(level: int, modulus: int) -> Iterator[Problem]:
  for digits in itertools.product(range(10), repeat=level + 1):
    for ops in itertools.product("+-", repeat=level):
      yield Problem(digits=digits, ops=ops, modulus=modulus)


def _stream(level: int, rng: np.random.Generator, modulus: int) -> Iterator[Problem]:
  """Problems of one level in a seeded random order: a permutation of all of them where that is
  small, independent uniform draws (repeats possible) otherwise. The order does not depend on
  the modulus (terms are digits for every modulus)."""
  size = 10 * 2 ** level * 10 ** level
  if size <= 5000:
    everything = list(_enumerate_level(level, modulus))
    for i in rng.permutation(len(everything)):
      yield everything[i]
    return
  for _ in range(200 * size):  # ends long before: callers stop once they have enough
    yield Problem(digits=tuple(int(d) for d in rng.integers(0, 10, level + 1)),
                  ops=tuple("+-"[int(b)] for b in rng.integers(0, 2, level)), modulus=modulus)


def generate_split_problems(*, seed: int, train_per_level: int, test_per_level: int,
                            levels: Sequence[int] = LEVELS,
                            modulus: int = DEFAULT_MODULUS) -> dict[str, list[Problem]]:
  """Deterministic train and test problems: level by level, test first (one problem per
  multiset of signed terms), then train (distinct texts, no multiset shared with test)."""
  check_modulus(modulus)
  splits: dict[str, list[Problem]] = {"train": [], "test": []}
  for level in levels:
    if level not in LEVELS:
      raise ValueError(f"level {level!r} is not accepted; expected one of {LEVELS}")
    stream = _stream(level, np.random.default_rng([seed, level]), modulus)
    test_keys: set = set()
    for problem in stream:
      if len(test_keys) >= test_per_level:
        break
      if problem.key not in test_keys:
        test_keys.add(problem.key)
        splits["test"].append(problem)
    seen: set[Problem] = set()
    for problem in stream:
      if len(seen) >= train_per_level:
        break
      if problem.key not in test_keys and problem not in seen:
        seen.add(problem)
        splits["train"].append(problem)
  return splits


def make_tokenizer() -> Tokenizer:
  """A character-level `tokenizers` tokenizer: one id per character, <unk> for the rest."""
  vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
  tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=UNK))
  tok.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
  tok.decoder = decoders.Fuse()  # concatenate characters; the default decoder joins with spaces
  tok.add_special_tokens(list(SPECIAL_TOKENS))
  return Tokenizer(tok=tok, bos_id=vocab[BOS], eos_ids=(vocab[EOS],), pad_id=vocab[PAD])


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
  """Reads back a tokenizer written by `make_tokenizer().save(directory)`."""
  return Tokenizer.from_file(os.fspath(path), bos=BOS, eos=(EOS,), pad=PAD)


class SyntheticTask(Task):
  """Signed digit chains modulo `modulus` (see the module docstring for the design).

  Args:
    seed: fixes both splits.
    train_per_level: training problems per level (level 1 has at most ~120).
    test_per_level: test problems per level (at most 155 at level 1).
    levels: the levels to include.
    num_solutions: reference solutions (distinct routes) per problem.
    correct_reward, wrong_reward: the reward of a correct and of any other completion.
    tokenizer: tokenizes the prompts; the task's character tokenizer by default.
    modulus: the answers are 0..modulus-1 (2 to MAX_MODULUS); the problems do not depend on it.
  """

  name = "synthetic"

  def __init__(self, *, seed: int = SyntheticOptions.seed,
               train_per_level: int = SyntheticOptions.train_per_level,
               test_per_level: int = SyntheticOptions.test_per_level,
               levels: Sequence[int] = SyntheticOptions.levels,
               num_solutions: int = SyntheticOptions.num_solutions,
               correct_reward: float = 1.0, wrong_reward: float = -1.0,
               tokenizer: Tokenizer | None = None, modulus: int = SyntheticOptions.modulus):
    if num_solutions < 1:
      raise ValueError(f"num_solutions={num_solutions} is not accepted; expected >= 1")
    self.seed = seed
    self.modulus = check_modulus(modulus)
    self.tokenizer = tokenizer or make_tokenizer()
    self.num_solutions = num_solutions
    self.correct_reward = float(correct_reward)
    self.wrong_reward = float(wrong_reward)
    self._levels = tuple(sorted(set(levels)))
    self._problems = generate_split_problems(
        seed=seed, train_per_level=train_per_level, test_per_level=test_per_level,
        levels=self._levels, modulus=self.modulus)
    self._prompts = {split: tuple(self._prompt(p) for p in problems)
                     for split, problems in self._problems.items()}

  def _prompt(self, problem: Problem) -> Prompt:
    return Prompt(id=problem.expression, text=problem.text,
                  tokens=tuple(self.tokenizer.encode(problem.text)),
                  metadata={"level": problem.level}, reference=problem.answer,
                  solution=solution(problem, range(problem.level + 1)))

  def prompts(self, split: str) -> Sequence[Prompt]:
    if split not in self._prompts:
      raise ValueError(f"split {split!r} is not accepted; expected one of {SPLITS}")
    return self._prompts[split]

  def levels(self) -> Sequence[int]:
    return self._levels

  def reference_solutions(self, prompt: Prompt) -> Sequence[str]:
    return reference_solutions(parse_problem(prompt.text), self.num_solutions)

  def records(self, split: str) -> Iterator[dict[str, Any]]:
    """The split as JSON-ready records, the form the data pipeline stores."""
    self.prompts(split)  # validates `split`
    for problem in self._problems[split]:
      yield {"id": problem.expression, "problem": problem.text, "answer": str(problem.answer),
             "level": problem.level,
             "solutions": list(reference_solutions(problem, self.num_solutions))}

  def prompt_from_record(self, record: Mapping[str, Any]) -> Prompt:
    text = record.get("problem")
    if not isinstance(text, str):
      raise DataError(f"synthetic record {record.get('id')!r} has no 'problem' string")
    problem = parse_problem(text)
    if problem.modulus != self.modulus:
      raise DataError(f"synthetic record {record.get('id')!r} is a problem modulo "
                      f"{problem.modulus}, but the task's modulus is {self.modulus}")
    if str(record.get("answer")) != str(problem.answer):
      raise DataError(f"synthetic record {record.get('id')!r} has answer {record.get('answer')!r}, "
                      f"but {problem.expression} mod {problem.modulus} is {problem.answer}")
    return self._prompt(problem)

  def score(self, prompts: Sequence[Prompt],
            completions: Sequence[Sequence[str]]) -> list[GroupScore]:
    return exact_answer_scores(prompts, completions, extract_answer, self.correct_reward,
                               self.wrong_reward)
