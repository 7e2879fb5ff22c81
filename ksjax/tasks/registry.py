"""Tasks by name: the one place that maps a config's task name to a `Task`, and each task to the
options it takes from a run's config.

"synthetic" and "planted" (EMBEDDED_TASKS) are generated in memory and bring their own character
tokenizer; "arithmetic" and "reasoning_gym" (reasoning-gym's generators, an optional package) are
generated in memory too, for the model's tokenizer and chat template. The others read a dataset
built by `ksjax.tasks.data` (array_record files under `data_dir`) and tokenize with the model's
tokenizer. Importing this module loads neither jax nor a dataset reader, so that config files
can name the tasks and their options: the task classes are built on request, and the embedded task
does not start math-verify worker pools or load the sandbox.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ksjax.tasks import arithmetic, planted, reasoning_gym, synthetic
from ksjax.tasks.base import Task
from ksjax.tokenization import Tokenizer

MATH_TASKS = ("math", "math500", "harp")
CODE_TASKS = ("code_contests", "taco")
# Generated in memory with their own character tokenizer, for a fresh model: no weights to load.
EMBEDDED_TASKS = ("synthetic", "planted")
# Generated in memory for an instruct model: its tokenizer and chat template come from the run.
CHAT_TASKS = ("arithmetic", "reasoning_gym")
TASKS = EMBEDDED_TASKS + CHAT_TASKS + MATH_TASKS + CODE_TASKS
# The options of the tasks that have any: each is the section of a run's config named after its
# task (config.synthetic, ...), passed to the task's class as keyword arguments.
OPTIONS = {"synthetic": synthetic.SyntheticOptions, "arithmetic": arithmetic.ArithmeticOptions,
           "reasoning_gym": reasoning_gym.ReasoningGymOptions, "planted": planted.PlantedOptions}


def make_task(name: str, *, tokenizer: Tokenizer | None = None,
              data_dir: str | os.PathLike | None = None, splits: Sequence[str] | None = None,
              **options: Any) -> Task:
  """The task `name`.

  Args:
    name: one of TASKS.
    tokenizer: the model's tokenizer; required except for EMBEDDED_TASKS (default: their own).
    data_dir: where `ksjax.tasks.data.build` put the dataset; required except for the generated
      tasks (EMBEDDED_TASKS and CHAT_TASKS).
    splits: the splits to hold in memory for `Task.prompts` (default: every built split). Pass
      () when prompts come only from the data pipeline (`batch_iterator(load_records(...),
      transform=task.prompt_from_record)`), e.g. for CodeContests, whose tests are large.
    **options: keyword arguments of the task class (`SyntheticTask`, `PlantedTask`,
      `ArithmeticTask`, `ReasoningGymTask`, `MathTask`, `CodeTask`): the fields of its OPTIONS,
      correct_reward and wrong_reward, worker counts; for CHAT_TASKS, chat_template and
      system_prompt.
  """
  if name not in TASKS:
    raise ValueError(f"task {name!r} is not accepted; expected one of "
                     f"{', '.join(TASKS)}")
  if name == "synthetic":
    return synthetic.SyntheticTask(tokenizer=tokenizer, **options)
  if name == "planted":
    return planted.PlantedTask(tokenizer=tokenizer, **options)
  if name in CHAT_TASKS:
    if tokenizer is None:
      raise ValueError(f"task {name!r} needs the model's tokenizer (and chat_template=)")
    if name == "reasoning_gym":
      return reasoning_gym.ReasoningGymTask(tokenizer=tokenizer, **options)
    return arithmetic.ArithmeticTask(tokenizer=tokenizer, **options)
  if tokenizer is None or data_dir is None:
    raise ValueError(f"task {name!r} needs the model's tokenizer and the data_dir of its built "
                     "dataset (see ksjax.tasks.data.build)")
  from ksjax.tasks import data  # pylint: disable=g-import-not-at-top
  if splits is None:
    splits = data.built_splits(name, data_dir=data_dir)
  records = {split: data.load_records(name, split, data_dir=data_dir) for split in splits}
  if name in MATH_TASKS:
    from ksjax.tasks.math_task import MathTask  # pylint: disable=g-import-not-at-top
    return MathTask(records, tokenizer, name=name, **options)
  from ksjax.tasks.code_task import CodeTask  # pylint: disable=g-import-not-at-top
  return CodeTask(records, tokenizer, name=name, **options)
