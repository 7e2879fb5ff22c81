"""k-sample objectives: per-sample policy-gradient weights for pass@k, majority voting and friends.

`k_sample_advantages` turns a group's rewards [G, n] into weights w [G, n] whose
`sum_i w_i grad log pi(y_i)` is an (unbiased) gradient estimate of a k-sample objective;
`objective_value` estimates that objective itself from the n samples. The mathematics, each
baseline's target and the n > k U-statistics are in `advantages.py`; the closed forms in `mean.py`
and `pass_at_k.py`; the exact subset enumeration for majority voting and softmax in
`enumerated.py`. What k samples achieve, estimated without bias from n >= k samples per problem
(pass@k in Chen et al.'s product form, maj@k by a dynamic programme over vote counts) is in
`estimates.py`, which evaluation and training logs use. Chen et al.'s normalised pass@k and verl's
grpo_passk, biased baselines to compare against, are in `normalized.py`; `k_at_step` (`schedule.py`)
anneals k over training. Objectives over every k, sum_k w_k E[f_k] (MaxRL's w_k = 1/k among them),
are `mixture_advantages` and `mixture_value` (`mixture.py`); the leave-one-out agreement reward of
voting without labels is `label_free.agreement`. docs/objectives.md lists them all.
"""

from ksjax.objectives.advantages import AGGREGATORS
from ksjax.objectives.advantages import ALL_BASELINES
from ksjax.objectives.advantages import BASELINES
from ksjax.objectives.advantages import CENTRED_BASELINES
from ksjax.objectives.advantages import NORMALIZED_BASELINES
from ksjax.objectives.advantages import SCALES
from ksjax.objectives.advantages import k_sample_advantages
from ksjax.objectives.advantages import objective_value
from ksjax.objectives.enumerated import MAX_SUBSETS
from ksjax.objectives.mixture import K_MIXTURES
from ksjax.objectives.mixture import MIXTURE_BASELINES
from ksjax.objectives.mixture import mixture_advantages
from ksjax.objectives.mixture import mixture_value
from ksjax.objectives.mixture import mixture_weights
from ksjax.objectives.schedule import K_SCHEDULES
from ksjax.objectives.schedule import k_at_step

__all__ = ["AGGREGATORS", "ALL_BASELINES", "BASELINES", "CENTRED_BASELINES", "K_MIXTURES",
           "K_SCHEDULES", "MAX_SUBSETS", "MIXTURE_BASELINES", "NORMALIZED_BASELINES", "SCALES",
           "k_at_step", "k_sample_advantages", "mixture_advantages", "mixture_value",
           "mixture_weights", "objective_value"]
