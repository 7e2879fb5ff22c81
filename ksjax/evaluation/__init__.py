"""Evaluation of saved checkpoints, apart from training: `python -m ksjax.eval`.

Files, one concept each: estimators.py (unbiased pass@k, maj@k and mean reward from n samples
per problem, pure numpy), settings.py (the eval config's validation), checkpoints.py (read-only
access to a trainer run's checkpoints: steps, shapes, parameters onto a mesh), results.py (a
checkpoint's record, summaries and averages, atomic JSON/CSV files), plots.py (the figures),
runner.py (the binary's job: checkpoints -> samples -> scores -> files; watch mode).
"""

from ksjax.evaluation.estimators import maj_at_k, mean_reward, pass_at_k, pass_at_ks

__all__ = ["maj_at_k", "mean_reward", "pass_at_k", "pass_at_ks"]
