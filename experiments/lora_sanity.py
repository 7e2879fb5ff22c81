"""LoRA against full fine-tuning on SmolLM2-135M-Instruct at matched steps: a sanity check, not a
claim (#36, "LoRA and QLoRA through qwix").

    python experiments/lora_sanity.py [--out=DIR] [--runs_dir=DIR] [--seeds=0,1] [--status]

Fixed before its first run (this file's commit), chosen from nothing measured on it:
  * the LoRA run: `configs/smollm2_pass_at_k_lora.py` (pass@4 leave-one-out, rank 16 on every
    weight matrix of the blocks) with the decisive study's matched-steps design
    (`experiments/decisive_study.py`, its pre-registration's `design`): the same seeds, 12
    steps, the same data order and start (the GGUF weights), every test problem held out;
  * its evaluation: the decisive study's main evaluation (the eval binary, all 160 test problems x
    16 samples, sampling seed 0, the KL to the start) at step 12 only;
  * the full run it is set beside: the decisive study's published `pass_at_k` run of the same seed,
    evaluated alike at step 12, on the same machine (`ksjax.machine.describe`); a seed whose full
    run is not published yet, or ran on another machine, is listed and left out;
  * what is reported: per seed, held-out pass@1, pass@4, pass@16, maj@4 and the KL to the start of
    both runs, their differences (LoRA minus full), and the training CPU time. Two seeds: no
    interval or test is drawn from them.
Stopped at any point, the same command continues: a published run is not run again, an
unfinished one resumes from its newest checkpoint, an evaluation already written is reused.
Each run is published to `<out>/<run>/` as the decisive study publishes its runs; commit `<out>`
after each.

Amended after both LoRA runs were published and before any full run of seed 1 existed (the
restarted decisive study reaches its seed 1 many sessions later): the full run of a seed is the
first published `pass_at_k` run on the LoRA run's machine found in the restarted study's runs,
then in its superseded pilot (`decisive_study_7f27d15`, the study's runs when the LoRA runs were
made), then in this check's own `<out>`, where `--train_full` trains it on this machine with the
study's design and evaluation, as the study would. Nothing else changed; the table names each
run's training commit, since the two runs of a seed may come from different commits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decisive_study import STUDY  # pylint: disable=wrong-import-position

from ksjax import files, machine  # pylint: disable=wrong-import-position
from ksjax.evaluation import results  # pylint: disable=wrong-import-position
from ksjax.studies import registered as reg  # pylint: disable=wrong-import-position
from ksjax.studies import runs_dir as rd  # pylint: disable=wrong-import-position
from ksjax.trainer import metrics  # pylint: disable=wrong-import-position

CONFIG = "smollm2_pass_at_k_lora"
ARM = "pass_at_k_lora"
FULL_ARM = "pass_at_k"  # the decisive study's run it is set beside
SEEDS = (0, 1)
DEFAULT_OUT = os.path.join(STUDY.root, "experiments", "results", "lora_sanity")
# The decisive study's runs when the LoRA runs were made, superseded by its restart (a pilot).
PILOT_OUT = os.path.join(STUDY.root, "experiments", "results", "decisive_study_7f27d15")
METRICS = ("pass@1", "pass@4", "pass@16", "maj@4", "kl")  # kl: k3 per completion, to the start


def lora_design() -> reg.Design:
  """The decisive study's design, on the LoRA config, with the one LoRA arm."""
  d = reg.design(STUDY, STUDY.load_registration())
  full = d.arms[FULL_ARM]
  return dataclasses.replace(d, config=CONFIG, arms={ARM: {**full, "seeds": list(SEEDS)}})


def run(d: reg.Design, runs_dir: str, out: str, seeds) -> None:
  """Each seed's LoRA run trained (or resumed), evaluated at its last step, published."""
  for seed in seeds:
    _train_and_publish(d, ARM, seed, runs_dir, out)


def train_full(full_d: reg.Design, runs_dir: str, out: str, seeds, full_outs) -> None:
  """The full run of each seed whose LoRA run is published, ran on this machine alone, and has
  no full run on that machine in `full_outs`: trained here with the study's design, evaluated as
  the LoRA run was, published to `out`."""
  here = machine.describe()
  for seed in seeds:
    lora = _published(out, rd.run_name(ARM, seed))
    if lora is None or full_run(seed, lora["machines"], full_outs) is not None:
      continue
    if lora["machines"] != [here]:
      print(f"lora_sanity: seed {seed}'s LoRA run ran on {lora['machines']}, not on {here}: "
            "its full run must be trained there", flush=True)
      continue
    _train_and_publish(full_d, FULL_ARM, seed, runs_dir, out)


def _train_and_publish(d: reg.Design, arm: str, seed: int, runs_dir: str, out: str) -> None:
  name = rd.run_name(arm, seed)
  if reg.published(out, name):
    return
  rd.train(STUDY.root, runs_dir, name, d.config, reg.train_overrides(d, arm, seed))
  last = rd.last_step(runs_dir, name)
  if last != d.steps:
    raise SystemExit(f"lora_sanity: {name} ended at step {last}, not {d.steps}")
  if last not in reg.records(reg.eval_dir(runs_dir, name, "eval")):
    reg.evaluate(STUDY, d, runs_dir, name, "eval", [last], include_start=False)
  publish(d, runs_dir, out, name, arm, seed, last)
  rd.prune_checkpoints(runs_dir, name)


def publish(d: reg.Design, runs_dir: str, out: str, name: str, arm: str, seed: int,
            last: int) -> None:
  target = rd.publish_run_files(STUDY.root, runs_dir, out, name)
  evaluations = json.load(open(os.path.join(runs_dir, name, "evaluations.json"),
                               encoding="utf-8"))
  files.write_json(os.path.join(target, "evaluations.json"), evaluations)
  record = reg.records(reg.eval_dir(runs_dir, name, "eval"))[last]
  os.makedirs(os.path.join(target, "eval"), exist_ok=True)
  results.save_step(os.path.join(target, "eval"),
                    rd.relative_checkpoint(record, runs_dir))
  attempts = json.load(open(os.path.join(runs_dir, name, "attempts.json"), encoding="utf-8"))
  rows = metrics.read_jsonl(os.path.join(target, "metrics.jsonl"))
  files.write_json(os.path.join(target, "published.json"), {
      "arm": arm, "seed": seed, "stop": "steps", "last_step": last, "config": d.config,
      "cpu_seconds": max(r.get("time/cpu_seconds", 0.0) for r in rows),
      "evaluated": {"eval": [last]},
      "machines": reg.run_machines(attempts, evaluations)})


def _published(out: str, name: str) -> dict | None:
  """Run `name`'s publication record in `out`, or None where it is not published there."""
  if not reg.published(out, name):
    return None
  return rd.published_json(out, name, "published.json")


def full_run(seed: int, machines: list[str], full_outs) -> str | None:
  """The directory that holds seed `seed`'s full run: the first of `full_outs` with a published
  `pass_at_k` run of that seed that ran on `machines` (the LoRA run's), or None."""
  name = rd.run_name(FULL_ARM, seed)
  for out in full_outs:
    pub = _published(out, name)
    if pub is not None and pub["machines"] == machines:
      return out
  return None


def _commit(out: str, name: str) -> str:
  """The commit a published run trained at (its first attempt's)."""
  attempts = rd.published_json(out, name, "attempts.json")
  return attempts[0].get("commit", "unrecorded")[:7]


def _values(directory: str, step: int) -> dict[str, float] | None:
  by_step = reg.records(os.path.join(directory, "eval"))
  if step not in by_step:
    return None
  m = by_step[step]["metrics"]
  return {k: m.get("kl_k3" if k == "kl" else k, float("nan")) for k in METRICS}


def report(d: reg.Design, out: str, full_outs, seeds) -> str:
  """The table of each seed's two runs at step 12 and their differences (a pure function of the
  published records)."""
  lines = [f"# LoRA against full fine-tuning on SmolLM2-135M, pass@4 training, step {d.steps}",
           "", "A sanity check on two seeds, not a claim: no interval or test is drawn from two "
           "seeds.", "", "| seed | run | " + " | ".join(METRICS)
           + " | training CPU-min | commit | machine |", "|---|---|" + "---|" * (len(METRICS) + 3)]
  left_out, sources = [], []
  for seed in seeds:
    lora_name, full_name = rd.run_name(ARM, seed), rd.run_name(FULL_ARM, seed)
    lora = _published(out, lora_name)
    full_out = None if lora is None else full_run(seed, lora["machines"], full_outs)
    if full_out is None:
      left_out.append(f"seed {seed}: " + ("its LoRA run is not published yet" if lora is None
                                          else "no full run on its LoRA run's machine yet"))
      continue
    sources.append(f"seed {seed}'s full run from "
                   f"`{os.path.relpath(os.path.join(full_out, full_name), STUDY.root)}`")
    runs = {"full": (full_out, full_name), "LoRA r16": (out, lora_name)}
    values = {label: _values(os.path.join(*run), d.steps) for label, run in runs.items()}
    for label, (run_out, name) in runs.items():
      pub = _published(run_out, name)
      lines.append(f"| {seed} | {label} | " + " | ".join(f"{values[label][k]:.3f}" for k in METRICS)
                   + f" | {pub['cpu_seconds'] / 60:.1f} | {_commit(run_out, name)} | "
                   f"{pub['machines'][0]} |")
    lines.append(f"| {seed} | LoRA − full | " + " | ".join(
        f"{values['LoRA r16'][k] - values['full'][k]:+.3f}" for k in METRICS) + " | | | |")
  if sources:
    lines += ["", "Where each full run comes from: " + "; ".join(sources) + "."]
  if left_out:
    lines += ["", "Left out: " + "; ".join(left_out) + "."]
  return "\n".join(lines) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=DEFAULT_OUT)
  parser.add_argument("--full_out",
                      default=",".join((os.path.join(STUDY.root, STUDY.out), PILOT_OUT)),
                      help="where the full runs are looked for, in order, before --out: the "
                      "decisive study's published runs, then its superseded pilot's")
  parser.add_argument("--runs_dir", default=os.path.join(STUDY.root, "runs", "lora_sanity"))
  parser.add_argument("--seeds", default=",".join(map(str, SEEDS)))
  parser.add_argument("--status", action="store_true", help="report only; train nothing")
  parser.add_argument("--train_full", action="store_true",
                      help="also train the full run of a seed whose LoRA run ran on this machine "
                      "where no full run on it is published")
  args = parser.parse_args()
  seeds = [int(s) for s in args.seeds.split(",")]
  full_outs = [o for o in args.full_out.split(",") if o] + [args.out]
  d = lora_design()
  if not args.status:
    print(f"lora_sanity on {machine.describe()}", flush=True)
    run(d, args.runs_dir, args.out, seeds)
    if args.train_full:
      train_full(reg.design(STUDY, STUDY.load_registration()), args.runs_dir, args.out, seeds,
                 full_outs)
  text = report(d, args.out, full_outs, seeds)
  os.makedirs(args.out, exist_ok=True)
  files.write_text(os.path.join(args.out, "README.md"), text)
  print(text)


if __name__ == "__main__":
  main()
