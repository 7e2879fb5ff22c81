"""The comparison statistics (ksjax.evaluation.statistics) against known truth.

Besides exact checks (scipy's paired t-test, published sample sizes, the textbook Holm
example), each method is run on many simulated studies whose true difference is known: the
intervals must cover it at their nominal rate, p-values must be uniform under the null, power
must be what the power function promised, and Holm must hold the family-wise error rate.
The simulations give a seed a large effect shared by both arms, so a test that ignored the
pairing (an unpaired standard error) would fail them, as would one that used the normal
quantile instead of Student's t with few seeds. Every simulation is vectorised and seeded.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from ksjax.evaluation import statistics

STUDIES = 20_000


def _paired_studies(rng: np.random.Generator, studies: int, n: int, delta: float,
                    seed_sd: float = 0.2, noise_sd: float = 0.05):
  """a, b [studies, n]: seed i's level is shared by both arms (same start, data order, luck),
  arm A is `delta` better, and each run adds its own noise. The seed effect is four times the
  noise, as when seeds matter more than the objective."""
  seed_level = 0.5 + seed_sd * rng.standard_normal((studies, n))
  a = seed_level + delta + noise_sd * rng.standard_normal((studies, n))
  b = seed_level + noise_sd * rng.standard_normal((studies, n))
  return a, b


# ---------------------------------------------------------------------------------------------
# paired
# ---------------------------------------------------------------------------------------------

def test_paired_matches_scipy_paired_t_test():
  a = [0.61, 0.55, 0.72, 0.58, 0.66]
  b = [0.52, 0.54, 0.60, 0.49, 0.61]
  result = statistics.paired(a, b, confidence=0.9)
  reference = scipy_stats.ttest_rel(a, b)
  interval = reference.confidence_interval(confidence_level=0.9)
  d = np.subtract(a, b)
  assert result.difference == pytest.approx(d.mean())
  assert result.standard_error == pytest.approx(d.std(ddof=1) / math.sqrt(5))
  assert result.t == pytest.approx(reference.statistic)
  assert result.p_value == pytest.approx(reference.pvalue)
  assert (result.ci_low, result.ci_high) == pytest.approx((interval.low, interval.high))
  assert (result.df, result.n, result.confidence) == (4, 5, 0.9)
  assert result.differences == pytest.approx(tuple(d))
  assert (result.seeds_positive, result.seeds_negative) == (5, 0)
  assert result.status == statistics.OK
  assert isinstance(result.p_value, float) and isinstance(result.seeds_positive, int)
  assert result.as_dict()["differences"] == pytest.approx(list(d))


def test_paired_over_a_batch_equals_one_comparison_at_a_time():
  rng = np.random.default_rng(0)
  a, b = _paired_studies(rng, 6, 4, delta=0.02)
  batch = statistics.paired(a, b)
  for i in range(6):
    one = statistics.paired(a[i], b[i])
    for name in ("difference", "standard_error", "t", "p_value", "ci_low", "ci_high",
                 "seeds_positive", "seeds_negative"):
      assert getattr(batch, name)[i] == pytest.approx(getattr(one, name)), name
    assert batch.status[i] == one.status
  assert batch.differences.shape == (6, 4) and batch.df == 3
  with pytest.raises(ValueError):
    batch.p_value[0] = 0.0  # read-only: a result is a record


def test_paired_with_one_seed_reports_the_difference_and_no_test():
  result = statistics.paired([0.7], [0.5])
  assert result.difference == pytest.approx(0.2)
  assert result.status == statistics.ONE_SEED and result.df == 0 and result.n == 1
  for name in ("standard_error", "t", "p_value", "ci_low", "ci_high"):
    assert math.isnan(getattr(result, name)), name


def test_paired_with_constant_differences_has_zero_spread():
  # 0.6 - 0.5 and 0.5 - 0.4 differ in the last bit; they are the same difference.
  up = statistics.paired([0.6, 0.5, 0.9], [0.5, 0.4, 0.8])
  assert up.status == statistics.CONSTANT and up.standard_error == 0.0
  assert up.t == math.inf and up.p_value == 0.0
  assert up.ci_low == up.ci_high == pytest.approx(0.1)
  down = statistics.paired([0.4, 0.3], [0.5, 0.4])
  assert down.t == -math.inf and down.p_value == 0.0 and down.seeds_negative == 2
  # A saturated metric: the same value everywhere is no evidence of any difference.
  same = statistics.paired([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
  assert (same.difference, same.t, same.p_value, same.ci_low, same.ci_high) == (0, 0, 1, 0, 0)
  assert same.status == statistics.CONSTANT
  assert (same.seeds_positive, same.seeds_negative) == (0, 0)
  # Not constant, only close: an ordinary test.
  assert statistics.paired([0.6, 0.5], [0.5, 0.41]).status == statistics.OK


@pytest.mark.parametrize("a, b, message", [
    ([0.1, 0.2], [0.1], "same shape"),
    ([], [], "at least one seed"),
    ([0.1, float("nan")], [0.1, 0.2], "finite"),
])
def test_paired_rejects_inputs_it_cannot_pair(a, b, message):
  with pytest.raises(ValueError, match=message):
    statistics.paired(a, b)
  with pytest.raises(ValueError, match="confidence"):
    statistics.paired([0.1, 0.2], [0.0, 0.1], confidence=1.0)


@pytest.mark.parametrize("n", [4, 8])
def test_paired_intervals_cover_the_true_difference(n):
  rng = np.random.default_rng(100 + n)
  delta = 0.03
  a, b = _paired_studies(rng, STUDIES, n, delta=delta)
  result = statistics.paired(a, b, confidence=0.95)
  coverage = np.mean((result.ci_low <= delta) & (delta <= result.ci_high))
  assert 0.93 <= coverage <= 0.97, f"95% intervals covered {coverage:.4f} at n={n}"


@pytest.mark.parametrize("n", [4, 8])
def test_paired_p_values_are_uniform_under_the_null(n):
  rng = np.random.default_rng(200 + n)
  a, b = _paired_studies(rng, STUDIES, n, delta=0.0)
  p = statistics.paired(a, b).p_value
  uniformity = scipy_stats.kstest(p, "uniform")
  assert uniformity.pvalue > 0.01, f"KS D={uniformity.statistic:.4f} at n={n}"
  rejected = np.mean(p < 0.05)
  assert 0.04 <= rejected <= 0.06, f"rejected {rejected:.4f} of null studies at n={n}"


# ---------------------------------------------------------------------------------------------
# Power: minimum_detectable_effect, seeds_needed, paired_power
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, sd", [(3, 1.0), (4, 0.05), (8, 0.05)])
def test_minimum_detectable_effect_is_detected_with_the_promised_power(n, sd):
  effect = statistics.minimum_detectable_effect(sd, n, power=0.8, alpha=0.05)
  assert statistics.paired_power(effect, sd, n) == pytest.approx(0.8, abs=1e-9)
  rng = np.random.default_rng(300 + n)
  # Studies at exactly that true difference, with the shared seed effect of the others.
  a, b = _paired_studies(rng, STUDIES, n, delta=effect, noise_sd=sd / math.sqrt(2))
  rejected = np.mean(statistics.paired(a, b).p_value < 0.05)
  assert abs(rejected - 0.8) <= 0.03, f"power {rejected:.4f} at the MDE {effect:.4f}, n={n}"


def test_the_normal_approximation_overstates_power_with_few_seeds():
  normal = (scipy_stats.norm.ppf(0.975) + scipy_stats.norm.ppf(0.8)) / math.sqrt(4)
  assert statistics.minimum_detectable_effect(1.0, 4) > 1.4 * normal
  assert statistics.paired_power(normal, 1.0, 4) < 0.6


def test_seeds_needed_matches_published_sample_sizes_and_inverts_the_mde():
  # One-sample/paired t-test, two-sided alpha 0.05, power 0.8 (G*Power): d = 0.5 needs 34
  # pairs (power 0.808), d = 0.8 needs 15 (0.821).
  assert statistics.seeds_needed(0.5, 1.0) == 34
  assert statistics.seeds_needed(0.8, 1.0) == 15
  assert statistics.seeds_needed(-0.04, 0.08) == 34  # the sign does not matter, only |d| / sd
  assert statistics.paired_power(0.5, 1.0, 34) == pytest.approx(0.808, abs=5e-4)
  for n in (2, 3, 5, 10, 40):
    effect = statistics.minimum_detectable_effect(0.1, n, power=0.9, alpha=0.01)
    assert statistics.seeds_needed(effect * 1.0001, 0.1, power=0.9, alpha=0.01) == n
    assert statistics.seeds_needed(effect * 0.9999, 0.1, power=0.9, alpha=0.01) == n + 1
  assert statistics.paired_power(0.0, 1.0, 10) == pytest.approx(0.05)


def test_power_functions_reject_impossible_designs():
  with pytest.raises(ValueError, match="n_seeds"):
    statistics.minimum_detectable_effect(1.0, 1)
  with pytest.raises(ValueError, match="sd_of_differences"):
    statistics.minimum_detectable_effect(0.0, 4)
  with pytest.raises(ValueError, match="power"):
    statistics.minimum_detectable_effect(1.0, 4, power=0.04)
  with pytest.raises(ValueError, match="nonzero"):
    statistics.seeds_needed(0.0, 1.0)
  with pytest.raises(ValueError, match="max_seeds"):
    statistics.seeds_needed(1e-3, 1.0, max_seeds=1000)


# ---------------------------------------------------------------------------------------------
# holm
# ---------------------------------------------------------------------------------------------

def test_holm_on_the_textbook_example():
  # Four hypotheses, alpha 0.05: sorted 0.005 <= 0.05/4 and 0.01 <= 0.05/3 are rejected,
  # 0.03 > 0.05/2 stops the procedure, so 0.04 is kept although it is below 0.05/1.
  adjusted, reject = statistics.holm([0.01, 0.04, 0.03, 0.005], alpha=0.05)
  np.testing.assert_allclose(adjusted, [0.03, 0.06, 0.06, 0.02])
  np.testing.assert_array_equal(reject, [True, False, False, True])


def test_holm_adjusted_p_values_are_monotone_capped_and_in_input_order():
  rng = np.random.default_rng(1)
  p = rng.uniform(size=(50, 7)) ** 3
  p[:, 3] = p[:, 2]  # ties
  p[0] = [0.9, 0.5, 0.6, 0.6, 0.7, 0.8, 0.95]  # would exceed 1 when multiplied
  adjusted, reject = statistics.holm(p, alpha=0.1)
  assert adjusted.shape == p.shape and np.all(adjusted >= p) and np.all(adjusted <= 1)
  assert np.all(adjusted[0] == 1.0)
  for row_p, row_adjusted, row_reject in zip(p, adjusted, reject):
    order = np.argsort(row_p, kind="stable")
    assert np.all(np.diff(row_adjusted[order]) >= 0)
    one = statistics.holm(row_p, alpha=0.1)
    np.testing.assert_array_equal(one.adjusted, row_adjusted)
    # The step-down rule itself: reject while p_(i) <= alpha / (m - i + 1).
    passes = row_p[order] <= 0.1 / np.arange(7, 0, -1)
    stop = np.argmin(passes) if not passes.all() else 7
    np.testing.assert_array_equal(row_reject[order], np.arange(7) < stop)
  assert statistics.holm([]).adjusted.shape == (0,)
  with pytest.raises(ValueError, match="no nan"):
    statistics.holm([0.01, float("nan")])


def test_holm_controls_the_family_wise_error_rate_under_the_global_null():
  rng = np.random.default_rng(2)
  # Independent tests: Holm's FWER is exactly 1 - (1 - alpha / m)^m at the global null.
  m = 5
  _, reject = statistics.holm(rng.uniform(size=(STUDIES, m)), alpha=0.05)
  fwer = np.mean(reject.any(axis=-1))
  assert 0.043 <= fwer <= 0.055, f"FWER {fwer:.4f}, exact {1 - (1 - 0.05 / m) ** m:.4f}"
  # Five correlated metrics of the same null studies (4 seeds each), tested with `paired`.
  shared = rng.standard_normal((STUDIES, 1, 4))
  a, b = _paired_studies(rng, STUDIES * m, 4, delta=0.0)
  a = a.reshape(STUDIES, m, 4) + 0.05 * shared
  b = b.reshape(STUDIES, m, 4)
  p = statistics.paired(a, b).p_value
  assert np.mean((p < 0.05).any(axis=-1)) > 0.15  # unadjusted: one in five or six families
  fwer = np.mean(statistics.holm(p, alpha=0.05).reject.any(axis=-1))
  assert fwer <= 0.055, f"FWER {fwer:.4f} over {m} correlated metrics"


def test_holm_controls_the_family_wise_error_rate_when_some_effects_are_real():
  rng = np.random.default_rng(3)
  # Three true nulls and three large real effects, which Holm rejects first; the true nulls
  # then face alpha/3, alpha/2, alpha: FWER = 1 - (1 - alpha/3)^3 = 0.0492.
  p = np.concatenate([rng.uniform(size=(STUDIES, 3)), np.full((STUDIES, 3), 1e-6)], axis=-1)
  _, reject = statistics.holm(p, alpha=0.05)
  assert reject[:, 3:].all()
  fwer = np.mean(reject[:, :3].any(axis=-1))
  assert 0.043 <= fwer <= 0.055, f"FWER {fwer:.4f}"


# ---------------------------------------------------------------------------------------------
# hierarchical_bootstrap
# ---------------------------------------------------------------------------------------------

def _two_level_studies(rng: np.random.Generator, studies: int, seeds: int, problems: int,
                       delta: float):
  """a, b [studies, seeds, problems]: each seed's level and each problem's difficulty are shared
  by both arms; the advantage of A varies by seed and, more, by problem (shared by all seeds,
  as the held-out problems are the same), plus each run's noise on each problem."""
  shape = (studies, seeds, problems)
  level = (0.2 * rng.standard_normal((studies, seeds, 1))
           + 0.3 * rng.standard_normal((studies, 1, problems)))
  advantage = (delta + 0.03 * rng.standard_normal((studies, seeds, 1))
               + 0.06 * rng.standard_normal((studies, 1, problems)))
  a = level + advantage + 0.05 * rng.standard_normal(shape)
  b = level + 0.05 * rng.standard_normal(shape)
  return a, b


def _bootstrap_many(a, b, num_resamples, rng):
  return [statistics.hierarchical_bootstrap(a[i], b[i], num_resamples=num_resamples, rng=rng)
          for i in range(len(a))]


def test_hierarchical_bootstrap_interval_covers_the_true_difference():
  rng = np.random.default_rng(4)
  delta = 0.02
  a, b = _two_level_studies(rng, 1000, seeds=10, problems=40, delta=delta)
  results = _bootstrap_many(a, b, 400, rng)
  coverage = np.mean([r.ci_low <= delta <= r.ci_high for r in results])
  assert 0.90 <= coverage <= 0.98, f"95% bootstrap intervals covered {coverage:.3f}"


def test_hierarchical_bootstrap_p_value_under_the_null_and_an_effect():
  rng = np.random.default_rng(5)
  a, b = _two_level_studies(rng, 1000, seeds=10, problems=40, delta=0.0)
  results = _bootstrap_many(a, b, 400, rng)
  p = np.array([r.p_value for r in results])
  excludes_zero = np.array([not r.ci_low <= 0 <= r.ci_high for r in results])
  assert 0.02 <= np.mean(p < 0.05) <= 0.10, f"rejected {np.mean(p < 0.05):.3f} at the null"
  # The p-value is the interval inverted: p < 0.05 exactly when the 95% interval excludes 0,
  # but for resamples within the (count + 1) / (B + 1) correction of the boundary.
  assert np.mean((p < 0.05) == excludes_zero) >= 0.98
  a, b = _two_level_studies(rng, 1, seeds=10, problems=40, delta=0.15)
  strong = statistics.hierarchical_bootstrap(a[0], b[0], num_resamples=400, rng=rng)
  assert strong.p_value == pytest.approx(2 / 401) and strong.ci_low > 0


@pytest.mark.parametrize("structure", ["seeds", "problems", "both"])
def test_hierarchical_bootstrap_resamples_seeds_and_shared_problems(structure):
  # The bootstrap variance of the mean is known exactly for additive differences: a seed
  # effect u_s contributes var(u)/S, a problem effect v_p shared by every seed var(v)/P
  # (population variances), and the two draws are independent. Drawing problems anew for each
  # seed would shrink the problem part S times.
  rng = np.random.default_rng(6)
  seeds, problems = 6, 25
  u = rng.standard_normal((seeds, 1)) if structure != "problems" else np.zeros((seeds, 1))
  v = rng.standard_normal((1, problems)) if structure != "seeds" else np.zeros((1, problems))
  d = u + v + 0.1
  result = statistics.hierarchical_bootstrap(d, np.zeros_like(d), num_resamples=20_000,
                                             rng=7)
  expected = u.var() / seeds + v.var() / problems
  assert result.standard_error ** 2 == pytest.approx(expected, rel=0.05)
  assert result.difference == pytest.approx(d.mean())
  assert (result.num_seeds, result.num_problems, result.num_resamples) == (6, 25, 20_000)


def test_hierarchical_bootstrap_is_reproducible_and_takes_a_generator():
  rng = np.random.default_rng(8)
  a, b = _two_level_studies(rng, 1, seeds=5, problems=12, delta=0.01)
  first = statistics.hierarchical_bootstrap(a[0], b[0], num_resamples=500, rng=3)
  again = statistics.hierarchical_bootstrap(a[0], b[0], num_resamples=500,
                                            rng=np.random.default_rng(3))
  other = statistics.hierarchical_bootstrap(a[0], b[0], num_resamples=500, rng=4)
  assert first == again and first != other
  assert first.as_dict()["p_value"] == first.p_value


def test_hierarchical_bootstrap_degenerate_and_bad_inputs():
  zero = statistics.hierarchical_bootstrap(np.ones((3, 4)), np.ones((3, 4)), num_resamples=50)
  assert (zero.difference, zero.ci_low, zero.ci_high, zero.p_value) == (0, 0, 0, 1)
  one_seed = statistics.hierarchical_bootstrap(np.ones((1, 4)), np.zeros((1, 4)))
  assert one_seed.status == statistics.ONE_SEED and one_seed.difference == 1
  assert math.isnan(one_seed.p_value) and math.isnan(one_seed.ci_low)
  with pytest.raises(ValueError, match="same shape"):
    statistics.hierarchical_bootstrap(np.ones((3, 4)), np.ones((4, 3)))
  with pytest.raises(ValueError, match="same shape"):
    statistics.hierarchical_bootstrap(np.ones(4), np.ones(4))
  with pytest.raises(ValueError, match="finite"):
    statistics.hierarchical_bootstrap(np.full((2, 2), np.nan), np.ones((2, 2)))
  with pytest.raises(ValueError, match="num_resamples"):
    statistics.hierarchical_bootstrap(np.ones((2, 2)), np.ones((2, 2)), num_resamples=0)
