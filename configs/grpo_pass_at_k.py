"""pass@k in the GRPO form (paper appendix): the biased pass@k advantage as the effective reward,
divided by the group's standard deviation, PPO's clipped ratio without a value model, and GRPO's
per-sequence token mean."""

from ksjax.run import config as run_config


def get_config():
  config = run_config.embedded_task_config()
  config.workdir = "runs/grpo_pass_at_k"
  config.aggregator = "pass_at_k"
  config.baseline = "loo_demeaned"
  config.scale = "group_std"
  config.algorithm = "grpo"
  config.loss_aggregation = "seq_mean_token_mean"
  config.num_minibatches = 2
  return config
