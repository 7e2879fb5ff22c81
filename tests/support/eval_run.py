"""A tiny training run made by the real trainer, and its evaluation by the real eval binary.

Shared by the eval-binary and notebook tests. pytest-xdist workers are separate processes, so
the run is made once under a file lock in the session's shared temporary directory and reused by
every worker.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

import filelock
import ml_collections

REPO = pathlib.Path(__file__).resolve().parents[2]
EVAL_ARGS = ("--config.num_samples=4", "--config.ks=1,2,4", "--config.batch_prompts=8")
# The trainer's tiny run: the embedded task at levels 1-2 (3 test problems each), 3 RL steps of
# 2 prompts x 2 completions, a checkpoint at every step.
RUN_FIELDS = {
    "synthetic.levels": (1, 2), "synthetic.train_per_level": 8, "synthetic.test_per_level": 3,
}
TRAIN_FIELDS = {
    "num_steps": 3, "batch_prompts": 2, "k": 2, "max_new_tokens": 24, "checkpoint_every": 1,
    "keep_checkpoints": 3, "async_checkpoints": False, "progress_bar": False,
    "eval.at_start": False, "eval.at_end": False, "mesh": (1, 1, 1), "sft_warmup.steps": 0,
}
# The eval binary shards over a (1, 2, 2) mesh of the fake CPU devices: FSDP and tensor parallel.
EVAL_MESH = "--config.run.mesh=1,2,2"


def run_overrides() -> list[str]:
  """The command-line overrides that make configs/eval.py describe the tiny run."""
  return [f"--config.run.{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}"
          for k, v in RUN_FIELDS.items()]


def eval_command(checkpoint_dir: str | os.PathLike, *extra: str) -> list[str]:
  return [sys.executable, "-m", "ksjax.eval", "--config=configs/eval.py",
          f"--config.checkpoint_dir={checkpoint_dir}", *run_overrides(), *EVAL_ARGS, *extra]


def run_eval(checkpoint_dir, *extra: str) -> subprocess.CompletedProcess:
  return subprocess.run(eval_command(checkpoint_dir, *extra), cwd=REPO, capture_output=True,
                        text=True, timeout=300, check=False)


def copy_run(run: pathlib.Path, dest: pathlib.Path, steps=(1, 2, 3),
             with_eval=True) -> pathlib.Path:
  """A private copy of the tiny run, with only `steps` of its checkpoints and, unless
  `with_eval`, without its evaluation (tests that write must not race other workers' readers)."""
  shutil.copytree(run, dest, ignore=shutil.ignore_patterns(
      *[str(s) for s in {1, 2, 3} - set(steps)], *(() if with_eval else ("eval",))))
  return dest


def configured(checkpoint_dir, **overrides) -> ml_collections.ConfigDict:
  """`eval_config` with EVAL_ARGS' settings (4 samples, ks 1, 2, 4, 8 problems per call) and
  `overrides` of top-level fields."""
  config = eval_config(checkpoint_dir)
  config.num_samples, config.ks, config.batch_prompts = 4, (1, 2, 4), 8
  for key, value in overrides.items():
    config[key] = value
  return config


def set_fields(config: ml_collections.ConfigDict, fields: dict) -> None:
  """Sets each "section.name" of `fields` in `config`."""
  for key, value in fields.items():
    node = config
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value


def eval_config(checkpoint_dir: str | os.PathLike) -> ml_collections.ConfigDict:
  """configs/eval.py describing the tiny run, as the binary would see it."""
  spec = importlib.util.spec_from_file_location("ksjax_eval_config", REPO / "configs" / "eval.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.checkpoint_dir = str(checkpoint_dir)
  set_fields(config.run, RUN_FIELDS)
  return config


def train(workdir: pathlib.Path, **fields) -> None:
  """The tiny run (RUN_FIELDS, TRAIN_FIELDS) made by the trainer in `workdir`, with `fields`
  ("section.name": value) changed."""
  from ksjax import trainer  # pylint: disable=g-import-not-at-top
  from ksjax.run import config as defaults  # pylint: disable=g-import-not-at-top
  config = defaults.embedded_task_config()  # what configs/eval.py describes by default
  config.workdir = str(workdir)
  set_fields(config, {**RUN_FIELDS, **TRAIN_FIELDS, **fields})
  trainer.run(config)


def session_dir(tmp_path_factory, worker_id: str) -> pathlib.Path:
  """This test session's temporary directory, the same for every xdist worker ("master" when
  not under xdist, whose base directory's parent would outlive the session)."""
  base = tmp_path_factory.getbasetemp()
  return base if worker_id == "master" else base.parent


def tiny_run(shared_tmp: pathlib.Path) -> pathlib.Path:
  """The run's workdir, with checkpoints 1..3, metrics.jsonl, final/ and an evaluation of every
  step by the binary (its stdout in eval_stdout.txt)."""
  workdir = shared_tmp / "eval_tiny_run"
  done = workdir / "FIXTURE_DONE"
  with filelock.FileLock(str(shared_tmp / "eval_tiny_run.lock")):
    if not done.exists():
      train(workdir)
      result = run_eval(workdir, "--config.steps=all", EVAL_MESH)
      if result.returncode != 0:
        raise RuntimeError(f"eval binary failed ({result.returncode}):\n{result.stderr[-3000:]}")
      (workdir / "eval_stdout.txt").write_text(result.stdout)
      done.write_text("")
  return workdir
