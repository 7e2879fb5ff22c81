"""The statistics for comparing two training objectives: paired tests, a two-level bootstrap,
power, and a multiple-comparison correction.

A study trains arm A (say pass@k training) and arm B (say mean training) with the same seeds,
evaluates every final checkpoint on the same held-out problems, and asks whether A beats B on
a metric. The studies in experiments/ and the analysis notebook (experiments/analysis.ipynb)
answer that with these functions, all plain numpy/scipy:
  * paired: the paired t-test over seeds. Runs with the same seed share the start, the data
    order and much of their luck, so the per-seed difference a[i] - b[i] is far less noisy than
    either arm; an unpaired standard error includes the seed-to-seed spread that the difference
    cancels, and hides real differences. Gives the difference, its standard error, t, df, the two-sided p-value, the
    t-interval and how many seeds favour A.
  * hierarchical_bootstrap: the same question from per-seed x per-problem values (e.g. each
    held-out problem's unbiased pass@4), resampling seeds and problems, so that the interval
    also counts which problems happened to be held out.
  * minimum_detectable_effect, seeds_needed, paired_power: the paired t-test's power from the
    noncentral t, to plan a study before running it (how many seeds, or what difference the
    seeds we can afford would detect) and to say what a null result rules out.
  * holm: the Holm-Bonferroni step-down adjustment for when a study tests several metrics or
    several pairs of arms and reports any of them as a finding.

`paired` and `holm` work along the last axis and accept leading batch axes (several metrics,
or many simulated studies at once); one study's 1-D input gives plain Python numbers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np
from scipy import optimize
from scipy import stats

# `PairedComparison.status` values.
OK = "ok"
ONE_SEED = "one_seed"  # n < 2: no spread to estimate, so no test (nan p-value and interval).
CONSTANT = "constant_differences"  # every seed's difference equal: zero spread (see `paired`).

# Differences that agree to a few ulps of the values they were computed from are equal: pass@k
# estimates like 0.6 - 0.5 and 0.5 - 0.4 must count as the same difference.
_CONSTANT_ULPS = 8


@dataclasses.dataclass(frozen=True, eq=False)
class PairedComparison:
  """A paired t-test of arm A against arm B over seeds (see `paired`).

  For 1-D input every field is a Python number (str for status, a tuple for differences); for
  input with leading batch axes each is an array of the batch shape (differences keeps the seed
  axis last).

  Attributes:
    difference: mean over seeds of a - b.
    standard_error: sd(a - b, ddof=1) / sqrt(n).
    t: difference / standard_error; +-inf for constant nonzero differences, 0 for all-zero.
    df: n - 1.
    p_value: two-sided, from Student's t with df degrees of freedom.
    ci_low, ci_high: the `confidence` t-interval for the mean difference.
    confidence: the interval's level.
    n: the number of seeds (pairs).
    differences: a[i] - b[i] per seed, in the input order.
    seeds_positive: on how many seeds a > b.
    seeds_negative: on how many seeds a < b.
    status: OK, ONE_SEED (no test) or CONSTANT (zero spread; see `paired`).
  """
  difference: Any
  standard_error: Any
  t: Any
  df: int
  p_value: Any
  ci_low: Any
  ci_high: Any
  confidence: float
  n: int
  differences: Any
  seeds_positive: Any
  seeds_negative: Any
  status: Any

  def as_dict(self) -> dict[str, Any]:
    """JSON-ready fields (arrays as nested lists; inf and nan stay floats)."""
    return {f.name: _json_ready(getattr(self, f.name)) for f in dataclasses.fields(self)}


def paired(a, b, confidence: float = 0.95) -> PairedComparison:
  """The paired t-test of a against b, where a[..., i] and b[..., i] come from the same seed.

  Args:
    a, b: one value per seed on the last axis (same shape; no broadcasting, so a mispaired
      call fails instead of silently comparing the wrong runs), finite. Leading axes are
      independent comparisons.
    confidence: the level of the interval, in (0, 1).

  Returns:
    A PairedComparison. Two degenerate cases have fixed answers instead of nan or a crash:
      * one seed (n = 1): the difference is that seed's, and there is no test: standard_error,
        t, p_value and the interval are nan, df = 0, status ONE_SEED.
      * constant differences (every seed's a - b equal, up to rounding, e.g. a saturated
        pass@100 that is 1.0 in both arms): the spread is zero, so standard_error = 0 and the
        interval is the single point. If the difference is 0, t = 0 and p = 1 (no evidence of
        any difference); otherwise t = +-inf and p = 0, the t-test's limit as the spread goes
        to zero. That limit rests on a zero variance estimated from few seeds, so status is
        CONSTANT: report such a result as "A beat B by the same amount on every seed", not by
        its p-value.

  Raises:
    ValueError: on mismatched shapes, no seeds, non-finite values, or a confidence outside
      (0, 1).
  """
  a = np.asarray(a, dtype=float)
  b = np.asarray(b, dtype=float)
  if a.shape != b.shape:
    raise ValueError(f"paired: a and b must have the same shape (seed i at index i in both); "
                     f"got {a.shape} and {b.shape}")
  if a.ndim == 0 or a.shape[-1] == 0:
    raise ValueError(f"paired: need at least one seed on the last axis; got shape {a.shape}")
  if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
    raise ValueError("paired: a and b must be finite; drop a failed seed from both arms")
  if not 0 < confidence < 1:
    raise ValueError(f"paired: confidence must be in (0, 1); got {confidence}")

  n = a.shape[-1]
  d = a - b
  difference = d.mean(axis=-1)
  positive = np.sum(d > 0, axis=-1)
  negative = np.sum(d < 0, axis=-1)
  batch = difference.shape
  if n < 2:
    nan = np.full(batch, np.nan)
    return _result(batch, difference=difference, standard_error=nan, t=nan, df=0, p_value=nan,
                   ci_low=nan, ci_high=nan, confidence=confidence, n=n, differences=d,
                   seeds_positive=positive, seeds_negative=negative,
                   status=np.full(batch, ONE_SEED))

  df = n - 1
  scale = np.maximum(np.abs(a).max(axis=-1), np.abs(b).max(axis=-1))
  tolerance = _CONSTANT_ULPS * np.finfo(float).eps * np.maximum(scale, np.finfo(float).tiny)
  constant = np.ptp(d, axis=-1) <= tolerance
  zero = constant & (np.abs(difference) <= tolerance)
  standard_error = np.where(constant, 0.0, d.std(axis=-1, ddof=1) / np.sqrt(n))
  with np.errstate(divide="ignore", invalid="ignore"):
    t = np.where(constant, np.sign(difference) * np.inf, difference / standard_error)
  t = np.where(zero, 0.0, t)
  difference = np.where(zero, 0.0, difference)
  p_value = np.minimum(1.0, 2.0 * stats.t.sf(np.abs(t), df))
  half_width = stats.t.ppf(0.5 + confidence / 2, df) * standard_error
  status = np.where(constant, CONSTANT, OK)
  return _result(batch, difference=difference, standard_error=standard_error, t=t, df=df,
                 p_value=p_value, ci_low=difference - half_width,
                 ci_high=difference + half_width, confidence=confidence, n=n, differences=d,
                 seeds_positive=positive, seeds_negative=negative, status=status)


def _result(batch: tuple[int, ...], **fields) -> PairedComparison:
  """Plain Python numbers for one comparison; read-only arrays for a batch."""
  if batch:
    for value in fields.values():
      if isinstance(value, np.ndarray):
        value.flags.writeable = False
    return PairedComparison(**fields)
  fields["differences"] = tuple(float(x) for x in fields["differences"])
  for name in ("difference", "standard_error", "t", "p_value", "ci_low", "ci_high"):
    fields[name] = float(fields[name])
  for name in ("seeds_positive", "seeds_negative"):
    fields[name] = int(fields[name])
  fields["status"] = str(fields["status"])
  return PairedComparison(**fields)


@dataclasses.dataclass(frozen=True)
class BootstrapComparison:
  """A two-level bootstrap comparison of arm A against arm B (see `hierarchical_bootstrap`).

  Attributes:
    difference: the mean over seeds and problems of a - b (the point estimate).
    ci_low, ci_high: the percentile interval of the resampled mean differences.
    confidence: the interval's level.
    p_value: two-sided: twice the share of resamples on the far side of 0 from the estimate,
      (count + 1) / (num_resamples + 1) so that it is never 0 (the smallest is
      2 / (num_resamples + 1)); capped at 1. nan with one seed.
    standard_error: the standard deviation of the resampled mean differences.
    num_seeds, num_problems, num_resamples: the sizes it was computed from.
    status: OK, or ONE_SEED (no seed-to-seed spread to resample: no interval, nan p).
  """
  difference: float
  ci_low: float
  ci_high: float
  confidence: float
  p_value: float
  standard_error: float
  num_seeds: int
  num_problems: int
  num_resamples: int
  status: str

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


# Elements of the [resamples, problems] block held at once (a few tens of MB of float64).
_BOOTSTRAP_BLOCK = 1 << 22


def hierarchical_bootstrap(a, b, *, num_resamples: int = 10_000, confidence: float = 0.95,
                           rng: np.random.Generator | int = 0) -> BootstrapComparison:
  """The mean difference of a over b on per-seed x per-problem values, with a two-level
  bootstrap interval and p-value.

  a[s, p] and b[s, p] are the values (e.g. unbiased pass@4) of seed s's checkpoints on
  held-out problem p: paired by seed (shared start, data order and luck) and by problem (the
  same problems for both arms). The analysis works on the differences d = a - b, which removes
  each seed's and each problem's shared level. What is left varies by seed (some seeds favour
  A more) and by problem (some problems gain more from A); both are samples, so the interval
  must count both. Each resample draws S seeds with replacement and P problems with
  replacement and averages d over that S x P grid. The problem draw is one per resample,
  shared by its seeds, because the held-out problems are the same for every seed: a problem
  that favours A does so in every seed's row, and drawing problems anew for each seed would
  average that shared problem effect away and give too narrow an interval. (The cost of the
  crossed resample is a slightly wide interval when seed x problem interaction dominates.)

  The percentile interval is known to under-cover with few seeds (its spread is a ddof=0
  variance and its tails are normal-like, not Student's): with fewer than about ten seeds,
  make `paired` on the per-seed means the headline test and use this for how much the choice
  of held-out problems adds.

  Args:
    a, b: arrays [num_seeds, num_problems] of the same shape, finite.
    num_resamples: bootstrap resamples.
    confidence: the level of the percentile interval, in (0, 1).
    rng: a numpy Generator, or a seed for one; the default 0 makes a study's numbers
      reproducible.

  Returns:
    A BootstrapComparison.

  Raises:
    ValueError: on shapes that are not the same 2-D shape, no problems, non-finite values, a
      confidence outside (0, 1) or num_resamples < 1.
  """
  a = np.asarray(a, dtype=float)
  b = np.asarray(b, dtype=float)
  if a.shape != b.shape or a.ndim != 2:
    raise ValueError(f"hierarchical_bootstrap: a and b must both be [num_seeds, num_problems] "
                     f"of the same shape; got {a.shape} and {b.shape}")
  num_seeds, num_problems = a.shape
  if num_seeds == 0 or num_problems == 0:
    raise ValueError(f"hierarchical_bootstrap: need at least one seed and one problem; got "
                     f"shape {a.shape}")
  if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
    raise ValueError("hierarchical_bootstrap: a and b must be finite")
  if not 0 < confidence < 1:
    raise ValueError(f"hierarchical_bootstrap: confidence must be in (0, 1); got {confidence}")
  if num_resamples < 1:
    raise ValueError(f"hierarchical_bootstrap: num_resamples must be >= 1; got "
                     f"{num_resamples}")
  d = a - b
  estimate = float(d.mean())
  if num_seeds < 2:
    return BootstrapComparison(difference=estimate, ci_low=np.nan, ci_high=np.nan,
                               confidence=confidence, p_value=np.nan, standard_error=np.nan,
                               num_seeds=num_seeds, num_problems=num_problems,
                               num_resamples=num_resamples, status=ONE_SEED)

  generator = np.random.default_rng(rng)
  # A resample with replacement is its multinomial counts: the resample's mean over its S x P
  # grid is counts_seeds @ d @ counts_problems / (S P), with no [resamples, S, P] array.
  seed_counts = generator.multinomial(num_seeds, np.full(num_seeds, 1 / num_seeds),
                                      size=num_resamples).astype(float)
  problem_counts = generator.multinomial(num_problems, np.full(num_problems, 1 / num_problems),
                                         size=num_resamples).astype(float)
  means = np.empty(num_resamples)
  block = max(1, _BOOTSTRAP_BLOCK // num_problems)
  for start in range(0, num_resamples, block):
    rows = slice(start, start + block)
    means[rows] = np.einsum("bp,bp->b", seed_counts[rows] @ d, problem_counts[rows])
  means /= num_seeds * num_problems

  ci_low, ci_high = np.quantile(means, [0.5 - confidence / 2, 0.5 + confidence / 2])
  # Resamples exactly at 0 count on both sides, so all-zero differences give p = 1.
  below = np.count_nonzero(means <= 0)
  above = np.count_nonzero(means >= 0)
  far_side = below if estimate >= 0 else above
  if estimate == 0:
    far_side = min(below, above)
  p_value = float(min(1.0, 2 * (far_side + 1) / (num_resamples + 1)))
  return BootstrapComparison(difference=estimate, ci_low=float(ci_low), ci_high=float(ci_high),
                             confidence=confidence, p_value=p_value,
                             standard_error=float(means.std(ddof=1)) if num_resamples > 1
                             else np.nan, num_seeds=num_seeds, num_problems=num_problems,
                             num_resamples=num_resamples, status=OK)


def paired_power(effect: float, sd_of_differences: float, n_seeds: int,
                 alpha: float = 0.05) -> float:
  """The power of the two-sided paired t-test at level alpha to detect a true mean difference
  `effect` when per-seed differences have standard deviation `sd_of_differences`, with n_seeds.

  Exact for normal differences: under the alternative the t statistic is noncentral t with
  n - 1 degrees of freedom and noncentrality effect * sqrt(n) / sd; the test rejects when
  |t| exceeds the central t quantile. (The normal approximation overstates the power with few
  seeds, which is when it matters.)
  """
  _check_design(sd_of_differences, n_seeds, alpha)
  df = n_seeds - 1
  critical = stats.t.ppf(1 - alpha / 2, df)
  noncentrality = abs(effect) * np.sqrt(n_seeds) / sd_of_differences
  # Rejections on the wrong side: at most alpha / 2, falling fast with the noncentrality, where
  # scipy's nct.cdf can return nan far out in the tail (it is then below 1e-20).
  wrong_side = stats.nct.cdf(-critical, df, noncentrality)
  if np.isnan(wrong_side):
    wrong_side = 0.0
  return float(stats.nct.sf(critical, df, noncentrality) + wrong_side)


def minimum_detectable_effect(sd_of_differences: float, n_seeds: int, power: float = 0.8,
                              alpha: float = 0.05) -> float:
  """The smallest true mean difference the two-sided paired t-test detects with `power`.

  Use it to plan (is a study with n_seeds worth running for the effect we expect?) and to
  read a null result (a non-significant comparison only rules out differences this large).
  Solved on the noncentral t power (`paired_power`), not from the normal approximation
  (z_{1-alpha/2} + z_power) * sd / sqrt(n), which at 80% power and alpha 0.05 gives two
  thirds of the true value at 4 seeds and 86% at 8.

  Args:
    sd_of_differences: the standard deviation of the per-seed difference a - b (from a pilot
      study, e.g. `sqrt(n) * paired(...).standard_error`), > 0.
    n_seeds: the number of paired seeds, >= 2.
    power: the wanted probability of rejecting at the effect, in (alpha, 1).
    alpha: the two-sided level.

  Returns:
    The effect, in the units of the values (an absolute difference, not a standardised one).
  """
  _check_design(sd_of_differences, n_seeds, alpha)
  if not alpha < power < 1:
    raise ValueError(f"minimum_detectable_effect: power must be in (alpha, 1) = ({alpha}, 1); "
                     f"got {power}")
  normal = ((stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power))
            * sd_of_differences / np.sqrt(n_seeds))
  high = normal
  while paired_power(high, sd_of_differences, n_seeds, alpha) < power:
    high *= 2
  return float(optimize.brentq(
      lambda e: paired_power(e, sd_of_differences, n_seeds, alpha) - power, 0.0, high,
      xtol=1e-12 * high, rtol=1e-12))


def seeds_needed(effect: float, sd_of_differences: float, power: float = 0.8,
                 alpha: float = 0.05, max_seeds: int = 100_000) -> int:
  """The smallest number of paired seeds (>= 2) at which the two-sided paired t-test detects a
  true mean difference `effect` with `power`: the inverse of `minimum_detectable_effect`.

  Raises:
    ValueError: if effect is 0, or more than max_seeds would be needed.
  """
  _check_design(sd_of_differences, 2, alpha)
  if not alpha < power < 1:
    raise ValueError(f"seeds_needed: power must be in (alpha, 1) = ({alpha}, 1); got {power}")
  if effect == 0 or not np.isfinite(effect):
    raise ValueError(f"seeds_needed: effect must be finite and nonzero; got {effect}")

  def enough(n: int) -> bool:
    return paired_power(effect, sd_of_differences, n, alpha) >= power

  # Power grows with n: double to a sufficient n, then bisect.
  low, high = 1, 2
  while not enough(high):
    if high >= max_seeds:
      raise ValueError(f"seeds_needed: more than max_seeds={max_seeds} seeds needed for effect "
                       f"{effect} with sd {sd_of_differences}")
    low, high = high, min(2 * high, max_seeds)
  while high - low > 1:
    middle = (low + high) // 2
    if enough(middle):
      high = middle
    else:
      low = middle
  return high


def _check_design(sd_of_differences: float, n_seeds: int, alpha: float) -> None:
  if not (np.isfinite(sd_of_differences) and sd_of_differences > 0):
    raise ValueError(f"sd_of_differences must be finite and > 0; got {sd_of_differences}")
  if n_seeds < 2:
    raise ValueError(f"a paired t-test needs n_seeds >= 2; got {n_seeds}")
  if not 0 < alpha < 1:
    raise ValueError(f"alpha must be in (0, 1); got {alpha}")


class HolmResult(NamedTuple):
  """`holm`'s answer, in the input order: unpack as `adjusted, reject = holm(p)`."""
  adjusted: np.ndarray  # Holm-adjusted p-values: monotone in the raw p-values, at most 1.
  reject: np.ndarray  # bool: adjusted <= alpha.


def holm(p_values, alpha: float = 0.05) -> HolmResult:
  """The Holm-Bonferroni step-down adjustment of a family of p-values.

  When a study reports any of m comparisons (several metrics, several pairs of arms) as a
  finding, the chance that at least one true-null comparison comes out significant grows
  with m; Holm keeps that family-wise error rate at most alpha under any dependence between
  the tests, and rejects everything Bonferroni does and more. Sorted ascending, the i-th
  smallest (1-based) is adjusted to max over j <= i of min(1, (m - j + 1) p_(j)); a hypothesis
  is rejected when its adjusted p-value is <= alpha, which is the step-down rule (reject while
  p_(i) <= alpha / (m - i + 1), stop at the first that is not).

  Args:
    p_values: the family on the last axis (leading axes: independent families), in [0, 1];
      a single number is a family of one.
    alpha: the family-wise level.

  Returns:
    HolmResult(adjusted, reject), both of the input's shape and order.

  Raises:
    ValueError: on a p-value outside [0, 1] or nan (a one-seed `paired` test has no p-value:
      leave it out of the family and say so).
  """
  p = np.asarray(p_values, dtype=float)
  if p.ndim == 0:
    p = p[None]
  if not 0 < alpha < 1:
    raise ValueError(f"holm: alpha must be in (0, 1); got {alpha}")
  if np.any(~((p >= 0) & (p <= 1))):
    raise ValueError(f"holm: p-values must be in [0, 1] (no nan); got {p}")
  m = p.shape[-1]
  if m == 0:
    return HolmResult(p.copy(), np.zeros(p.shape, bool))
  order = np.argsort(p, axis=-1, kind="stable")
  ranked = np.take_along_axis(p, order, axis=-1)
  factors = np.arange(m, 0, -1, dtype=float)
  stepped = np.minimum(1.0, np.maximum.accumulate(ranked * factors, axis=-1))
  adjusted = np.empty_like(p)
  np.put_along_axis(adjusted, order, stepped, axis=-1)
  return HolmResult(adjusted, adjusted <= alpha)


def _json_ready(value: Any) -> Any:
  if isinstance(value, np.ndarray):
    return value.tolist()
  if isinstance(value, tuple):
    return list(value)
  return value
