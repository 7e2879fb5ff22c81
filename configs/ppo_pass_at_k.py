"""pass@k with PPO (paper appendix): clipped ratio (eps = 0.2), A_i = R_i - V(x) with R_i the
pass@k leave-one-out advantage, and a value head trained with the clipped value loss (alpha = 0.2).

Two epochs of two mini-batches per batch of completions, so later optimizer steps are off-policy
and the clipping matters. The value loss reads every completion: no sparse updates.
"""

from ksjax.run import config as run_config


def get_config():
  config = run_config.embedded_task_config()
  config.workdir = "runs/ppo_pass_at_k"
  config.aggregator = "pass_at_k"
  config.baseline = "loo"
  config.algorithm = "ppo"
  config.ppo_epochs = 2
  config.num_minibatches = 2
  config.clip_eps = 0.2
  config.value_clip = 0.2
  config.sparse_updates = False
  return config
