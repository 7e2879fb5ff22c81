"""Voting without labels (TTRL-style, leave-one-out): each completion is rewarded for agreeing
with the majority of the other completions of its prompt; the labels only reach the logged
accuracy, and a labelled probe of held-out prompts every 10 steps shows the true accuracy.

Run: python -m ksjax.main --config=configs/label_free.py

The embedded task as configs/pass_at_k.py runs it (the same warm-up to a calibration pass@1 of
0.25), with 8 completions per prompt so that each sample is judged by a vote of 7, half the
prompts per step for the same completions per step, and the mean objective with its
leave-one-out weights (RLOO, Dr. GRPO's advantages up to a constant). What it estimates, and
why it follows the modal answer wherever that is wrong: ksjax/objectives/label_free.py and
docs/objectives.md, which has a single run of it.
"""

from ksjax.run import config as run_config


def get_config():
  config = run_config.embedded_task_config()
  config.workdir = "runs/label_free"
  config.label_free = True
  config.aggregator = "mean"
  config.baseline = "loo"
  config.n = 8
  config.batch_prompts = config.batch_prompts // 2  # the same completions per step
  config.eval.probe_every = 10
  return config
