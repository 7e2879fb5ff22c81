"""The paper's softmax-bandit study of k-sample policy-gradient estimators (Figure 1).

`run(config)` is what `python -m ksjax.main --config=configs/bandit.py` calls. The pieces:
`variants` (which estimators), `policy_gradient` (one gradient estimate), `train` (the jitted,
seed-vectorised training scan), `exact` (closed-form metrics and target objectives), `variance`
(gradient error at initialisation), `comparisons` (reading curves at matched KL), `report` (files).
"""

from ksjax.bandit.study import run

__all__ = ["run"]
