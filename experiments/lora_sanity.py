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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decisive_study as ds  # pylint: disable=wrong-import-position
import real_model_study as rms  # pylint: disable=wrong-import-position

from ksjax import files, machine  # pylint: disable=wrong-import-position
from ksjax.evaluation import results  # pylint: disable=wrong-import-position
from ksjax.trainer import metrics  # pylint: disable=wrong-import-position

CONFIG = "smollm2_pass_at_k_lora"
ARM = "pass_at_k_lora"
FULL_ARM = "pass_at_k"  # the decisive study's run it is set beside
SEEDS = (0, 1)
DEFAULT_OUT = os.path.join(ds.REPO, "experiments", "results", "lora_sanity")
METRICS = ("pass@1", "pass@4", "pass@16", "maj@4", "kl")  # kl: k3 per completion, to the start


def lora_design() -> ds.Design:
  """The decisive study's design, on the LoRA config, with the one LoRA arm."""
  d = ds.design(ds.load_registration())
  full = d.arms[FULL_ARM]
  return dataclasses.replace(d, config=CONFIG, arms={ARM: {**full, "seeds": list(SEEDS)}})


def run(d: ds.Design, runs_dir: str, out: str, seeds) -> None:
  """Each seed's LoRA run trained (or resumed), evaluated at its last step, published."""
  for seed in seeds:
    name = rms.run_name(ARM, seed)
    if ds.published(out, name):
      continue
    rms.real_model().run_config(name, runs_dir, config=d.config,
                                overrides=ds.train_overrides(d, ARM, seed), held_out=False)
    last = rms._last_step(runs_dir, name)  # pylint: disable=protected-access
    if last != d.steps:
      raise SystemExit(f"lora_sanity: {name} ended at step {last}, not {d.steps}")
    if last not in ds.records(ds.eval_dir(runs_dir, name, "eval")):
      ds.evaluate(d, runs_dir, name, "eval", [last], include_start=False)
    publish(d, runs_dir, out, name, seed, last)
    rms.prune_checkpoints(runs_dir, name)


def publish(d: ds.Design, runs_dir: str, out: str, name: str, seed: int, last: int) -> None:
  target = rms.publish_run_files(runs_dir, out, name)
  evaluations = json.load(open(os.path.join(runs_dir, name, "evaluations.json"),
                               encoding="utf-8"))
  files.write_json(os.path.join(target, "evaluations.json"), evaluations)
  record = ds.records(ds.eval_dir(runs_dir, name, "eval"))[last]
  os.makedirs(os.path.join(target, "eval"), exist_ok=True)
  results.save_step(os.path.join(target, "eval"),
                    rms._relative_checkpoint(record, runs_dir))  # pylint: disable=protected-access
  attempts = json.load(open(os.path.join(runs_dir, name, "attempts.json"), encoding="utf-8"))
  rows = metrics.read_jsonl(os.path.join(target, "metrics.jsonl"))
  files.write_json(os.path.join(target, "published.json"), {
      "arm": ARM, "seed": seed, "stop": "steps", "last_step": last, "config": d.config,
      "cpu_seconds": max(r.get("time/cpu_seconds", 0.0) for r in rows),
      "evaluated": {"eval": [last]},
      "machines": ds._machines(attempts, evaluations)})  # pylint: disable=protected-access


def _values(directory: str, step: int) -> dict[str, float] | None:
  by_step = ds.records(os.path.join(directory, "eval"))
  if step not in by_step:
    return None
  m = by_step[step]["metrics"]
  return {k: m.get("kl_k3" if k == "kl" else k, float("nan")) for k in METRICS}


def report(d: ds.Design, out: str, full_out: str, seeds) -> str:
  """The table of each seed's two runs at step 12 and their differences (a pure function of the
  published records)."""
  lines = [f"# LoRA against full fine-tuning on SmolLM2-135M, pass@4 training, step {d.steps}",
           "", "A sanity check on two seeds, not a claim: no interval or test is drawn from two "
           "seeds.", "", "| seed | run | " + " | ".join(METRICS) + " | training CPU-min | machine |",
           "|---|---|" + "---|" * (len(METRICS) + 2)]
  left_out = []
  for seed in seeds:
    lora_name, full_name = rms.run_name(ARM, seed), rms.run_name(FULL_ARM, seed)
    if not (ds.published(out, lora_name) and ds.published(full_out, full_name)):
      left_out.append(f"seed {seed}: not both runs published yet")
      continue
    pub = {n: json.load(open(os.path.join(o, n, "published.json"), encoding="utf-8"))
           for n, o in ((lora_name, out), (full_name, full_out))}
    if pub[lora_name]["machines"] != pub[full_name]["machines"]:
      left_out.append(f"seed {seed}: the runs ran on {pub[lora_name]['machines']} and "
                      f"{pub[full_name]['machines']}")
      continue
    values = {lora_name: _values(os.path.join(out, lora_name), d.steps),
              full_name: _values(os.path.join(full_out, full_name), d.steps)}
    for n, label in ((full_name, "full"), (lora_name, "LoRA r16")):
      lines.append(f"| {seed} | {label} | " + " | ".join(f"{values[n][k]:.3f}" for k in METRICS)
                   + f" | {pub[n]['cpu_seconds'] / 60:.1f} | {pub[n]['machines'][0]} |")
    lines.append(f"| {seed} | LoRA − full | " + " | ".join(
        f"{values[lora_name][k] - values[full_name][k]:+.3f}" for k in METRICS) + " | | |")
  if left_out:
    lines += ["", "Left out: " + "; ".join(left_out) + "."]
  return "\n".join(lines) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=DEFAULT_OUT)
  parser.add_argument("--full_out", default=ds.DEFAULT_OUT,
                      help="the decisive study's published runs")
  parser.add_argument("--runs_dir", default=os.path.join(ds.REPO, "runs", "lora_sanity"))
  parser.add_argument("--seeds", default=",".join(map(str, SEEDS)))
  parser.add_argument("--status", action="store_true", help="report only; train nothing")
  args = parser.parse_args()
  seeds = [int(s) for s in args.seeds.split(",")]
  d = lora_design()
  if not args.status:
    print(f"lora_sanity on {machine.describe()}", flush=True)
    run(d, args.runs_dir, args.out, seeds)
  text = report(d, args.out, args.full_out, seeds)
  os.makedirs(args.out, exist_ok=True)
  files.write_text(os.path.join(args.out, "README.md"), text)
  print(text)


if __name__ == "__main__":
  main()
