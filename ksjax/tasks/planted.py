"""A planted task: prompts whose k-sample optima are known in closed form and differ by objective.

Each split holds instances of one prompt text (`prompt 0`), with distinct ids and a hidden label
each: one of m answers, the capital letters A, B, ... A completion is right when it is exactly
its instance's letter; anything else, or nothing, answers nothing and is wrong. The labels come
in exact proportions, `labels` = (3, 2) by default: of every five instances, three are right
with A and two with B, so a policy that answers A with probability q_A and B with q_B is right
with probability f_A q_A + f_B q_B, f = (0.6, 0.4).

Why instances and not a random label in `score`: the trainer's prompt stream draws instances,
so a group's n samples are graded against one instance's label, drawn with frequency f (as
ESTIMATORS.md's planted optimum assumes), scoring is a pure function of the prompt and the
completion, and a resumed run sees the same labels. With batch_prompts a multiple of a split's
size, every step holds each instance equally often.

What each objective's optimum is (`ksjax.objectives.planted`, derived in docs/objectives.md):
the mean and majority voting answer the most frequent letter always (value 0.6 at f = (0.6,
0.4)); pass@4 mixes A and B as 0.534 / 0.466 (pass@4 0.939, against 0.6 at the mean's optimum).

The start. The supervised warm-up (config.sft_warmup) trains on `reference_solutions`, which are
not the labels but `start`: `start[j]` copies of letter j per prompt, so the warm-up's
maximum-likelihood policy answers with proportions start / sum(start). The default (1, 4) starts
at q_A = 0.2, off every optimum: the mean and voting must move A up to 1, pass@4 to 0.534 and the
MaxRL mixture to 0.639.

More prompt types (`prompts`): type t has its own text (`prompt t`) and its labels and start
rotated by t answers (type 1: A 40%, B 60%), so that no policy that ignores the prompt is
optimal. One type is the default because with two, on the tiny Llama, mean training did not
separate them: in one run at a learning rate of 3e-3 (100 steps) it drove both types to answer
A, and one at 1e-3 ended 200 steps at a mean of 0.546 of 0.6. A type whose policy has become
deterministic gets no leave-one-out signal (all its samples agree), so a shared push toward one
answer is not undone.

The tokenizer is the embedded task's, one token per character (`ksjax.tasks.synthetic`), so the
tiny Llama of the embedded configs runs on it; an answer is one token, and configs/planted.py
samples completions of one token, so the probability of being graded j is exactly that of
sampling token j (`ksjax.evaluation.planted`).
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Sequence
from typing import Any

import numpy as np

from ksjax import config_fields as cf
from ksjax import config_validation as cv
from ksjax.config_validation import ConfigError
from ksjax.tasks import synthetic
from ksjax.tasks.base import GroupScore, Prompt, Task, exact_answer_scores
from ksjax.tokenization import Tokenizer

SPLITS = ("train", "test")
ANSWERS = tuple(string.ascii_uppercase)  # the letters, in order: answer j is ANSWERS[j]
MAX_PROMPTS = 100


def _counts(config: Any, name: str) -> tuple[int, ...]:
  """Counts per answer: 2 to 26 integers >= 0, not all 0."""
  value = cv.get(config, name)
  ok = (isinstance(value, (tuple, list)) and 2 <= len(value) <= len(ANSWERS)
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
        and any(value))
  if not ok:
    raise ConfigError(f"config.{name}={value!r} is not accepted; expected 2 to {len(ANSWERS)} "
                      "integers >= 0, not all 0 (one per answer A, B, ...)")
  return tuple(value)


@dataclasses.dataclass(frozen=True)
class PlantedOptions(cf.Spec, path="planted"):
  """The planted task's options in a run's config (config.planted); also `PlantedTask`'s
  defaults."""
  labels: tuple[int, ...] = cf.field((3, 2), "instances per answer (A, B, ...) of each prompt "
                                     "in each split: the labels' exact frequencies",
                                     check=_counts)
  start: tuple[int, ...] = cf.field((1, 4), "warm-up solutions per answer of each prompt: where "
                                    "the warm-up puts the start", check=_counts)
  prompts: int = cf.field(1, "prompt types; type t's labels and start are rotated by t answers",
                          lo=1, hi=MAX_PROMPTS)

  def __post_init__(self):
    super().__post_init__()
    self._start_names_every_answer()

  def _start_names_every_answer(self):
    if len(self.start) != len(self.labels):
      raise ConfigError(f"config.planted.start={self.start!r} is not accepted with "
                        f"config.planted.labels={self.labels!r}; expected {len(self.labels)} "
                        "counts, one per answer")


def rotated(counts: Sequence[int], t: int) -> tuple[int, ...]:
  """`counts` of prompt type t: answer j takes counts[(j - t) mod m]."""
  m = len(counts)
  return tuple(counts[(j - t) % m] for j in range(m))


def frequencies(labels: Sequence[int], prompts: int) -> np.ndarray:
  """f [P, m], float64: the share of each type's instances that answer j is right for."""
  counts = np.asarray([rotated(labels, t) for t in range(prompts)], np.float64)
  return counts / counts.sum(1, keepdims=True)


def prompt_text(t: int) -> str:
  return f"prompt {t}\n"


class PlantedTask(Task):
  """Prompt types with hidden labels in exact proportions (see the module docstring).

  Args:
    labels: instances per answer of each prompt type in each split (type t's rotated by t).
    start: warm-up solutions per answer of each prompt type (rotated alike).
    prompts: the number of prompt types.
    correct_reward, wrong_reward: the reward of a right and of any other completion.
    tokenizer: the embedded task's character tokenizer by default.
  """

  name = "planted"

  def __init__(self, *, labels: Sequence[int] = PlantedOptions.labels,
               start: Sequence[int] = PlantedOptions.start,
               prompts: int = PlantedOptions.prompts, correct_reward: float = 1.0,
               wrong_reward: float = -1.0, tokenizer: Tokenizer | None = None):
    options = PlantedOptions(labels=tuple(labels), start=tuple(start), prompts=prompts)
    self.labels, self.start, self.num_types = options.labels, options.start, options.prompts
    self.answers = ANSWERS[:len(self.labels)]
    self.tokenizer = tokenizer or synthetic.make_tokenizer()
    self.correct_reward = float(correct_reward)
    self.wrong_reward = float(wrong_reward)
    self._prompts = {split: tuple(self._instances(split)) for split in SPLITS}

  def _instances(self, split: str):
    for t in range(self.num_types):
      text = prompt_text(t)
      tokens = tuple(self.tokenizer.encode(text))
      counts = rotated(self.labels, t)
      labels = [a for a, c in zip(self.answers, counts) for _ in range(c)]
      for i, label in enumerate(labels):
        yield Prompt(id=f"{split}/{t}/{i}", text=text, tokens=tokens,
                     metadata={"level": t}, reference=label, solution=None)

  def prompts(self, split: str) -> Sequence[Prompt]:
    if split not in self._prompts:
      raise ValueError(f"split {split!r} is not accepted; expected one of {SPLITS}")
    return self._prompts[split]

  def levels(self) -> Sequence[int]:
    """The prompt types: per-type breakdowns in the held-out table."""
    return tuple(range(self.num_types))

  def type_prompts(self, split: str = "test") -> list[Prompt]:
    """One prompt per type, in type order (the types' texts: what the policy is measured on)."""
    seen: dict[int, Prompt] = {}
    for prompt in self.prompts(split):
      seen.setdefault(prompt.metadata["level"], prompt)
    return [seen[t] for t in range(self.num_types)]

  def frequencies(self) -> np.ndarray:
    """f [P, m]: each type's label frequencies (the same in both splits)."""
    return frequencies(self.labels, self.num_types)

  def reference_solutions(self, prompt: Prompt) -> Sequence[str]:
    """The warm-up's solutions for the prompt's type: `start` copies of each letter, not the
    label (module docstring)."""
    counts = rotated(self.start, prompt.metadata["level"])
    return tuple(a for a, c in zip(self.answers, counts) for _ in range(c))

  def extract_answer(self, completion: str) -> str | None:
    """The completion if it is exactly one of the answers, else None (never raises)."""
    return completion if isinstance(completion, str) and completion in self.answers else None

  def score(self, prompts: Sequence[Prompt],
            completions: Sequence[Sequence[str]]) -> list[GroupScore]:
    return exact_answer_scores(prompts, completions, self.extract_answer, self.correct_reward,
                               self.wrong_reward)
