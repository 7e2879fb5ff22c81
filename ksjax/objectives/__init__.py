"""k-sample objectives: per-sample policy-gradient weights for pass@k, majority voting and friends.

`k_sample_advantages` turns a group's rewards [G, n] into weights w [G, n] whose
`sum_i w_i grad log pi(y_i)` is an (unbiased) gradient estimate of a k-sample objective;
`objective_value` estimates that objective itself from the n samples. The mathematics, each
baseline's target and the n > k U-statistics are in `advantages.py`; the closed forms in `mean.py`
and `pass_at_k.py`; the exact subset enumeration for majority voting and softmax in
`enumerated.py`. What k samples achieve, estimated without bias from n >= k samples per problem
(pass@k in Chen et al.'s product form, maj@k by a dynamic programme over vote counts) is in
`estimates.py`, which evaluation and training logs use.
"""

from ksjax.objectives.advantages import AGGREGATORS
from ksjax.objectives.advantages import BASELINES
from ksjax.objectives.advantages import SCALES
from ksjax.objectives.advantages import k_sample_advantages
from ksjax.objectives.advantages import objective_value
from ksjax.objectives.enumerated import MAX_SUBSETS

__all__ = ["AGGREGATORS", "BASELINES", "MAX_SUBSETS", "SCALES", "k_sample_advantages",
           "objective_value"]
