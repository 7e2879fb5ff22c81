"""Unbiased pass@k and maj@k from n samples per problem, and the mean reward (numpy, scipy).

Evaluation draws n >= k completions per problem and reports what k completions would achieve,
averaged over every k-subset of the n (an unbiased U-statistic, with far less variance than
drawing k once).

pass@k (Chen et al. 2021): with c of n samples correct, 1 - C(n-c, k) / C(n, k). The binomials
overflow float64 near n = 1030, so it is taken in Chen et al.'s product form
1 - prod_{i = n-c+1..n} (1 - k / i), which is 1 when n - c < k.

maj@k: the reward of the answer most of the k samples give, ties broken uniformly at random, in
expectation: on a subset where t answer classes tie for the most votes, the mean of their rewards.
Averaged over the C(n, k) subsets without listing them: a k-subset is fixed by how many members
x_j it takes from each answer class j (of c_j members), and C(c_1, x_1) ... C(c_m, x_m) subsets
share those counts. Splitting by the winning vote count v, the subsets whose plurality is v are
those where every class takes x_j <= v and at least one takes x_j = v; a dynamic programme over
the classes with c_j >= v (at most n / v of them; the smaller ones cannot reach v and together
contribute one binomial) counts them by total size s and number t of classes at v, and carries
the sum of the tied classes' rewards alongside. Every class is visited once per v <= c_j, so a
problem costs sum_j min(c_j, k) transitions of a [k+1, t] table, with no enumeration.

Scaling. The counts reach C(200, 100) ~ 1e59 and overflow float64 for n above ~1000, so each
class's coefficients C(c_j, x) are multiplied by p^x (1-p)^(c_j - x) with p = k / n, which makes
them binomial probabilities, and the total is divided by the same factor for the whole group,
Binom(n, p) at k (about 1 / sqrt(n)). Every intermediate is then a probability in [0, 1] and the
terms that matter (totals near k = n p) are not small.

`ksjax.objectives.objective_value(aggregator="majority_vote")` computes the same maj@k by
enumerating subsets, which is exact but limited to C(n, k) <= MAX_SUBSETS; evaluation needs
n = 200 and k = 100.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np


# Convolutions with up to this many taps run as shifted adds, longer ones by FFT.
_MAX_SHIFTED_TAPS = 16


def _check_k(k: int, n: int) -> int:
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= n:
    raise ValueError(f"k={k!r} is not accepted; expected an integer with 1 <= k <= n={n} "
                     "(the samples per problem)")
  return int(k)


def pass_at_k(num_correct: np.ndarray, num_samples: int, k: int) -> np.ndarray:
  """Unbiased pass@k per problem, float64 with the shape of `num_correct`.

  Args:
    num_correct: int [...], c, the correct samples of each problem, 0 <= c <= n.
    num_samples: n, the samples per problem.
    k: 1 <= k <= n.
  """
  n = int(num_samples)
  k = _check_k(k, n)
  c = np.asarray(num_correct)
  if not np.issubdtype(c.dtype, np.integer) or np.any((c < 0) | (c > n)):
    raise ValueError(f"num_correct must be integers in [0, {n}]; got {c!r}")
  # survive[j] = prod_{i = n-j+1..n} (1 - k / i): the chance that k draws miss j correct samples.
  # Factors with i <= k (zero or negative) are never used: they belong to n - c < k, where
  # pass@k is 1.
  i = np.arange(n, 0, -1, dtype=np.float64)  # n, n-1, ..., 1
  survive = np.concatenate([[1.0], np.cumprod(1.0 - k / i)])  # [n + 1], index j = c
  return np.where(n - c < k, 1.0, 1.0 - survive[c])


def pass_at_ks(num_correct: np.ndarray, num_samples: int,
               ks: Sequence[int]) -> dict[int, np.ndarray]:
  """pass@k per problem for each k."""
  return {int(k): pass_at_k(num_correct, num_samples, k) for k in ks}


def mean_reward(rewards_gn: np.ndarray) -> np.ndarray:
  """Mean reward of each problem's samples, float64 [G]."""
  return np.asarray(rewards_gn, np.float64).mean(axis=-1)


def answer_class_profile(answer_ids_n: np.ndarray,
                         values_n: np.ndarray) -> tuple[tuple[int, float], ...]:
  """The (size, value) of each answer class of one problem's n samples, sorted.

  Raises ValueError if samples of one class have different values: the vote's outcome would not
  be defined by the winning answer alone (`ksjax.tasks.base.GroupScore` guarantees it is).
  """
  ids_n = np.asarray(answer_ids_n)
  values_n = np.asarray(values_n, np.float64)
  classes, inverse, counts = np.unique(ids_n, return_inverse=True, return_counts=True)
  low = np.full(len(classes), np.inf)
  high = np.full(len(classes), -np.inf)
  np.minimum.at(low, inverse, values_n)
  np.maximum.at(high, inverse, values_n)
  if np.any(low != high):
    bad = classes[np.argmax(low != high)]
    raise ValueError(f"answer class {bad} holds samples with different values "
                     f"({low[classes == bad][0]} and {high[classes == bad][0]}); expected one "
                     "value per answer class")
  return tuple(sorted(zip(counts.tolist(), low.tolist())))


@functools.lru_cache(maxsize=4096)
def majority_at_k(profile: tuple[tuple[int, float], ...], k: int) -> float:
  """maj@k of one problem from its answer classes' (size, value): the average over every
  k-subset of its n = sum(sizes) samples of the mean value of the subset's plurality classes.

  Cached: problems with the same profile (e.g. all n samples giving one answer) are common.
  """
  # Imported here: scipy.stats and scipy.signal take about 1.5 s to import, and every binary
  # imports this module (through ksjax.run.scoring) while only maj@k reads them.
  from scipy import signal, stats  # pylint: disable=g-import-not-at-top
  sizes = np.asarray([c for c, _ in profile], np.int64)
  values = np.asarray([r for _, r in profile], np.float64)
  n = int(sizes.sum())
  k = _check_k(k, n)
  p = k / n
  # pmf[c][x] = C(c, x) p^x (1 - p)^(c - x): the scaled count of ways a class of c takes x.
  pmf = {c: stats.binom.pmf(np.arange(min(c, k) + 1), c, p) for c in set(sizes.tolist())}
  total = 0.0
  for v in range(1, min(k, int(sizes.max())) + 1):  # v: the plurality's vote count
    big = np.flatnonzero(sizes >= v)
    small_samples = int(sizes[sizes < v].sum())
    # count_st[s, t]: the scaled number of ways the big classes take s samples in all, each at
    # most v, t of them exactly v. value_st[s, t]: the same ways weighted by the sum of the
    # values of those t classes. Both are carried side by side as table_sxt[:, 0] and [:, 1].
    max_ties = min(len(big), k // v)  # t classes at v need t * v <= k samples
    table_sxt = np.zeros((k + 1, 2, max_ties + 1))
    table_sxt[0, 0, 0] = 1.0
    for j in big:
      weights_x = pmf[int(sizes[j])]  # x = 0..v
      # x < v: a convolution over s with v taps (shifted adds for a few, else an FFT, whose
      # rounding, ~1e-16 of the table's largest entry <= 1, is far below what evaluation reads).
      if v <= _MAX_SHIFTED_TAPS:
        new_sxt = weights_x[0] * table_sxt
        for x in range(1, v):
          new_sxt[x:] += weights_x[x] * table_sxt[:k + 1 - x]
      else:
        new_sxt = signal.fftconvolve(table_sxt, weights_x[:v, None, None], axes=0)[:k + 1]
      # x = v: s grows by v and t by 1; the class's value joins the tied sum.
      tied_sxt = weights_x[v] * table_sxt[:k + 1 - v, :, :-1]
      new_sxt[v:, 0, 1:] += tied_sxt[:, 0]
      new_sxt[v:, 1, 1:] += tied_sxt[:, 1] + values[j] * tied_sxt[:, 0]
      table_sxt = new_sxt
    # The small classes supply the other k - s samples, in any way: Binom(small_samples, p).
    small_s = stats.binom.pmf(k - np.arange(k + 1), small_samples, p)  # [k + 1]
    ties_t = np.arange(1, max_ties + 1)
    total += float(small_s @ (table_sxt[:, 1, 1:] / ties_t).sum(axis=1))
  return total / float(stats.binom.pmf(k, n, p))


def maj_at_k(answer_ids_gn: np.ndarray, values_gn: np.ndarray, k: int) -> np.ndarray:
  """Unbiased maj@k per problem, float64 [G].

  Args:
    answer_ids_gn: int [G, n], answer classes within each problem (`GroupScore.answer_ids`).
    values_gn: [G, n], each sample's outcome, constant within a class: `correct` (bool) for the
      chance that the majority answer is right, or the rewards for the majority's reward.
    k: 1 <= k <= n.
  """
  ids_gn = np.asarray(answer_ids_gn)
  values_gn = np.asarray(values_gn, np.float64)
  if ids_gn.ndim != 2 or ids_gn.shape != values_gn.shape:
    raise ValueError(f"answer_ids {ids_gn.shape} and values {values_gn.shape} must both be [G, n]")
  k = _check_k(k, ids_gn.shape[1])
  return np.asarray([majority_at_k(answer_class_profile(ids, vals), k)
                     for ids, vals in zip(ids_gn, values_gn)], np.float64)
