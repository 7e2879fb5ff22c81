"""A study's runs with the trainer and the eval binary: the work of the real studies.

The shared start is one trainer run (`start`: a supervised warm-up, no RL steps) in
<out>/runs/start, whose policy `start/start` is every run's initial checkpoint and KL reference;
the eval binary evaluates it as step 0. A run is the trainer (`ksjax.trainer.loop.run`) with its
arm's config file ("config") and overrides over `common` and `run`, resumed from its newest
checkpoint after a stop; then the eval binary's runner (`ksjax.evaluation.runner.run`, what
`python -m ksjax.eval` calls) on every checkpoint without a record, with `evaluation` (over
configs/eval.py) and the KL to the start on the held-out samples. Overrides are dotted config
fields: {"synthetic.levels": (2, 3)}.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from ksjax.run.directory import RunDirectory
from ksjax.studies import declaration
from ksjax.studies import store
from ksjax.studies.declaration import StudyError


def _config(root: str, path: str, overrides: Mapping[str, Any]):
  config = declaration.load_module(os.path.join(root, path), "ksjax_study_config").get_config()
  for field, value in overrides.items():
    if field == "config":
      continue
    *parents, leaf = field.split(".")
    node = config
    for part in parents:
      node = node[part]
    node[leaf] = value
  return config


def state_digest(state_dir: str) -> str:
  """sha256 over a checkpoint's training state (parameters, optimizer state, step, random key):
  each array's path, dtype, shape and bytes, in path order. Orbax restores the state item
  without a target. Orbax's own file manifest cannot serve: its metadata files differ between
  two saves of equal arrays."""
  import hashlib  # pylint: disable=g-import-not-at-top
  import warnings  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  with warnings.catch_warnings():  # "Sharding info not provided": the arrays are read whole
    warnings.simplefilter("ignore", UserWarning)
    with ocp.PyTreeCheckpointer() as checkpointer:
      tree = checkpointer.restore(os.path.abspath(state_dir))
  digest = hashlib.sha256()
  for path, leaf in sorted(jax.tree_util.tree_flatten_with_path(tree)[0],
                           key=lambda item: jax.tree_util.keystr(item[0])):
    array = np.ascontiguousarray(np.asarray(leaf))
    digest.update(f"{jax.tree_util.keystr(path)}:{array.dtype}:{array.shape};".encode())
    digest.update(array.tobytes())
  return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class TrainerRuns:
  root: str  # the repository the config paths are relative to
  start: Mapping[str, Any]  # the start's config file ("config") and overrides
  common: Mapping[str, Any]  # every run's and the start's
  run: Mapping[str, Any]  # every run's
  evaluation: Mapping[str, Any]  # over configs/eval.py
  kl_metric: str = "kl_k3"
  has_start: bool = True

  def _start_dir(self, out: str) -> str:
    return store.run_dir(out, store.START)

  def start_config(self, out: str):
    return _config(self.root, self.start["config"], {**self.common, **self.start,
                                                     "workdir": self._start_dir(out)})

  def run_config(self, out: str, name: str, overrides: Mapping[str, Any], seed: int):
    start = RunDirectory(self._start_dir(out)).start_dir
    return _config(self.root, overrides["config"], {
        **self.common, **self.run, **overrides, "workdir": store.run_dir(out, name),
        "seed": seed, "init_checkpoint": start})

  def eval_config(self, out: str, train_config):
    config = _config(self.root, "configs/eval.py", {
        **self.evaluation, "checkpoint_dir": train_config.workdir,
        "kl_reference": RunDirectory(self._start_dir(out)).start_dir})
    config.run = train_config
    return config

  def _eval_dir(self, out: str, train_config) -> str:
    from ksjax.evaluation import settings  # pylint: disable=g-import-not-at-top
    name = settings.validate(self.eval_config(out, train_config)).output_name()
    return RunDirectory(train_config.workdir).eval_dir(name)

  def check(self, out: str, arm: str, overrides: Mapping[str, Any]) -> None:
    """The arm's trainer config, read as the trainer reads it: a bad field is a ConfigError."""
    del arm
    from ksjax.run import spec  # pylint: disable=g-import-not-at-top
    if "config" not in overrides:
      raise StudyError(f"overrides {dict(overrides)!r} name no config file; expected "
                       "{'config': 'configs/<name>.py', ...}")
    spec.from_config(self.run_config(out, "check", overrides, 0))

  def schedule(self, overrides: Mapping[str, Any]) -> tuple[int, int]:
    """Steps, and checkpoints evaluated: every `checkpoint_every`, and step 1 (the trainer's
    checkpoint manager saves a run's first step)."""
    s = {**self.run, **overrides}
    return s["num_steps"], s["num_steps"] // s["checkpoint_every"] + (s["checkpoint_every"] > 1)

  def shortened(self, overrides: Mapping[str, Any], steps: int) -> dict[str, Any]:
    return {**overrides, "num_steps": steps, "checkpoint_every": steps, "keep_checkpoints": 2}

  def prepare(self, out: str, shortened: int | None = None) -> None:
    from ksjax import model  # pylint: disable=g-import-not-at-top
    from ksjax.evaluation import runner  # pylint: disable=g-import-not-at-top
    from ksjax.evaluation import settings  # pylint: disable=g-import-not-at-top
    from ksjax.trainer import loop  # pylint: disable=g-import-not-at-top
    # The start is made whole even for the budget (`shortened`): a run's cost depends on where it
    # starts (a warm-up cut to a few steps leaves every sample wrong, every update skipped and
    # every completion short, which under-measured the regime map several times over). The
    # budget counts the start's time once.
    del shortened
    config = self.start_config(out)
    start = RunDirectory(config.workdir)
    if not os.path.isdir(start.final_dir):
      loop.run(config)
    # The start is a ksjax.model checkpoint, not a trainer step: the eval binary's Evaluator
    # evaluates it as loaded, with the same settings and estimators as every checkpoint.
    s = settings.validate(self.eval_config(out, config))
    evaluator = runner.open_evaluator(s, RunDirectory(config.workdir, start.start_dir),
                                      runner.open_task(s), self._eval_dir(out, config))
    policy, _ = model.load_checkpoint(start.start_dir, evaluator.mesh)
    os.makedirs(evaluator.output_dir, exist_ok=True)
    evaluator.evaluate_policy(0, policy, start.start_dir)

  def train(self, run) -> None:
    from ksjax.trainer import loop  # pylint: disable=g-import-not-at-top
    config = self.run_config(run.out, run.name, run.overrides, run.seed)
    directory = RunDirectory(config.workdir)
    if not os.path.isdir(directory.final_dir):
      config.resume = os.path.isdir(directory.steps_dir)
      loop.run(config)

  def evaluate(self, run) -> None:
    from ksjax.evaluation import runner  # pylint: disable=g-import-not-at-top
    config = self.run_config(run.out, run.name, run.overrides, run.seed)
    runner.run(self.eval_config(run.out, config))

  def progress(self, run_dir: str) -> tuple[bool, bool]:
    evaluated = os.path.join(run_dir, "eval")
    return (RunDirectory(run_dir).has_checkpoints(),
            os.path.isdir(evaluated) and any(
                n.startswith("step_") for d in os.listdir(evaluated)
                for n in os.listdir(os.path.join(evaluated, d))))

  def carried(self, run_dir: str) -> list[str]:
    evaluated = os.path.join(run_dir, "eval")
    if not os.path.isdir(evaluated):
      return []
    return sorted(os.path.join("eval", d, n) for d in os.listdir(evaluated)
                  for n in os.listdir(os.path.join(evaluated, d)) if n.startswith("step_"))

  def state_digest(self, run_dir: str, step: int) -> str:
    return state_digest(RunDirectory(run_dir).state_dir(step))

  def records(self, out: str, name: str) -> list[dict]:
    """The eval binary's records of run `name` (its output directory is named by the evaluation
    settings, the same for every run of the study: the start's)."""
    from ksjax.evaluation import results  # pylint: disable=g-import-not-at-top
    evaluated = self._eval_dir(out, self.start_config(out))
    return results.load_records(os.path.join(store.run_dir(out, name),
                                             os.path.relpath(evaluated, self._start_dir(out))))

  def start_record(self, out: str) -> dict:
    return self.records(out, store.START)[0]
