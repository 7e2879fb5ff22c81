"""Step time of lockstep training against rollouts sampled ahead, in one process.

  python benchmarks/async_rollouts.py                       # 8 fake CPU devices, tiny model
  python benchmarks/async_rollouts.py --steps=12 --sampler_devices=2

Runs the trainer (`ksjax.trainer.loop.run`) on the embedded task with the tiny preset, no
warm-up and no held-out evaluation, three times in this process on the same devices:
  lockstep:        config.max_lag=0, the learner's mesh on every device;
  ahead, shared:   max_lag=1, the sampler on the learner's devices (a worker thread);
  ahead, split:    max_lag=1, the last --sampler_devices devices sample, the others learn;
and prints, for each, the median wall-clock seconds per step over the steps after the first
--skip (which compile), the step's split into the logged time/* phases (lockstep) or the
learner's wait for rollouts (ahead), and each one's ratio to lockstep. On fake CPU devices every
"device" shares the same cores, so two programs running at once compete for them: the ratio
measured here is what overlapping buys on this machine, not on a pod (docs/scaling.md models
that from the step split).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile


def _config(workdir: str, steps: int, batch_prompts: int, **overrides):
  from ksjax.run import config as defaults  # pylint: disable=g-import-not-at-top
  c = defaults.embedded_task_config()
  c.workdir = workdir
  c.update({"num_steps": steps, "batch_prompts": batch_prompts, "mesh": (-1, 1, 1),
            "checkpoint_every": 10_000, "progress_bar": False})
  c.sft_warmup.steps = 0
  c.eval.at_start = False
  c.eval.at_end = False
  c.update(overrides)
  return c


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=8, help="fake CPU devices")
  parser.add_argument("--sampler_devices", type=int, default=4)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--skip", type=int, default=3, help="first steps left out (compiling)")
  parser.add_argument("--batch_prompts", type=int, default=16)
  args = parser.parse_args()
  os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from ksjax.run.directory import RunDirectory  # pylint: disable=g-import-not-at-top
  from ksjax.trainer import loop, metrics  # pylint: disable=g-import-not-at-top

  modes = {
      "lockstep": {},
      "ahead, shared": {"max_lag": 1, "is_cap": 2.0},
      "ahead, split": {"max_lag": 1, "is_cap": 2.0, "sampler_devices": args.sampler_devices},
  }
  rows = {}
  with tempfile.TemporaryDirectory() as tmp:
    for name, overrides in modes.items():
      workdir = os.path.join(tmp, name.replace(", ", "_"))
      loop.run(_config(workdir, args.steps, args.batch_prompts, **overrides))
      lines = metrics.read_jsonl(RunDirectory(workdir).metrics_jsonl)[args.skip:]
      phases = sorted({k for line in lines for k in line
                       if k.startswith("time/") and k not in ("time/step", "time/cpu_seconds")})
      rows[name] = (statistics.median(line["time/step"] for line in lines),
                    {p: statistics.median(line.get(p, 0.0) for line in lines) for p in phases})
  base = rows["lockstep"][0]
  print(f"\n{args.devices} fake CPU devices, {os.cpu_count()} cores; median seconds per step over "
        f"steps {args.skip + 1}-{args.steps}")
  print(f"{'mode':<16}{'s/step':>8}{'vs lockstep':>13}  phases (median s)")
  for name, (step, phases) in rows.items():
    split = ", ".join(f"{p.split('/')[1]} {v:.3f}" for p, v in phases.items())
    print(f"{name:<16}{step:8.3f}{step / base:12.2f}x  {split}")


if __name__ == "__main__":
  main()
