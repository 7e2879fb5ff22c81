"""Reading the bandit curves at a matched KL budget, for the paper's KL-efficiency statement.

"More KL-efficient" means: when the policy has moved a given KL(pi || pi_ref) away from the
reference, it scores higher. Each seed's run is read at the first step its KL reaches the budget
(linearly interpolated between the two steps around the crossing), so runs are compared at equal
KL rather than at equal step; seeds share their bandit across estimators, so differences are paired.
"""

from __future__ import annotations

import numpy as np


def value_at_kl(kl_st: np.ndarray, values_st: np.ndarray, budgets_b: np.ndarray) -> np.ndarray:
  """values at the first crossing of each KL budget: [S, B]; NaN where a run never reaches it.

  Args:
    kl_st: KL of each seed's policy at steps 0..T-1, [S, T].
    values_st: the metric at the same steps, [S, T].
    budgets_b: KL budgets, [B], each > 0.
  """
  kl_st, values_st = np.asarray(kl_st, np.float64), np.asarray(values_st, np.float64)
  out = np.full((kl_st.shape[0], len(budgets_b)), np.nan)
  for s in range(kl_st.shape[0]):
    for b, budget in enumerate(budgets_b):
      crossed = np.flatnonzero(kl_st[s] >= budget)
      if crossed.size == 0:
        continue
      t = crossed[0]
      if t == 0:
        out[s, b] = values_st[s, 0]
        continue
      frac = (budget - kl_st[s, t - 1]) / (kl_st[s, t] - kl_st[s, t - 1])
      out[s, b] = values_st[s, t - 1] + frac * (values_st[s, t] - values_st[s, t - 1])
  return out


def common_budgets(kl_runs: list[np.ndarray], num: int) -> np.ndarray:
  """`num` KL budgets evenly spaced in (0, the largest KL that every seed of every run reaches]."""
  reach = min(float(np.max(kl_st, axis=1).min()) for kl_st in kl_runs)
  return np.linspace(0.0, reach, num + 1)[1:]
