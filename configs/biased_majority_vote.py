"""Biased majority voting: leave-one-out advantages minus their mean (the paper's eq. 3)."""

from ksjax.run import config as run_config


def get_config():
  config = run_config.embedded_task_config()
  config.workdir = "runs/biased_majority_vote"
  config.aggregator = "majority_vote"
  config.baseline = "loo_demeaned"
  return config
