"""The comparison baselines: "normalized" against Chen et al.'s closed form and its k-subset
definition, "verl_grpo_passk" against verl's definition written in torch; rejections.

What each is unbiased for, and its bias, is proven by enumeration in `test_exact.py`.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.support import objectives_naive
from ksjax import objectives

BETA = 0.7
STATIC = ("aggregator", "baseline", "k", "p", "scale")


@pytest.fixture(autouse=True)
def _float64():
  with jax.enable_x64(True):
    yield


def _chen(n: int, c: int, k: int) -> tuple[float, float]:
  """(A_pos, A_neg) of Chen et al. 2025 for c correct of n, in exact arithmetic (0, 0 when
  sigma = 0)."""
  comb = lambda a, b: math.comb(a, b) if 0 <= b <= a else 0
  mean = 1 - Fraction(comb(n - c, k), comb(n, k))
  variance = mean * (1 - mean)
  if variance == 0:
    return 0.0, 0.0
  sigma = math.sqrt(variance)  # rounded once, like the division below
  neg = 1 - mean - Fraction(comb(n - c - 1, k - 1), comb(n - 1, k - 1))
  return float(1 - mean) / sigma, float(neg) / sigma


@pytest.mark.parametrize("n,k", [(2, 1), (4, 1), (5, 2), (6, 3), (8, 5), (8, 7), (16, 4)])
def test_normalized_pass_at_k_is_chens_closed_form(n, k):
  """Every count of correct samples c = 0..n; rewards {0, 1} and {-1, +1} give the same weights
  (the std over subsets generalises sqrt(R(1-R)) affinely)."""
  correct_gn = np.arange(n)[None, :] < np.arange(n + 1)[:, None]  # group c has c correct
  want = np.array([[_chen(n, c, k)[0] if ok else _chen(n, c, k)[1] for ok in row]
                   for c, row in enumerate(correct_gn)])
  for rewards_gn in (correct_gn.astype(np.float64), np.where(correct_gn, 1.0, -1.0)):
    got = objectives.k_sample_advantages(rewards_gn, aggregator="pass_at_k", baseline="normalized",
                                         k=k)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_normalized_pass_at_k_large_n_in_float32():
  """C(100, 50) ~ 1e29 overflows no intermediate: the binomial ratios are exact rationals rounded
  once; float32 weights agree with the exact closed form."""
  n, k = 100, 50
  counts = [1, 2, 10, 30, 50, 51]
  correct_gn = np.arange(n)[None, :] < np.array(counts)[:, None]
  got = objectives.k_sample_advantages(correct_gn.astype(np.float32), aggregator="pass_at_k",
                                       baseline="normalized", k=k)
  assert got.dtype == jnp.float32 and np.all(np.isfinite(got))
  want = np.array([[_chen(n, c, k)[0] if ok else _chen(n, c, k)[1] for ok in row]
                   for c, row in zip(counts, correct_gn)])
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
  assert np.all(got[-1] == 0)  # 51 correct of 100: every 50-subset holds one, sigma = 0


def _literal_normalized(aggregator, k, rewards_gn, answers_gn):
  """(phi_k(i) - Rbar) / sigma straight from the definition: f on every k-subset."""
  out = np.zeros(rewards_gn.shape)
  n = rewards_gn.shape[1]
  subsets = list(itertools.combinations(range(n), k))
  for g, (rewards, answers) in enumerate(zip(rewards_gn, answers_gn)):
    values = np.array([objectives_naive.f(aggregator, rewards[list(s)], answers[list(s)], BETA)
                       for s in subsets])
    if np.ptp(values) <= 1e-12:  # every subset agrees: sigma = 0 (up to rounding here)
      continue
    for i in range(n):
      out[g, i] = np.mean([(v - values.mean()) for v, s in zip(values, subsets) if i in s])
    out[g] /= values.std()
  return out


def _groups(kind, n, seed, groups=4):
  """Rewards [G, n] constant within answer classes [G, n]: continuous, tied or binary +-1."""
  rng = np.random.default_rng(seed)
  answers_gn = rng.integers(0, 3, size=(groups, n))
  values = {"continuous": rng.normal(size=(groups, 3)),
            "ties": rng.choice([0.0, 0.5, 0.5, 1.0], size=(groups, 3)),
            "binary": rng.choice([-1.0, 1.0], size=(groups, 3))}[kind]
  rewards_gn = np.take_along_axis(values, answers_gn, axis=1)
  if kind == "continuous":
    rewards_gn = rewards_gn + 0.1 * rng.normal(size=rewards_gn.shape)
  # A group where every k-subset (k >= 2) holds a 1: sigma = 0 for pass_at_k.
  rewards_gn[0] = np.where(np.arange(n) == 0, -0.5, 1.0)
  answers_gn[0] = np.where(np.arange(n) == 0, 1, 0)
  return rewards_gn, answers_gn


@pytest.mark.parametrize("aggregator", objectives.AGGREGATORS)
@pytest.mark.parametrize("kind,n", [("continuous", 5), ("ties", 5), ("binary", 6)])
def test_normalized_matches_its_k_subset_definition(aggregator, kind, n):
  rewards_gn, answers_gn = _groups(kind, n, seed=n)
  for k in range(1, n):
    got = objectives.k_sample_advantages(rewards_gn, aggregator=aggregator, baseline="normalized",
                                         k=k, beta=BETA, answer_ids=answers_gn)
    want = _literal_normalized(aggregator, k, rewards_gn, answers_gn)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-10, err_msg=f"{aggregator} k={k}")


def test_normalized_with_k_1_is_grpo_with_the_population_std():
  rewards_gn, answers_gn = _groups("continuous", 6, seed=3)
  grpo = (rewards_gn - rewards_gn.mean(1, keepdims=True)) / rewards_gn.std(1, keepdims=True)
  for aggregator in objectives.AGGREGATORS:
    got = objectives.k_sample_advantages(rewards_gn, aggregator=aggregator, baseline="normalized",
                                         k=1, beta=BETA, answer_ids=answers_gn)
    np.testing.assert_allclose(got, grpo, rtol=1e-10, atol=1e-12)


def test_normalized_is_shift_and_scale_free():
  """f(a r + b) = a f(r) + b (a > 0) for every aggregator but softmax (where a changes beta r)."""
  rewards_gn, answers_gn = _groups("ties", 5, seed=4)
  for aggregator in ("mean", "pass_at_k", "majority_vote"):
    kwargs = dict(aggregator=aggregator, baseline="normalized", k=3, answer_ids=answers_gn)
    np.testing.assert_allclose(
        objectives.k_sample_advantages(3.5 * rewards_gn - 20.0, **kwargs),
        objectives.k_sample_advantages(rewards_gn, **kwargs), rtol=1e-9, atol=1e-10)


def _verl_grpo_passk(rewards_gn: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
  """verl's compute_grpo_passk_outcome_advantage (norm_adv_by_std_in_grpo=True), per group."""
  advantages = torch.zeros_like(rewards_gn)
  for g, rewards in enumerate(rewards_gn):
    topk, topk_idx = torch.topk(rewards, 2)
    advantages[g, topk_idx[0]] = (topk[0] - topk[1]) / (torch.std(rewards) + eps)
  return advantages


VERL_GROUPS = np.array([
    [0.2, 0.9, -0.4, 0.5, 0.1],   # a unique maximum
    [0.2, 0.9, -0.4, 0.9, 0.1],   # tied maximum: all zeros
    [1.0, -1.0, -1.0, -1.0, -1.0],  # one correct of binary +-1
    [1.0, -1.0, 1.0, -1.0, -1.0],  # two correct: all zeros
    [-1.0, -1.0, -1.0, -1.0, -1.0],  # none correct: std 0, all zeros
    [3.0, 2.5, 2.5, 2.5, 2.5],    # a tied runner-up
])


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 1e-6)])
def test_verl_grpo_passk_matches_verl_in_torch(dtype, tol):
  rewards_gn = VERL_GROUPS.astype(dtype)
  want = _verl_grpo_passk(torch.from_numpy(rewards_gn)).numpy()
  got = objectives.k_sample_advantages(rewards_gn, aggregator="pass_at_k",
                                       baseline="verl_grpo_passk")
  assert got.dtype == dtype
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
  assert np.all(np.asarray(got)[[1, 3, 4]] == 0)
  # eps is verl's epsilon.
  want = _verl_grpo_passk(torch.from_numpy(rewards_gn), eps=0.5).numpy()
  got = objectives.k_sample_advantages(rewards_gn, aggregator="pass_at_k",
                                       baseline="verl_grpo_passk", eps=0.5)
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("n", [2, 3, 8])
def test_verl_grpo_passk_random_groups_match_verl(n):
  rng = np.random.default_rng(n)
  rewards_gn = np.concatenate([rng.normal(size=(5, n)), rng.choice([0.0, 1.0], size=(5, n)),
                               rng.choice([0.0, 0.5, 1.0], size=(5, n))])
  want = _verl_grpo_passk(torch.from_numpy(rewards_gn)).numpy()
  got = objectives.k_sample_advantages(rewards_gn, aggregator="pass_at_k",
                                       baseline="verl_grpo_passk")
  np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_jit_matches_eager():
  advantages = jax.jit(objectives.k_sample_advantages, static_argnames=STATIC)
  rewards_gn, answers_gn = _groups("continuous", 5, seed=5)
  rewards_gn = rewards_gn.astype(np.float32)
  for aggregator in objectives.AGGREGATORS:
    kwargs = dict(aggregator=aggregator, baseline="normalized", k=3, answer_ids=answers_gn)
    np.testing.assert_allclose(advantages(rewards_gn, **kwargs),
                               objectives.k_sample_advantages(rewards_gn, **kwargs),
                               rtol=1e-6, atol=1e-6)
  kwargs = dict(aggregator="pass_at_k", baseline="verl_grpo_passk")
  np.testing.assert_allclose(advantages(rewards_gn, **kwargs),
                             objectives.k_sample_advantages(rewards_gn, **kwargs), rtol=1e-6)


@pytest.mark.parametrize("overrides,message", [
    (dict(baseline="normalized"), r"^k=5 is not accepted with baseline='normalized' and n=5; "
                                  r"expected k < n"),
    (dict(baseline="normalized", k=3, scale="group_std"),
     r"^scale='group_std' is not accepted with baseline='normalized'.*expected scale='none'"),
    (dict(baseline="verl_grpo_passk", scale="group_std"),
     r"^scale='group_std' is not accepted with baseline='verl_grpo_passk'"),
    (dict(baseline="verl_grpo_passk", aggregator="mean"),
     r"^aggregator='mean' is not accepted with baseline='verl_grpo_passk'.*'pass_at_k'"),
    (dict(baseline="verl_grpo_passk", k=3), r"^k=3 is not accepted with "
                                            r"baseline='verl_grpo_passk' and n=5; expected k = n"),
    (dict(baseline="verl_grpo_passk", eps=0.0), r"^eps=0.0 .*> 0"),
    (dict(baseline="normalized", k=4, aggregator="majority_vote", answer_ids=None),
     r"^answer_ids is missing"),
])
def test_rejects(overrides, message):
  kwargs = dict(aggregator="pass_at_k", answer_ids=np.zeros((2, 5), np.int32))
  kwargs.update(overrides)
  with pytest.raises(ValueError, match=message) as error:
    objectives.k_sample_advantages(np.zeros((2, 5)), **kwargs)
  assert "\n" not in str(error.value)


def test_rejects_single_sample_groups():
  for baseline in ("normalized", "verl_grpo_passk"):
    with pytest.raises(ValueError, match=rf"k=1 is not accepted with baseline='{baseline}'"):
      objectives.k_sample_advantages(np.zeros((2, 1)), aggregator="pass_at_k", baseline=baseline)


def test_rejects_enumeration_beyond_limit():
  with pytest.raises(ValueError, match=r"C\(64, 4\) = 635376 exceeds"):
    objectives.k_sample_advantages(np.zeros((1, 64)), aggregator="softmax", baseline="normalized",
                                   k=4)


def test_permuting_a_group_permutes_its_weights():
  rewards_gn, answers_gn = _groups("ties", 5, seed=6)
  permutation = np.array([3, 0, 4, 1, 2])
  for aggregator in objectives.AGGREGATORS:
    for baseline, k in (("normalized", 2), ("normalized", 4), ("verl_grpo_passk", 5)):
      if baseline == "verl_grpo_passk" and aggregator != "pass_at_k":
        continue
      kwargs = dict(aggregator=aggregator, baseline=baseline, k=k, beta=BETA)
      weights_gn = objectives.k_sample_advantages(rewards_gn, answer_ids=answers_gn, **kwargs)
      permuted_gn = objectives.k_sample_advantages(
          rewards_gn[:, permutation], answer_ids=answers_gn[:, permutation], **kwargs)
      np.testing.assert_allclose(permuted_gn, np.asarray(weights_gn)[:, permutation], rtol=1e-10,
                                 atol=1e-12)
