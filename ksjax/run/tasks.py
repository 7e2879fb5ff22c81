"""From a run's task spec to the task, its tokenizer and the training prompt stream.

`ksjax.tasks.registry.make_task` is the one place that knows the tasks; this module only turns a
`TaskSpec` into its arguments and opens the grain iterator (checkpointable state) over the
training prompts: the embedded task's prompts in memory, or a built dataset's records mapped
through `Task.prompt_from_record`.
"""

from __future__ import annotations

import os

import grain

from ksjax.config_validation import ConfigError
from ksjax.run.spec import ModelSpec, TaskSpec
from ksjax.tasks import data, registry
from ksjax.tasks.base import Task
from ksjax.tokenization import Tokenizer


def tokenizer(task: TaskSpec, model: ModelSpec) -> Tokenizer:
  """The model's tokenizer for a dataset task: tokenizer.path, else the init_hf directory's."""
  path = task.tokenizer_path or model.init_hf
  if path is None:
    raise ConfigError(f"config.tokenizer.path is missing; task {task.name!r} tokenizes with the "
                      "model's tokenizer: expected a tokenizer.json (or config.init_hf)")
  try:
    return Tokenizer.from_file(os.fspath(path), bos=task.tokenizer_bos,
                               eos=tuple(task.tokenizer_eos), pad=task.tokenizer_pad)
  except (FileNotFoundError, ValueError) as e:
    raise ConfigError(f"config.tokenizer: {e}") from None


def make_task(task: TaskSpec, model: ModelSpec, eval_split: str) -> Task:
  """The task `task` names; a dataset task loads `eval_split` besides the training split."""
  if task.is_synthetic:
    return registry.make_task(
        "synthetic", seed=task.synthetic_seed, levels=task.synthetic_levels,
        train_per_level=task.synthetic_train_per_level,
        test_per_level=task.synthetic_test_per_level,
        num_solutions=task.synthetic_num_solutions, reward_correct=task.correct_reward,
        reward_wrong=task.wrong_reward)
  if task.data_dir is None:
    raise ConfigError(f"config.data.data_dir is missing; task {task.name!r} reads a dataset "
                      "built by `python -m ksjax.tasks.data`: expected its data_dir")
  options = dict(reward_correct=task.correct_reward, reward_wrong=task.wrong_reward)
  if task.name in registry.MATH_TASKS:
    options["workers"] = task.reward_workers
  return registry.make_task(task.name, tokenizer=tokenizer(task, model),
                            data_dir=task.data_dir, splits=(eval_split,), **options)


def train_iterator(spec: TaskSpec, task: Task, *, batch_prompts: int,
                   seed: int) -> grain.DatasetIterator:
  """Endless batches of `batch_prompts` training prompts, reshuffled every epoch."""
  if spec.is_synthetic:
    source = task.prompts("train")
    transform = None
  else:
    source = data.load_records(spec.name, spec.train_split, data_dir=spec.data_dir)
    transform = task.prompt_from_record
  return data.batch_iterator(source, batch_size=batch_prompts, seed=seed, transform=transform)
