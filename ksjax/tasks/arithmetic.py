"""Arithmetic word problems for real instruct models: the embedded task with a large answer space.

The synthetic task (`ksjax.tasks.synthetic`) is made for tiny character models trained from
scratch. This one is made for small pretrained instruct models (SmolLM2-135M-Instruct, Llama 3.2
1B Instruct): plain-English questions in the model's own chat template with integer answers
from 1 to 144, so a guessing model's wrong answers spread over many classes and majority voting
is a real choice.

  level 1: "What is 7 + 8?", "What is 4 times 3?" (sums of digits 1-9, products of digits 2-5)
  level 2: "What is 8 times 7?", "Multiply 11 by 6." (the times tables up to 12 x 12 beyond
           level 1's: a factor of 6-12)
  level 3: "Tom has 12 apples. He buys 7 more. How many apples does he have now?" (one step of
           adding or taking away a digit 2-9, from a start of 3-15)
  level 4: "Mia has 5 cookies. She gives away 3 and then finds 9 more. How many cookies does she
           have now?" (the same with two steps)

Calibration. The aim is a start of RL where pass@1 per level spans about 0.02-0.4 and pass@16
about 0.3-0.95, the regime in which training for pass@k and for the mean differ. The levels were
chosen on SmolLM2-135M-Instruct's training problems with `benchmarks/calibrate_arithmetic.py`
(the figures per level: docs/results.md). Two-digit sums are beyond this model (it answers
"41 + 5" with 96): stories of two and three steps over them sat at the guessing floor, where
level 4 was no harder than level 3. The model knows some of the times tables by heart, so
products of up to 12 x 12 take level 2's place. Each calibration figure rests on 16 problems;
differences below about 0.05 in pass@1 are noise.

Prompts. The user message is the question and a short instruction ("Give the final answer as a
number."), optionally after a system prompt, rendered with the model's chat template
(`ksjax.tasks.chat.ChatTemplate`) and tokenized by the model's tokenizer with its BOS policy
(`Tokenizer.add_bos`), except that a template which writes `bos_token` itself (Llama 3's) gets
no second one: a doubled BOS is out of distribution. Prompts then equal transformers'
`apply_chat_template` token for token wherever the tokenizer adds BOS only when it should.

Scoring. Instruct models state a number in many ways ("The answer is 85", "\\boxed{85}", "85.",
"**85**", "7 + 8 = 15"), and a task that accepts only one of them measures format compliance,
not arithmetic. `extract_answer` takes, in this order: a `\\boxed{}` or "final answer is"
statement (`ksjax.tasks.math_answer`, the last one stated); else the number after the last
"answer is"/"answer:"; else the last number in the completion. A last `\\boxed{` that never
closes (a completion cut off by the length limit) states no answer. The answers are then checked
against the gold by the hardened math-verify pool and grouped into answer classes exactly as
`MathTask` does (`math_task.score_answers`): same workers, time limits, rewards and classes.

Splits. Problems are generated deterministically from the seed, level by level: test problems
first, then training problems, skipping any problem whose key (the numbers and operations, not
the wording: names, objects, phrasing and the order of a sum's or product's operands) is in the
test split. So no test problem appears in training even reworded, and the test split does not
change with the training split's size. Level 1 has 55 problems up to wording: a test split takes
at most that many, and the training split gets the rewordings of the rest (about 80 for the
default 40 test problems).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ksjax import config_fields as cf
from ksjax import config_validation as cv
from ksjax.tasks import math_answer
from ksjax.tasks.base import GroupScore, Prompt, Task
from ksjax.tasks.chat import ChatTemplate
from ksjax.tasks.math_checker import AnswerChecker, CheckerConfig
from ksjax.tasks.math_task import score_answers
from ksjax.tokenization import Tokenizer

LEVELS = (1, 2, 3, 4)
SPLITS = ("train", "test")
DEFAULT_INSTRUCTION = "Give the final answer as a number."

# Operand ranges per level (inclusive), set by the calibration (module docstring).
SINGLE_DIGIT_SUM = (1, 9)  # level 1
SMALL_PRODUCT = (2, 5)  # level 1
TIMES_TABLE = (2, 12)  # level 2: products up to 12 x 12 but not both factors SMALL_PRODUCT
SINGLE_DIGIT = (2, 9)  # the story steps
STORY_START = (3, 15)  # levels 3 and 4
STORY_STEPS = {3: 1, 4: 2}

_FINAL_SENTENCE = "The final answer is {}."

_NAMES = (("Tom", "he"), ("Anna", "she"), ("Ben", "he"), ("Lucy", "she"), ("Omar", "he"),
          ("Mia", "she"), ("Ravi", "he"), ("Zoe", "she"), ("Carlos", "he"), ("Priya", "she"),
          ("Leo", "he"), ("Aisha", "she"), ("Jack", "he"), ("Nina", "she"), ("Sam", "he"),
          ("Emma", "she"))
_THINGS = ("apples", "marbles", "stickers", "pencils", "cookies", "books", "coins", "stamps",
           "shells", "cards", "balloons", "toy cars")
_GAINS = ("buys {} more", "finds {} more", "gets {} more from a friend", "wins {} more")
_LOSSES = ("gives away {}", "loses {}", "sells {}", "gives {} to a friend")
_SUM_PHRASES = ("What is {} + {}?", "What is {} plus {}?", "Add {} and {}.")
_PRODUCT_PHRASES = ("What is {} times {}?", "What is {} * {}?", "Multiply {} by {}.")

# Answer extraction. Every pattern is linear: no nested quantifiers.
_LOOSE_PHRASE = re.compile(r"answer\s*(?:is|:|=)", re.IGNORECASE)
# A number not glued to a word or another number ("H2O", "12-5" give "2" and "5" no sign); commas
# group thousands ("1,234"); a final "." is punctuation ("85." is 85).
_NUMBER = re.compile(r"(?<![0-9A-Za-z_.])(-?)([0-9]+(?:,[0-9]{3})*(?:\.[0-9]+)?)(?![0-9])")
_DECORATION = " \t\n*_$`\"'"  # Markdown emphasis, math and quote marks around a stated answer.
_PLAIN_ANSWER = re.compile(r"(-?[0-9]+(?:,[0-9]{3})*(?:\.[0-9]+)?)[ A-Za-z.!]*")
_PHRASE_WINDOW = 80  # characters after "answer is" searched for the number
_MATH_SIGNS = "\\/^(){}+-*"  # an answer with these is an expression: math-verify reads it


@dataclasses.dataclass(frozen=True)
class Step:
  """One operation of a worked solution: `left op right = result`."""
  left: int
  op: str  # "+", "-" or "*"
  right: int
  result: int

  def text(self) -> str:
    return f"{self.left} {'×' if self.op == '*' else self.op} {self.right} = {self.result}"


@dataclasses.dataclass(frozen=True)
class Problem:
  """A question with its worked steps.

  Attributes:
    level: 1-4.
    question: the problem in words (without the instruction).
    steps: the worked solution, one operation each; the last result is the answer.
    key: identity up to wording: problems with equal keys are the same problem.
  """
  level: int
  question: str
  steps: tuple[Step, ...]
  key: tuple

  @property
  def answer(self) -> int:
    return self.steps[-1].result

  def solution(self) -> str:
    """The worked solution in the model's output format, ending in the answer sentence."""
    return "\n".join([s.text() for s in self.steps] + [_FINAL_SENTENCE.format(self.answer)])


def _pick(rng: np.random.Generator, options: Sequence[Any]) -> Any:
  return options[int(rng.integers(len(options)))]


def _between(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
  return int(rng.integers(bounds[0], bounds[1] + 1))


def _two_operands(rng: np.random.Generator, level: int, op: str, bounds: tuple[int, int],
                  phrases: Sequence[str]) -> Problem:
  a, b = _between(rng, bounds), _between(rng, bounds)
  result = a + b if op == "+" else a * b
  return Problem(level=level, question=_pick(rng, phrases).format(a, b),
                 steps=(Step(a, op, b, result),), key=(level, op, min(a, b), max(a, b)))


def _level1(rng: np.random.Generator) -> Problem:
  """Sums of digits 1-9 and products of digits 2-5: 45 + 10 problems up to wording."""
  if rng.integers(5) == 0:
    return _two_operands(rng, 1, "*", SMALL_PRODUCT, _PRODUCT_PHRASES)
  return _two_operands(rng, 1, "+", SINGLE_DIGIT_SUM, _SUM_PHRASES)


def _level2(rng: np.random.Generator) -> Problem:
  """The times tables beyond level 1's: 66 - 10 = 56 problems up to wording."""
  while True:  # ends: 56 of the 66 factor pairs qualify
    problem = _two_operands(rng, 2, "*", TIMES_TABLE, _PRODUCT_PHRASES)
    if problem.key[-1] > SMALL_PRODUCT[1]:
      return problem


def _story(rng: np.random.Generator, level: int, num_steps: int) -> Problem:
  """`num_steps` gains or losses of a count that starts at STORY_START and never drops below 1."""
  name, pronoun = _pick(rng, _NAMES)
  things = _pick(rng, _THINGS)
  total = _between(rng, STORY_START)
  start = total
  steps, clauses = [], []
  for _ in range(num_steps):
    amount = _between(rng, SINGLE_DIGIT)
    if rng.integers(2) and amount < total:
      steps.append(Step(total, "-", amount, total - amount))
      clauses.append(_pick(rng, _LOSSES).format(amount))
    else:
      steps.append(Step(total, "+", amount, total + amount))
      clauses.append(_pick(rng, _GAINS).format(amount))
    total = steps[-1].result
  if num_steps == 1:
    actions = clauses[0]
  elif num_steps == 2:
    actions = f"{clauses[0]} and then {clauses[1]}"
  else:
    actions = ", then ".join(clauses[:-1]) + f", and then {clauses[-1]}"
  question = (f"{name} has {start} {things}. {pronoun.capitalize()} {actions}. "
              f"How many {things} does {pronoun} have now?")
  key = (level, start) + tuple((s.op, s.right) for s in steps)
  return Problem(level=level, question=question, steps=tuple(steps), key=key)


_GENERATORS: dict[int, Callable[[np.random.Generator], Problem]] = {
    1: _level1,
    2: _level2,
    3: lambda rng: _story(rng, 3, STORY_STEPS[3]),
    4: lambda rng: _story(rng, 4, STORY_STEPS[4]),
}


def generate_split_problems(*, seed: int, train_per_level: int, test_per_level: int,
                            levels: Sequence[int] = LEVELS) -> dict[str, list[Problem]]:
  """Deterministic train and test problems: level by level, test first (distinct keys), then
  train (distinct questions, no key shared with test). A level whose problems run out (level 1)
  gives fewer training problems; one that cannot fill its test split is an error."""
  if train_per_level < 0 or test_per_level < 0:
    raise ValueError(f"train_per_level={train_per_level} and test_per_level={test_per_level} "
                     "must be >= 0")
  splits: dict[str, list[Problem]] = {"train": [], "test": []}
  for level in levels:
    if level not in LEVELS:
      raise ValueError(f"level {level!r} is not accepted; expected one of {LEVELS}")
    rng = np.random.default_rng([seed, level])
    # Bounded: enough draws to exhaust level 1 (~500 wordings) many times over.
    draws = iter(range(max(20_000, 50 * (train_per_level + test_per_level))))
    test_keys: set[tuple] = set()
    for _ in draws:
      if len(test_keys) >= test_per_level:
        break
      problem = _GENERATORS[level](rng)
      if problem.key not in test_keys:
        test_keys.add(problem.key)
        splits["test"].append(problem)
    if len(test_keys) < test_per_level:
      raise ValueError(f"level {level} has only {len(test_keys)} distinct problems; "
                       f"test_per_level={test_per_level} asks for more")
    seen: set[str] = set()
    for _ in draws:
      if len(seen) >= train_per_level:
        break
      problem = _GENERATORS[level](rng)
      if problem.key not in test_keys and problem.question not in seen:
        seen.add(problem.question)
        splits["train"].append(problem)
  return splits


def _plain_number(answer: str) -> str:
  """`answer` without decoration: the right-hand side of an equation ("7 + 8 = 15" is 15); the
  number in words ("85 apples", "that he has 14"). An expression ("\\frac{30}{2}", "30/2") is
  returned for math-verify to read."""
  answer = answer.replace("**", "").strip(_DECORATION)  # Markdown bold anywhere: "**14** apples"
  if "=" in answer:
    answer = answer.rsplit("=", 1)[1].strip(_DECORATION)
  match = _PLAIN_ANSWER.fullmatch(answer)
  if match:
    return match.group(1).replace(",", "")
  if not any(c in answer for c in _MATH_SIGNS):
    # Words around a number ("that Tom has 14 apples"): the number they state, the last one.
    numbers = list(_NUMBER.finditer(answer))
    if numbers:
      return numbers[-1].group(1) + numbers[-1].group(2).replace(",", "")
  return answer.rstrip(".").strip(_DECORATION)


def extract_answer(completion: str) -> str | None:
  """The answer a completion states (rules in the module docstring), or None. Linear time."""
  if not isinstance(completion, str):
    return None
  box = math_answer.last_boxed(completion)
  if box is not None and box[1] is None:
    return None  # the last box never closes: cut off, its answer may be incomplete ("\\boxed{85")
  marked = math_answer.extract_answer(completion)
  if marked is not None:
    answer = _plain_number(marked)
    return answer or None
  phrases = list(_LOOSE_PHRASE.finditer(completion))
  if phrases:
    end = phrases[-1].end()
    number = _NUMBER.search(completion, end, end + _PHRASE_WINDOW)
    if number is not None:
      return number.group(1) + number.group(2).replace(",", "")
  last = None
  for last in _NUMBER.finditer(completion):
    pass
  if last is None:
    return None
  return last.group(1) + last.group(2).replace(",", "")


@dataclasses.dataclass(frozen=True)
class ArithmeticOptions(cf.Spec, path="arithmetic"):
  """The task's options in a run's config (config.arithmetic); also `ArithmeticTask`'s
  defaults."""
  seed: int = cf.field(0, "fixes the train and test problems (independent of the run's seed)",
                       lo=0, hi=2**32 - 1)
  levels: tuple[int, ...] = cf.field(LEVELS, "the levels in both splits",
                                     check=lambda c, name: cv.distinct_levels(c, name, LEVELS))
  train_per_level: int = cf.field(500, "training problems per level (level 1 has fewer)", lo=1)
  test_per_level: int = cf.field(40, "test problems per level (level 1 has at most 55)", lo=1)


class ArithmeticTask(Task):
  """Arithmetic word problems in a chat template, scored by math-verify (module docstring).

  Args:
    tokenizer: the model's tokenizer.
    chat_template: the model's template (`ChatTemplate`, or its Jinja source).
    seed: fixes both splits.
    levels: the levels to include (of LEVELS).
    train_per_level, test_per_level: problems per level and split (level 1 has at most 55
      test problems and gives fewer training problems than asked).
    correct_reward, wrong_reward: the reward of a correct and of any other completion.
    workers, timeout_s, memory_limit_bytes: the checker pool, as in `MathTask`.
    system_prompt: a system message before each question (None: the template's own; with
      SmolLM2's, its default system message).
    instruction: appended to each question in the user message.
    checker: an already started pool to share (then the limits above are ignored and the task
      does not close it).
  """

  name = "arithmetic"

  def __init__(self, *, tokenizer: Tokenizer, chat_template: ChatTemplate | str,
               seed: int = ArithmeticOptions.seed, levels: Sequence[int] = ArithmeticOptions.levels,
               train_per_level: int = ArithmeticOptions.train_per_level,
               test_per_level: int = ArithmeticOptions.test_per_level, correct_reward: float = 1.0,
               wrong_reward: float = -1.0, workers: int = 2, system_prompt: str | None = None,
               instruction: str = DEFAULT_INSTRUCTION, timeout_s: float = 5.0,
               memory_limit_bytes: int = 2 << 30, checker: AnswerChecker | None = None):
    if not isinstance(tokenizer, Tokenizer):
      raise ValueError(f"tokenizer is a {type(tokenizer).__name__}; expected a "
                       "ksjax.tokenization.Tokenizer (the model's)")
    if isinstance(chat_template, str):
      chat_template = ChatTemplate.from_string(chat_template)
    if not isinstance(chat_template, ChatTemplate):
      raise ValueError(f"chat_template is a {type(chat_template).__name__}; expected a "
                       "ksjax.tasks.chat.ChatTemplate or a Jinja template string")
    if system_prompt is not None:
      chat_template = chat_template.with_system_prompt(system_prompt)
    self.tokenizer = tokenizer
    self.chat_template = chat_template
    self.instruction = instruction
    self.seed = seed
    self.correct_reward = float(correct_reward)
    self.wrong_reward = float(wrong_reward)
    self._levels = tuple(sorted(set(levels)))
    self._problems = generate_split_problems(seed=seed, train_per_level=train_per_level,
                                             test_per_level=test_per_level, levels=self._levels)
    self._prompts = {split: self._split_prompts(problems)
                     for split, problems in self._problems.items()}
    self._owned = checker is None
    self.checker = checker or AnswerChecker(CheckerConfig(
        workers=workers, timeout_s=timeout_s, memory_limit_bytes=memory_limit_bytes))

  def user_message(self, problem: Problem) -> str:
    return f"{problem.question} {self.instruction}" if self.instruction else problem.question

  def encode_prompt(self, text: str) -> tuple[int, ...]:
    """Token ids of a rendered prompt: the tokenizer's BOS policy (`Tokenizer.add_bos`), but BOS
    never twice when the template wrote it itself (Llama 3's writes `bos_token`)."""
    ids = self.tokenizer.encode(text)
    bos = self.tokenizer.bos_id
    if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
      ids = ids[1:]
    return tuple(ids)

  def _split_prompts(self, problems: Sequence[Problem]) -> tuple[Prompt, ...]:
    # Ids count per level so that a level's ids do not depend on the other levels' sizes.
    counts: dict[int, int] = {}
    prompts = []
    for problem in problems:
      index = counts[problem.level] = counts.get(problem.level, -1) + 1
      text = self.chat_template.render_user(self.user_message(problem))
      prompts.append(Prompt(id=f"L{problem.level}-{index:04d}", text=text,
                            tokens=self.encode_prompt(text), metadata={"level": problem.level},
                            reference=str(problem.answer), solution=problem.solution()))
    return tuple(prompts)

  def problems(self, split: str) -> Sequence[Problem]:
    """The problems behind `prompts(split)`, in the same order."""
    self.prompts(split)  # validates `split`
    return tuple(self._problems[split])

  def prompts(self, split: str) -> Sequence[Prompt]:
    if split not in self._prompts:
      raise ValueError(f"split {split!r} is not accepted; expected one of {SPLITS}")
    return self._prompts[split]

  def levels(self) -> Sequence[int]:
    return self._levels

  def close(self) -> None:
    if self._owned:
      self.checker.close()

  def score(self, prompts: Sequence[Prompt],
            completions: Sequence[Sequence[str]]) -> list[GroupScore]:
    if len(prompts) != len(completions):
      raise ValueError(f"{len(prompts)} prompts but {len(completions)} completion groups")
    answers = [[extract_answer(c) for c in group] for group in completions]  # [G][n]
    return score_answers(self.checker, [p.reference for p in prompts], answers,
                         correct_reward=self.correct_reward, wrong_reward=self.wrong_reward)
