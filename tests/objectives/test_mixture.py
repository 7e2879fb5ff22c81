"""Objectives over every k and MaxPO's leave-two-out baseline, proved by exact enumeration.

The pattern of `test_exact.py`: on a softmax bandit, every n-tuple of actions is enumerated, and
E[sum_i w_i grad log pi(y_i)] (a finite sum) must equal the gradient of the stated target, itself
a finite sum over k-tuples of the literal f (`objectives_naive.f`), in float64 to 1e-8:

  leave_two_out                 grad E[f(y_1..y_k)], k < n, and the weights of a group sum to 0;
  mixture (none, loo, l2o)      grad sum_k w_k E[f(y_1..y_k)];
  MaxRL's practical form        n grad sum_{k<n} (1/k) pass@k (rewards in {0, 1}).
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ksjax import objectives
from ksjax.objectives import mixture
from tests.objectives import test_exact as exact
from tests.support import objectives_naive


@pytest.fixture(autouse=True)
def _float64():
  with jax.enable_x64(True):
    yield


def _bandit(name: str):
  rewards_a, answers_a = exact.BANDITS[name]
  return rewards_a, answers_a, exact.THETA[:len(rewards_a)]


def _expected(weights_fn, n: int, bandit: str, theta=None) -> np.ndarray:
  """E[sum_i w_i grad log pi(y_i)] over every n-tuple, weights_fn(rewards [T, n], answers)."""
  rewards_a, answers_a, default_theta = _bandit(bandit)
  tuples_tn = exact._tuples(len(rewards_a), n)
  weights_tn = np.asarray(weights_fn(jnp.asarray(rewards_a[tuples_tn]),
                                     jnp.asarray(answers_a[tuples_tn])))
  assert weights_tn.dtype == np.float64
  return exact._expected_estimate(weights_tn, tuples_tn, default_theta if theta is None else theta)


def _objective_gradient(aggregator: str, k_weights, bandit: str, theta=None) -> np.ndarray:
  """grad_theta sum_k w_k E[f(y_1..y_k)], each term a finite sum over k-tuples of literal f."""
  rewards_a, answers_a, default_theta = _bandit(bandit)
  theta = default_theta if theta is None else theta
  total = np.zeros(len(theta))
  for k, w in enumerate(k_weights, 1):
    if w:
      tuples_tk = exact._tuples(len(rewards_a), k)
      values_t = np.array([objectives_naive.f(aggregator, rewards_a[t], answers_a[t], exact.BETA)
                           for t in tuples_tk])
      total += float(w) * np.asarray(exact._target_gradient(jnp.asarray(theta), values_t,
                                                            tuples_tk))
  return total


GROUP_SHAPE = (4, 6)  # one shape for the direct checks: they share their compilations


# ---- MaxPO's leave-two-out baseline ----------------------------------------------------------

# The default suite proves one case per aggregator (each its own code path); `-m slow`, the rest.
SLOW = pytest.mark.slow
L2O_DEFAULT = {"pass_at_k": (4, 2, "tied"), "mean": (3, 1, "distinct"),
               "majority_vote": (4, 3, "tied"), "softmax": (3, 2, "distinct")}
L2O_SIZES = [(n, k, bandit) for bandit in ("distinct", "tied") for n in (2, 3, 4)
             for k in range(1, n)] + [(5, 3, "three_actions")]
L2O_CASES = [pytest.param(aggregator, *size, marks=() if L2O_DEFAULT[aggregator] == size else SLOW)
             for aggregator in objectives.AGGREGATORS for size in L2O_SIZES]


@pytest.mark.parametrize("aggregator,n,k,bandit", L2O_CASES)
def test_leave_two_out_is_unbiased_for_the_k_sample_objective(aggregator, n, k, bandit):
  weights = lambda r, a: objectives.k_sample_advantages(
      r, aggregator=aggregator, baseline="leave_two_out", k=k, beta=exact.BETA, answer_ids=a)
  estimate = _expected(weights, n, bandit)
  one_hot = [0] * (k - 1) + [1]
  gradient = _objective_gradient(aggregator, one_hot, bandit)
  np.testing.assert_allclose(estimate, gradient, rtol=0, atol=1e-8,
                             err_msg=f"{aggregator} n={n} k={k} {bandit}")
  assert np.abs(gradient).max() > 1e-3


def _literal_leave_two_out(aggregator, k, rewards_n, answers_n):
  """MaxPO's construction, loop by loop: sample i's signal is the mean of f over the k-subsets
  of the group holding i; its baseline is the mean over j != i of j's signal computed in the
  group without i and j (the k-subsets holding j, drawn from the others). Weights (k/n) x the
  difference, the U-statistic scale of every estimator here."""
  n = len(rewards_n)
  f = lambda s: objectives_naive.f(aggregator, [rewards_n[x] for x in s],
                                   [answers_n[x] for x in s], exact.BETA)

  def signal(j, pool):
    return np.mean([f((j,) + rest) for rest in itertools.combinations(pool, k - 1)])

  out = []
  for i in range(n):
    others = [x for x in range(n) if x != i]
    baseline = np.mean([signal(j, [x for x in others if x != j]) for j in others])
    out.append(k / n * (signal(i, others) - baseline))
  return out


@pytest.mark.parametrize("aggregator", ["pass_at_k"] + [
    pytest.param(a, marks=SLOW) for a in objectives.AGGREGATORS if a != "pass_at_k"])
def test_leave_two_out_is_the_literal_construction_and_is_centred(aggregator):
  rng = np.random.default_rng(7)
  answers_gn = rng.integers(0, 3, size=GROUP_SHAPE)
  rewards_gn = np.array([0.4, -1.0, 1.3])[answers_gn]
  for k in (1, 4):
    got = np.asarray(objectives.k_sample_advantages(
        rewards_gn, aggregator=aggregator, baseline="leave_two_out", k=k, beta=exact.BETA,
        answer_ids=answers_gn))
    want = [_literal_leave_two_out(aggregator, k, r, a) for r, a in zip(rewards_gn, answers_gn)]
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=f"k={k}")
    np.testing.assert_allclose(got.sum(axis=1), 0.0, atol=1e-12)
  if aggregator != "mean":  # the mean's leave-outs all coincide, and are centred
    # Leave-one-out's are not centred: the property is the baseline's, not the data's.
    loo = objectives.k_sample_advantages(rewards_gn, aggregator=aggregator, baseline="loo", k=4,
                                         beta=exact.BETA, answer_ids=answers_gn)
    assert np.abs(np.asarray(loo).sum(axis=1)).max() > 1e-3


def test_leave_two_out_is_shift_invariant_and_permutation_equivariant():
  rng = np.random.default_rng(3)
  rewards_gn = rng.normal(size=GROUP_SHAPE)
  kwargs = dict(aggregator="pass_at_k", baseline="leave_two_out", k=3)
  base = np.asarray(objectives.k_sample_advantages(rewards_gn, **kwargs))
  np.testing.assert_allclose(objectives.k_sample_advantages(rewards_gn + 40.0, **kwargs), base,
                             rtol=0, atol=1e-12)
  order = rng.permutation(GROUP_SHAPE[1])
  np.testing.assert_allclose(objectives.k_sample_advantages(rewards_gn[:, order], **kwargs),
                             base[:, order], rtol=0, atol=1e-12)


# ---- Mixtures over k -------------------------------------------------------------------------

MIXTURE_CASES = [
    (4, (1.0, 1 / 2, 1 / 3, 1 / 4), "tied"),  # MaxRL, K = n
    (3, (1.0, 1 / 2, 1 / 3), "distinct"),
    (4, (0.0, 2.0, 0.0, 0.5), "distinct"),  # gaps, no k = 1 term
    (5, (0.3, 0.0, 1.0), "three_actions"),  # K < n
]


@pytest.mark.parametrize("aggregator,n,k_weights,bandit", [
    pytest.param(aggregator, *case, marks=() if (aggregator, case) in (
        ("pass_at_k", MIXTURE_CASES[0]), ("majority_vote", MIXTURE_CASES[1])) else SLOW)
    for aggregator in objectives.AGGREGATORS for case in MIXTURE_CASES])
def test_mixture_weights_are_the_gradient_of_the_mixture(aggregator, n, k_weights, bandit):
  gradient = _objective_gradient(aggregator, k_weights, bandit)
  assert np.abs(gradient).max() > 1e-3
  for baseline in objectives.MIXTURE_BASELINES:
    weights = k_weights
    if baseline == "leave_two_out" and len(weights) >= n:  # its terms need k < n
      weights = weights[:n - 1]
    target = gradient if weights == k_weights else _objective_gradient(aggregator, weights, bandit)
    estimate = _expected(lambda r, a: objectives.mixture_advantages(
        r, k_weights=weights, aggregator=aggregator, baseline=baseline, beta=exact.BETA,
        answer_ids=a), n, bandit)
    np.testing.assert_allclose(estimate, target, rtol=0, atol=1e-8,
                               err_msg=f"{aggregator} {baseline} n={n} w={weights} {bandit}")


@pytest.mark.parametrize("baseline", ["loo", pytest.param("none", marks=SLOW),
                                      pytest.param("leave_two_out", marks=SLOW)])
def test_pass_at_k_mixture_is_one_sort_of_the_summed_coefficients(baseline):
  """The exact-coefficient path equals the sum of the per-k estimators, ties included."""
  rng = np.random.default_rng(5)
  rewards_gn = rng.choice([-1.0, 0.0, 0.5, 2.0], size=GROUP_SHAPE)
  weights = tuple(Fraction(w) for w in ("1", "1/2", "0", "1/4", "3/2"))
  got = objectives.mixture_advantages(rewards_gn, k_weights=weights, aggregator="pass_at_k",
                                      baseline=baseline)
  want = sum(float(w) * np.asarray(objectives.k_sample_advantages(
      rewards_gn, aggregator="pass_at_k", baseline=mixture._term_baseline(baseline, k), k=k))
             for k, w in enumerate(weights, 1) if w)
  np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [6, pytest.param(4, marks=SLOW), pytest.param(9, marks=SLOW)])
def test_maxrl_binary_closed_form(n):
  """Rewards {0, 1}, loo, w_k = 1/k to K = n: a correct sample among c gets 1/c - 1/n from
  k >= 2 (hockey stick), a wrong one 0, plus the k = 1 term (r_i - rbar)/(n - 1); rewards {-1, 1}
  double everything. Group c holds c correct samples, c = 0..n."""
  weights = objectives.mixture_weights("maxrl", n)
  c_g1 = np.arange(n + 1)[:, None]
  rewards_gn = (np.arange(n)[None] < c_g1).astype(np.float64)
  got = np.asarray(objectives.mixture_advantages(rewards_gn, k_weights=weights,
                                                 aggregator="pass_at_k", baseline="loo"))
  first_gn = (rewards_gn - rewards_gn.mean(axis=1, keepdims=True)) / (n - 1)
  higher_gn = rewards_gn * (1 / np.maximum(c_g1, 1) - 1 / n)
  np.testing.assert_allclose(got, first_gn + higher_gn, rtol=0, atol=1e-12)
  doubled = objectives.mixture_advantages(2 * rewards_gn - 1, k_weights=weights,
                                          aggregator="pass_at_k", baseline="loo")
  np.testing.assert_allclose(doubled, 2 * got, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", [3, pytest.param(2, marks=SLOW), pytest.param(4, marks=SLOW)])
def test_maxrl_practical_form_targets_maxrl_truncated_at_n_minus_one_times_n(n):
  """(r_i - rbar)/rbar with rewards {0, 1} is unbiased for n sum_{k<n} (1/k) grad pass@k, not
  for MaxRL at K = n (module docstring of `mixture.py`)."""
  for theta in (exact.THETA, np.array([1.0, -0.5, 0.3, -0.2])):
    estimate = _expected(lambda r, a: mixture.maxrl_practical(r), n, "binary", theta)
    maxrl = lambda K: [1 / k for k in range(1, K + 1)]
    want = n * _objective_gradient("pass_at_k", maxrl(n - 1), "binary", theta)
    np.testing.assert_allclose(estimate, want, rtol=0, atol=1e-8)
    full = _objective_gradient("pass_at_k", maxrl(n), "binary", theta)
    assert np.abs(estimate - n * full).max() > 1e-3  # the K = n reading is wrong


def test_mixture_value_is_the_sum_of_the_per_k_estimates():
  groups, n = GROUP_SHAPE
  c = np.arange(groups)  # correct samples per group
  rewards_gn = np.where(np.arange(n)[None] < c[:, None], 1.0, -1.0)
  weights = objectives.mixture_weights("maxrl", n)
  got = objectives.mixture_value(rewards_gn, k_weights=weights, aggregator="pass_at_k")
  pass_at = lambda k: 1 - np.array([math.comb(n - ci, k) for ci in c]) / math.comb(n, k)
  want = sum((2 * pass_at(k) - 1) / k for k in range(1, n + 1))  # rewards -1/+1: 2 pass@k - 1
  np.testing.assert_allclose(got, want, rtol=1e-12)


def test_mixture_weights_presets_and_schedule_truncation():
  assert objectives.mixture_weights("none", 4) is None
  assert objectives.mixture_weights("maxrl", 3) == (1, Fraction(1, 2), Fraction(1, 3))
  assert objectives.mixture_weights("weights", 2, (0.5, 2.0, 1.0)) == (0.5, 2.0)  # truncated
  with pytest.raises(ValueError, match=r"^k=4 is not accepted with k_mixture='weights' and 3 "
                                       r"k_weights; expected k <= 3"):
    objectives.mixture_weights("weights", 4, (0.5, 2.0, 1.0))
  with pytest.raises(ValueError, match=r"^k_weights=\(1.0,\) is not accepted with "
                                       r"k_mixture='maxrl'"):
    objectives.mixture_weights("maxrl", 4, (1.0,))
  with pytest.raises(ValueError, match=r"^k_mixture='harmonic' is not accepted"):
    objectives.mixture_weights("harmonic", 4)


@pytest.mark.parametrize("kwargs,message", [
    (dict(k_weights=()), r"^k_weights=\(\) is not accepted; expected a non-empty tuple"),
    (dict(k_weights=(0.0, 0.0)), r"^k_weights=\(0.0, 0.0\) is not accepted"),
    (dict(k_weights=(1.0, -0.5)), r"^k_weights=\(1.0, -0.5\) is not accepted"),
    (dict(k_weights=(1.0, float("nan"))), r"^k_weights=\(1.0, nan\) is not accepted"),
    (dict(k_weights=(1.0,) * 6), r"^k_weights has 6 entries, more than the n=5 samples"),
    (dict(baseline="loo_demeaned"), r"^baseline='loo_demeaned' is not accepted with a mixture"),
    (dict(baseline="leave_two_out", k_weights=(1.0,) * 5),
     r"^k=5 is not accepted in a mixture with baseline='leave_two_out' and n=5 \(w_5 > 0\); "
     r"expected weight only on k < n"),
    (dict(scale="group_std", baseline="none"), r"^scale='group_std' is not accepted with "
                                               r"baseline='none'"),
    (dict(aggregator="majority_vote"), r"^answer_ids is missing"),
])
def test_mixture_rejects(kwargs, message):
  args = {**dict(k_weights=(1.0, 0.5), aggregator="pass_at_k", baseline="loo"), **kwargs}
  with pytest.raises(ValueError, match=message):
    objectives.mixture_advantages(np.zeros((2, 5)), **args)


def test_leave_two_out_rejects_k_equal_to_n():
  with pytest.raises(ValueError, match=r"^k=5 is not accepted with baseline='leave_two_out' and "
                                       r"n=5; expected k < n"):
    objectives.k_sample_advantages(np.zeros((1, 5)), aggregator="mean", baseline="leave_two_out")
