"""The ksjax entry point: `python -m ksjax.main --config=configs/<file>.py [--config.field=value ...]`.

The config's `task` field chooses what runs. Every field can be overridden on the command line
(ml_collections config flags). Bad input (a config file that is missing or not valid Python, a
config value, a data set, a model to start from, an unreadable checkpoint) prints one line naming
it and what is accepted, exits with status 2, and writes nothing (`ksjax.errors`).
"""

from __future__ import annotations

import importlib
import sys

from absl import app
from ml_collections import config_flags

from ksjax import allocator, config_validation, errors
from ksjax.config_validation import ConfigError

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to an ml_collections config file (configs/*.py).", lock_config=True)

# task name -> "module:function"; the function takes the config and runs the job. Imported
# lazily, after `allocator`'s re-execution, so that a bandit run does not import the
# language-model stack; the trainer's tasks are the registry's (`ksjax.tasks.registry.TASKS`).
BANDIT = "bandit"
RUNNERS = {BANDIT: "ksjax.bandit:run", "trainer": "ksjax.trainer:run"}


def runner_for(task: str):
  """The job of `config.task`: the bandit, or the trainer for every task of the registry."""
  from ksjax.tasks import registry  # pylint: disable=g-import-not-at-top
  if task != BANDIT and task not in registry.TASKS:
    raise ConfigError(f"config.task={task!r} is not accepted; expected one of "
                      f"{', '.join(map(repr, sorted((BANDIT,) + registry.TASKS)))}")
  module, fn = RUNNERS[BANDIT if task == BANDIT else "trainer"].split(":")
  return getattr(importlib.import_module(module), fn)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  config = _CONFIG.value
  if config is None:
    print("ksjax: --config is required (e.g. --config=configs/bandit.py)", file=sys.stderr)
    sys.exit(2)
  runner_for(config.get("task", None))(config)


if __name__ == "__main__":
  allocator.reexec_with_allocator("ksjax")  # before jax loads (allocator.malloc_environment)
  app.run(errors.boundary("ksjax", main), flags_parser=config_validation.parse_flags_or_exit)
