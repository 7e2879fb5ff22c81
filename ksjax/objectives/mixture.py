"""Objectives over every k: J = sum_{k=1..K} w_k E[f(y_1..y_k)] from one group of n >= K samples.

Why: pass@k for one k trains for one sample budget; a policy is used at many. A mixture weighs
them all, and one choice of weights is maximum likelihood itself: MaxRL (arXiv 2602.02710)
notes that with p the chance that one sample is right, grad log p = sum_{k>=1} (1/k) grad pass@k
(pass@k = 1 - (1-p)^k), so w_k = 1/k truncated at K = n is the log-likelihood of success as far
as n samples can see it ("maxrl" below).

Estimation is linear. Each E[f(y_1..y_k)] has an unbiased U-statistic from the n samples and an
unbiased per-sample gradient weight (`ksjax.objectives.advantages`), so sum_k w_k of them is
unbiased for J and its gradient; the per-k estimator is the configured baseline's at that k:

  baseline       term at k                                 k = 1 term
  none           (k/n) phi_k(i)                            r_i / n
  loo            (k/n) (phi_k(i) - psi_{k-1}(i))           (r_i - rbar) / (n - 1)
  leave_two_out  (k/n) (phi_k(i) - psi_k(i)), k < n        (r_i - rbar) / (n - 1)

loo has no k = 1 form (it would subtract f of no sample), so its k = 1 term is the mean's
leave-one-out weight, which is also every leave-out baseline's at k = 1: unbiased for grad E[r]
and, like the other loo terms, unchanged by a constant added to the rewards. (ESTIMATORS.md's
closed form for binary rewards, a correct sample's weight sum_k w_k C(n-c, k-1)/C(n, k), takes
the k = 1 term as r_i / n with rewards in {0, 1}; both are unbiased, and with w_1 = 0 they agree.)
With rewards in {0, 1} and loo, the k >= 2 terms credit correct samples only, so for MaxRL's
w_k = 1/k and K = n a correct sample among c gets sum_{k=2..n} (1/k) C(n-c, k-1)/C(n, k)
= 1/c - 1/n (hockey-stick identity), plus its k = 1 term.

loo_demeaned and leave_p_out are refused: their targets are the (k - p)-sample objectives, so a
mixture of them is a different mixture. So are the normalised comparison baselines (no target).

MaxRL's practical form (prime-rl), A_i = (r_i - rbar)/rbar with rewards in {0, 1} (0 when
rbar = 0), is n times the per-sample weights 1[correct]/c minus 1 on every sample of a group
with c >= 1; the "-1" is 1[c >= 1] on each sample, whose expected sum_i score_i is grad P(c >= 1)
= grad pass@n. So it is unbiased for n sum_{k=1..n} (1/k) pass@k - pass@n
= n sum_{k=1..n-1} (1/k) pass@k: MaxRL truncated at n - 1, times n
(`tests/objectives/test_mixture.py` proves it by enumeration).

A k schedule (`ksjax.objectives.schedule`) composes by truncation: at a step whose scheduled k
is k_s the trainer optimises sum_{k<=k_s} w_k f_k (`mixture_weights(..., k=k_s)`), so PKPO's
annealing of k becomes an annealing of how far the mixture reaches. Explicit weights end at
their last entry, so a schedule may not reach past it.

pass_at_k's mixture is one sort: the per-k coefficients of `pass_at_k.py` are summed in exact
rational arithmetic and rounded once. The others sum the per-k weights of
`k_sample_advantages` (the enumerated aggregators within `enumerated.MAX_SUBSETS` at every k).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np

from ksjax.objectives import advantages
from ksjax.objectives import pass_at_k

# none: one k; maxrl: w_k = 1/k for k = 1..K (K = the config's k); weights: w_1..w_K given.
K_MIXTURES = ("none", "maxrl", "weights")
MIXTURE_BASELINES = ("none", "loo", "leave_two_out")
_PASS_AT_K_TERMS = {"none": "none", "loo": "loo", "leave_two_out": "leave_out"}


def check_k_weights(k_weights) -> tuple[Fraction, ...]:
  """w_1..w_K as exact Fractions; ValueError unless finite, >= 0, not all 0, K >= 1."""
  values = k_weights if isinstance(k_weights, (tuple, list)) else None
  ok = bool(values) and all(
      isinstance(w, (int, float, Fraction, np.integer, np.floating)) and not isinstance(w, bool)
      and math.isfinite(w) and w >= 0 for w in values)
  if not ok or not any(values):
    raise ValueError(f"k_weights={k_weights!r} is not accepted; expected a non-empty tuple of "
                     "finite numbers >= 0, not all 0 (w_1, ..., w_K of sum_k w_k E[f_k])")
  return tuple(Fraction(w) for w in values)


def mixture_weights(mixture: str, k: int, k_weights=None) -> tuple[Fraction, ...] | None:
  """w_1..w_k of a named mixture truncated at k (the objective's k, or a schedule's k at a step);
  None for "none" (the single-k objective).

  Raises ValueError naming the argument: "weights" needs k_weights with at least k entries (a
  schedule cannot reach past the last weight given); the others take no k_weights.
  """
  advantages._choice("k_mixture", mixture, K_MIXTURES)
  if mixture != "weights":
    if k_weights is not None:
      raise ValueError(f"k_weights={k_weights!r} is not accepted with k_mixture={mixture!r}; "
                       "expected None (or k_mixture='weights')")
    return None if mixture == "none" else tuple(Fraction(1, j) for j in range(1, k + 1))
  weights = check_k_weights(k_weights)
  if k > len(weights):
    raise ValueError(f"k={k} is not accepted with k_mixture='weights' and {len(weights)} "
                     f"k_weights; expected k <= {len(weights)} (the weights end at "
                     f"k = {len(weights)})")
  return weights[:k]


def _terms(k_weights, baseline: str, n: int) -> list[tuple[int, Fraction]]:
  """(k, w_k) with w_k > 0, checked against the group size and the baseline."""
  weights = check_k_weights(k_weights)
  if len(weights) > n:
    raise ValueError(f"k_weights has {len(weights)} entries, more than the n={n} samples of a "
                     f"group; expected at most {n} (w_k for k = 1..K <= n)")
  terms = [(k, w) for k, w in enumerate(weights, 1) if w]
  top = terms[-1][0]
  if baseline == "leave_two_out" and top >= n:
    raise ValueError(f"k={top} is not accepted in a mixture with baseline='leave_two_out' and "
                     f"n={n} (w_{top} > 0); expected weight only on k < n (its baseline needs a "
                     "k-subset without the sample)")
  if baseline == "loo" and n < 2:
    raise ValueError(f"baseline='loo' is not accepted with n={n}; leave-out baselines need "
                     "n >= 2")
  return terms


def _term_baseline(baseline: str, k: int) -> str:
  """The estimator of the k-th term: the baseline's own, or the mean's leave-one-out at k = 1."""
  return "leave_two_out" if baseline == "loo" and k == 1 else baseline


def _check_mixture_baseline(baseline: str) -> None:
  if baseline not in MIXTURE_BASELINES:
    raise ValueError(f"baseline={baseline!r} is not accepted with a mixture over k; expected "
                     f"one of {', '.join(map(repr, MIXTURE_BASELINES))} (loo_demeaned and "
                     "leave_p_out target the (k-p)-sample objectives; the normalised ones none)")


def mixture_advantages(rewards, *, k_weights: Sequence[float], aggregator: str, baseline: str,
                       beta: float | jax.Array = 1.0, answer_ids=None, scale: str = "none",
                       eps: float = 1e-6) -> jax.Array:
  """Per-sample weights of grad sum_k w_k E[f(y_1..y_k)], [G, n] -> [G, n].

  Args:
    rewards: float [G, n], finite.
    k_weights: w_1..w_K, K <= n, each finite and >= 0, not all 0 (`mixture_weights` gives the
      named ones); floats or Fractions (the latter keep pass_at_k's coefficients exact).
    aggregator, beta, answer_ids, scale, eps: as in `k_sample_advantages`.
    baseline: "none", "loo" or "leave_two_out" (module docstring: the term each uses at k).

  Returns:
    Weights [G, n] in the rewards' dtype.
  """
  rewards_gn = advantages._check_rewards(rewards)
  advantages._choice("aggregator", aggregator, advantages.AGGREGATORS)
  _check_mixture_baseline(baseline)
  advantages._choice("scale", scale, advantages.SCALES)
  n = rewards_gn.shape[-1]
  terms = _terms(k_weights, baseline, n)
  if scale == "group_std":
    if baseline == "none":
      raise ValueError("scale='group_std' is not accepted with baseline='none'; expected "
                       "baseline 'loo' or 'leave_two_out'")
    advantages._check_finite_scalar("eps", eps, positive=True)
  if aggregator == "pass_at_k":
    if baseline != "none":  # exact zeros for equal rewards, as in `advantages._weights`
      rewards_gn = advantages._from_group_max(rewards_gn)
    weights_gn = pass_at_k.mixture(rewards_gn, tuple(
        (k, w, _PASS_AT_K_TERMS[_term_baseline(baseline, k)]) for k, w in terms))
  else:
    weights_gn = sum(float(w) * advantages.k_sample_advantages(
        rewards_gn, aggregator=aggregator, baseline=_term_baseline(baseline, k), k=k,
        beta=beta, answer_ids=answer_ids) for k, w in terms)
  if scale == "group_std":
    weights_gn = advantages._divide_by_group_std(weights_gn, eps)
  return weights_gn


def mixture_value(rewards, *, k_weights: Sequence[float], aggregator: str,
                  beta: float | jax.Array = 1.0, answer_ids=None) -> jax.Array:
  """Unbiased estimate of sum_k w_k E[f(y_1..y_k)] from each group's n samples, [G]."""
  rewards_gn = advantages._check_rewards(rewards)
  terms = _terms(k_weights, "none", rewards_gn.shape[-1])
  return sum(float(w) * advantages.objective_value(rewards_gn, aggregator=aggregator, k=k,
                                                   beta=beta, answer_ids=answer_ids)
             for k, w in terms)


def maxrl_practical(rewards01) -> jax.Array:
  """prime-rl's MaxRL advantage (r_i - rbar)/rbar for rewards in {0, 1}, 0 where rbar = 0, [G, n]:
  unbiased for n sum_{k<n} (1/k) grad pass@k (module docstring), for comparison."""
  rewards_gn = advantages._check_rewards(rewards01)
  mean_g1 = jnp.mean(rewards_gn, axis=-1, keepdims=True)
  return jnp.where(mean_g1 > 0, (rewards_gn - mean_g1) / jnp.where(mean_g1 > 0, mean_g1, 1), 0)
