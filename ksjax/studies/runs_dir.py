"""Runs made in a runs directory by the trainer's and the eval binary's commands, then published.

The layout of the real-model studies that predate the run store (`store.py`):
experiments/real_model_study.py, experiments/decisive_study.py and experiments/lora_sanity.py.
Their committed records (under experiments/results/) are in it, so it is kept as an adapter
rather than moved: a run trains in `<runs_dir>/<run>/` (`python -m ksjax.main`, each attempt
appended to its `attempts.json` with the commit and the machine), is evaluated there by
`python -m ksjax.eval`, and is published to `<out>/<run>/` (its step log, its config naming no
path of the machine, its attempts, its evaluation records) with a file written last that marks
it published. Checkpoints stay in the runs directory, all but the last pruned once published.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from typing import Any

from ksjax import files
from ksjax import machine
from ksjax.config_validation import ConfigError
from ksjax.run import checkpoints
from ksjax.run.directory import RunDirectory
from ksjax.trainer import metrics

# --quick: the embedded task's tiny model (no download, no wheel), seconds per run.
QUICK_CONFIG = "pass_at_k"
QUICK_FIELDS = (("model.hidden_size", 32), ("model.num_layers", 1), ("model.num_heads", 2),
                ("model.num_kv_heads", 1), ("model.head_dim", 16),
                ("model.intermediate_size", 64), ("mesh", "(1,1,1)"),
                ("synthetic.levels", "(1,2)"), ("synthetic.train_per_level", 24),
                ("synthetic.test_per_level", 2), ("max_new_tokens", 8),
                ("sft_warmup.steps", 0))
QUICK_TRAIN = (("batch_prompts", 4), ("checkpoint_every", 1))
RUNS_DIR = "<runs_dir>"  # how a published record names the runs directory


def in_one_line(name: str, command, *args) -> None:
  """Runs a study's command; a registration or a published record that cannot be read (data,
  never code) is one line, `<name>: <what>`, and exit status 1."""
  try:
    command(*args)
  except (ConfigError, json.JSONDecodeError, OSError) as e:
    raise SystemExit(f"{name}: {e}") from None


def run_name(arm: str, seed: int) -> str:
  return f"{arm}_s{seed}"


def flags(fields: Iterable[tuple[str, Any]]) -> tuple[str, ...]:
  return tuple(f"--config.{k}={v}" for k, v in fields)


def commit(root: str) -> str:
  try:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                          check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def dirty(root: str) -> bool:
  """Whether tracked files have uncommitted changes."""
  out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                       capture_output=True, text=True, check=False).stdout
  return bool(out.strip())


def train(root: str, runs_dir: str, name: str, config: str, overrides: Iterable[str], *,
          finished: Callable[[RunDirectory], bool] | None = None) -> list[dict]:
  """Trains (or resumes) configs/<config>.py with `overrides` (`--config.x=v` flags) in
  <runs_dir>/<name> until it has `finished` (by default: its final policy is saved); returns its
  attempts, each appended to `attempts.json` (wall time, peak memory, exit status, commit,
  machine). A failed attempt is a SystemExit after it is recorded: the same command resumes it."""
  run = RunDirectory(os.path.join(runs_dir, name))
  path = os.path.join(run.workdir, "attempts.json")
  attempts = json.load(open(path, encoding="utf-8")) if os.path.exists(path) else []
  if (finished or (lambda r: os.path.isdir(r.final_dir)))(run):
    return attempts
  command = [sys.executable, "-m", "ksjax.main", f"--config=configs/{config}.py",
             f"--config.workdir={run.workdir}", "--config.progress_bar=False", *overrides]
  if run.has_checkpoints():
    command.append("--config.resume=True")
  print(" ".join(command[1:]), flush=True)
  child = machine.run_child(command, cwd=root)
  attempts.append({"wall_seconds": round(child.wall_seconds, 1),
                   "peak_rss_bytes": child.peak_rss_bytes,
                   "resumed": "--config.resume=True" in command,
                   "exit_status": child.exit_status, "commit": commit(root),
                   "machine": machine.describe()})
  os.makedirs(run.workdir, exist_ok=True)
  files.write_json(path, attempts)
  if attempts[-1]["exit_status"] != 0:
    raise SystemExit(f"{run.workdir} (configs/{config}.py) stopped with status "
                     f"{attempts[-1]['exit_status']}; run the same command again to resume it")
  return attempts


def eval_command(run_dir: str, output_dir: str, *, config: str, settings: dict, steps: str,
                 include_start: bool, run_fields=()) -> list[str]:
  """The eval binary's command line: checkpoints `steps` of `run_dir` (and its start policy, as
  step 0) with the evaluation `settings` ({field: value}; a sequence as a comma-separated list)
  and the trainer config `config` with `run_fields` ((field, value) pairs) set, into
  `output_dir`."""
  value = lambda v: ",".join(map(str, v)) if isinstance(v, (tuple, list)) else v
  return [sys.executable, "-m", "ksjax.eval", f"--config=configs/eval.py:{config}",
          f"--config.checkpoint_dir={run_dir}", f"--config.steps={steps}",
          f"--config.output_dir={output_dir}", "--config.plots=False",
          f"--config.include_start={include_start}",
          *(f"--config.{k}={value(v)}" for k, v in settings.items()),
          *(f"--config.run.{k}={v}" for k, v in run_fields)]


def last_step(runs_dir: str, name: str) -> int:
  rows = metrics.read_jsonl(RunDirectory(os.path.join(runs_dir, name)).metrics_jsonl)
  return max(r["step"] for r in rows)


def relative_checkpoint(record: dict, runs_dir: str) -> dict:
  """The record as published: its checkpoint path relative to the runs directory."""
  record = dict(record)
  if "checkpoint" in record:
    record["checkpoint"] = os.path.join(RUNS_DIR, os.path.relpath(record["checkpoint"], runs_dir))
  return record


def _published_path(root: str, path: str, placeholder: str) -> str:
  """`path` as the published files name it: a file of an installed package as
  <site-packages>/<package>/<file>; else relative to the repository when inside it; else
  `placeholder`/<its name>."""
  path = os.path.abspath(path)
  parts = path.split(os.sep)
  if "site-packages" in parts:
    return os.path.join("<site-packages>", *parts[parts.index("site-packages") + 1:])
  relative = os.path.relpath(path, root)
  return relative if not relative.startswith(os.pardir) else os.path.join(
      placeholder, os.path.basename(path))


def publishable_config(root: str, config_path: str, runs_dir: str, name: str) -> None:
  """Rewrites a copied config.json so that it names no path of the machine that ran it (the
  trainer records its work directory and starting point absolute)."""
  with open(config_path, encoding="utf-8") as f:
    config = json.load(f)
  workdir = os.path.relpath(os.path.join(runs_dir, name), root)
  config["workdir"] = (os.path.join(RUNS_DIR, name) if workdir.startswith(os.pardir)
                       else workdir)
  for field in ("init_hf", "init_checkpoint", "init_gguf"):
    if isinstance(config.get(field), str) and os.path.isabs(config[field]):
      config[field] = _published_path(root, config[field], f"<{field}>")
  files.write_json(config_path, config, sort_keys=True)


def publish_run_files(root: str, runs_dir: str, out: str, name: str) -> str:
  """Copies run `name`'s step log, attempts and config (naming no path of this machine) from
  `runs_dir` to `<out>/<name>`; returns that directory."""
  run = RunDirectory(os.path.join(runs_dir, name))
  target = os.path.join(out, name)
  os.makedirs(target, exist_ok=True)
  for path in (run.metrics_jsonl, run.config_json,
               os.path.join(runs_dir, name, "attempts.json")):
    files.write_text(os.path.join(target, os.path.basename(path)),
                     open(path, encoding="utf-8").read())
  publishable_config(root, os.path.join(target, os.path.basename(run.config_json)), runs_dir,
                     name)
  return target


def prune_checkpoints(runs_dir: str, name: str) -> None:
  """Deletes a finished and evaluated run's checkpoints but the last (the one evaluated, kept so
  that it can be evaluated again): at SmolLM2's size each is about 1.8 GB."""
  run = RunDirectory(os.path.join(runs_dir, name))
  for step in checkpoints.steps(run)[:-1]:
    shutil.rmtree(run.step_dir(step))


def published_json(out: str, name: str, file: str):
  """A published run's JSON file (data, never code)."""
  with open(os.path.join(out, name, file), encoding="utf-8") as f:
    return json.load(f)


def values(record: dict) -> dict[str, float]:
  """A record's overall metrics, its levels' as "level<L>/<metric>", and "kl" (k3) where it was
  measured."""
  out = dict(record["metrics"])
  for group, by_metric in record["groups"].items():
    if group.startswith("level="):
      out.update({f"level{group[6:]}/{m}": v for m, v in by_metric.items()
                  if m != "num_problems"})
  if "kl_k3" in record["metrics"]:
    out["kl"] = record["metrics"]["kl_k3"]
  return out
