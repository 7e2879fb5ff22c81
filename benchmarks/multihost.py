"""The cost of going multi-process on one machine: 2 processes x 2 CPU devices vs 1 x 4.

  python benchmarks/multihost.py [--steps=20] [--out=/tmp/multihost]

Runs the same tiny trainer config (configs/pass_at_k.py on a (4, 1, 1) mesh) once as one process
with 4 CPU devices and once as two processes with 2 devices each (`ksjax.tools.local_cluster`),
one after the other, and prints the median time per step and per phase (steps 3 and later, after
compilation) from each run's metrics.jsonl, and their ratio. The runs themselves are identical
(tests/trainer/test_multihost.py); what differs is the cross-process work: gathering the prompt shards
and the sampler's outputs, gloo collectives instead of in-process ones, and the scored groups.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from absl import app, flags

from ksjax.run.directory import RunDirectory
from ksjax.tools import local_cluster

_STEPS = flags.DEFINE_integer("steps", 20, "Training steps per run.")
_OUT = flags.DEFINE_string("out", "multihost_benchmark", "Directory for the two runs.")
_BATCH = flags.DEFINE_integer("batch_prompts", 8, "Prompts per step.")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("time/sampling", "time/reward", "time/reference", "time/update", "time/other",
          "time/step")


def run(workdir: str, processes: int, devices: int) -> tuple[dict[str, float], float]:
  args = ["--config=configs/pass_at_k.py", f"--config.workdir={workdir}",
          "--config.mesh=(4,1,1)", f"--config.num_steps={_STEPS.value}",
          f"--config.batch_prompts={_BATCH.value}", "--config.checkpoint_every=1000000",
          "--config.sft_warmup.steps=0", "--config.eval.at_start=False",
          "--config.eval.at_end=False", "--config.progress_bar=False",
          "--config.aggregator=mean", "--config.baseline=none"]
  start = time.perf_counter()
  rc = local_cluster.wait(local_cluster.start(args, processes=processes,
                                              devices_per_process=devices, logs=workdir,
                                              cwd=ROOT))
  wall = time.perf_counter() - start
  if rc:
    raise SystemExit(f"the {processes}-process run failed; see {workdir}.*.log")
  with open(RunDirectory(workdir).metrics_jsonl, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f][2:]
  return {p: float(np.median([r[p] for r in rows])) for p in PHASES}, wall


def main(argv):
  del argv
  os.makedirs(_OUT.value, exist_ok=True)
  one, wall_one = run(os.path.join(_OUT.value, "one_x4"), 1, 4)
  two, wall_two = run(os.path.join(_OUT.value, "two_x2"), 2, 2)
  print(f"median seconds per step (steps 3-{_STEPS.value}, {_BATCH.value} prompts x 4 "
        "completions, tiny model):")
  print(f"{'phase':<16}{'1 proc x 4':>12}{'2 procs x 2':>13}{'ratio':>8}")
  for p in PHASES:
    print(f"{p:<16}{one[p]:>12.4f}{two[p]:>13.4f}{two[p] / max(one[p], 1e-9):>8.2f}")
  print(f"{'wall (run)':<16}{wall_one:>12.1f}{wall_two:>13.1f}{wall_two / wall_one:>8.2f}")


if __name__ == "__main__":
  app.run(main)
