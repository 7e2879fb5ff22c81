"""From a run's task spec to the task, its tokenizer and the training prompt stream.

`ksjax.tasks.registry.make_task` is the one place that knows the tasks; this module only gives
it what a `TaskSpec` holds (the task's own options section, the rewards, the model's tokenizer
and chat template) and opens the grain iterator (checkpointable state) over the training
prompts: a generated task's prompts in memory, or a built dataset's records mapped through
`Task.prompt_from_record`.

Instruct models bring their own tokenizer and chat template: a GGUF file carries both in its
metadata; a Hugging Face directory has tokenizer.json and tokenizer_config.json. A chat task's
rows also stop on the template's end-of-turn tokens.
"""

from __future__ import annotations

import dataclasses
import os

import grain

from ksjax.config_validation import ConfigError
from ksjax.run.spec import ModelSpec, TaskSpec
from ksjax.tasks import data, registry
from ksjax.tasks.base import Task
from ksjax.tasks.chat import ChatTemplate
from ksjax.tokenization import Tokenizer


def _from_gguf(task: TaskSpec, model: ModelSpec) -> bool:
  return task.tokenizer.path is None and model.init_gguf is not None


def tokenizer(task: TaskSpec, model: ModelSpec) -> Tokenizer:
  """The model's tokenizer: tokenizer.path, else init_gguf's metadata, else init_hf's file."""
  if _from_gguf(task, model):
    from ksjax.model import gguf_io  # pylint: disable=g-import-not-at-top
    try:
      return Tokenizer.from_gguf(model.init_gguf)
    except (gguf_io.GGUFError, FileNotFoundError, OSError) as e:
      raise ConfigError(f"config.init_gguf: {e}") from None
  path = task.tokenizer.path or model.init_hf
  if path is None:
    raise ConfigError(f"config.tokenizer.path is missing; task {task.name!r} tokenizes with the "
                      "model's tokenizer: expected a tokenizer.json (or config.init_hf or "
                      "config.init_gguf)")
  try:
    return Tokenizer.from_file(os.fspath(path), bos=task.tokenizer.bos, eos=task.tokenizer.eos,
                               pad=task.tokenizer.pad)
  except (FileNotFoundError, ValueError) as e:
    raise ConfigError(f"config.tokenizer: {e}") from None


def chat_template(task: TaskSpec, model: ModelSpec, tok: Tokenizer) -> ChatTemplate:
  """The checkpoint's own chat template, with the config's system prompt."""
  if _from_gguf(task, model):
    from ksjax.model import gguf_io  # pylint: disable=g-import-not-at-top
    try:
      source = gguf_io.read_gguf_tokenizer(model.init_gguf).chat_template
    except (gguf_io.GGUFError, OSError) as e:
      raise ConfigError(f"config.init_gguf: {e}") from None
    if not source:
      raise ConfigError(f"config.init_gguf={model.init_gguf!r} has no tokenizer.chat_template; "
                        f"task {task.name!r} prompts an instruct model: expected a GGUF of one")
    name = lambda i: None if i is None else tok.tok.id_to_token(i)
    template = ChatTemplate.from_string(source, bos_token=name(tok.bos_id),
                                        eos_token=name(tok.eos_id))
  else:
    path = task.tokenizer.path or model.init_hf
    directory = path if path is None or os.path.isdir(path) else os.path.dirname(path)
    try:
      template = ChatTemplate.from_tokenizer_config(directory)
    except (FileNotFoundError, ValueError, TypeError) as e:
      raise ConfigError(f"config.tokenizer: no chat template for task {task.name!r} ({e}); "
                        "expected a tokenizer_config.json with chat_template beside the "
                        "tokenizer") from None
  return template.with_system_prompt(task.chat.system_prompt)


def with_end_of_turn(tok: Tokenizer, template: ChatTemplate) -> Tokenizer:
  """`tok` whose rows also end on the template's end-of-turn tokens."""
  extra = [tok.tok.token_to_id(t) for t in template.end_of_turn_tokens]
  eos = tuple(dict.fromkeys(tok.eos_ids + tuple(i for i in extra if i is not None)))
  return dataclasses.replace(tok, eos_ids=eos)


def make_task(task: TaskSpec, model: ModelSpec, eval_split: str) -> Task:
  """The task `task` names; a dataset task loads `eval_split` besides the training split."""
  kwargs = dict(correct_reward=task.correct_reward, wrong_reward=task.wrong_reward,
                **(task.options.values() if task.options else {}))
  if task.is_embedded:
    return registry.make_task(task.name, **kwargs)
  if task.name in registry.CHAT_TASKS:
    tok = tokenizer(task, model)
    template = chat_template(task, model, tok)
    return registry.make_task(task.name, tokenizer=with_end_of_turn(tok, template),
                              chat_template=template, workers=task.reward_workers, **kwargs)
  if task.data.data_dir is None:
    raise ConfigError(f"config.data.data_dir is missing; task {task.name!r} reads a dataset "
                      "built by `python -m ksjax.tasks.data`: expected its data_dir")
  if task.name in registry.MATH_TASKS:
    kwargs["workers"] = task.reward_workers
  return registry.make_task(task.name, tokenizer=tokenizer(task, model),
                            data_dir=task.data.data_dir, splits=(eval_split,), **kwargs)


def train_iterator(spec: TaskSpec, task: Task, *, batch_prompts: int,
                   seed: int) -> grain.DatasetIterator:
  """Endless batches of `batch_prompts` training prompts, reshuffled every epoch."""
  if spec.is_generated:
    source = task.prompts("train")
    transform = None
  else:
    source = data.load_records(spec.name, spec.data.train_split, data_dir=spec.data.data_dir)
    transform = task.prompt_from_record
  return data.batch_iterator(source, batch_size=batch_prompts, seed=seed, transform=transform)
