"""Dynamic sampling at an equal CPU budget (issue #16, item 4): held-out pass@4 and pass@16
gained per CPU-minute by pass@4 leave-one-out and by the mean objective, each with and without
dynamic sampling, on the embedded default task.

    python experiments/dynamic_sampling.py [--out=DIR] [--runs_dir=DIR]

The four runs are configs/pass_at_k.py and configs/mean.py (RLOO), each with
--config.dynamic_sampling=False and =True (dynamic_max_rounds at its default, 4), everything
else as those configs have it (the same warm-up, seed and held-out evaluation: 180 test problems
x 16 samples at the warmed-up start and at the end), plus the same CPU budget
(config.max_cpu_minutes; `ksjax.trainer.loop` counts the training loop only, so the warm-up and
the two evaluations, the same work for all four, are left out) and the same ceiling of steps,
which is there to be out of reach: the budget ends every run. They run one after the other
through experiments/real_model.py's runner, each a process of its own, so that they do not share
the two cores with each other.

The budget, fixed before any held-out number of these runs was seen: 1 CPU-minute. The
default runs train 100 steps. A probe of configs/mean.py (the costlier objective per step: RLOO
updates most of the 64 rows, pass@4 leave-one-out about a tenth) with its held-out evaluations
off (`python -m ksjax.main --config=configs/mean.py --config.eval.at_start=False
--config.eval.at_end=False`), so with no held-out result, used 0.69 CPU-minutes of training loop for its 100 steps (11 s
of it the first step's compilations) on this repository's shared two-core machine. So 1
CPU-minute gives the mean objective its usual 100 steps with room for a busy machine's variation,
and each of the others what the same CPU buys it. The ceiling, 2,000 steps, is far beyond what
any of them can reach in it.

What is written to `experiments/results/dynamic_sampling/` (or --out): README.md with the table
(held-out pass@4 and pass@16 at the start and the end, the gain, its standard error over the
held-out problems, the gain per CPU-minute, the CPU-minutes and steps each run used), summary.json
with every number and each run's attempts (wall time, peak memory, commit), and each run's
eval_table.txt, held-out results, step log and config.

Stopped at any point, the same command continues: a finished run is not run again, one with
checkpoints resumes (exactly, its CPU budget continuing from its step log). The numbers belong to
the code that made them, so the script refuses to start or to publish from a checkout whose
tracked files have uncommitted changes; `--quick` (a seconds-long smoke run on a tiny model, what
the test suite runs) is exempt and says in its README that it is not a measurement.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, REPO)

# pylint: disable=wrong-import-position
from experiments import real_model
from ksjax import files
from ksjax.run.directory import RunDirectory
from ksjax.studies import runs_dir as runs_dir_lib
from ksjax.trainer import metrics
# pylint: enable=wrong-import-position

DEFAULT_OUT = os.path.join(REPO, "experiments", "results", "dynamic_sampling")
MAX_CPU_MINUTES = 1.0  # see the module docstring for why, chosen before any result
NUM_STEPS = 2000       # a ceiling none of the runs should reach within the budget
KS = (4, 16)
# name -> (config file, dynamic sampling, label)
RUNS = {
    "pass_at_k": ("pass_at_k", False, "pass@4 leave-one-out"),
    "pass_at_k_dynamic": ("pass_at_k", True, "pass@4 leave-one-out + dynamic sampling"),
    "mean": ("mean", False, "mean (RLOO)"),
    "mean_dynamic": ("mean", True, "mean (RLOO) + dynamic sampling"),
}
# --quick: a tiny model, no warm-up, four held-out problems, the sizes of the trainer's tests.
QUICK = ("--config.model.hidden_size=32", "--config.model.num_layers=1",
         "--config.model.num_heads=2", "--config.model.num_kv_heads=1",
         "--config.model.head_dim=16", "--config.model.intermediate_size=64",
         "--config.mesh=(1,1,1)", "--config.synthetic.levels=(1,2)",
         "--config.synthetic.train_per_level=24", "--config.synthetic.test_per_level=4",
         "--config.batch_prompts=4", "--config.max_new_tokens=8", "--config.sft_warmup.steps=0",
         "--config.eval.num_prompts=4", "--config.eval.batch_prompts=4",
         "--config.checkpoint_every=1")
QUICK_CPU_MINUTES, QUICK_STEPS = 0.002, 3


def overrides(name: str, max_cpu_minutes: float, num_steps: int, quick: bool) -> tuple[str, ...]:
  """The `--config.x=v` flags that make run `name` from its config file."""
  _, dynamic, _ = RUNS[name]
  return ((f"--config.dynamic_sampling={dynamic}", f"--config.max_cpu_minutes={max_cpu_minutes}",
           f"--config.num_steps={num_steps}") + (QUICK if quick else ()))


def run_all(runs_dir: str, *, max_cpu_minutes: float, num_steps: int,
            quick: bool = False) -> dict[str, list[dict]]:
  """Runs (or resumes, or skips when finished) the four runs, one after the other."""
  return {name: real_model.run_config(name, runs_dir, config=RUNS[name][0],
                                      overrides=overrides(name, max_cpu_minutes, num_steps, quick))
          for name in RUNS}


# ---------------------------------------------------------------------------------------------
# The numbers
# ---------------------------------------------------------------------------------------------

def summarize(name: str, runs_dir: str) -> dict:
  """One finished run's numbers."""
  run = RunDirectory(os.path.join(runs_dir, name))
  start = real_model.per_problem_pass_at_k(run.held_out_json("start"), KS)
  end = real_model.per_problem_pass_at_k(run.held_out_json("end"), KS)
  rows = metrics.read_jsonl(run.metrics_jsonl)
  cpu_minutes = rows[-1]["time/cpu_seconds"] / 60
  prompts = sum(row.get("dynamic/prompts_consumed", 0.0) for row in rows)
  out = {"label": RUNS[name][2], "steps": rows[-1]["step"], "cpu_minutes": cpu_minutes,
         "prompts_sampled": prompts or None,
         "rounds_mean": (float(np.mean([row["dynamic/rounds"] for row in rows]))
                         if "dynamic/rounds" in rows[-1] else 1.0)}
  for k in KS:
    gain = end[k] - start[k]
    out[f"pass@{k}"] = {"start": float(start[k].mean()), "end": float(end[k].mean()),
                        "gain": float(gain.mean()), "gain_stderr": real_model.stderr(gain),
                        "gain_per_cpu_minute": float(gain.mean()) / cpu_minutes}
  return out


def dynamic_minus_static(runs_dir: str) -> dict[str, dict[str, dict[str, float]]]:
  """End pass@k of each objective with dynamic sampling minus without, paired over problems."""
  out = {}
  for static in ("pass_at_k", "mean"):
    a = real_model.per_problem_pass_at_k(
        RunDirectory(os.path.join(runs_dir, static + "_dynamic")).held_out_json("end"), KS)
    b = real_model.per_problem_pass_at_k(
        RunDirectory(os.path.join(runs_dir, static)).held_out_json("end"), KS)
    out[static] = {f"pass@{k}": {"difference": float((a[k] - b[k]).mean()),
                                 "stderr": real_model.stderr(a[k] - b[k])} for k in KS}
  return out


def table(summary: dict[str, dict]) -> str:
  """The markdown table of the four runs."""
  head = ["run", "steps", "CPU-min"]
  for k in KS:
    head += [f"pass@{k} start → end", "gain ± s.e.", "gain per CPU-min"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for s in summary.values():
    cells = [s["label"], f"{s['steps']}", f"{s['cpu_minutes']:.2f}"]
    for k in KS:
      p = s[f"pass@{k}"]
      cells += [f"{p['start']:.3f} → {p['end']:.3f}", f"{p['gain']:+.3f} ± {p['gain_stderr']:.3f}",
                f"{p['gain_per_cpu_minute']:+.4f}"]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def collect(runs_dir: str, out: str, attempts: dict[str, list[dict]], *,
            max_cpu_minutes: float, num_steps: int, quick: bool = False) -> str:
  """Writes the README, summary.json and each run's files to `out`; returns the table."""
  for name in RUNS:
    if not real_model._finished(RunDirectory(os.path.join(runs_dir, name))):  # pylint: disable=protected-access
      raise SystemExit(f"{os.path.join(runs_dir, name)} has not finished; run this script again")
  summary = {name: summarize(name, runs_dir) for name in RUNS}
  differences = dynamic_minus_static(runs_dir)
  commits = sorted({a["commit"] for runs in attempts.values() for a in runs})
  collected_at = runs_dir_lib.commit(real_model.REPO)
  os.makedirs(out, exist_ok=True)
  for name in RUNS:
    real_model.publish_run(runs_dir, name, out)
  text = table(summary)
  lines = ["# Dynamic sampling at an equal CPU budget", ""]
  if quick:
    lines += ["**A smoke run (`--quick`, a tiny untrained model): not a measurement.**", ""]
  lines += [
      f"Produced by `python experiments/dynamic_sampling.py`: four runs on the embedded task "
      f"(trained at commit {', '.join(c[:7] for c in commits)}, collected at "
      f"{collected_at[:7]}), each stopped by a budget of {max_cpu_minutes:g} CPU-minute(s) of "
      f"its training loop (ceiling {num_steps} steps), then evaluated on the held-out split. Gains are end minus start per held-out "
      "problem, averaged; the standard error is over the problems (one training seed per run, "
      "so it leaves out the spread between seeds).", "", text, "",
      "End pass@k with dynamic sampling minus without, paired over the held-out problems:", ""]
  for static, diff in differences.items():
    lines.append(f"- {RUNS[static][2]}: " + ", ".join(
        f"pass@{k} {d['difference']:+.3f} ± {d['stderr']:.3f}"
        for k, d in ((k, diff[f'pass@{k}']) for k in KS)))
  lines.append("")
  files.write_json(os.path.join(out, "summary.json"),
                   {"max_cpu_minutes": max_cpu_minutes, "num_steps": num_steps, "quick": quick,
                    "commits": commits, "collected_at": collected_at, "runs": summary,
                    "dynamic_minus_static": differences, "attempts": attempts})
  files.write_text(os.path.join(out, "README.md"), "\n".join(lines))
  print(text)
  print(f"wrote {out}")
  return text


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=DEFAULT_OUT)
  parser.add_argument("--runs_dir", default=os.path.join(REPO, "runs", "dynamic_sampling"))
  parser.add_argument("--quick", action="store_true", help="a smoke run on a tiny model")
  args = parser.parse_args(argv)
  budget, steps = (QUICK_CPU_MINUTES, QUICK_STEPS) if args.quick else (MAX_CPU_MINUTES, NUM_STEPS)
  dirty = "the checkout has uncommitted changes to tracked files; commit them first: the results "
  if not args.quick and runs_dir_lib.dirty(real_model.REPO):
    raise SystemExit(dirty + "must name the code that made them")
  attempts = run_all(args.runs_dir, max_cpu_minutes=budget, num_steps=steps, quick=args.quick)
  if not args.quick and runs_dir_lib.dirty(real_model.REPO):
    raise SystemExit(dirty + "would not match the commit the runs recorded")
  collect(args.runs_dir, args.out, attempts, max_cpu_minutes=budget, num_steps=steps,
          quick=args.quick)


if __name__ == "__main__":
  main()
