"""The regime map's pilots, on TRAINING problems only (experiments/regime_map.py's registration).

  python benchmarks/regime_map_pilot.py calibrate   # the start's pass@k per level, 24 problems x 64
  python benchmarks/regime_map_pilot.py sgd         # the mean arm at each SGD rate, 150 steps

Both make the map's start (its `start_config`: the 400-step warm-up on levels 1-3) in a scratch
directory, deleted at the end. `calibrate` samples the first 24 TRAINING problems of levels 1-4
64 times each at temperature 1 and prints pass@1/4/16/64 per level (unbiased from the 64): the
difficulty axis. `sgd` trains the map's centre mean arm (RLOO, level 2, seed 0) for 150 steps
at Adam 1e-4 and at each SGD rate, evaluating nothing, and prints from the training log the
KL to the start (kl/k3) and the training pass@1 (batch/pass_at_1) over windows of steps: the SGD
rates were chosen from this. The held-out split is never sampled.

Run it with one compute thread when the machine is shared:
  XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" nice -n 19 \\
      python benchmarks/regime_map_pilot.py sgd
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATES = (0.03, 0.1, 0.2, 0.5, 2.0, 8.0)


def _map():
  sys.path.insert(0, REPO)
  from ksjax.studies import declaration  # pylint: disable=g-import-not-at-top
  return declaration.load_module(os.path.join(REPO, "experiments", "regime_map.py")).MAP


def _start(work, out: str):
  from ksjax.run.directory import RunDirectory  # pylint: disable=g-import-not-at-top
  from ksjax.trainer import loop  # pylint: disable=g-import-not-at-top
  config = work.start_config(out)
  if not os.path.isdir(RunDirectory(config.workdir).final_dir):
    loop.run(config)
  return config


def calibrate(work, out: str) -> None:
  from ksjax import model  # pylint: disable=g-import-not-at-top
  from ksjax.run import scoring  # pylint: disable=g-import-not-at-top
  from ksjax.run import spec as spec_lib  # pylint: disable=g-import-not-at-top
  from ksjax.run import tasks as run_tasks  # pylint: disable=g-import-not-at-top
  from ksjax.run.directory import RunDirectory  # pylint: disable=g-import-not-at-top
  config = _start(work, out)
  config.synthetic.levels = (1, 2, 3, 4)
  spec = spec_lib.from_config(config)
  task = run_tasks.make_task(spec.task, spec.model, "test")
  prompts = [p for level in (1, 2, 3, 4)
             for p in [q for q in task.prompts("train") if q.metadata["level"] == level][:24]]
  mesh = model.make_mesh(spec.run.mesh)
  policy, _ = model.load_checkpoint(RunDirectory(config.workdir).start_dir, mesh)
  draw = scoring.Draw(num_samples=64, max_new_tokens=50, temperature=1.0, top_p=1.0, top_k=0)
  outcomes = scoring.evaluate(policy, task, prompts, draw, seed=0, batch_prompts=8, mesh=mesh)
  values = scoring.per_problem(outcomes.correct_gn, outcomes.answer_ids_gn, outcomes.rewards_gn,
                               (1, 4, 16, 64))
  levels = np.asarray([p.metadata["level"] for p in prompts])
  print("level  problems  pass@1  pass@4  pass@16  pass@64 (training problems)")
  for level in (1, 2, 3, 4):
    mask = levels == level
    print(f"{level:>5}  {int(mask.sum()):>8}  " + "  ".join(
        f"{values[f'pass@{k}'][mask].mean():.3f}" for k in (1, 4, 16, 64)))


def sgd(m, out: str) -> None:
  from ksjax.run.directory import RunDirectory  # pylint: disable=g-import-not-at-top
  from ksjax.trainer import loop  # pylint: disable=g-import-not-at-top
  _start(m.work, out)
  print("run          KL 6-15  KL 41-60  KL 91-110  KL 141-150  pass@1 1-20  pass@1 131-150")
  for name, overrides in [("adam 1e-4", {})] + [
      (f"sgd {r:g}", {"optimizer": "sgd", "learning_rate": r}) for r in RATES]:
    config = m.work.run_config(out, name.replace(" ", "_"), {
        **m.arms["mean"], "k": 4, "n": 4, "num_steps": 150, "checkpoint_every": 150,
        "keep_checkpoints": 1, **overrides}, 0)
    loop.run(config)
    with open(RunDirectory(config.workdir).metrics_jsonl, encoding="utf-8") as f:
      rows = [json.loads(line) for line in f if line.strip()]
    mean = lambda key, a, b: np.mean([r[key] for r in rows if a <= r["step"] <= b])
    print(f"{name:<11}  " + "  ".join(f"{mean('kl/k3', a, b):7.3f}" for a, b in (
        (6, 15), (41, 60), (91, 110), (141, 150))) + "  " + "  ".join(
            f"{mean('batch/pass_at_1', a, b):11.3f}" for a, b in ((1, 20), (131, 150))))


def main(argv) -> None:
  if len(argv) != 2 or argv[1] not in ("calibrate", "sgd"):
    raise SystemExit("usage: python benchmarks/regime_map_pilot.py calibrate|sgd")
  m = _map()
  out = tempfile.mkdtemp(prefix="ksjax_regime_map_pilot_")
  try:
    (calibrate(m.work, out) if argv[1] == "calibrate" else sgd(m, out))
  finally:
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
  main(sys.argv)
