"""Closed forms of the k-sample objectives on a planted task, and their optimal policies.

A planted task (`ksjax.tasks.planted`) grades each prompt's k samples against one hidden instance
label i, drawn with known frequencies f_i (f_A = 0.6, f_B = 0.4, say); a policy answers i with
probability q_i and gives no answer with the rest, 1 - sum_i q_i (always wrong). In probability
units (rewards 1 for right, 0 for wrong; +1/-1 rewards are an increasing affine map of these, which
every aggregator here commutes with, so the optima are the same):

  pass@j  = sum_i f_i (1 - (1 - q_i)^j)                      (pass@1 is the mean reward)
  maj@j   = sum_i f_i P(i is the plurality of j votes)        (ties split evenly; "no answer" is a
                                                               class of its own that can win)

A `Target` is what a trainer config optimises, `sum_j w_j pass@j` or `sum_j w_j maj@j`:
the mean is pass@1; pass@k with baseline none, loo or leave_two_out is pass@k; the paper's
de-meaned leave-one-out (`loo_demeaned`) is unbiased for E[(1/k) sum_i f(y_-i)], and
E[((k-1)/k) r_(k) + (1/k) r_(k-1)] = pass@(k-1) (ESTIMATORS.md; for binary rewards
1 - (1-q)^k - q (1-q)^(k-1) = 1 - (1-q)^(k-1)); leave_p_out targets pass@(k-p); a mixture over k
(MaxRL: w_j = 1/j) is its weights. `target` maps a config's estimator to its Target.

Optima. maj@j <= max_i f_i for every policy (the winner is one class), with equality when all mass
is on argmax_i f_i; so every majority target's optimum answers argmax f always. pass@1 is linear
in q: the same optimum. Any target with weight on some j >= 2 is strictly concave in q, and at its
optimum every answer with q_i > 0 has the same marginal
g_i(q_i) = f_i sum_j w_j j (1 - q_i)^(j-1) = lambda (and q_i = 0 where g_i(0) <= lambda); g_i
falls in q_i, so each q_i(lambda) is one root found by bisection, and lambda is found by bisection
on sum_i q_i(lambda) = 1 (`optimum`). The no-answer mass is 0 at every optimum.

Everything here is float64 NumPy: arrays in, numbers out. tests/objectives/test_planted.py proves
each value against an exact enumeration of every k-tuple of answers and every instance label, with
f on each tuple computed by `ksjax.objectives.objective_value` (1e-10), and the worked case of
ESTIMATORS.md ("A planted optimum").
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np

# Count vectors enumerated by a maj@j value (compositions of j votes into m + 1 classes).
MAX_VOTE_PROFILES = 1_000_000
_BISECTIONS = 64  # halvings of [0, 1] and of lambda's bracket: 2^-64, below float64's resolution


@dataclasses.dataclass(frozen=True)
class Target:
  """sum_j weights[j-1] pass@j (vote=False) or sum_j weights[j-1] maj@j (vote=True)."""
  weights: tuple[float, ...]  # w_1..w_K, >= 0, not all 0
  vote: bool = False

  def __post_init__(self):
    w = tuple(float(x) for x in self.weights)
    if not w or any(not math.isfinite(x) or x < 0 for x in w) or not any(w):
      raise ValueError(f"weights={self.weights!r} is not accepted; expected w_1..w_K, finite, "
                       ">= 0 and not all 0")
    object.__setattr__(self, "weights", w)

  @property
  def linear(self) -> bool:
    """Whether the target is linear in q (all weight on j = 1: the mean)."""
    return not any(self.weights[1:])

  @property
  def name(self) -> str:
    terms = [(j, w) for j, w in enumerate(self.weights, 1) if w]
    what = "maj" if self.vote else "pass"
    if len(terms) == 1 and terms[0][1] == 1.0:
      return "mean" if terms[0][0] == 1 else f"{what}@{terms[0][0]}"
    return " + ".join(f"{w:g} {what}@{j}" for j, w in terms)


def single(j: int, vote: bool = False) -> Target:
  """pass@j (or maj@j) alone."""
  if not isinstance(j, int) or j < 1:
    raise ValueError(f"j={j!r} is not accepted; expected an integer >= 1")
  return Target(tuple(1.0 if i == j else 0.0 for i in range(1, j + 1)), vote)


MEAN = single(1)


def target(aggregator: str, baseline: str, k: int, p: int = 1,
           k_weights: Sequence[float] | None = None) -> Target:
  """The target a trainer config optimises (its `aggregator`, `baseline`, `k`, `p`, and the
  mixture's w_1..w_k as `ksjax.objectives.mixture_weights` gives them, or None).

  Raises ValueError for estimators without a stated target here: softmax, and the normalised
  baselines (biased: no objective of which they are the gradient)."""
  if aggregator == "mean":
    return MEAN
  if aggregator not in ("pass_at_k", "majority_vote"):
    raise ValueError(f"aggregator={aggregator!r} has no planted closed form; expected mean, "
                     "pass_at_k or majority_vote")
  vote = aggregator == "majority_vote"
  if k_weights is not None:
    return Target(tuple(float(w) for w in k_weights), vote)
  shift = {"none": 0, "loo": 0, "leave_two_out": 0, "loo_demeaned": 1, "leave_p_out": p}
  if baseline not in shift:
    raise ValueError(f"baseline={baseline!r} has no stated target; expected one of "
                     f"{', '.join(shift)}")
  return single(k - shift[baseline], vote)


def _rows(q, f) -> tuple[np.ndarray, np.ndarray]:
  """q and f as float64 [P, m], checked: f a distribution per row, q >= 0 with sum <= 1."""
  q_pm = np.atleast_2d(np.asarray(q, np.float64))
  f_pm = np.atleast_2d(np.asarray(f, np.float64))
  if q_pm.shape != f_pm.shape or q_pm.ndim != 2:
    raise ValueError(f"q of shape {q_pm.shape} and f of shape {f_pm.shape}: expected both "
                     "[P, m] (prompt types x answers)")
  bad_f = (f_pm < 0).any(1) | ~np.isclose(f_pm.sum(1), 1.0, rtol=0.0, atol=1e-12)
  if bad_f.any():
    row = int(np.argmax(bad_f))
    raise ValueError(f"f[{row}]={f_pm[row].tolist()} is not accepted; expected frequencies >= 0 "
                     "summing to 1 per prompt type")
  bad_q = (q_pm < -1e-15).any(1) | (q_pm.sum(1) > 1 + 1e-12)
  if bad_q.any():
    row = int(np.argmax(bad_q))
    raise ValueError(f"q[{row}]={q_pm[row].tolist()} is not accepted; expected probabilities >= 0 "
                     "whose sum per prompt type is at most 1 (the rest: no answer)")
  return np.clip(q_pm, 0.0, 1.0), f_pm


def _pass_values(weights: Sequence[float], q_pm: np.ndarray, f_pm: np.ndarray) -> np.ndarray:
  return sum(w * (f_pm * (1.0 - (1.0 - q_pm) ** j)).sum(1)
             for j, w in enumerate(weights, 1) if w)


def _compositions(total: int, parts: int):
  """Every tuple of `parts` non-negative integers summing to `total`."""
  for bars in itertools.combinations(range(total + parts - 1), parts - 1):
    edges = (-1,) + bars + (total + parts - 1,)
    yield tuple(b - a - 1 for a, b in zip(edges, edges[1:]))


def majority_at(j: int, q_m: np.ndarray, f_m: np.ndarray) -> float:
  """maj@j of one prompt type: the sum over vote profiles (counts of the m answers and of "no
  answer") of their multinomial probability times the mean f of the tied winning answers (a
  winning "no answer" counts 0)."""
  m = len(q_m)
  if math.comb(j + m, m) > MAX_VOTE_PROFILES:
    raise ValueError(f"maj@{j} over {m} answers has {math.comb(j + m, m)} vote profiles, more "
                     f"than {MAX_VOTE_PROFILES}; expected fewer samples or answers")
  probs = np.append(q_m, max(0.0, 1.0 - q_m.sum()))
  grades = np.append(f_m, 0.0)
  log_factorial = [math.lgamma(c + 1) for c in range(j + 1)]
  total = 0.0
  for counts in _compositions(j, m + 1):
    if any(c and not p for c, p in zip(counts, probs)):
      continue
    log_mass = log_factorial[j] + sum(c * math.log(p) - log_factorial[c]
                                      for c, p in zip(counts, probs) if c)
    top = max(counts)
    winners = [i for i, c in enumerate(counts) if c == top]
    total += math.exp(log_mass) * float(np.mean(grades[winners]))
  return total


def values(tgt: Target, q, f) -> np.ndarray:
  """The target's value at policy q, per prompt type: float64 [P] (q, f: [P, m] or [m])."""
  q_pm, f_pm = _rows(q, f)
  if not tgt.vote or tgt.linear:  # maj@1 = pass@1
    return _pass_values(tgt.weights, q_pm, f_pm)
  return np.asarray([sum(w * majority_at(j, q_m, f_m) for j, w in enumerate(tgt.weights, 1) if w)
                     for q_m, f_m in zip(q_pm, f_pm)])


def value(tgt: Target, q, f) -> float:
  """The target's value at q, averaged over prompt types (the held-out split weighs each type
  equally)."""
  return float(np.mean(values(tgt, q, f)))


def _argmax_policy(f_m: np.ndarray) -> np.ndarray:
  best = f_m == f_m.max()
  return best / best.sum()


def _marginal(weights: Sequence[float], f_m: np.ndarray, x_m: np.ndarray) -> np.ndarray:
  """g_i(x_i) = f_i sum_j w_j j (1 - x_i)^(j-1), falling in x_i."""
  return f_m * sum(w * j * (1.0 - x_m) ** (j - 1) for j, w in enumerate(weights, 1) if w)


def _water_fill(weights: Sequence[float], f_m: np.ndarray) -> np.ndarray:
  def q_at(lam: float) -> np.ndarray:
    lo, hi = np.zeros_like(f_m), np.ones_like(f_m)
    for _ in range(_BISECTIONS):  # the root of g_i(x) = lam, or an end of [0, 1]
      mid = 0.5 * (lo + hi)
      above = _marginal(weights, f_m, mid) > lam
      lo, hi = np.where(above, mid, lo), np.where(above, hi, mid)
    return np.where(_marginal(weights, f_m, np.zeros_like(f_m)) <= lam, 0.0, 0.5 * (lo + hi))

  lo, hi = 0.0, float(_marginal(weights, f_m, np.zeros_like(f_m)).max())
  for _ in range(_BISECTIONS):  # sum_i q_i(lam) falls in lam
    mid = 0.5 * (lo + hi)
    lo, hi = (mid, hi) if q_at(mid).sum() > 1.0 else (lo, mid)
  q_m = q_at(0.5 * (lo + hi))
  return q_m / q_m.sum()


def optimum(tgt: Target, f) -> np.ndarray:
  """The optimal policy q* [P, m] (module docstring): all mass on argmax f for the mean and every
  majority target (split evenly over tied maxima), the water-filling of equal marginals for a
  concave pass@j mixture."""
  f_pm = np.atleast_2d(np.asarray(f, np.float64))
  _rows(np.zeros_like(f_pm), f_pm)
  if tgt.vote or tgt.linear:
    return np.stack([_argmax_policy(f_m) for f_m in f_pm])
  return np.stack([_water_fill(tgt.weights, f_m) for f_m in f_pm])


def optimal_value(tgt: Target, f) -> float:
  """The target's value at its optimum."""
  return value(tgt, optimum(tgt, f), f)
