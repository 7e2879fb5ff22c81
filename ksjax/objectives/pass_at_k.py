"""The pass@k aggregator, f = max of the k rewards: every estimator in closed form after one sort.

Sort each group ascending, r_(1) <= ... <= r_(n), and let q be sample i's position. Counting the
m-subsets by the position of their largest member gives the subset averages of
`ksjax.objectives.advantages`:

  C(n-1, m-1) phi_m(i) = C(q-1, m-1) r_(q) + sum_{j>q} C(j-2, m-2) r_(j)
  C(n-1, m)   psi_m(i) = sum_{j<q} C(j-1, m-1) r_(j) + sum_{j>q} C(j-2, m-1) r_(j)

(the first term: subsets whose other members all sit below q have maximum r_(q)). Every estimator is
therefore `own_q r_(q) + sum_{j<q} below_j r_(j) + sum_{j>q} above_j r_(j)`: one sort and two
cumulative sums per group, O(n log n), no subset is ever enumerated. With m = k, (k/n) phi_k is
PKPO's weight s_(i) and (k/n)(phi_k - psi_{k-1}) is PKPO's averaged leave-one-out
[C(q-1, k-1) r_(q) - sum_{j<q} C(j-1, k-2) r_(j)] / C(n, k) (Walder & Karkhanis 2025).

Ties: the maximum of a set does not depend on how its tied members are ordered, so the counting
above is exact for any order among equal rewards, and a stable sort suffices. With n = k and a
tied maximum, loo gives r_(n) - r_(n-1) = 0 exactly: those two coefficients are exactly 1 and the
others exactly 0.

Binomial coefficients overflow float32 from n = 35 on (C(100, 50) ~ 1e29) and lose digits in log
space, while the ratios used here are all below n. n and k are static shapes, so the ratios are
formed once in exact rational arithmetic and rounded once to float64; jitted code sees constants.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np

from ksjax.objectives import exclusive_sums

# (own [n], below [n], above [n]) coefficients over sorted positions, float64.
_Coefficients = tuple[np.ndarray, np.ndarray, np.ndarray]


def _comb(a: int, b: int) -> int:
  """C(a, b), 0 outside 0 <= b <= a (so sums over positions need no bounds)."""
  return math.comb(a, b) if 0 <= b <= a else 0


def _to_float64(values: list[Fraction | int]) -> np.ndarray:
  array = np.array([float(v) for v in values], dtype=np.float64)  # float() rounds exactly once.
  array.flags.writeable = False
  return array


# Exact (own, below, above) coefficient lists over sorted positions, before rounding.
_Exact = tuple[list[Fraction], list[Fraction], list[Fraction]]


def _none_exact(n: int, k: int) -> _Exact:
  """(k/n) phi_k: [C(q-1, k-1) r_(q) + sum_{j>q} C(j-2, k-2) r_(j)] / C(n, k)."""
  total = math.comb(n, k)
  positions = range(1, n + 1)
  own = [Fraction(_comb(q - 1, k - 1), total) for q in positions]
  above = [Fraction(_comb(j - 2, k - 2), total) for j in positions]
  return own, [Fraction(0)] * n, above


def _loo_exact(n: int, k: int) -> _Exact:
  """(k/n)(phi_k - psi_{k-1}): [C(q-1, k-1) r_(q) - sum_{j<q} C(j-1, k-2) r_(j)] / C(n, k)."""
  total = math.comb(n, k)
  positions = range(1, n + 1)
  own = [Fraction(_comb(q - 1, k - 1), total) for q in positions]
  below = [Fraction(-_comb(j - 1, k - 2), total) for j in positions]
  return own, below, [Fraction(0)] * n


def _leave_p_out_exact(n: int, m: int, factor: Fraction = Fraction(1)) -> _Exact:
  """factor (m/n)(phi_m - psi_m), m < n, using (m/n) / C(n-1, m) = m / ((n-m) C(n, m))."""
  total = math.comb(n, m)
  ratio = Fraction(m, n - m)
  positions = range(1, n + 1)
  own = [factor * Fraction(_comb(q - 1, m - 1), total) for q in positions]
  below = [-factor * ratio * Fraction(_comb(j - 1, m - 1), total) for j in positions]
  above = [factor * (_comb(j - 2, m - 2) - ratio * _comb(j - 2, m - 1)) / total
           for j in positions]
  return own, below, above


# The per-k estimators a mixture over k may combine (`ksjax.objectives.mixture`): "leave_out" is
# (k/n)(phi_k - psi_k), the leave-p-out form with m = k.
_EXACT = {"none": _none_exact, "loo": _loo_exact, "leave_out": _leave_p_out_exact}


def _rounded(exact: _Exact) -> _Coefficients:
  return tuple(_to_float64(values) for values in exact)


@functools.lru_cache(maxsize=256)
def _none_coefficients(n: int, k: int) -> _Coefficients:
  return _rounded(_none_exact(n, k))


@functools.lru_cache(maxsize=256)
def _loo_coefficients(n: int, k: int) -> _Coefficients:
  return _rounded(_loo_exact(n, k))


@functools.lru_cache(maxsize=256)
def _leave_p_out_coefficients(n: int, m: int, factor: Fraction = Fraction(1)) -> _Coefficients:
  """`factor` is applied in exact arithmetic, before the single rounding to float64."""
  return _rounded(_leave_p_out_exact(n, m, factor))


@functools.lru_cache(maxsize=256)
def _mixture_coefficients(n: int, terms: tuple[tuple[int, Fraction, str], ...]) -> _Coefficients:
  """sum over terms (k, w_k, estimator) of w_k times that estimator's coefficients at k: the sum
  is formed exactly and rounded once, so a mixture costs one sort like a single k."""
  own, below, above = ([Fraction(0)] * n for _ in range(3))
  for k, weight, estimator in terms:
    term = _EXACT[estimator](n, k)
    own = [a + weight * b for a, b in zip(own, term[0])]
    below = [a + weight * b for a, b in zip(below, term[1])]
    above = [a + weight * b for a, b in zip(above, term[2])]
  return _rounded((own, below, above))


@functools.lru_cache(maxsize=256)
def _objective_coefficients(n: int, k: int) -> np.ndarray:
  """U-statistic of E[max of k]: sum_{j>=k} C(j-1, k-1) r_(j) / C(n, k)."""
  total = math.comb(n, k)
  return _to_float64([Fraction(_comb(j - 1, k - 1), total) for j in range(1, n + 1)])


def _apply(rewards_gn: jax.Array, coefficients: _Coefficients) -> jax.Array:
  """own_q r_(q) + sum_{j<q} below_j r_(j) + sum_{j>q} above_j r_(j), back in sample order."""
  return _apply_jit(rewards_gn, *(jnp.asarray(c, rewards_gn.dtype) for c in coefficients))


# Jitted with the coefficients as arguments: one compilation per shape serves every k, p and
# baseline, also when called eagerly.
@jax.jit
def _apply_jit(rewards_gn, own_n, below_n, above_n):
  order_gn = jnp.argsort(rewards_gn, axis=-1, stable=True)
  sorted_gn = jnp.take_along_axis(rewards_gn, order_gn, axis=-1)
  weights_sorted_gn = (own_n * sorted_gn + exclusive_sums.before(below_n * sorted_gn)
                       + exclusive_sums.after(above_n * sorted_gn))
  return jnp.put_along_axis(
      jnp.zeros_like(rewards_gn), order_gn, weights_sorted_gn, axis=-1, inplace=False)


def none(rewards_gn: jax.Array, k: int) -> jax.Array:
  """REINFORCE weights averaged over k-subsets (PKPO's s_(i)), [G, n]."""
  return _apply(rewards_gn, _none_coefficients(rewards_gn.shape[-1], k))


def loo(rewards_gn: jax.Array, k: int) -> jax.Array:
  """Leave-one-out weights averaged over k-subsets (Tang's LOO when n = k), [G, n]."""
  return _apply(rewards_gn, _loo_coefficients(rewards_gn.shape[-1], k))


def leave_p_out(rewards_gn: jax.Array, m: int) -> jax.Array:
  """Leave-p-out weights for the (m = k - p)-sample target, [G, n]."""
  return _apply(rewards_gn, _leave_p_out_coefficients(rewards_gn.shape[-1], m))


def mixture(rewards_gn: jax.Array, terms: tuple[tuple[int, Fraction, str], ...]) -> jax.Array:
  """sum_k w_k (the k-th term's estimator: "none", "loo" or "leave_out"), [G, n]; `terms` is a
  tuple of (k, w_k as a Fraction, estimator)."""
  return _apply(rewards_gn, _mixture_coefficients(rewards_gn.shape[-1], terms))


def centred(rewards_gn: jax.Array, k: int) -> jax.Array:
  """phi_k(i) - mean of f over all k-subsets, k < n, [G, n]: ((n-k)/k) times leave_p_out(m=k).

  The mean over all k-subsets is (k/n) phi_k(i) + (1 - k/n) psi_k(i), so the difference is
  (1 - k/n)(phi_k - psi_k) = ((n-k)/k) (k/n)(phi_k - psi_k): the leave-p-out coefficients with
  m = k, scaled exactly. Chen et al.'s normalised pass@k numerator (`normalized.py`).
  """
  n = rewards_gn.shape[-1]
  return _apply(rewards_gn, _leave_p_out_coefficients(n, k, Fraction(n - k, k)))


def subset_std(rewards_gn: jax.Array, k: int) -> jax.Array:
  """Standard deviation of max over the C(n, k) k-subsets (population: over all of them), [G, 1].

  A k-subset's maximum is r_(j) for C(j-1, k-1) of them, so with c_j = C(j-1, k-1)/C(n, k) the
  mean is sum_j c_j r_(j) and the variance sum_j c_j (r_(j) - mean)^2: centred before squaring,
  so a group whose top n-k+1 rewards are equal (every subset has the same maximum) gets exactly
  0 once the rewards are measured from the group maximum.
  """
  weights_n = jnp.asarray(_objective_coefficients(rewards_gn.shape[-1], k), rewards_gn.dtype)
  return _sorted_std(rewards_gn, weights_n)


@jax.jit
def _sorted_std(rewards_gn, weights_n):
  sorted_gn = jnp.sort(rewards_gn, axis=-1)
  mean_g1 = jnp.sum(sorted_gn * weights_n, axis=-1, keepdims=True)
  return jnp.sqrt(jnp.sum(weights_n * jnp.square(sorted_gn - mean_g1), axis=-1, keepdims=True))


def objective(rewards_gn: jax.Array, k: int) -> jax.Array:
  """Unbiased estimate of E[max of k rewards] from the n samples of each group, [G]."""
  weights_n = jnp.asarray(_objective_coefficients(rewards_gn.shape[-1], k), rewards_gn.dtype)
  return _sorted_dot(rewards_gn, weights_n)


@jax.jit
def _sorted_dot(rewards_gn, weights_n):
  return jnp.sum(jnp.sort(rewards_gn, axis=-1) * weights_n, axis=-1)
