"""Each objective's policy converging to its own optimum on the planted task (issue #65).

  python experiments/planted.py [--steps=200] [--seed=0] [--out=experiments/results/planted]

One supervised warm-up (configs/planted.py), then the real trainer (`ksjax.trainer.loop.run`,
what `python -m ksjax.main` runs) from that start for every objective of
`configs/planted.py:OBJECTIVES`, a checkpoint every `--every` steps. At each checkpoint the
policy's answer probabilities q are read exactly (`ksjax.evaluation.planted`) and every
objective's held-out value at q follows in closed form (`ksjax.objectives.planted`). Writes
results.json (q and the values per step, the optima, the machine) and planted.png (q_A and
each run's distance to its own optimum against the step) to --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import sys

import numpy as np

from ksjax import files, machine
from ksjax.evaluation import planted as measure
from ksjax.objectives import planted as closed
from ksjax.run import spec as spec_lib
from ksjax.tasks import planted as planted_task
from ksjax.trainer import loop

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_configs():
  """configs/planted.py as a module: `get_config(objective)` and `OBJECTIVES`."""
  path = os.path.join(REPO, "configs", "planted.py")
  module_spec = importlib.util.spec_from_file_location("planted_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module


def train(config, workdir: str, start: str | None = None, **overrides) -> None:
  """The trainer on `config` with `overrides`, into a fresh `workdir`, from the policy at `start`
  if given (no warm-up), without the sampled held-out evaluation (the policy is measured exactly
  instead)."""
  shutil.rmtree(workdir, ignore_errors=True)
  config.workdir = workdir
  if start is not None:
    config.init_checkpoint, config.sft_warmup.steps = start, 0
  config.eval.at_start = config.eval.at_end = config.progress_bar = False
  for field, value in overrides.items():
    config[field] = value
  loop.run(config)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--every", type=int, default=5, help="steps between checkpoints")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default=os.path.join(REPO, "experiments", "results", "planted"))
  args = parser.parse_args(argv)
  configs = load_configs()
  runs = os.path.join(args.out, "runs")
  start = os.path.join(runs, "start")
  train(configs.get_config(), start, num_steps=0, seed=args.seed)
  task = planted_task.PlantedTask(**dict(configs.get_config().planted))
  f = task.frequencies()
  targets = {name: measure.target(spec_lib.from_config(configs.get_config(name)).estimator)
             for name in configs.OBJECTIVES}
  result = {"command": "python experiments/planted.py " + shlex.join(argv or sys.argv[1:]),
            "machine": machine.describe(), "frequencies": f.tolist(),
            "targets": {n: {"name": t.name, "weights": t.weights, "vote": t.vote}
                        for n, t in targets.items()},
            "optimum_q": {n: closed.optimum(t, f).tolist() for n, t in targets.items()},
            "optimum_value": measure.optimal_values(task, targets), "runs": {}}
  for name in configs.OBJECTIVES:
    workdir = os.path.join(runs, name)
    train(configs.get_config(name), workdir, os.path.join(start, "start"), num_steps=args.steps,
          seed=args.seed, checkpoint_every=args.every,
          keep_checkpoints=args.steps // args.every + 1)
    steps, q_spm = measure.trajectory(workdir, task)
    result["runs"][name] = {"steps": steps, "q": q_spm.tolist(),
                            "values": [measure.values(q, task, targets) for q in q_spm]}
    shutil.rmtree(workdir)  # the checkpoints: the measured q is the result
  shutil.rmtree(runs)
  files.write_json(os.path.join(args.out, "results.json"), result, indent=1)
  plot(result, os.path.join(args.out, "planted.png"))
  for name, run in result["runs"].items():
    own = run["values"][-1][name]
    print(f"{name:18s} q_A {run['q'][-1][0][0]:.3f} (optimum {result['optimum_q'][name][0][0]:.3f})"
          f"  own value {own:.4f} (optimum {result['optimum_value'][name]:.4f})")


def plot(result: dict, path: str) -> None:
  """q_A against the step, each optimum dashed; and each run's distance to its own optimum."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
  for i, (name, run) in enumerate(result["runs"].items()):
    color = f"C{i}"
    q_a = [q[0][0] for q in run["q"]]
    left.plot(run["steps"], q_a, color=color, label=name)
    left.axhline(result["optimum_q"][name][0][0], color=color, ls="--", lw=0.8)
    weight = sum(result["targets"][name]["weights"])
    gap = [(result["optimum_value"][name] - v[name]) / weight for v in run["values"]]
    right.plot(run["steps"], np.maximum(gap, 1e-5), color=color, label=name)
  left.set(xlabel="RL step", ylabel="q_A (P(answer A)), optimum dashed", ylim=(-0.02, 1.02))
  right.set(xlabel="RL step", ylabel="own optimum - own value (per unit weight)", yscale="log")
  left.legend(fontsize=8)
  fig.suptitle(f"planted task, f = {result['frequencies'][0]}: {result['command']}\n"
               f"{result['machine']}", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


if __name__ == "__main__":
  main()
