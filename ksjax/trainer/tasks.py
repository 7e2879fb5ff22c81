"""From a trainer config to the task, its tokenizer and the training prompt stream.

`ksjax.tasks.registry.make_task` is the one place that knows the tasks; this module only reads
the trainer's config fields into its arguments and opens the grain iterator (checkpointable
state) over the training prompts: the embedded task's prompts in memory, or a built dataset's
records mapped through `Task.prompt_from_record`.
"""

from __future__ import annotations

import os
from typing import Any

import grain

from ksjax.config_validation import ConfigError
from ksjax.tasks import data, registry
from ksjax.tasks.base import Task
from ksjax.tokenization import Tokenizer

TASKS = registry.TASKS


def _tokenizer(config: Any) -> Tokenizer:
  path = config.tokenizer.path or config.init_hf
  if path is None:
    raise ConfigError(f"config.tokenizer.path is missing; task {config.task!r} tokenizes with the "
                      "model's tokenizer: expected a tokenizer.json (or config.init_hf)")
  try:
    return Tokenizer.from_file(os.fspath(path), bos=config.tokenizer.bos,
                               eos=tuple(config.tokenizer.eos), pad=config.tokenizer.pad)
  except (FileNotFoundError, ValueError) as e:
    raise ConfigError(f"config.tokenizer: {e}") from None


def make_task(config: Any) -> Task:
  """The task named by config.task, built from the config's fields."""
  if config.task == "synthetic":
    s = config.synthetic
    return registry.make_task(
        "synthetic", seed=s.seed, levels=tuple(s.levels), train_per_level=s.train_per_level,
        test_per_level=s.test_per_level, num_solutions=s.num_solutions,
        reward_correct=config.correct_reward, reward_wrong=config.wrong_reward)
  if config.data.data_dir is None:
    raise ConfigError(f"config.data.data_dir is missing; task {config.task!r} reads a dataset "
                      "built by `python -m ksjax.tasks.data`: expected its data_dir")
  options = dict(reward_correct=config.correct_reward, reward_wrong=config.wrong_reward)
  if config.task in registry.MATH_TASKS:
    options["workers"] = config.reward_workers
  return registry.make_task(config.task, tokenizer=_tokenizer(config),
                            data_dir=config.data.data_dir, splits=(config.eval.split,), **options)


def train_iterator(config: Any, task: Task) -> grain.DatasetIterator:
  """Endless batches of `config.batch_prompts` training prompts, reshuffled every epoch."""
  if config.task == "synthetic":
    source = task.prompts("train")
    transform = None
  else:
    source = data.load_records(config.task, config.data.train_split,
                               data_dir=config.data.data_dir)
    transform = task.prompt_from_record
  return data.batch_iterator(source, batch_size=config.batch_prompts, seed=config.seed,
                             transform=transform)
