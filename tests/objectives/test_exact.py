"""Proof by exact enumeration: every estimator is an unbiased gradient of its stated target.

On a softmax bandit pi = softmax(theta) over a handful of actions, all n-tuples of actions are
enumerated: E[sum_i w_i grad log pi(y_i)] is a finite sum over tuples, compared (float64, 1e-8) with
jax.grad of the target objective, itself a finite sum over k-tuples of the literal target functional
(`objectives_naive.target`: f(y) for none/loo, (1/k) sum_i f(y_-i) for loo_demeaned, the appendix's
leave-p-out average for leave_p_out). This catches every sign, factor, tie and n > k mistake.

The comparison baselines divided by a data-dependent standard deviation ("normalized",
"verl_grpo_passk") are unbiased for no objective: their undivided numerators are checked against the
target they are unbiased for, and their bias is shown to be what `normalized.py` states.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support import objectives_naive
from ksjax import objectives

BETA = 1.3
# name: (rewards per action, answer class per action). Majority voting reads a class's reward from
# any of its actions, so actions sharing a class share a reward ("tied" also has equal rewards).
BANDITS = {
    "distinct": (np.array([0.3, -1.2, 0.7, 0.1]), np.array([0, 1, 2, 3])),
    "tied": (np.array([1.0, -0.5, -0.5, 0.3]), np.array([0, 1, 1, 2])),
    "three_actions": (np.array([0.9, -0.4, 0.2]), np.array([0, 1, 2])),
    "binary": (np.array([1.0, 0.0, 0.0, 1.0]), np.array([0, 1, 2, 0])),
}
THETA = np.array([0.4, -0.3, 0.1, 0.25])
CASES = [(n, k, "distinct") for n in range(1, 5) for k in range(1, n + 1)]
CASES += [(n, k, "tied") for n in (3, 4) for k in range(2, n + 1)]
CASES += [(5, 3, "three_actions"), (5, 5, "three_actions")]


@pytest.fixture(autouse=True)
def _float64():
  with jax.enable_x64(True):
    yield


def _baselines(k: int):
  """(baseline, p) pairs valid for k."""
  if k < 2:
    return [("none", 1)]
  return [("none", 1), ("loo", 1), ("loo_demeaned", 1)] + [("leave_p_out", p) for p in range(1, k)]


def _tuples(actions: int, length: int) -> np.ndarray:
  return np.array(list(itertools.product(range(actions), repeat=length)), dtype=np.int64)


def _expected_estimate(weights_tn: np.ndarray, tuples_tn: np.ndarray,
                       theta: np.ndarray) -> np.ndarray:
  """E[sum_i w_i grad log pi(y_i)] over all n-tuples, with grad_theta log pi(a) = e_a - pi, [A]."""
  pi = np.exp(theta - theta.max())
  pi /= pi.sum()
  prob_t = np.prod(pi[tuples_tn], axis=1)
  score_tna = np.eye(len(theta))[tuples_tn] - pi
  return np.einsum("t,tn,tna->a", prob_t, weights_tn, score_tna)


@jax.jit
@jax.grad
def _target_gradient(theta_a: jax.Array, values_t: jax.Array, tuples_tk: jax.Array) -> jax.Array:
  """grad_theta of the exact target: sum over all k-tuples of prod_i pi(y_i) * value(tuple), [A]."""
  log_pi_a = jax.nn.log_softmax(theta_a)
  return jnp.sum(jnp.exp(jnp.sum(log_pi_a[tuples_tk], axis=1)) * values_t)


@pytest.mark.parametrize("aggregator", objectives.AGGREGATORS)
@pytest.mark.parametrize("n,k,bandit", CASES)
def test_expected_weights_are_target_gradient(aggregator, n, k, bandit):
  rewards_a, answers_a = BANDITS[bandit]
  theta = THETA[:len(rewards_a)]
  tuples_tn = _tuples(len(rewards_a), n)
  tuples_tk = _tuples(len(rewards_a), k)
  for baseline, p in _baselines(k):
    weights_tn = objectives.k_sample_advantages(
        jnp.asarray(rewards_a[tuples_tn]), aggregator=aggregator, baseline=baseline, k=k, p=p,
        beta=BETA, answer_ids=jnp.asarray(answers_a[tuples_tn]))
    assert weights_tn.dtype == jnp.float64
    estimate = _expected_estimate(np.asarray(weights_tn), tuples_tn, theta)
    values_t = np.array([
        objectives_naive.target(aggregator, baseline, p, rewards_a[t], answers_a[t], BETA)
        for t in tuples_tk])
    gradient = np.asarray(_target_gradient(jnp.asarray(theta), values_t, tuples_tk))
    np.testing.assert_allclose(estimate, gradient, rtol=0, atol=1e-8,
                               err_msg=f"{aggregator} {baseline} p={p} n={n} k={k} {bandit}")
    assert np.abs(gradient).max() > 1e-3  # The comparison is not vacuous.


@pytest.mark.parametrize("k", [2, 3, 4])
def test_loo_demeaned_pass_at_k_target_is_best_and_second_best_mix(k):
  """The paper's closed form of the biased objective: E[((k-1)/k) r_(k) + (1/k) r_(k-1)]."""
  rewards_a, answers_a = BANDITS["distinct"]
  tuples_tk = _tuples(len(rewards_a), k)
  literal_t = np.array([objectives_naive.target("pass_at_k", "loo_demeaned", 1, rewards_a[t],
                                                answers_a[t], BETA) for t in tuples_tk])
  top_two_t = np.sort(rewards_a[tuples_tk], axis=1)[:, -2:]
  closed_t = (k - 1) / k * top_two_t[:, 1] + top_two_t[:, 0] / k
  np.testing.assert_allclose(literal_t, closed_t, rtol=0, atol=1e-12)


# ---- The biased comparison baselines (ksjax/objectives/normalized.py). ----

NORMALIZED_CASES = [(n, k, bandit) for bandit in ("distinct", "tied") for n in (2, 3, 4)
                    for k in range(1, n)]
NORMALIZED_CASES += [(5, 3, "three_actions"), (4, 2, "binary")]


def _expected_and_target(aggregator, baseline, n, k, bandit, theta, multiply=None):
  """(E[sum_i w_i grad log pi(y_i)], grad_theta E[f(y_1..y_k)]) on the bandit, each [A]; with
  `multiply(rewards_n, answers_n)`, each tuple's weights are multiplied by it first."""
  rewards_a, answers_a = BANDITS[bandit]
  theta = theta[:len(rewards_a)]
  tuples_tn, tuples_tk = _tuples(len(rewards_a), n), _tuples(len(rewards_a), k)
  weights_tn = np.asarray(objectives.k_sample_advantages(
      jnp.asarray(rewards_a[tuples_tn]), aggregator=aggregator, baseline=baseline, k=k, beta=BETA,
      answer_ids=jnp.asarray(answers_a[tuples_tn])))
  if multiply is not None:
    weights_tn = weights_tn * np.array([[multiply(rewards_a[t], answers_a[t])] for t in tuples_tn])
  values_t = np.array([objectives_naive.f(aggregator, rewards_a[t], answers_a[t], BETA)
                       for t in tuples_tk])
  return (_expected_estimate(weights_tn, tuples_tn, theta),
          np.asarray(_target_gradient(jnp.asarray(theta), values_t, tuples_tk)))


def _subset_std(aggregator, k):
  """The population standard deviation of f over the k-subsets of one group, literally."""
  def std(rewards_n, answers_n):
    values = [objectives_naive.f(aggregator, [rewards_n[i] for i in s], [answers_n[i] for i in s],
                                 BETA) for s in itertools.combinations(range(len(rewards_n)), k)]
    return float(np.std(values))
  return std


def _parallel_factor(estimate, gradient):
  """c minimising |estimate - c gradient|, and the part of `estimate` not along `gradient`."""
  c = estimate @ gradient / (gradient @ gradient)
  return c, np.abs(estimate - c * gradient).max()


@pytest.mark.parametrize("aggregator", objectives.AGGREGATORS)
@pytest.mark.parametrize("n,k,bandit", NORMALIZED_CASES)
def test_normalized_times_its_std_is_unbiased_for_a_multiple_of_the_objective(
    aggregator, n, k, bandit):
  """sigma A_i = phi_k(i) - Rbar is ((n-k)/k) times leave-p-out with m = k: unbiased for
  ((n-k)/k) grad E[f(y_1..y_k)], sigma being the std of f over the group's k-subsets."""
  estimate, gradient = _expected_and_target(aggregator, "normalized", n, k, bandit, THETA,
                                            multiply=_subset_std(aggregator, k))
  np.testing.assert_allclose(estimate, (n - k) / k * gradient, rtol=0, atol=1e-8,
                             err_msg=f"{aggregator} n={n} k={k} {bandit}")
  assert np.abs(gradient).max() > 1e-3


@pytest.mark.parametrize("aggregator", objectives.AGGREGATORS)
@pytest.mark.parametrize("n,k", [(3, 2), (4, 2), (4, 3)])
def test_normalized_is_biased_in_direction_for_non_binary_rewards(aggregator, n, k):
  """Dividing by sigma, which depends on the sample, turns the expectation away from
  grad E[f(y_1..y_k)]: not only its length is off."""
  estimate, gradient = _expected_and_target(aggregator, "normalized", n, k, "distinct", THETA)
  cosine = estimate @ gradient / np.linalg.norm(estimate) / np.linalg.norm(gradient)
  assert 0 < cosine < 1 - 1e-3, (aggregator, n, k, cosine)


@pytest.mark.parametrize("n,k", [(3, 2), (4, 3), (4, 2), (5, 3), (5, 2)])
def test_normalized_pass_at_k_with_binary_rewards_is_right_in_direction_not_in_size(n, k):
  """Binary rewards: weights that depend only on which samples are correct have an expectation
  along grad P(correct), hence along grad pass@k, with a factor c(theta) > 0. With n - k = 1 only
  groups with one correct sample have sigma > 0 (sigma_1 = sqrt(k (n-k)) / n), so c is the constant
  ((n-k)/k) / sigma_1; with n - k >= 2 it changes with the policy: a bias between prompts."""
  factors = []
  for theta in (THETA, np.array([1.0, -0.5, 0.3, -0.2])):
    estimate, gradient = _expected_and_target("pass_at_k", "normalized", n, k, "binary", theta)
    c, residual = _parallel_factor(estimate, gradient)
    assert residual < 1e-8 and c > 0
    factors.append(c)
  if n - k == 1:
    np.testing.assert_allclose(factors, (n - k) / k / (math.sqrt(k * (n - k)) / n), rtol=1e-8)
  else:
    assert abs(factors[0] / factors[1] - 1) > 1e-3, factors


@pytest.mark.parametrize("n,bandit", [(2, "distinct"), (3, "distinct"), (4, "distinct"),
                                      (3, "tied"), (4, "tied"), (5, "three_actions")])
def test_verl_grpo_passk_times_its_std_is_unbiased_for_pass_at_k(n, bandit):
  """Before verl's division by torch.std(r) + eps it is Tang's leave-one-out: unbiased for
  grad E[max of n]."""
  undo = lambda rewards_n, answers_n: np.std(rewards_n, ddof=1) + 1e-6
  estimate, gradient = _expected_and_target("pass_at_k", "verl_grpo_passk", n, n, bandit, THETA,
                                            multiply=undo)
  np.testing.assert_allclose(estimate, gradient, rtol=0, atol=1e-8)
  assert np.abs(gradient).max() > 1e-3


@pytest.mark.parametrize("n", [2, 3, 4])
def test_verl_grpo_passk_bias(n):
  """Rewards {0, 1}: only a group with one correct sample has a non-zero weight, and its std is
  then 1/sqrt(n), so verl's estimator is exactly sqrt(n)/(1 + sqrt(n) eps) grad pass@n: unbiased
  up to a constant. Rewards of more than two values: the std varies between the groups with a
  non-zero weight and the expectation turns away from grad pass@n."""
  estimate, gradient = _expected_and_target("pass_at_k", "verl_grpo_passk", n, n, "binary", THETA)
  np.testing.assert_allclose(estimate, math.sqrt(n) / (1 + math.sqrt(n) * 1e-6) * gradient,
                             rtol=0, atol=1e-8)
  if n > 2:  # With two samples the std is |r_1 - r_2| / sqrt(2): the weight is a constant sign.
    estimate, gradient = _expected_and_target("pass_at_k", "verl_grpo_passk", n, n, "distinct",
                                              THETA)
    cosine = estimate @ gradient / np.linalg.norm(estimate) / np.linalg.norm(gradient)
    assert 0 < cosine < 1 - 1e-4, cosine
