"""pass@k in the Dr. GRPO form (paper appendix): biased pass@k is exactly Dr. GRPO on the
effective reward A_i; no division by the standard deviation, token sums over a constant."""

from ksjax.run import config as run_config


def get_config():
  config = run_config.embedded_task_config()
  config.workdir = "runs/dr_grpo_pass_at_k"
  config.aggregator = "pass_at_k"
  config.baseline = "loo_demeaned"
  config.scale = "none"
  config.algorithm = "dr_grpo"
  config.loss_aggregation = "token_sum"
  config.num_minibatches = 2
  return config
