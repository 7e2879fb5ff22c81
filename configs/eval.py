"""Evaluation of a training run's checkpoints, in a process of its own.

Run: python -m ksjax.eval --config=configs/eval.py --config.checkpoint_dir=runs/pass_at_k
     python -m ksjax.eval --config=configs/eval.py:<train config> ...   (e.g. :grpo_pass_at_k)

`config.run` is the trainer config that says which task and model the checkpoints hold, and the
mesh: by default the default CPU run's config (`ksjax.run.config.embedded_task_config`, which every
CPU config in configs/ starts from); after the colon, the name of another config file in this
directory. Its fields can be set like any other (`--config.run.model.dtype=bfloat16`,
`--config.run.mesh=1,1,8`). The evaluation's own settings are the top-level fields, declared in
`ksjax.evaluation.settings.EvalSpec`. A LoRA run's checkpoints hold its adapters alone: give
config.run.lora as the run had it (`--config.run.lora.rank=8`), and config.run's starting model
and seed build the base they are evaluated on (its sha256 checked against the checkpoints').

Large-k diagnostics, e.g. pass@k and maj@k for k = 1, 2, 4, ..., 256 on the first 50 problems:
  --config.num_prompts=50 --config.num_samples=256   (ks default to that ladder; with a large
  model, lower batch_rows, the sampler's rows per call, to what the device holds)
"""

import importlib.util
import os

import ml_collections

from ksjax import config_fields
from ksjax.evaluation import settings
from ksjax.run import config as run_config


def _train_config(name: str | None) -> ml_collections.ConfigDict:
  if not name:
    return run_config.embedded_task_config()
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"configs/eval.py:{name}: no trainer config {path}")
  spec = importlib.util.spec_from_file_location(f"ksjax_train_config_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def get_config(train_config: str | None = None) -> ml_collections.ConfigDict:
  # The evaluation's own fields, their defaults and what they mean: `ksjax.evaluation.settings.
  # EvalSpec` (`python -m ksjax.evaluation.settings` lists them).
  c = config_fields.config_dict(settings.EvalSpec)
  c.run = _train_config(train_config)
  return c
