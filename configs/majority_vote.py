"""Majority voting (maj@k) policy gradient, unbiased leave-one-out estimator.

Answer classes come from the task's scorer (equal answers vote together).
"""

from ksjax.trainer import defaults


def get_config():
  config = defaults.embedded_task_config()
  config.workdir = "runs/majority_vote"
  config.aggregator = "majority_vote"
  config.baseline = "loo"
  return config
