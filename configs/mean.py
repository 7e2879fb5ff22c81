"""The baseline: mean-reward (pass@1) policy gradient with the leave-one-out baseline (RLOO)."""

from ksjax.trainer import defaults


def get_config():
  config = defaults.embedded_task_config()
  config.workdir = "runs/mean"
  config.aggregator = "mean"
  config.baseline = "loo"
  return config
