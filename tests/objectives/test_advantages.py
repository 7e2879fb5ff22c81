"""The public surface of ksjax.objectives: jit, dtypes, GRPO parity of group_std, rejections."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.support import objectives_naive
from ksjax import objectives
from ksjax.objectives import enumerated

STATIC = ("aggregator", "baseline", "k", "p", "scale")
REWARDS = np.array([[0.2, 0.9, -0.4, 0.5, 0.9], [1.0, -1.0, -1.0, 1.0, -1.0]], dtype=np.float32)
ANSWERS = np.array([[0, 1, 2, 3, 1], [0, 1, 1, 0, 2]], dtype=np.int32)


@pytest.mark.parametrize("aggregator", objectives.AGGREGATORS)
def test_jit_matches_eager(aggregator):
  advantages = jax.jit(objectives.k_sample_advantages, static_argnames=STATIC)
  for baseline in objectives.BASELINES:
    kwargs = dict(aggregator=aggregator, baseline=baseline, k=4, p=2, answer_ids=ANSWERS)
    got = advantages(jnp.asarray(REWARDS), **kwargs)
    assert got.shape == REWARDS.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(got, objectives.k_sample_advantages(REWARDS, **kwargs),
                               rtol=1e-6, atol=1e-7)


def test_traced_beta():
  """beta may be a traced value: one compilation serves every temperature."""
  advantages = jax.jit(objectives.k_sample_advantages, static_argnames=STATIC)
  for beta in (0.0, 2.5):
    got = advantages(REWARDS, aggregator="softmax", baseline="loo", beta=jnp.float32(beta))
    want = objectives_naive.weights("softmax", "loo", 5, 1, REWARDS, ANSWERS, beta)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # beta = 0 is the mean objective.
  np.testing.assert_allclose(
      advantages(REWARDS, aggregator="softmax", baseline="loo", beta=0.0),
      objectives.k_sample_advantages(REWARDS, aggregator="mean", baseline="loo"),
      rtol=1e-5, atol=1e-6)


def test_non_finite_rewards_under_jit_stay_in_their_group():
  rewards = REWARDS.copy()
  rewards[0, 2] = np.nan
  for aggregator in objectives.AGGREGATORS:
    got = jax.jit(objectives.k_sample_advantages, static_argnames=STATIC)(
        rewards, aggregator=aggregator, baseline="loo", answer_ids=ANSWERS)
    assert not np.all(np.isfinite(got[0]))
    np.testing.assert_allclose(got[1], objectives.k_sample_advantages(
        REWARDS, aggregator=aggregator, baseline="loo", answer_ids=ANSWERS)[1], rtol=1e-6)


def test_group_std_is_grpo_for_the_mean():
  """mean + loo + group_std is GRPO's (r - mean)/(std + eps) with torch.std, as in TRL and verl."""
  rewards = np.random.default_rng(0).normal(size=(6, 8)).astype(np.float32)
  rewards_t = torch.from_numpy(rewards)
  n, eps = rewards.shape[1], 1e-6
  grpo = (rewards_t - rewards_t.mean(1, keepdim=True)) / (rewards_t.std(1, keepdim=True) + eps)
  # The weights are (r - mean)/(n - 1), so our eps acts as (n - 1) eps on the reward scale.
  got = objectives.k_sample_advantages(rewards, aggregator="mean", baseline="loo",
                                       scale="group_std", eps=eps / (n - 1))
  np.testing.assert_allclose(got, grpo.numpy(), rtol=1e-5, atol=1e-6)


def test_group_std_of_constant_group_is_zero():
  got = objectives.k_sample_advantages(np.full((2, 4), 0.7), aggregator="pass_at_k",
                                       baseline="loo_demeaned", scale="group_std")
  np.testing.assert_array_equal(got, 0.0)


@pytest.mark.parametrize("aggregator", ["majority_vote", "softmax"])
def test_large_n_equals_k(aggregator):
  """n = k = 64 needs only the group and its 64 leave-one-outs (the complement vote count path)."""
  rng = np.random.default_rng(1)
  answers = rng.integers(0, 4, size=(2, 64))
  rewards = np.array([1.0, -1.0, -1.0, 0.0])[answers]
  with jax.enable_x64(True):
    for baseline in ("loo", "loo_demeaned"):
      got = objectives.k_sample_advantages(rewards, aggregator=aggregator, baseline=baseline,
                                           answer_ids=answers)
      want = [objectives_naive.weights_k(aggregator, baseline, 1, r, a, 1.0)
              for r, a in zip(rewards, answers)]
      np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("k", [4, 6])
def test_softmax_is_stable_for_large_beta(k):
  """beta * r spanning hundreds underflows every weight of subsets far below the maximum unless
  each subset is shifted by its own maximum (k = n = 6: the leave-one-out path; k = 4: columns)."""
  rewards = np.array([[2.0, -1.0, 0.5, -3.0, 1.5, 2.0], [0.1, -4.0, 3.0, 0.2, -0.3, 0.0]])
  for baseline in ("loo", "loo_demeaned"):
    got = objectives.k_sample_advantages(rewards.astype(np.float32), aggregator="softmax",
                                         baseline=baseline, k=k, beta=300.0)
    want = objectives_naive.weights("softmax", baseline, k, 1, rewards, rewards < 0, 300.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("aggregator,n,k,baseline", [
    ("majority_vote", 12, 5, "none"),  # votes counted among the members, gathered
    ("majority_vote", 8, 7, "leave_p_out"),  # m = 5: votes counted among the left-outs
    ("softmax", 19, 17, "none"),  # gathered [G, C, m]
])
def test_every_enumeration_path_matches_literal(aggregator, n, k, baseline):
  """The small tests take the per-member-column and leave-one-out paths; these sizes the others."""
  rng = np.random.default_rng(n)
  answers = rng.integers(0, 3, size=(2, n))
  rewards = np.array([0.4, -1.0, 1.0])[answers]
  with jax.enable_x64(True):
    got = objectives.k_sample_advantages(rewards, aggregator=aggregator, baseline=baseline, k=k,
                                         p=2, answer_ids=answers)
  want = objectives_naive.weights(aggregator, baseline, k, 2, rewards, answers, 1.0)
  np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_majority_vote_in_chunks(monkeypatch):
  """Groups processed in chunks (bounded memory) give the same weights as all at once."""
  rng = np.random.default_rng(2)
  answers = rng.integers(0, 3, size=(7, 6))
  rewards = np.array([1.0, -1.0, 0.5], dtype=np.float32)[answers]
  kwargs = dict(aggregator="majority_vote", baseline="loo", k=3, answer_ids=answers)
  whole = objectives.k_sample_advantages(rewards, **kwargs)
  monkeypatch.setattr(enumerated, "_VOTE_ELEMENTS_PER_CHUNK", 2 * math.comb(6, 3) * 9)
  enumerated.majority_vote_values.clear_cache()  # The chunk size is read when tracing.
  chunked = objectives.k_sample_advantages(rewards, **kwargs)
  enumerated.majority_vote_values.clear_cache()
  np.testing.assert_array_equal(chunked, whole)


def test_one_sample_objective_is_the_mean_reward():
  """f of a single sample is its reward for every aggregator, so the k = 1 objective is the mean."""
  rewards = np.array([[1.0, -1.0, 1.0, 1.0, -1.0], [0.3, 0.1, -2.0, 0.3, 0.0]], dtype=np.float32)
  for aggregator in objectives.AGGREGATORS:
    np.testing.assert_allclose(
        objectives.objective_value(rewards, aggregator=aggregator, k=1, answer_ids=ANSWERS),
        rewards.mean(1), rtol=1e-6)


# ---- Rejections: one ValueError naming the argument and what is accepted. ----

def _call(rewards=REWARDS, **overrides):
  kwargs = dict(aggregator="pass_at_k", baseline="loo", answer_ids=ANSWERS)
  kwargs.update(overrides)
  return objectives.k_sample_advantages(rewards, **kwargs)


@pytest.mark.parametrize("overrides,message", [
    (dict(k=6), r"k=6 .*\[1, n=5\]"),
    (dict(k=0), r"k=0 .*\[1, n=5\]"),
    (dict(k=2.0), r"k=2.0 .*integer"),
    (dict(k=1), r"k=1 .*baseline='loo'.*k >= 2"),
    (dict(k=1, baseline="leave_p_out"), r"k=1 .*k >= 2"),
    (dict(baseline="leave_p_out", k=3, p=3), r"p=3 .*\[1, k-1 = 2\]"),
    (dict(baseline="leave_p_out", p=0), r"p=0 "),
    (dict(aggregator="max"), r"aggregator='max' .*'pass_at_k'"),
    (dict(baseline="rloo"), r"baseline='rloo' .*'loo_demeaned'"),
    (dict(scale="std"), r"scale='std' .*'group_std'"),
    (dict(scale="group_std", baseline="none"), r"scale='group_std' .*baseline='none'"),
    (dict(scale="group_std", eps=0.0), r"eps=0.0 .*> 0"),
    (dict(aggregator="softmax", beta=float("inf")), r"beta=inf .*finite"),
    (dict(aggregator="majority_vote", answer_ids=None), r"answer_ids is missing"),
    (dict(aggregator="majority_vote", answer_ids=ANSWERS[:, :4]), r"answer_ids has shape \(2, 4\)"),
    (dict(aggregator="majority_vote", answer_ids=ANSWERS.astype(np.float32)),
     r"answer_ids .*integer"),
])
def test_rejects(overrides, message):
  with pytest.raises(ValueError, match=message):
    _call(**overrides)


@pytest.mark.parametrize("rewards,message", [
    (REWARDS[0], r"rewards has shape \(5,\)"),
    (REWARDS[None], r"rewards has shape \(1, 2, 5\)"),
    (REWARDS.astype(np.int32), r"rewards has dtype int32"),
    (np.where(np.arange(5) == 3, np.inf, REWARDS).astype(np.float32), r"rewards\[0, 3\] = inf"),
    (np.where(np.arange(5) == 1, np.nan, REWARDS).astype(np.float32), r"rewards\[0, 1\] = nan"),
])
def test_rejects_rewards(rewards, message):
  with pytest.raises(ValueError, match=message):
    _call(rewards)


def test_rejects_enumeration_beyond_limit():
  rewards = np.zeros((1, 64), np.float32)
  answers = np.zeros((1, 64), np.int32)
  with pytest.raises(ValueError, match=r"C\(64, 4\) = 635376 exceeds the limit of 20000"):
    objectives.k_sample_advantages(rewards, aggregator="majority_vote", baseline="none", k=4,
                                   answer_ids=answers)
  with pytest.raises(ValueError, match=r"C\(64, 32\) = \d+ exceeds"):
    objectives.k_sample_advantages(rewards, aggregator="softmax", baseline="leave_p_out", p=32)
  with pytest.raises(ValueError, match=r"C\(64, 4\) = 635376 exceeds"):
    objectives.objective_value(rewards, aggregator="softmax", k=4)
  # The closed forms have no limit.
  closed = objectives.k_sample_advantages(rewards, aggregator="pass_at_k", baseline="leave_p_out",
                                          p=32)
  assert np.all(closed == 0)


def test_objective_value_rejects():
  with pytest.raises(ValueError, match=r"k=9 "):
    objectives.objective_value(REWARDS, aggregator="mean", k=9)
  with pytest.raises(ValueError, match=r"answer_ids is missing"):
    objectives.objective_value(REWARDS, aggregator="majority_vote")
