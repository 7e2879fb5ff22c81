"""What the dataset-backed tasks share: splits of normalized records, prompts built on demand.

`MathTask` (MATH, MATH-500, HARP) and `CodeTask` (CodeContests, TACO) differ in their records,
prompts and scorers, and agree on everything around them, which lives here once:

* each split is given as records (a reader's dicts, e.g. decoded from a built dataset) or as a
  path read by one of the task's `READERS`; every record is validated when the task is made, so
  a malformed one fails there, naming its split and index;
* `prompts(split)` builds the split's prompts on first use; `prompt_from_record` does the same
  for one record as the data pipeline (`ksjax.tasks.data`) stores it;
* the worker pool a task starts to score is registered with `_own` and stopped by `close` (a
  pool passed in by the caller stays the caller's to close).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, TypeVar

from ksjax.tasks.base import Prompt, Task
from ksjax.tokenization import Tokenizer

Source = Iterable[Mapping[str, Any]] | str | os.PathLike


class _Closable(Protocol):

  def close(self) -> None:
    ...


_C = TypeVar("_C", bound=_Closable)


class RecordTask(Task):
  """A task over splits of normalized records.

  Subclasses set READERS (format name -> function path -> records) and implement `_validated`,
  `_prompt` and `score`.

  Args:
    splits: split name -> records or a path read with the reader `fmt`. May be {} when prompts
      come from the data pipeline (`prompt_from_record`).
    tokenizer: encodes the prompt text.
    fmt: the reader (a key of READERS) of the splits given as paths.
    correct_reward, wrong_reward: rewards of a correct and of any other completion.
    name: the task's name in logs.
  """

  READERS: ClassVar[Mapping[str, Callable[[str], Iterable[Mapping[str, Any]]]]]

  def __init__(self, splits: Mapping[str, Source], tokenizer: Tokenizer, *, fmt: str | None,
               correct_reward: float, wrong_reward: float, name: str):
    if fmt is not None and fmt not in self.READERS:
      raise ValueError(f"fmt={fmt!r} is not accepted; expected one of {sorted(self.READERS)}")
    self.name = name
    self.tokenizer = tokenizer
    self.correct_reward = float(correct_reward)
    self.wrong_reward = float(wrong_reward)
    self._owned: list[_Closable] = []
    self._records: dict[str, list[dict[str, Any]]] = {}
    for split, source in splits.items():
      if isinstance(source, (str, os.PathLike)):
        if fmt is None:
          raise ValueError(f"split {split!r} is a path; pass fmt= ({' or '.join(self.READERS)}) "
                           "to say how to read it")
        source = self.READERS[fmt](os.fspath(source))
      self._records[split] = [self._validated(f"split {split!r}, record {i}", r)
                              for i, r in enumerate(source)]
    self._prompts: dict[str, list[Prompt]] = {}

  @staticmethod
  @abc.abstractmethod
  def _validated(where: str, record: Any) -> dict[str, Any]:
    """The record as the task keeps it, or DataError starting with `where` and naming the
    fields the task accepts."""

  @abc.abstractmethod
  def _prompt(self, record: Mapping[str, Any]) -> Prompt:
    """The prompt of a validated record."""

  def _own(self, resource: _C) -> _C:
    """Registers a worker pool this task started, for `close` to stop."""
    self._owned.append(resource)
    return resource

  def close(self) -> None:
    """Stops the worker pools this task started (not those it was given)."""
    for resource in self._owned:
      resource.close()

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
