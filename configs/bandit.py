"""The paper's bandit study (Figure 1): k-sample policy gradients on a 100-armed softmax bandit.

Run: python -m ksjax.main --config=configs/bandit.py [--config.field=value ...]

Compares mean policy gradient (mean:loo), pass@k policy gradient (pass_at_k:loo) and the biased
pass@k variant (pass_at_k:loo_demeaned), plus the (aggregator, baseline, scale) named by the shared
fields below when it is not one of those, plus `extra_variants`.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.task = "bandit"
  config.workdir = "runs/bandit"
  config.seed = 0
  config.num_seeds = 200  # independent bandits (rewards redrawn), each trained by every variant

  # The bandit: deterministic rewards r(a) ~ N(0, 1), policy softmax(theta), theta = 0 at the start.
  config.num_actions = 100
  config.learning_rate = 1.0  # plain SGD on theta, as in the paper
  config.num_steps = 2000
  config.groups_per_step = 1  # prompt groups averaged per update

  # Shared estimator fields (same names in every ksjax config).
  config.aggregator = "pass_at_k"  # mean | pass_at_k | majority_vote | softmax
  config.baseline = "loo"  # none | loo | loo_demeaned | leave_p_out
  config.k = 4  # samples in the k-sample objective; also the k of the pass@k metric
  config.n = ml_collections.config_dict.placeholder(int)  # samples per group; None means n = k
  config.p = 1  # leave_p_out only
  config.beta = 1.0  # softmax only
  config.scale = "none"  # none | group_std

  # More estimators to compare: comma-separated "aggregator:baseline[:scale]", e.g.
  # "softmax:loo,pass_at_k:leave_p_out,majority_vote:loo".
  config.extra_variants = ""

  # Single-group gradient estimates drawn per bandit for the variance table at initialisation.
  config.variance_draws = 5_000
  return config
