"""pass@k and maj@k against their definitions, enumerated.

pass@k and maj@k are averages over the k-subsets of n samples; small n lists every subset.
Larger n (where the maj@k dynamic programme runs its matrix path) is checked against exact
rational arithmetic over the vote-count vectors, a different enumeration of the same sum.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from ksjax import objectives
from ksjax.objectives import estimates as estimators


def subsets_pass_at_k(correct: list[bool], k: int) -> float:
  combos = list(itertools.combinations(correct, k))
  return sum(any(c) for c in combos) / len(combos)


def subsets_maj_at_k(ids: list[int], values: list[float], k: int) -> float:
  """Lists every k-subset; ties between plurality answers split the outcome evenly."""
  value_of = dict(zip(ids, values))
  total = 0.0
  combos = list(itertools.combinations(ids, k))
  for combo in combos:
    votes = {a: combo.count(a) for a in set(combo)}
    top = max(votes.values())
    winners = [a for a, c in votes.items() if c == top]
    total += sum(value_of[a] for a in winners) / len(winners)
  return total / len(combos)


def count_vectors_maj_at_k(sizes: list[int], values: list[Fraction], k: int) -> Fraction:
  """Exact rational maj@k over the vote-count vectors (x_1..x_m), each C(c_1,x_1)..C(c_m,x_m)
  subsets."""
  total = Fraction(0)
  for xs in itertools.product(*(range(c + 1) for c in sizes)):
    if sum(xs) != k:
      continue
    ways = math.prod(math.comb(c, x) for c, x in zip(sizes, xs))
    top = max(xs)
    winners = [r for r, x in zip(values, xs) if x == top]
    total += ways * sum(winners, Fraction(0)) / len(winners)
  return total / math.comb(sum(sizes), k)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_subset_enumeration(n):
  for c in range(n + 1):
    correct = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
      got = estimators.pass_at_k(np.asarray([c]), n, k)[0]
      assert got == pytest.approx(subsets_pass_at_k(correct, k), abs=1e-12), (n, c, k)


def test_pass_at_n_is_the_naive_estimate():
  n = 37
  c = np.arange(n + 1)
  np.testing.assert_array_equal(estimators.pass_at_k(c, n, n), (c > 0).astype(np.float64))


def test_pass_at_1_is_the_fraction_correct():
  n = 200
  c = np.arange(n + 1)
  np.testing.assert_allclose(estimators.pass_at_k(c, n, 1), c / n, rtol=0, atol=1e-14)


def test_pass_at_k_large_n_matches_exact_binomials():
  # n = 2000 overflows the float binomials; Python's integers and Fractions do not.
  n = 2000
  for c, k in [(1, 1000), (3, 10), (1990, 5), (40, 100), (0, 7)]:
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert estimators.pass_at_k(np.asarray(c), n, k) == pytest.approx(float(exact), abs=1e-12)


def test_pass_at_ks_keeps_shapes():
  c_g = np.asarray([[0, 1], [2, 3]])
  out = estimators.pass_at_ks(c_g, 3, [1, 2, 3])
  assert sorted(out) == [1, 2, 3] and all(v.shape == (2, 2) for v in out.values())


@pytest.mark.parametrize("k,n", [(0, 4), (5, 4), (2.0, 4)])
def test_bad_k_is_one_clear_error(k, n):
  with pytest.raises(ValueError, match=r"k=.* is not accepted; expected an integer with 1 <= k"):
    estimators.pass_at_k(np.asarray([1]), n, k)
  with pytest.raises(ValueError, match=r"k=.* is not accepted"):
    estimators.maj_at_k(np.zeros((1, n), np.int32), np.zeros((1, n)), k)


def test_bad_counts_are_refused():
  with pytest.raises(ValueError, match=r"num_correct must be integers in \[0, 4\]"):
    estimators.pass_at_k(np.asarray([5]), 4, 2)


# Vote patterns with ties in the counts: two classes of equal size, a correct class tied with
# wrong ones, all samples distinct, one answer for everything, a correct minority.
TIED_PATTERNS = [
    ([0, 0, 1, 1], [1, 1, 0, 0]),
    ([0, 0, 1, 1, 2, 2], [0, 0, 1, 1, 0, 0]),
    ([0, 1, 2, 3, 4], [1, 0, 0, 0, 0]),
    ([0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]),
    ([0, 1, 1, 2, 2, 3, 3, 3], [1, 0, 0, 0, 0, 0, 0, 0]),
    ([0, 0, 0, 1, 1, 1, 2, 2, 2], [1, 1, 1, 0, 0, 0, 0, 0, 0]),
]


@pytest.mark.parametrize("shifted_taps", [16, 0])  # both convolution paths of the programme
@pytest.mark.parametrize("ids,values", TIED_PATTERNS)
def test_maj_at_k_equals_subset_enumeration_with_ties(ids, values, shifted_taps, monkeypatch):
  monkeypatch.setattr(estimators, "_MAX_SHIFTED_TAPS", shifted_taps)
  estimators.majority_at_k.cache_clear()
  for k in range(1, len(ids) + 1):
    got = estimators.maj_at_k(np.asarray([ids]), np.asarray([values]), k)[0]
    assert got == pytest.approx(subsets_maj_at_k(ids, values, k), abs=1e-12), k
  estimators.majority_at_k.cache_clear()


def test_maj_at_k_random_groups_equal_subset_enumeration():
  rng = np.random.default_rng(0)
  for _ in range(60):
    n = int(rng.integers(1, 11))
    ids = rng.integers(0, int(rng.integers(1, n + 1)), n)
    class_values = rng.normal(size=n)  # any real value per class, not only 0/1
    values = class_values[ids]
    k = int(rng.integers(1, n + 1))
    got = estimators.maj_at_k(ids[None], values[None], k)[0]
    assert got == pytest.approx(subsets_maj_at_k(ids.tolist(), values.tolist(), k), abs=1e-12)


def test_maj_at_k_agrees_with_the_objectives_enumeration():
  rng = np.random.default_rng(1)
  ids_gn = rng.integers(0, 4, (16, 10)).astype(np.int32)
  correct_gn = ids_gn == 0
  for k in (1, 3, 5, 10):
    reference = objectives.objective_value(correct_gn.astype(np.float32),
                                           aggregator="majority_vote", k=k, answer_ids=ids_gn)
    np.testing.assert_allclose(estimators.maj_at_k(ids_gn, correct_gn, k), reference, atol=1e-6)


@pytest.mark.parametrize("sizes,k", [([30, 30, 20], 40), ([25, 25, 1, 1, 1, 1, 1], 31),
                                     ([45, 3, 2], 50), ([18, 18, 18], 27)])
def test_maj_at_k_large_n_matches_exact_count_vectors(sizes, k):
  values = [Fraction(1)] + [Fraction(0)] * (len(sizes) - 1)
  ids = np.repeat(np.arange(len(sizes)), sizes)
  got = estimators.maj_at_k(ids[None], (ids == 0)[None], k)[0]
  assert got == pytest.approx(float(count_vectors_maj_at_k(sizes, values, k)), abs=1e-12)


def test_maj_at_k_closed_forms_at_large_n():
  # All answers distinct: every subset is an n-way tie, so maj@k is the mean value.
  ids = np.arange(300)
  values = (ids % 7 == 0).astype(float)
  assert estimators.maj_at_k(ids[None], values[None], 150)[0] == pytest.approx(values.mean(),
                                                                              abs=1e-12)
  # One answer: maj@k is its value. n = 1500 overflows float binomials; the scaled programme not.
  ones = np.zeros((1, 1500), np.int32)
  assert estimators.maj_at_k(ones, np.ones((1, 1500)), 700)[0] == pytest.approx(1.0, abs=1e-12)
  # Two classes, the correct one strictly larger: maj@n is 1.
  ids = np.asarray([[0] * 101 + [1] * 99])
  assert estimators.maj_at_k(ids, ids == 0, 200)[0] == pytest.approx(1.0, abs=1e-12)


def test_maj_at_k_refuses_values_that_differ_within_a_class():
  with pytest.raises(ValueError, match="answer class 0 holds samples with different values"):
    estimators.maj_at_k(np.asarray([[0, 0, 1]]), np.asarray([[1.0, 0.0, 0.0]]), 2)


def test_mean_reward():
  np.testing.assert_allclose(estimators.mean_reward(np.asarray([[1.0, -1.0, 1.0], [0, 0, 3]])),
                             [1 / 3, 1.0])
