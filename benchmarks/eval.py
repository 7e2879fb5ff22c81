"""Evaluation throughput (problems x samples per second) of the eval binary on the default config.

  python benchmarks/eval.py [--run_dir=runs/pass_at_k] [--warmup_steps=300]
                            [--batch_prompts=8,32,64] [--num_prompts=0]

What is timed is `ksjax.evaluation.runner.Evaluator.evaluate` on one checkpoint, exactly what
`python -m ksjax.eval --config=configs/eval.py` does per checkpoint: restore the parameters,
sample n = 20 completions per problem for the 300 test problems of the embedded task, score them,
estimate pass@k / maj@k and write the files. Each batch size is evaluated twice in one process:
cold (compilation included, what the first checkpoint of a run costs) and warm (what every later
checkpoint costs). Side by side in one run, the ratios between batch sizes hold on a shared
machine where absolute numbers do not.

Without --run_dir a checkpoint is made with the real trainer on the default config: a supervised
warm-up of --warmup_steps steps (so completions end at the answer, as a trained policy's do, and
not at max_new_tokens) and one RL step. The estimators' share of the time is reported too, and
maj@k at n = 200 (the paper's pass@100 setting), which is where its dynamic programme is costly.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time

import numpy as np
from absl import app, flags

from ksjax.evaluation import runner
from ksjax.evaluation import settings as settings_lib
from ksjax.objectives import estimates
from ksjax.run import checkpoints, scoring
from ksjax.run import config as defaults
from ksjax.run.directory import locate

_RUN_DIR = flags.DEFINE_string("run_dir", None, "A trainer run to evaluate; None: make one.")
_WARMUP = flags.DEFINE_integer("warmup_steps", 300, "Supervised warm-up steps of the made run.")
_BATCH = flags.DEFINE_list("batch_prompts", ["8", "32", "64"], "Problems per sampler call.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 0, "Problems to evaluate; 0: the split.")


def make_run(workdir: str, warmup_steps: int) -> None:
  from ksjax import trainer  # pylint: disable=g-import-not-at-top
  config = defaults.base_config()
  config.workdir = workdir
  config.num_steps = 1
  config.checkpoint_every = 1
  config.sft_warmup.steps = warmup_steps
  config.eval.at_start = config.eval.at_end = False
  config.progress_bar = False
  trainer.run(config)


def eval_config(run_dir: str, batch_prompts: int, output_dir: str):
  """configs/eval.py (the default evaluation) for `run_dir`, at `batch_prompts`."""
  spec_path = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "eval.py")
  spec = importlib.util.spec_from_file_location("ksjax_eval_config", spec_path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.checkpoint_dir = run_dir
  config.batch_prompts = batch_prompts
  config.output_dir = output_dir
  config.plots = False
  if _NUM_PROMPTS.value:
    config.num_prompts = _NUM_PROMPTS.value
  return config


def time_evaluations(run_dir: str, batch_prompts: int) -> tuple[float, float, dict]:
  """(cold seconds, warm seconds, warm record) of evaluating the newest checkpoint twice."""
  with tempfile.TemporaryDirectory() as out:
    config = eval_config(run_dir, batch_prompts, out)
    s = settings_lib.validate(config)
    run = locate(run_dir)
    step = checkpoints.steps(run)[-1]
    evaluator = runner.open_evaluator(s, run, runner.open_task(s), out)
    seconds = []
    for _ in range(2):
      evaluator.records.clear()  # evaluate again, not read back
      start = time.perf_counter()
      record = evaluator.evaluate(step)
      seconds.append(time.perf_counter() - start)
  return seconds[0], seconds[1], record


def estimator_seconds(num_problems: int, n: int, ks, seed: int = 0) -> float:
  """Seconds for pass@k, maj@k and reward of `num_problems` problems of n samples, answers from a
  few classes (as a half-trained policy gives) with a long tail of singletons."""
  rng = np.random.default_rng(seed)
  shape = (num_problems, n)
  ids_gn = np.where(rng.random(shape) < 0.8, rng.integers(0, 4, shape),
                    rng.integers(4, 10 * n, shape))
  correct_gn = ids_gn == 0
  rewards_gn = np.where(correct_gn, 1.0, -1.0)
  estimates.majority_at_k.cache_clear()
  start = time.perf_counter()
  scoring.per_problem(correct_gn, ids_gn, rewards_gn, ks)
  return time.perf_counter() - start


def main(argv):
  del argv
  with tempfile.TemporaryDirectory() as tmp:
    run_dir = _RUN_DIR.value
    if run_dir is None:
      run_dir = os.path.join(tmp, "run")
      start = time.perf_counter()
      make_run(run_dir, _WARMUP.value)
      print(f"made a run with {_WARMUP.value} warm-up steps in {time.perf_counter() - start:.0f}s")
    rows = []
    for bp in map(int, _BATCH.value):
      cold, warm, record = time_evaluations(run_dir, bp)
      rows.append((bp, cold, warm, record))
    print(f"\n{'batch_prompts':>13} {'problems x n':>13} {'cold s':>8} {'warm s':>8} "
          f"{'samples/s':>10} {'vs first':>9}   pass@1  pass@20")
    base = rows[0][3]["num_problems"] * rows[0][3]["num_samples"] / rows[0][2]
    for bp, cold, warm, record in rows:
      samples = record["num_problems"] * record["num_samples"]
      rate = samples / warm
      print(f"{bp:>13} {record['num_problems']:>6} x {record['num_samples']:<4} {cold:>8.1f} "
            f"{warm:>8.1f} {rate:>10.1f} {rate / base:>8.2f}x   {record['metrics']['pass@1']:.3f}"
            f"   {record['metrics'].get('pass@20', float('nan')):.3f}")
    record = rows[-1][3]
    share = estimator_seconds(record["num_problems"], record["num_samples"],
                              tuple(record["ks"])) / rows[-1][2]
    print(f"\nestimators (pass@k, maj@k, reward) at n = {record['num_samples']}: "
          f"{100 * share:.2f}% of a warm evaluation")
    per_problem = estimator_seconds(100, 200, (1, 10, 100)) / 100
    print(f"estimators at n = 200, k = 1, 10, 100: {1e3 * per_problem:.1f} ms per problem")


if __name__ == "__main__":
  app.run(main)
