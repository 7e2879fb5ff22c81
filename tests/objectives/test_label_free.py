"""Voting without labels: the leave-one-out agreement reward, and what its gradient estimates.

On a softmax bandit whose actions are answers (two actions share an answer; one gives none),
every n-tuple is enumerated. With r_i = g(a_i; a_-i), the agreement of sample i with the
plurality of the other n - 1 (ties split, no-answer samples neither vote nor agree), and
A(theta_s, theta_v) = E_{a ~ pi_s, b ~ pi_v^(n-1)}[g(a; b)], `ksjax.objectives.label_free` states

  mean aggregator, leave-one-out weights:  E[sum_i w_i score_i] = d_s A - d_v A / (n - 1),
  REINFORCE with k = n (w_i = rbar):       E[sum_i w_i score_i] = d_s A + d_v A,

each proved here exactly (float64, 1e-10), with A a finite sum over n-tuples of the literal g
below (no code shared with the implementation); and that it is not a gradient of accuracy.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ksjax import objectives
from ksjax.objectives import label_free
from tests.objectives import test_exact as exact

# Actions 0..3 answer "A", "B", "B", nothing; "A" is the correct answer.
ANSWERS = ("A", "B", "B", None)
CLASS_IDS = np.array([0, 1, 1, 2])  # the answer classes (no answer: a class of its own)
ANSWERED = np.array([True, True, True, False])
THETA = np.array([0.4, -0.3, 0.1, -0.8])


@pytest.fixture(autouse=True)
def _float64():
  with jax.enable_x64(True):
    yield


def literal_agreement(answer, others) -> float:
  """g(a; b): 1/t if `answer` is one of the t answers with the most votes among `others`."""
  if answer is None:
    return 0.0
  votes = collections.Counter(b for b in others if b is not None)
  if not votes:
    return 0.0
  top = max(votes.values())
  tied = [b for b, v in votes.items() if v == top]
  return 1.0 / len(tied) if answer in tied else 0.0


def test_agreement_is_the_literal_definition():
  rng = np.random.default_rng(0)
  for n in (1, 2, 3, 5, 8):
    ids_gn = rng.integers(0, 4, size=(40, n))
    answered_gn = rng.random((40, n)) > 0.2
    got = label_free.agreement(ids_gn, answered_gn)
    assert got.dtype == np.float32
    for ids, answered, row in zip(ids_gn, answered_gn, got):
      answers = [int(a) if ok else None for a, ok in zip(ids, answered)]
      want = [literal_agreement(answers[i], answers[:i] + answers[i + 1:]) for i in range(n)]
      np.testing.assert_allclose(row, want, rtol=1e-7)
  # Constant within an answer class (the majority_vote aggregator reads one reward per class).
  ids_gn = rng.integers(0, 3, size=(50, 7))
  reward_gn = label_free.agreement(ids_gn, np.ones_like(ids_gn, bool))
  for ids, rewards in zip(ids_gn, reward_gn):
    for c in np.unique(ids):
      assert len(set(rewards[ids == c].tolist())) == 1


@jax.jit
@functools.partial(jax.grad, argnums=(0, 1))
def _agreement_gradients(theta_s, theta_v, tuples_tn, values_t):
  """(d_s A, d_v A) of A(theta_s, theta_v), in which tuple (a, b_1..b_{n-1}) has probability
  pi_s(a) prod pi_v(b_j)."""
  log_s, log_v = jax.nn.log_softmax(theta_s), jax.nn.log_softmax(theta_v)
  log_p = log_s[tuples_tn[:, 0]] + jnp.sum(log_v[tuples_tn[:, 1:]], axis=1)
  return jnp.sum(jnp.exp(log_p) * values_t)


def _partials(n: int, theta: np.ndarray):
  """(d_s A, d_v A) at theta_s = theta_v = theta, [A] each."""
  tuples_tn = exact._tuples(len(ANSWERS), n)
  values_t = np.array([literal_agreement(ANSWERS[t[0]], [ANSWERS[b] for b in t[1:]])
                       for t in tuples_tn])
  grads = _agreement_gradients(jnp.asarray(theta), jnp.asarray(theta), jnp.asarray(tuples_tn),
                               jnp.asarray(values_t))
  return tuple(np.asarray(g) for g in grads)


def _expected(n: int, theta: np.ndarray, baseline: str) -> np.ndarray:
  """E[sum_i w_i grad log pi(a_i)] with the trainer's weights on the agreement rewards."""
  tuples_tn = exact._tuples(len(ANSWERS), n)
  rewards_tn = label_free.agreement(CLASS_IDS[tuples_tn], ANSWERED[tuples_tn]).astype(np.float64)
  weights_tn = objectives.k_sample_advantages(rewards_tn, aggregator="mean", baseline=baseline)
  return exact._expected_estimate(np.asarray(weights_tn), tuples_tn, theta)


@pytest.mark.parametrize("n", [3] + [pytest.param(n, marks=pytest.mark.slow) for n in (2, 4, 5)])
def test_leave_one_out_weights_estimate_own_minus_a_share_of_the_voters_gradient(n):
  own, voters = _partials(n, THETA)
  assert np.abs(own).max() > 1e-3 and np.abs(voters).max() > 1e-3
  np.testing.assert_allclose(_expected(n, THETA, "loo"), own - voters / (n - 1), rtol=0,
                             atol=1e-10)
  # REINFORCE with k = n (every weight the group's mean agreement): the total gradient of A.
  np.testing.assert_allclose(_expected(n, THETA, "none"), own + voters, rtol=0, atol=1e-10)


def _correct_gradient(theta):
  """grad_theta P(answer "A") = grad pi(0) for the softmax: pi_0 (e_0 - pi)."""
  pi = np.exp(theta - theta.max())
  pi /= pi.sum()
  return pi[0] * (np.eye(len(theta))[0] - pi)


@pytest.mark.parametrize("theta,rises", [
    (np.array([1.2, -0.2, -0.3, -1.0]), True),   # "A" is the modal answer (pi_A ~ 0.55)
    (np.array([0.0, 0.3, 0.4, -1.0]), False),    # "B" is (pi_A ~ 0.26, pi_B ~ 0.65)
])
def test_it_is_a_gradient_of_agreement_not_of_accuracy(theta, rises):
  """The expected update raises accuracy when the right answer leads the vote and lowers it
  when a wrong one does: labels never enter, the modal answer gains."""
  change = _expected(5, theta, "loo") @ _correct_gradient(theta)
  assert (change > 1e-4) if rises else (change < -1e-4), change
