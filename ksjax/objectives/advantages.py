"""k-sample policy-gradient weights (Tang et al., section 3 and appendix), extended to n >= k.

A group holds n i.i.d. samples y_1..y_n of one prompt with rewards r_i. The k-sample objective is
E[f(y_1..y_k)] for an aggregator f (mean, max = pass@k, majority vote, softmax-weighted reward).
For n = k the paper's estimators give each sample a weight w_i, the gradient estimate being
sum_i w_i grad log pi(y_i). With A_s = f(y) - f(y_-s):

  baseline      w_i (n = k)                                     unbiased gradient of
  none          f(y)                                            E[f(y_1..y_k)]
  loo           A_i = f(y) - f(y_-i)                            E[f(y_1..y_k)]
  loo_demeaned  A_i - mean_j A_j                                E[(1/k) sum_i f(y_-i)]
  leave_p_out   (1/C(k-1,p-1)) sum_{|s|=p, s has i} (A_s - mean A)
                                                                E[(1/C(k,p)) sum_{|s|=p} f(y_-s)]
  leave_two_out (needs n > k; below)                            E[f(y_1..y_k)]

The leave-out weights equal mean_{|s|=p} f(y_-s) - mean_{|s|=p, s has i} f(y_-s): what is
subtracted never involves y_i, which is why each estimate is unbiased for its target. The appendix
states leave_p_out for f = max; its derivation never uses the form of f, so the same weights serve
every aggregator ("max" replaced by f on the complement). The loo_demeaned and leave_p_out targets
are the (k-1)- and (k-p)-sample objectives E[f(y_1..y_{k-p})], each y_-s being k - p i.i.d.
samples; for pass@k and p = 1 that is the paper's E[((k-1)/k) r_(k) + (1/k) r_(k-1)].

For n > k every estimator is the U-statistic over the C(n, k) k-subsets S of the group,
W_i = (1/C(n, k)) sum_S [w^S_i if i in S else 0], unbiased for the same target as the n = k
estimator (each S is k i.i.d. samples). Write phi_m(i) for the mean of f over the m-subsets of the
n samples that contain i, psi_m(i) for the mean over those that do not. Then

  none:           W_i = (k/n) phi_k(i)
  loo:            W_i = (k/n) (phi_k(i) - psi_{k-1}(i))
  leave_p_out:    W_i = (m/n) (phi_m(i) - psi_m(i)),  m = k - p;  loo_demeaned is p = 1.
  leave_two_out:  W_i = (k/n) (phi_k(i) - psi_k(i)),  k < n.

Proof for leave_p_out (the others are alike): summed over the k-subsets S containing i, the mean of
f over the m-subsets T of S counts each T containing i C(n-m, k-m) times and each T without i
C(n-m-1, k-m-1) times, each over C(k, m); the mean over the T in S without i counts each T without
i C(n-m-1, k-m-1) times over C(k-1, m). With C(n,k) C(k,m) = C(n,m) C(n-m,k-m) the coefficients
of the two sums reduce to m/n and -m/n. Two consequences: leave_p_out depends on (k, p) only
through k - p; and with p = k - 1 (target E[r], since f of one sample is its reward for every
aggregator here) it is the mean aggregator's leave-one-out weight (r_i - rbar)/(n - 1) for every f,
which is the appendix's "p = k - 1 gives the mean objective", exactly.

leave_two_out is MaxPO's Leave-Two-Out baseline (Takashiro et al. 2026, arXiv 2606.06080), read
from its construction: sample i's signal phi_k(i), the mean of f over the k-subsets holding i, is
compared with the same signal of each other sample j computed in the group without i and j
(the mean of f over the k-subsets holding j and not i), averaged over j. Each k-subset without i
holds k such j, so that average is psi_k(i) exactly, and the weights are the leave-p-out form
with m = k, i.e. p = 0: the target stays E[f(y_1..y_k)] itself (unbiased, as psi_k(i) never
involves y_i), and the weights of a group sum to exactly 0 (sum_i phi_k(i) = sum_i psi_k(i) = n
times the mean of f over all k-subsets), which leave-one-out's do not. It needs a k-subset
without i: k < n. For the mean aggregator it is the common leave-out weight (r_i - rbar)/(n - 1).
`tests/objectives/test_mixture.py` proves it by enumeration and against the literal two-sample
construction. Kept apart from BASELINES (the paper's, each defined for n = k).

mean and pass_at_k evaluate phi and psi in closed form (`mean.py`, `pass_at_k.py`); majority_vote
and softmax enumerate subsets (`enumerated.py`).

scale="group_std" divides each group's weights by their sample standard deviation (Bessel-
corrected, as torch.std in the GRPO implementations of TRL and verl) plus eps. The paper's appendix
("Integrating with GRPO") treats the k-sample advantage as the effective reward, subtracts the
group mean (Dr. GRPO) and "further divides by the standard deviation" for the GRPO form: the std of
the effective rewards, which is the std of the weights themselves. For aggregator="mean" this is
GRPO's (r_i - rbar) / (std(r) + (n - 1) eps). It is rejected with baseline="none", whose weights
are constant within a group when k = n (a standard deviation of 0).

Two more baselines divide by a standard deviation of the group itself, which makes them biased for
every objective; they are there to compare against (`normalized.py`, NORMALIZED_BASELINES):
"normalized" (Chen et al. 2025: GRPO over the k-subsets; every aggregator, k < n) and
"verl_grpo_passk" (verl's grpo_passk: Tang's leave-one-out over torch.std(r) + eps; pass_at_k,
k = n). Both normalise already, so scale="group_std" is rejected with them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ksjax.objectives import enumerated
from ksjax.objectives import mean
from ksjax.objectives import normalized
from ksjax.objectives import pass_at_k

AGGREGATORS = ("mean", "pass_at_k", "majority_vote", "softmax")
# The paper's baselines: each an unbiased gradient of a stated target objective.
BASELINES = ("none", "loo", "loo_demeaned", "leave_p_out")
# Divided by a data-dependent standard deviation: biased, for comparison (`normalized.py`).
NORMALIZED_BASELINES = ("normalized", "verl_grpo_passk")
# Unbiased and exactly centred within each group; needs n > k (MaxPO's Leave-Two-Out).
CENTRED_BASELINES = ("leave_two_out",)
ALL_BASELINES = BASELINES + CENTRED_BASELINES + NORMALIZED_BASELINES
SCALES = ("none", "group_std")
_ENUMERATED = ("majority_vote", "softmax")


def _choice(name: str, value, accepted: tuple[str, ...]) -> None:
  if value not in accepted:
    raise ValueError(
        f"{name}={value!r} is not accepted; expected one of {', '.join(map(repr, accepted))}")


def _is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_concrete(value) -> bool:
  return not isinstance(value, jax.core.Tracer)


def _check_rewards(rewards) -> jax.Array:
  rewards = jnp.asarray(rewards)
  if rewards.ndim != 2:
    raise ValueError(f"rewards has shape {rewards.shape}; expected a float array [G, n] "
                     "(G groups of n samples)")
  if not jnp.issubdtype(rewards.dtype, jnp.floating):
    raise ValueError(
        f"rewards has dtype {rewards.dtype}; expected a floating dtype (float32, float64)")
  if _is_concrete(rewards):
    values = np.asarray(rewards)
    if not np.isfinite(values).all():
      bad = tuple(np.argwhere(~np.isfinite(values))[0])
      raise ValueError(f"rewards[{bad[0]}, {bad[1]}] = {values[bad]} is not finite; "
                       "expected finite rewards")
  return rewards


def _check_k(k, n: int) -> int:
  if k is None:
    return n
  if not _is_int(k) or not 1 <= k <= n:
    raise ValueError(
        f"k={k!r} is not accepted; expected an integer in [1, n={n}] (or None for k = n)")
  return int(k)


def _check_answer_ids(answer_ids, shape: tuple[int, ...]) -> jax.Array:
  if answer_ids is None:
    raise ValueError("answer_ids is missing; aggregator='majority_vote' needs an integer array "
                     "[G, n] giving each sample's answer class")
  answer_ids = jnp.asarray(answer_ids)
  if answer_ids.shape != shape or not jnp.issubdtype(answer_ids.dtype, jnp.integer):
    raise ValueError(f"answer_ids has shape {answer_ids.shape} and dtype {answer_ids.dtype}; "
                     f"expected an integer array of the rewards' shape {shape}")
  return answer_ids


def _check_finite_scalar(name: str, value, *, positive: bool = False) -> None:
  if not _is_concrete(value):
    return
  try:
    number = float(value)
  except (TypeError, ValueError):
    number = math.nan
  if not math.isfinite(number) or (positive and number <= 0):
    raise ValueError(f"{name}={value!r} is not accepted; expected a finite number"
                     + (" > 0" if positive else ""))


def _check_normalized(aggregator: str, baseline: str, k: int, n: int, scale: str) -> None:
  if scale != "none":
    raise ValueError(f"scale={scale!r} is not accepted with baseline={baseline!r}, which divides "
                     "by a standard deviation itself; expected scale='none'")
  if baseline == "normalized" and k >= n:
    raise ValueError(f"k={k} is not accepted with baseline='normalized' and n={n}; expected "
                     "k < n (with k = n the only k-subset is the whole group: all weights 0)")
  if baseline == "verl_grpo_passk":
    if aggregator != "pass_at_k":
      raise ValueError(f"aggregator={aggregator!r} is not accepted with "
                       "baseline='verl_grpo_passk' (it credits the group's best sample alone); "
                       "expected aggregator='pass_at_k'")
    if k != n or n < 2:
      raise ValueError(f"k={k} is not accepted with baseline='verl_grpo_passk' and n={n}; "
                       "expected k = n >= 2 (verl's grpo_passk takes the whole group)")


def _check_baseline(baseline: str, k: int, p, n: int) -> int | None:
  """The subset size m of the leave-p-out form (k for leave_two_out), or None for the others."""
  if baseline in NORMALIZED_BASELINES:
    return None
  if baseline == "leave_two_out":
    if k >= n:
      raise ValueError(f"k={k} is not accepted with baseline='leave_two_out' and n={n}; expected "
                       "k < n (a sample's baseline averages f over the k-subsets of the others)")
    return k
  if baseline != "none" and k < 2:
    raise ValueError(
        f"k={k} is not accepted with baseline={baseline!r}; leave-out baselines need k >= 2")
  if baseline == "loo_demeaned":
    return k - 1
  if baseline == "leave_p_out":
    if not _is_int(p) or not 1 <= p <= k - 1:
      raise ValueError(f"p={p!r} is not accepted with baseline='leave_p_out' and k={k}; expected "
                       f"an integer in [1, k-1 = {k - 1}]")
    return k - int(p)
  return None


def _subset_values(rewards_gn, aggregator, m, beta, answer_ids_gn):
  if aggregator == "softmax":
    return enumerated.softmax_values(rewards_gn, beta, m)
  return enumerated.majority_vote_values(rewards_gn, answer_ids_gn, m)


@jax.jit
def _from_group_max(rewards_gn: jax.Array) -> jax.Array:
  return rewards_gn - jnp.max(rewards_gn, axis=-1, keepdims=True)


@jax.jit
def _divide_by_group_std(weights_gn: jax.Array, eps: float | jax.Array) -> jax.Array:
  return weights_gn / (jnp.std(weights_gn, axis=-1, keepdims=True, ddof=1) + eps)


def _weights(rewards_gn, aggregator, baseline, k, m, beta, answer_ids_gn, eps) -> jax.Array:
  n = rewards_gn.shape[-1]
  if baseline != "none":
    # Leave-out weights are unchanged by a constant added to a group's rewards (f(y + c) = f(y) + c
    # for every aggregator here). Measuring rewards from the group maximum makes equal rewards
    # exactly 0, so groups whose weights vanish in exact arithmetic get exact zeros rather than
    # rounding noise (which scale="group_std" would blow up by 1/eps), and large offsets do not
    # cancel.
    rewards_gn = _from_group_max(rewards_gn)
  if baseline == "verl_grpo_passk":
    return normalized.verl_grpo_passk(rewards_gn, eps)
  if baseline == "normalized":
    values_k = None if aggregator in ("mean", "pass_at_k") else _subset_values(
        rewards_gn, aggregator, k, beta, answer_ids_gn)
    return normalized.normalized(rewards_gn, aggregator, k, values_k)
  if aggregator == "mean":
    return mean.none(rewards_gn, k) if baseline == "none" else mean.leave_out(rewards_gn)
  if aggregator == "pass_at_k":
    if baseline == "none":
      return pass_at_k.none(rewards_gn, k)
    if baseline == "loo":
      return pass_at_k.loo(rewards_gn, k)
    return pass_at_k.leave_p_out(rewards_gn, m)
  values = lambda size: _subset_values(rewards_gn, aggregator, size, beta, answer_ids_gn)
  if baseline == "none":
    return enumerated.none(values(k), n, k)
  if baseline == "loo":
    return enumerated.loo(values(k), values(k - 1), n, k)
  return enumerated.leave_p_out(values(m), n, m)


def k_sample_advantages(rewards, *, aggregator: str, baseline: str, k: int | None = None,
                        p: int = 1, beta: float | jax.Array = 1.0, answer_ids=None,
                        scale: str = "none", eps: float = 1e-6) -> jax.Array:
  """Per-sample weights of the k-sample policy gradient, [G, n] -> [G, n].

  The gradient estimate for group g is sum_i w[g, i] grad log pi(y_{g,i}); see the module docstring
  for each baseline's target objective and the n > k U-statistic. Pure and jit-able with aggregator,
  baseline, k, p, scale (and eps) static; beta may be traced.

  Args:
    rewards: float32 or float64 [G, n], finite. Checked for finiteness when concrete; under jit a
      non-finite reward is not detected and makes its group's weights non-finite.
    aggregator: "mean" (f = mean reward), "pass_at_k" (f = max), "majority_vote" (f = reward of the
      plurality answer, ties broken uniformly at random, in expectation: the mean reward of the tied
      plurality classes), "softmax" (f = sum_i p_i r_i, p = softmax(beta * r) over the k samples).
    baseline: "none" (REINFORCE), "loo" (unbiased leave-one-out), "loo_demeaned" (the paper's biased
      variant), "leave_p_out" (the appendix's leave-p-out; p = 1 equals loo_demeaned),
      "leave_two_out" (MaxPO: unbiased for E[f(y_1..y_k)] and centred, k < n); for
      comparison, biased: "normalized" (Chen et al.'s normalised k-subset advantage, k < n) and
      "verl_grpo_passk" (verl's grpo_passk, pass_at_k with k = n); see `normalized.py`.
    k: samples of the objective, 1 <= k <= n (>= 2 for loo, loo_demeaned and leave_p_out; < n
      for leave_two_out); None means n.
    p: samples left out by "leave_p_out", 1 <= p <= k - 1; ignored by the other baselines.
    beta: inverse temperature of "softmax" (finite; 0 gives the mean, large beta approaches max).
    answer_ids: integer [G, n] answer classes, required by "majority_vote", ignored otherwise.
    scale: "none" or "group_std" (divide each group's weights by their standard deviation + eps);
      "none" with the NORMALIZED_BASELINES.
    eps: added to the standard deviation by "group_std" and "verl_grpo_passk" (verl's epsilon,
      also 1e-6 by default), > 0.

  Returns:
    Weights [G, n] in the rewards' dtype.

  Raises:
    ValueError: naming the argument and what is accepted, for any invalid argument or combination;
      for majority_vote and softmax also when a subset family to enumerate exceeds
      `enumerated.MAX_SUBSETS` (k = n is always accepted for none, loo and loo_demeaned).
  """
  rewards_gn = _check_rewards(rewards)
  _choice("aggregator", aggregator, AGGREGATORS)
  _choice("baseline", baseline, ALL_BASELINES)
  _choice("scale", scale, SCALES)
  n = rewards_gn.shape[-1]
  k = _check_k(k, n)
  m = _check_baseline(baseline, k, p, n)
  if baseline in NORMALIZED_BASELINES:
    _check_normalized(aggregator, baseline, k, n, scale)
  if baseline == "verl_grpo_passk":
    _check_finite_scalar("eps", eps, positive=True)
  if scale == "group_std":
    if baseline == "none":
      raise ValueError("scale='group_std' is not accepted with baseline='none' (its weights are "
                       "constant within a group when k = n); expected baseline 'loo', "
                       "'loo_demeaned', 'leave_p_out' or 'leave_two_out'")
    _check_finite_scalar("eps", eps, positive=True)
  answer_ids_gn = None
  if aggregator == "majority_vote":
    answer_ids_gn = _check_answer_ids(answer_ids, rewards_gn.shape)
  if aggregator == "softmax":
    _check_finite_scalar("beta", beta)
  if aggregator in _ENUMERATED:
    sizes = {"none": (k,), "normalized": (k,), "loo": (k, k - 1)}.get(baseline, (m,))
    enumerated.check_enumerable(aggregator, n, sizes)

  weights_gn = _weights(rewards_gn, aggregator, baseline, k, m, beta, answer_ids_gn, eps)
  if scale == "group_std":
    weights_gn = _divide_by_group_std(weights_gn, eps)
  return weights_gn


def objective_value(rewards, *, aggregator: str, k: int | None = None,
                    beta: float | jax.Array = 1.0, answer_ids=None) -> jax.Array:
  """Unbiased estimate of the k-sample objective E[f(y_1..y_k)] from each group's n samples, [G].

  The U-statistic (1/C(n, k)) sum_{|S|=k} f(y_S): for pass_at_k the closed form
  sum_{j>=k} C(j-1, k-1) r_(j) / C(n, k) over sorted rewards (with rewards in {0, 1} and c correct,
  Chen et al.'s 1 - C(n-c, k)/C(n, k)); for majority_vote (maj@k) and softmax by enumerating the
  k-subsets, within `enumerated.MAX_SUBSETS`. Arguments as in `k_sample_advantages`.
  """
  rewards_gn = _check_rewards(rewards)
  _choice("aggregator", aggregator, AGGREGATORS)
  n = rewards_gn.shape[-1]
  k = _check_k(k, n)
  if aggregator == "mean":
    return mean.objective(rewards_gn)
  if aggregator == "pass_at_k":
    return pass_at_k.objective(rewards_gn, k)
  answer_ids_gn = None
  if aggregator == "majority_vote":
    answer_ids_gn = _check_answer_ids(answer_ids, rewards_gn.shape)
  else:
    _check_finite_scalar("beta", beta)
  enumerated.check_enumerable(aggregator, n, (k,))
  return jnp.mean(_subset_values(rewards_gn, aggregator, k, beta, answer_ids_gn), axis=-1)
