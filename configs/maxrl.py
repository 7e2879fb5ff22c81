"""MaxRL: the mixture sum_{j<=k} (1/j) pass@j, maximum likelihood of success truncated at k = n
(arXiv 2602.02710; ksjax/objectives/mixture.py), with leave-one-out weights at every j.

Run: python -m ksjax.main --config=configs/maxrl.py

The embedded task as configs/pass_at_k.py runs it, with k = n = 8 so that the mixture reaches
every k the samples can see, and half the prompts per step for the same completions per step.
--config.baseline=leave_two_out with --config.n=9 puts MaxPO's centred baseline under each term
(it needs k < n).
"""

from ksjax.run import config as run_config


def get_config():
  config = run_config.embedded_task_config()
  config.workdir = "runs/maxrl"
  config.aggregator = "pass_at_k"
  config.baseline = "loo"
  config.k_mixture = "maxrl"
  config.k = 8
  config.batch_prompts = config.batch_prompts // 2  # the same completions per step
  return config
