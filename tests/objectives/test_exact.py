"""Proof by exact enumeration: every estimator is an unbiased gradient of its stated target.

On a softmax bandit pi = softmax(theta) over a handful of actions, all n-tuples of actions are
enumerated: E[sum_i w_i grad log pi(y_i)] is a finite sum over tuples, compared (float64, 1e-8) with
jax.grad of the target objective, itself a finite sum over k-tuples of the literal target functional
(`objectives_naive.target`: f(y) for none/loo, (1/k) sum_i f(y_-i) for loo_demeaned, the appendix's
leave-p-out average for leave_p_out). This catches every sign, factor, tie and n > k mistake.
"""

from __future__ import annotations

import itertools

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
