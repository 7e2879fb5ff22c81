"""Evaluation of saved checkpoints, apart from training: `python -m ksjax.eval`.

Files: estimators.py (unbiased pass@k, maj@k and mean reward from n samples per problem, pure
numpy), runner.py (checkpoints -> samples -> scores -> results files), plots.py (the PNG figures).
"""

from ksjax.evaluation.estimators import maj_at_k, mean_reward, pass_at_k, pass_at_ks

__all__ = ["maj_at_k", "mean_reward", "pass_at_k", "pass_at_ks"]
