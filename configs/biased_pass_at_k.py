"""Biased pass@k: the leave-one-out advantages minus their mean (the paper's eq. 3).

Targets E[((k-1)/k) r_(k) + (1/k) r_(k-1)]; lower variance, denser signal than configs/pass_at_k.py.
"""

from ksjax.run import config as run_config


def get_config():
  config = run_config.embedded_task_config()
  config.workdir = "runs/biased_pass_at_k"
  config.aggregator = "pass_at_k"
  config.baseline = "loo_demeaned"
  return config
