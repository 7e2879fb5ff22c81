"""pass@k from n > k samples: the leave-one-out estimator averaged over all k-subsets of the n
completions (PKPO's recommended form; Walder & Karkhanis 2025), computed in closed form."""

from ksjax.run import config as run_config


def get_config():
  config = run_config.embedded_task_config()
  config.workdir = "runs/pkpo_pass_at_k"
  config.aggregator = "pass_at_k"
  config.baseline = "loo"
  config.n = 2 * config.k
  config.batch_prompts = config.batch_prompts // 2  # the same completions per step
  return config
