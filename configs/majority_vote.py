"""Majority voting (maj@k) policy gradient, unbiased leave-one-out estimator.

Answer classes come from the task's scorer (equal answers vote together).
"""

from ksjax.run import config as run_config


def get_config():
  config = run_config.embedded_task_config()
  config.workdir = "runs/majority_vote"
  config.aggregator = "majority_vote"
  config.baseline = "loo"
  return config
