"""Annealing k over training (PKPO, Walder & Karkhanis 2025, arXiv 2505.15201): the k of the
k-sample objective as a pure function of the step.

PKPO reports that optimising pass@k with a large k early and a small one later (k = 1 at the end)
improves both pass@1 and pass@k over optimising either throughout: a large k rewards solving
problems the policy rarely solves (exploration), a small k sharpens what it already solves. The
trainer consults `k_at_step(step, ...)` before computing a step's advantages:

  none:    k at every step (k_start must be None or k).
  linear:  from k_start at step 0 to k at step `steps`, then k; rounded half up to an integer.
  step:    k_start for steps < `steps`, then k (PKPO's switch).

`step` counts the optimizer updates already done (0 for the first), as optax schedules do. k is a
static shape of the estimators, so each distinct value compiles once: at most |k - k_start| + 1
of them. Every value lies between k_start and k, so checking both against the group size n
checks the whole schedule (the enumerated aggregators' subset limits are not monotone in k:
`ksjax.run.spec.EstimatorSpec.check_with` checks each value).
"""

from __future__ import annotations

import numpy as np

K_SCHEDULES = ("none", "linear", "step")


def _is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_k_schedule(schedule: str, k: int, k_start: int | None, steps: int) -> None:
  """Raises ValueError naming the argument and what is accepted."""
  if schedule not in K_SCHEDULES:
    raise ValueError(f"k_schedule={schedule!r} is not accepted; expected one of "
                     f"{', '.join(map(repr, K_SCHEDULES))}")
  if not _is_int(k) or k < 1:
    raise ValueError(f"k={k!r} is not accepted; expected an integer >= 1")
  if schedule == "none":
    if k_start is not None and k_start != k:
      raise ValueError(f"k_start={k_start!r} is not accepted with k_schedule='none'; expected "
                       f"None (or k={k}), or a k_schedule of 'linear' or 'step'")
    return
  if not _is_int(k_start) or k_start < 1:
    raise ValueError(f"k_start={k_start!r} is not accepted with k_schedule={schedule!r}; "
                     "expected an integer >= 1")
  if not _is_int(steps) or steps < 1:
    raise ValueError(f"k_schedule_steps={steps!r} is not accepted with k_schedule={schedule!r}; "
                     "expected an integer >= 1")


def k_at_step(step: int, *, k: int, schedule: str = "none", k_start: int | None = None,
              steps: int = 0) -> int:
  """The k to optimise at `step` (0-based count of updates done), a Python int.

  Args:
    step: integer >= 0.
    k: the final k (the config's `k`), >= 1.
    schedule: one of K_SCHEDULES.
    k_start: the k at step 0 for "linear" and "step" (larger or smaller than k); None for "none".
    steps: "linear" reaches k at this step, "step" switches to k at it; >= 1 unless "none".
  """
  check_k_schedule(schedule, k, k_start, steps)
  if not _is_int(step) or step < 0:
    raise ValueError(f"step={step!r} is not accepted; expected an integer >= 0")
  if schedule == "none" or step >= steps:
    return int(k)
  if schedule == "step":
    return int(k_start)
  # k_start + (k - k_start) step / steps, rounded half up in exact integer arithmetic.
  return int(k_start + (2 * (k - k_start) * step + steps) // (2 * steps))
