"""`budget.py` for a study in the published-run layout (`registered.py`: the decisive study).

Measured on the machine at hand before a (re)start, with shortened runs of the study's own
commands at this checkout's commit: each matched-steps arm trains `steps` steps with the study's
trainer flags (seed 0; only the step count and the checkpoint cadence shortened), then the first
arm's last checkpoint goes through the study's main evaluation on `eval_per_level` test problems
per level and its ladder on `ladder_per_level` (the rest as registered). Each child's CPU-seconds
come from its rusage, a training step's from the step log; the evaluation's start-up is its wall
time outside sampling, at the call's CPU rate. `projection` scales these to the registered
design (its steps, checkpoints and evaluations, the equal-CPU arms' budget, the start once).
`measure` writes `<runs_dir>/budget.json` as it goes; nothing here is a study run and nothing is
published. A module of its own, as `carry_runs.py` is.
"""

from __future__ import annotations

import os
import sys

from ksjax import files
from ksjax import machine
from ksjax.studies import registered
from ksjax.studies import runs_dir as rd
from ksjax.trainer import metrics

LEVELS = 4  # the arithmetic task's difficulty levels, each with `test_per_level` held-out problems


def timed(root: str, command) -> dict:
  """Runs `command`; its wall seconds, CPU-seconds (user + system) and peak resident GiB."""
  child = machine.run_child(command, cwd=root)
  if child.exit_status != 0:
    raise SystemExit(f"budget: {' '.join(command[1:4])} ... stopped with status "
                     f"{child.exit_status}")
  return {"wall": round(child.wall_seconds, 1), "cpu": round(child.cpu_seconds, 1),
          "peak_gib": round(child.peak_rss_bytes / 2**30, 2)}


def train(spec, d: registered.Design, runs_dir: str, arm: str, steps: int) -> dict:
  shortened = ("--config.num_steps=", "--config.checkpoint_every=")
  flags = [f for f in registered.train_overrides(d, arm, 0) if not f.startswith(shortened)]
  measured = timed(spec.root, [
      sys.executable, "-m", "ksjax.main", f"--config=configs/{d.config}.py",
      f"--config.workdir={os.path.join(runs_dir, arm)}", "--config.progress_bar=False", *flags,
      f"--config.num_steps={steps}", f"--config.checkpoint_every={steps}"])
  rows = metrics.read_jsonl(os.path.join(runs_dir, arm, "metrics.jsonl"))
  measured["loop_cpu_by_step"] = [round(r["time/cpu_seconds"], 1) for r in rows
                                  if "time/cpu_seconds" in r]
  return measured


def evaluate(spec, d: registered.Design, runs_dir: str, arm: str, which: str, step: int,
             per_level: int) -> dict:
  settings, fields = registered.eval_settings(d, which)
  fields = tuple((k, per_level if k.endswith("test_per_level") else v) for k, v in fields)
  run_dir = os.path.join(runs_dir, arm)
  measured = timed(spec.root, rd.eval_command(
      run_dir, os.path.join(run_dir, which), config=d.config, settings=settings,
      steps=str(step), include_start=False, run_fields=fields))
  record = registered.records(os.path.join(run_dir, which))[step]
  measured.update(samples=record["num_problems"] * record["num_samples"],
                  sampling_seconds=round(record["seconds"], 1))
  return measured


def projection(d: registered.Design, measured: dict) -> dict:
  """CPU-seconds of the registered design from the shortened runs: per matched-steps arm, an
  equal-CPU run, the start, and the whole study (CPU-hours)."""
  def split(call):  # (start-up CPU-s, CPU-s per sample)
    startup = call["cpu"] * (call["wall"] - call["sampling_seconds"]) / call["wall"]
    return startup, (call["cpu"] - startup) / call["samples"]

  e0, e1 = split(measured["eval"])
  l0, l1 = split(measured["ladder"])
  checkpoints = len(d.checkpoint_steps)
  eval_samples = LEVELS * d.test_per_level * d.evaluation["num_samples"]
  ladder_samples = LEVELS * d.ladder["test_per_level"] * d.ladder["num_samples"]
  one_eval = e0 + eval_samples * e1
  ladder = l0 + ladder_samples * l1
  trained, startups = {}, []
  for arm, m in measured["arms"].items():
    loop = m["loop_cpu_by_step"]
    startups.append(m["cpu"] - loop[-1])
    later = (loop[-1] - loop[0]) / max(1, len(loop) - 1)
    trained[arm] = m["cpu"] - loop[-1] + loop[0] + (d.steps - 1) * later
  arms = {arm: trained.get(arm, max(trained.values())) + e0 + checkpoints * (one_eval - e0)
          + ladder for arm, spec in d.arms.items() if spec["stop"] == "steps"}
  cpu_run = max(startups) + 60 * d.cpu_minutes + one_eval
  start = one_eval + ladder
  total = sum(arms[a] * len(d.arm_seeds(a)) for a in arms) + start + sum(
      cpu_run * len(d.arm_seeds(a)) for a, spec in d.arms.items() if spec["stop"] == "cpu")
  return {"eval_startup": e0, "eval_per_sample": e1, "ladder_startup": l0,
          "ladder_per_sample": l1, "matched_steps_run": arms, "equal_cpu_run": cpu_run,
          "start": start, "cpu_hours": total / 3600}


def measure(spec, d: registered.Design, runs_dir: str, arms, steps: int, eval_per_level: int,
            ladder_per_level: int) -> dict:
  """The shortened runs of `arms` (matched-steps ones) and the two evaluations of the first
  one's last checkpoint, with the projection; written to <runs_dir>/budget.json as it goes."""
  matched = [a for a in d.arms if d.arms[a]["stop"] == "steps"]
  if not arms or set(arms) - set(matched) or steps < 2:
    raise SystemExit(f"{spec.name}: --arms={','.join(arms)!r} --budget={steps} are not "
                     f"accepted for the budget; expected arms among {', '.join(matched)} and "
                     "at least 2 steps")
  out = os.path.join(runs_dir, "budget.json")
  measured = {"machine": machine.describe(), "commit": rd.commit(spec.root), "arms": {}}
  for arm in arms:
    measured["arms"][arm] = train(spec, d, runs_dir, arm, steps)
    files.write_json(out, measured)
  for which, per_level in (("eval", eval_per_level), ("ladder", ladder_per_level)):
    measured[which] = evaluate(spec, d, runs_dir, arms[0], which, steps, per_level)
    files.write_json(out, measured)
  measured["projection"] = projection(d, measured)
  files.write_json(out, measured)
  return measured
