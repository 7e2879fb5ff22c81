"""Hypothesis properties of the k-sample weights that hold for every input, ties included.

Shapes stay fixed within each property (only values, k, p and the baseline vary), so the compiled
operations are reused across examples.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ksjax import objectives

GROUPS, N = 3, 5
LEAVE_OUT = ("loo", "loo_demeaned", "leave_p_out")
# Rewards from a small set so that ties are common, or continuous.
reward_values = st.one_of(st.sampled_from([-1.0, 0.0, 0.5, 1.0]),
                          st.floats(-3, 3, allow_nan=False, allow_subnormal=False))
rewards_strategy = st.lists(reward_values, min_size=GROUPS * N, max_size=GROUPS * N).map(
    lambda values: np.array(values, dtype=np.float64).reshape(GROUPS, N))
answers_strategy = st.lists(st.integers(0, 2), min_size=GROUPS * N, max_size=GROUPS * N).map(
    lambda values: np.array(values).reshape(GROUPS, N))


@pytest.fixture(autouse=True)
def _float64():
  with jax.enable_x64(True):
    yield


@st.composite
def configs(draw, baselines=objectives.BASELINES):
  """(aggregator, baseline, k, p) valid for N samples."""
  aggregator = draw(st.sampled_from(objectives.AGGREGATORS))
  baseline = draw(st.sampled_from(baselines))
  k = draw(st.integers(1 if baseline == "none" else 2, N))
  p = draw(st.integers(1, k - 1)) if baseline == "leave_p_out" else 1
  return aggregator, baseline, k, p


def _weights(rewards_gn, answers_gn, config, **kwargs):
  aggregator, baseline, k, p = config
  return np.asarray(objectives.k_sample_advantages(
      rewards_gn, aggregator=aggregator, baseline=baseline, k=k, p=p, beta=0.8,
      answer_ids=answers_gn, **kwargs))


@settings(max_examples=40, deadline=None)
@given(rewards_strategy, answers_strategy, configs(), st.permutations(range(N)))
def test_permutation_equivariance(rewards_gn, answers_gn, config, permutation):
  rewards_gn = _class_consistent(rewards_gn, answers_gn)
  weights_gn = _weights(rewards_gn, answers_gn, config)
  permuted_gn = _weights(rewards_gn[:, permutation], answers_gn[:, permutation], config)
  np.testing.assert_allclose(permuted_gn, weights_gn[:, permutation], rtol=1e-9, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(rewards_strategy, answers_strategy, configs(LEAVE_OUT), st.floats(-100, 100))
def test_leave_out_weights_are_shift_invariant(rewards_gn, answers_gn, config, shift):
  """f(y + c) = f(y) + c for every aggregator, so every leave-out difference ignores c."""
  rewards_gn = _class_consistent(rewards_gn, answers_gn)
  np.testing.assert_allclose(_weights(rewards_gn + shift, answers_gn, config),
                             _weights(rewards_gn, answers_gn, config), rtol=0,
                             atol=1e-10 * (1 + abs(shift)))


@settings(max_examples=40, deadline=None)
@given(rewards_strategy, answers_strategy, configs(("loo_demeaned", "leave_p_out")))
def test_demeaned_weights_sum_to_zero(rewards_gn, answers_gn, config):
  rewards_gn = _class_consistent(rewards_gn, answers_gn)
  np.testing.assert_allclose(_weights(rewards_gn, answers_gn, config).sum(axis=1), 0, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(rewards_strategy)
def test_pass_at_k_loo_is_sparse(rewards_gn):
  """k = n: only a unique argmax is non-zero, with r_(n) - r_(n-1); a tied maximum gives zeros."""
  weights_gn = _weights(rewards_gn, None, ("pass_at_k", "loo", N, 1))
  for rewards_n, weights_n in zip(rewards_gn, weights_gn):
    assert np.count_nonzero(weights_n) <= 1
    top_two = np.sort(rewards_n)[-2:]
    np.testing.assert_allclose(weights_n[np.argmax(rewards_n)], top_two[1] - top_two[0], rtol=1e-12)


@settings(max_examples=30, deadline=None)
@given(rewards_strategy, answers_strategy, configs(LEAVE_OUT), st.floats(0.01, 100))
def test_group_std_is_scale_free(rewards_gn, answers_gn, config, factor):
  """Rescaling rewards by a positive factor leaves group_std weights unchanged (not for softmax,
  where it changes beta * r).

  Checked on groups whose weights are not (numerically) all zero, where eps is negligible.
  """
  if config[0] == "softmax":
    config = ("pass_at_k",) + config[1:]
  rewards_gn = _class_consistent(rewards_gn, answers_gn)
  spread_g = np.std(_weights(rewards_gn, answers_gn, config), axis=1, ddof=1)
  live = spread_g > 1e-6 * max(1.0, 1 / factor)
  scaled_gn = _weights(rewards_gn, answers_gn, config, scale="group_std", eps=1e-12)
  rescaled_gn = _weights(factor * rewards_gn, answers_gn, config, scale="group_std", eps=1e-12)
  np.testing.assert_allclose(rescaled_gn[live], scaled_gn[live], rtol=1e-6, atol=1e-9)
  np.testing.assert_allclose(np.std(scaled_gn[live], axis=1, ddof=1), 1.0, rtol=1e-6)


def _class_consistent(rewards_gn, answers_gn):
  """Majority voting reads one reward per answer class: every class gets its first member's."""
  first_gn = np.argmax(answers_gn[:, None, :] == answers_gn[:, :, None], axis=2)
  return np.take_along_axis(rewards_gn, first_gn, axis=1)
