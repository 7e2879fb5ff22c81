"""Vectorised estimators against literal per-group loops, and the closed forms of the literature.

The loops (`objectives_naive`) enumerate every k-subset, apply the paper's n = k estimator to it and
average with zeros for the samples it leaves out: the definition of the n > k estimators. Rewards
come continuous, with ties, and binary +-1, since ties are where sort-based closed forms go wrong.
"""

from __future__ import annotations

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support import objectives_naive
from ksjax import objectives

BETA = 0.7


@pytest.fixture(autouse=True)
def _float64():
  with jax.enable_x64(True):
    yield


def _groups(kind: str, n: int, seed: int, groups: int = 4):
  """(rewards [G, n], answer ids [G, n]) with rewards constant within an answer class."""
  rng = np.random.default_rng(seed)
  answers_gn = rng.integers(0, 3, size=(groups, n))
  if kind == "continuous":
    class_rewards_gc = rng.normal(size=(groups, 3))
  elif kind == "ties":
    class_rewards_gc = rng.choice([0.0, 0.5, 0.5, 1.0], size=(groups, 3))
  else:  # binary +-1, the default task reward
    class_rewards_gc = rng.choice([-1.0, 1.0], size=(groups, 3))
  rewards_gn = np.take_along_axis(class_rewards_gc, answers_gn, axis=1)
  if kind == "continuous":  # Distinct rewards per sample too; majority voting uses class means.
    rewards_gn = rewards_gn + 0.1 * rng.normal(size=rewards_gn.shape)
  return rewards_gn, answers_gn


def _configs(n: int):
  for k in range(1, n + 1):
    yield k, "none", 1
    if k >= 2:
      yield k, "loo", 1
      yield k, "loo_demeaned", 1
      for p in range(1, k):
        yield k, "leave_p_out", p


@pytest.mark.parametrize("aggregator", objectives.AGGREGATORS)
@pytest.mark.parametrize("kind,n", [("continuous", 5), ("ties", 5), ("binary", 5)])
def test_matches_literal_u_statistic(aggregator, kind, n):
  rewards_gn, answers_gn = _groups(kind, n, seed=n)
  for k, baseline, p in _configs(n):
    got = objectives.k_sample_advantages(jnp.asarray(rewards_gn), aggregator=aggregator,
                                         baseline=baseline, k=k, p=p, beta=BETA,
                                         answer_ids=jnp.asarray(answers_gn))
    want = objectives_naive.weights(aggregator, baseline, k, p, rewards_gn, answers_gn, BETA)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12,
                               err_msg=f"{aggregator} {baseline} k={k} p={p}")


@pytest.mark.parametrize("aggregator", objectives.AGGREGATORS)
def test_group_std_matches_literal(aggregator):
  rewards_gn, answers_gn = _groups("ties", 5, seed=1)
  for baseline in ("loo", "loo_demeaned", "leave_p_out"):
    got = objectives.k_sample_advantages(rewards_gn, aggregator=aggregator, baseline=baseline, k=4,
                                         p=2, beta=BETA, answer_ids=answers_gn, scale="group_std")
    want = objectives_naive.weights(aggregator, baseline, 4, 2, rewards_gn, answers_gn, BETA,
                                    scale="group_std")
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("aggregator", objectives.AGGREGATORS)
def test_objective_value_matches_literal(aggregator):
  rewards_gn, answers_gn = _groups("ties", 5, seed=2)
  for k in range(1, 6):
    got = objectives.objective_value(rewards_gn, aggregator=aggregator, k=k, beta=BETA,
                                     answer_ids=answers_gn)
    want = objectives_naive.objective(aggregator, k, rewards_gn, answers_gn, BETA)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_float32_agrees_with_float64():
  rewards_gn, answers_gn = _groups("continuous", 5, seed=3)
  for aggregator in objectives.AGGREGATORS:
    for baseline in objectives.BASELINES:
      kwargs = dict(aggregator=aggregator, baseline=baseline, k=4, p=2, beta=BETA,
                    answer_ids=answers_gn)
      single = objectives.k_sample_advantages(rewards_gn.astype(np.float32), **kwargs)
      assert single.dtype == jnp.float32
      np.testing.assert_allclose(single, objectives.k_sample_advantages(rewards_gn, **kwargs),
                                 rtol=1e-5, atol=1e-6)


# ---- Closed forms quoted in ESTIMATORS.md, each computed here from its own formula. ----


def _sorted_positions(rewards_n):
  """1-based ascending position of each sample (stable among ties)."""
  positions = np.empty(len(rewards_n), dtype=int)
  positions[np.argsort(rewards_n, kind="stable")] = np.arange(1, len(rewards_n) + 1)
  return positions


@pytest.mark.parametrize("n,k", [(6, 1), (6, 3), (7, 7), (9, 4)])
def test_pass_at_k_pkpo_and_tang_formulas(n, k):
  """PKPO's s_(i) (baseline none) and Tang's LOO averaged over k-subsets (loo)."""
  rewards_n = np.random.default_rng(n + k).choice([0.0, 0.3, 0.3, 1.0, 2.0], size=n)
  order = np.sort(rewards_n)
  total = math.comb(n, k)
  comb = lambda a, b: math.comb(a, b) if 0 <= b <= a else 0
  pkpo, tang = [], []
  for q in _sorted_positions(rewards_n):
    pkpo.append((comb(q - 1, k - 1) * order[q - 1]
                 + sum(comb(j - 2, k - 2) * order[j - 1] for j in range(q + 1, n + 1))) / total)
    tang.append((comb(q - 1, k - 1) * order[q - 1]
                 - sum(comb(j - 1, k - 2) * order[j - 1] for j in range(1, q))) / total)
  weights = lambda baseline: objectives.k_sample_advantages(
      rewards_n[None], aggregator="pass_at_k", baseline=baseline, k=k)[0]
  np.testing.assert_allclose(weights("none"), pkpo, rtol=1e-12, atol=1e-14)
  if k >= 2:
    np.testing.assert_allclose(weights("loo"), tang, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("n,k", [(8, 2), (8, 4), (8, 8), (16, 5)])
def test_pass_at_k_loo_binary_rewards(n, k):
  """Rewards in {0, 1}, c correct: correct samples C(n-c, k-1)/C(n, k), wrong 0; {-1, 1}: twice."""
  for c in range(n + 1):
    correct_n = np.arange(n) < c
    np.random.default_rng(c).shuffle(correct_n)
    expected_n = np.where(correct_n, math.comb(n - c, k - 1) / math.comb(n, k), 0.0)
    for low, factor in ((0.0, 1.0), (-1.0, 2.0)):
      rewards_n = np.where(correct_n, 1.0, low)
      got = objectives.k_sample_advantages(rewards_n[None], aggregator="pass_at_k", baseline="loo",
                                           k=k)
      np.testing.assert_allclose(got[0], factor * expected_n, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("n,k", [(8, 3), (16, 4), (12, 6)])
def test_pass_at_k_binary_chen_et_al_advantages(n, k):
  """Chen et al. 2025: R = 1 - C(n-c,k)/C(n,k), A_pos = (1-R)/s,
  A_neg = (1 - R - C(n-c-1,k-1)/C(n-1,k-1))/s with s = sqrt(R(1-R)).

  Their advantage is a k-subset's max minus R over s, averaged over the subsets holding the sample:
  (n/k) (w_none - mean w_none) / s in terms of this library.
  """
  for c in range(1, n - k + 1):  # 0 < R < 1
    rewards_n = (np.arange(n) < c).astype(np.float64)
    big_r = 1 - math.comb(n - c, k) / math.comb(n, k)
    sigma = math.sqrt(big_r * (1 - big_r))
    a_pos = (1 - big_r) / sigma
    a_neg = (1 - big_r - math.comb(n - c - 1, k - 1) / math.comb(n - 1, k - 1)) / sigma
    estimate = objectives.objective_value(rewards_n[None], aggregator="pass_at_k", k=k)[0]
    np.testing.assert_allclose(estimate, big_r, rtol=1e-12)
    none_n = np.asarray(objectives.k_sample_advantages(
        rewards_n[None], aggregator="pass_at_k", baseline="none", k=k)[0])
    np.testing.assert_allclose(n / k * (none_n - none_n.mean()) / sigma,
                               np.where(rewards_n > 0, a_pos, a_neg), rtol=1e-10, atol=1e-12)


def test_pass_at_k_objective_large_n_float32():
  """C(100, 50) overflows float32; the unbiased pass@k (Chen et al. 2021) must not."""
  n, k = 100, 50
  rewards_gn = np.zeros((n - 1, n), dtype=np.float32)
  for c in range(1, n):
    rewards_gn[c - 1, :c] = 1.0
  got = objectives.objective_value(rewards_gn, aggregator="pass_at_k", k=k)
  assert got.dtype == jnp.float32
  exact = [1 - Fraction(math.comb(n - c, k), math.comb(n, k)) for c in range(1, n)]
  stable = [1.0 if n - c < k else 1 - math.prod(1 - k / i for i in range(n - c + 1, n + 1))
            for c in range(1, n)]
  np.testing.assert_allclose(got, [float(e) for e in exact], rtol=2e-6)
  np.testing.assert_allclose(stable, [float(e) for e in exact], rtol=1e-12)
  weights = objectives.k_sample_advantages(rewards_gn, aggregator="pass_at_k", baseline="loo", k=k)
  assert np.all(np.isfinite(weights))


def test_paper_n_equals_k_forms():
  """Section 3, n = k: mean LOO (1/k)(r_i - mean_{j!=i} r_j); pass@k r_(k) - r_(k-1) on argmax."""
  rewards_gn = np.array([[0.2, 0.9, -0.4, 0.5], [1.0, 1.0, 0.0, -1.0], [0.3, 0.3, 0.3, 0.3]])
  k = rewards_gn.shape[1]
  others_mean_gn = (rewards_gn.sum(1, keepdims=True) - rewards_gn) / (k - 1)
  np.testing.assert_allclose(
      objectives.k_sample_advantages(rewards_gn, aggregator="mean", baseline="loo"),
      (rewards_gn - others_mean_gn) / k, rtol=1e-12)
  pass_at_k = np.asarray(objectives.k_sample_advantages(rewards_gn, aggregator="pass_at_k",
                                                        baseline="loo"))
  np.testing.assert_array_equal(pass_at_k, [[0, 0.9 - 0.5, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])


def test_majority_vote_loo_support():
  """n = k: non-zero only for plurality voters when the plurality is tied or wins by one vote."""
  rng = np.random.default_rng(4)
  k = 7
  answers_gn = rng.integers(0, 3, size=(64, k))
  rewards_gn = np.array([-1.0, 1.0, 0.5])[answers_gn]
  weights_gn = np.asarray(objectives.k_sample_advantages(
      rewards_gn, aggregator="majority_vote", baseline="loo", answer_ids=answers_gn))
  for weights_n, answers_n in zip(weights_gn, answers_gn):
    counts = np.bincount(answers_n, minlength=3)
    top, second = np.sort(counts)[-1], np.sort(counts)[-2]
    may_move = (counts[answers_n] == top) & (top - second <= 1)
    assert np.all(weights_n[~may_move] == 0)
  assert np.count_nonzero(weights_gn) > 30


@pytest.mark.parametrize("aggregator", objectives.AGGREGATORS)
def test_leave_k_minus_1_out_is_mean_loo(aggregator):
  """Appendix: p = k - 1 targets the mean objective; the weights are exactly mean's LOO."""
  rewards_gn, answers_gn = _groups("continuous", 5, seed=5)
  mean_loo = objectives.k_sample_advantages(rewards_gn, aggregator="mean", baseline="loo")
  for k in (2, 3, 5):
    got = objectives.k_sample_advantages(rewards_gn, aggregator=aggregator, baseline="leave_p_out",
                                         k=k, p=k - 1, beta=BETA, answer_ids=answers_gn)
    np.testing.assert_allclose(got, mean_loo, rtol=1e-10, atol=1e-13)


def test_leave_p_out_depends_on_k_minus_p_only():
  rewards_gn, answers_gn = _groups("ties", 5, seed=6)
  for aggregator in objectives.AGGREGATORS:
    for m in (1, 2, 3):
      results = [objectives.k_sample_advantages(rewards_gn, aggregator=aggregator,
                                                baseline="leave_p_out", k=m + p, p=p, beta=BETA,
                                                answer_ids=answers_gn) for p in range(1, 6 - m)]
      for result in results[1:]:
        np.testing.assert_allclose(result, results[0], rtol=1e-10, atol=1e-13)
