"""The task interface shared by the trainer and the eval binary.

A task yields prompts and scores groups of completions. Scoring is where adversarial model output
meets the system (answer checkers, program sandboxes), so implementations must never hang, crash
or leak: every score returns, within its time limit, a finite reward.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
  from ksjax.tokenization import Tokenizer


@dataclasses.dataclass(frozen=True)
class Prompt:
  """One problem.

  Attributes:
    id: stable identifier, unique within the task's split.
    text: the prompt text given to the model (instructions included).
    tokens: `text` tokenized by the task's tokenizer (BOS included where the tokenizer uses one).
    metadata: e.g. {"level": 3, "subject": "Algebra"}; values are str/int/float.
    reference: what the scorer checks against (gold answer for math, tests for code); opaque.
    solution: a reference solution in the model's output format, for supervised warm-up (or None).
  """
  id: str
  text: str
  tokens: tuple[int, ...]
  metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  reference: Any = None
  solution: str | None = None


@dataclasses.dataclass(frozen=True)
class GroupScore:
  """Scores of the n completions of one prompt.

  Attributes:
    rewards: float32 [n]; +1/-1 by default (configurable per task).
    correct: bool [n].
    answers: the extracted final answer of each completion (None where none could be extracted).
    answer_ids: int32 [n]; equivalence classes within the group for majority voting: completions
      whose answers are equal (mathematically, for math) share an id. Completions without an answer
      all share one class, whose reward is the failure reward. Ids are 0..m-1 in order of first
      appearance. Within a class every completion has the same reward.
  """
  rewards: np.ndarray
  correct: np.ndarray
  answers: tuple[str | None, ...]
  answer_ids: np.ndarray


class Task(abc.ABC):
  """A source of prompts with a verifier.

  A task may start worker processes to score (answer checkers, program sandboxes); `close`
  stops them, and `with task:` closes it on the way out. Attributes: `name`, and `tokenizer`,
  the tokenizer of `Prompt.tokens`, which also decodes the model's completions.
  """

  name: str
  tokenizer: Tokenizer

  def close(self) -> None:
    """Stops the worker processes the task started to score (none by default); safe to call
    more than once."""

  def metrics(self) -> dict[str, float]:
    """What the task measured while scoring since the last call (e.g. how answers were read),
    logged with the step's metrics; none by default. Each process counts the completions it
    scored."""
    return {}

  def __enter__(self) -> Task:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  @abc.abstractmethod
  def prompts(self, split: str) -> Sequence[Prompt]:
    """All prompts of `split` ("train" or "test"; tasks may offer more), in a fixed order."""

  @abc.abstractmethod
  def score(self, prompts: Sequence[Prompt], completions: Sequence[Sequence[str]]) -> list[GroupScore]:
    """Scores `completions[g]` (n strings) against `prompts[g]`, for every group g.

    Implementations may score in parallel; the result is in the order of `prompts`.
    """

  def levels(self) -> Sequence[Any]:
    """The values of metadata["level"] this task uses, for per-level breakdowns ([] if none)."""
    return []

  def reference_solutions(self, prompt: Prompt) -> Sequence[str]:
    """Reference solutions of `prompt` in the model's output format, for supervised warm-up.

    Tasks with several solutions per problem (different routes to the answer) return them all.
    """
    return () if prompt.solution is None else (prompt.solution,)

  def prompt_from_record(self, record: Mapping[str, Any]) -> Prompt:
    """Turns one normalized dataset record (as the `ksjax.tasks.data` pipeline stores it) into a
    Prompt, so the trainer can map the grain pipeline's records to prompts."""
    raise NotImplementedError(f"task {self.name!r} does not read dataset records")


def exact_answer_scores(prompts: Sequence[Prompt], completions: Sequence[Sequence[str]],
                        extract: Callable[[str], str | None], correct_reward: float,
                        wrong_reward: float) -> list[GroupScore]:
  """`Task.score` for tasks whose answers are canonical strings: a completion is right when
  `extract` (which never raises) gives str(prompt.reference), and its class is its answer."""
  if len(prompts) != len(completions):
    raise ValueError(f"{len(prompts)} prompts but {len(completions)} completion groups")
  scores = []
  for prompt, group in zip(prompts, completions):
    answers = tuple(extract(c) for c in group)
    correct = np.asarray([a == str(prompt.reference) for a in answers], dtype=bool)  # [n]
    rewards = np.where(correct, correct_reward, wrong_reward).astype(np.float32)
    scores.append(GroupScore(rewards=rewards, correct=correct, answers=answers,
                             answer_ids=answer_classes(answers)))
  return scores


def answer_classes(keys: Sequence[Any]) -> np.ndarray:
  """int32 ids 0..m-1 in order of first appearance for hashable, already-canonical keys."""
  seen: dict[Any, int] = {}
  return np.asarray([seen.setdefault(key, len(seen)) for key in keys], dtype=np.int32)


class DataError(ValueError):
  """A dataset file is missing or malformed; the message names the path and the expected format."""
