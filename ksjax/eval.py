"""The evaluation binary.

  python -m ksjax.eval --config=configs/eval.py --config.checkpoint_dir=DIR [--config.field=value]

Evaluates a training run's checkpoints (one step, the latest, all, or each of the last N and
their average; or, with --config.watch=True, each new one as it lands) in a process of its own,
possibly on another machine than the trainer. Every field: configs/eval.py. Bad input (a config
field, a missing directory, a directory without checkpoints, a checkpoint of another model shape,
k larger than the samples per problem, a checkpoint that fails its checksums, a LoRA checkpoint
recording another base than config.run's) prints one line naming what was wrong and what is
accepted, exits with status 2, and writes nothing (`ksjax.errors`). SIGTERM or SIGINT finishes
the record in progress, says where it stopped and exits with 143 or 130; the same command
continues from there (`ksjax.evaluation.runner`). A full disk is one line and exit status 74.
"""

from __future__ import annotations

import sys

from absl import app
from ml_collections import config_flags

from ksjax import allocator, config_validation, errors

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to an evaluation config (configs/eval.py).", lock_config=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  config = _CONFIG.value
  if config is None:
    print("ksjax.eval: --config is required (e.g. --config=configs/eval.py "
          "--config.checkpoint_dir=runs/pass_at_k)", file=sys.stderr)
    sys.exit(2)
  # Imported here so that --help and a missing --config answer without loading jax.
  from ksjax.evaluation import runner  # pylint: disable=g-import-not-at-top
  runner.run(config)


if __name__ == "__main__":
  allocator.reexec_with_allocator("ksjax.eval")  # before jax loads (allocator.malloc_environment)
  app.run(errors.boundary("ksjax.eval", main), flags_parser=config_validation.parse_flags_or_exit)
