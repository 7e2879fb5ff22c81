"""The baseline: mean-reward (pass@1) policy gradient with the leave-one-out baseline (RLOO)."""

from ksjax.run import config as run_config


def get_config():
  config = run_config.embedded_task_config()
  config.workdir = "runs/mean"
  config.aggregator = "mean"
  config.baseline = "loo"
  return config
