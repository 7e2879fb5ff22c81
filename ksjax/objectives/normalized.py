"""Estimators divided by a data-dependent standard deviation: Chen et al.'s normalised pass@k and
verl's grpo_passk. Neither is an unbiased gradient of any objective; both are here to be compared.

baseline="normalized" (Chen et al. 2025, arXiv 2508.10751, "Pass@k Training"). GRPO applied to
the k-subsets instead of the samples: each of the C(n, k) k-subsets S of a group is a pseudo-sample
with reward f(S); these are standardised over all subsets, (f(S) - Rbar) / sigma with Rbar their
mean and sigma their (population) standard deviation, and each sample is credited with the mean
over the subsets that contain it:

  A_i = (phi_k(i) - Rbar) / sigma,   Rbar = (1/C(n,k)) sum_S f(S),
  sigma^2 = (1/C(n,k)) sum_S (f(S) - Rbar)^2.

With binary rewards in {0, 1}, c correct and f = max this is the paper's closed form:
Rbar = 1 - C(n-c, k)/C(n, k), sigma = sqrt(Rbar (1 - Rbar)) (f is Bernoulli over subsets),
A_pos = (1 - Rbar)/sigma, A_neg = (1 - Rbar - C(n-c-1, k-1)/C(n-1, k-1))/sigma. Taking sigma as the
standard deviation over subsets, rather than sqrt(Rbar (1 - Rbar)), generalises it to any
rewards and keeps A unchanged by r -> a r + b (a > 0): rewards in {-1, +1} give the same weights
as {0, 1}. phi_k(i) - Rbar is (n/k)(W_i - mean_j W_j) for baseline "none"'s weights W, i.e. the
REINFORCE U-statistic minus its group mean, up to the factor n/k.

Aggregators. Only f on k-subsets enters, so every aggregator is accepted: pass_at_k and mean in
closed form (mean: sqrt((n-k)/(k(n-1))) (r_i - rbar)/std(r), GRPO rescaled), majority_vote and
softmax by enumerating the k-subsets. With k = 1 it is GRPO for every aggregator (f of one sample
is its reward), with the population standard deviation. k = n is rejected: the only k-subset is
the whole group, so every weight would be 0 (sigma = 0).

What it estimates. Rbar = (k/n) phi_k(i) + (1 - k/n) psi_k(i) (psi_k(i): the mean over the
k-subsets without i), so sigma A_i = ((n-k)/k) (k/n)(phi_k(i) - psi_k(i)): (n-k)/k times the
leave-p-out weight with m = k, whose baseline psi_k(i) does not involve y_i. Before dividing by
sigma it is therefore an unbiased gradient of ((n-k)/k) E[f(y_1..y_k)]. sigma depends on the
sample itself, so A is biased: its expectation is in general not even parallel to
grad E[f(y_1..y_k)] (`tests/objectives/test_exact.py` shows both by exact enumeration).
With binary rewards every estimator whose weights depend only on which samples are correct has
an expectation parallel to grad P(correct), so there the direction is right per prompt and the
bias is a prompt- and policy-dependent positive factor: prompts are reweighted against each other
(with n - k = 1 only groups with one correct sample have sigma > 0, and for rewards {0, 1} the
factor is the constant ((n-k)/k) n / sqrt(k (n-k)); from n - k = 2 on it varies with the policy).
Groups whose k-subsets all have the same f (sigma = 0; e.g. n - c < k with binary rewards) get
weights 0, as their numerator is 0.

baseline="verl_grpo_passk" (verl's `compute_grpo_passk_outcome_advantage`, Tang et al. 2025).
Per group of n = k samples: the first sample holding the maximum gets r_max - r_second (the two
largest of torch.topk(rewards, 2)), every other sample 0; then, as with verl's default
norm_adv_by_std_in_grpo, the group is divided by torch.std(rewards) + eps (Bessel-corrected).
Ties at the top give r_max - r_second = 0, so all zeros. Before the division it is exactly the
pass_at_k leave-one-out weight (unbiased for grad E[max of k]); the division by the reward
std makes it biased like any GRPO-style normalisation. With rewards of two values a < b only
groups with one correct sample have a non-zero weight, and their std is (b - a)/sqrt(n), so it is
then unbiased up to the constant 1/((b - a)/sqrt(n) + eps); with more reward values the std varies
between groups and the expectation turns away from grad E[max of k] (`test_exact.py`). It is
defined for pass_at_k and k = n only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ksjax.objectives import enumerated
from ksjax.objectives import mean
from ksjax.objectives import pass_at_k


@jax.jit
def _divide(centred_gn: jax.Array, std_g1: jax.Array) -> jax.Array:
  """centred / std, 0 where std = 0 (there the numerator is 0 too: all k-subsets agree)."""
  live_g1 = std_g1 > 0
  return jnp.where(live_g1, centred_gn / jnp.where(live_g1, std_g1, 1), 0)


@functools.partial(jax.jit, static_argnames=("n", "k"))
def _enumerated_normalized(values_gc: jax.Array, n: int, k: int) -> jax.Array:
  # Measured from the first subset's value, subsets with equal f give exact zeros (the weights
  # and sigma are unchanged by a shift of f), so a group whose subsets all agree gets sigma = 0
  # exactly rather than rounding noise that the division would blow up.
  values_gc = values_gc - values_gc[:, :1]
  centred_gn = (n - k) / k * enumerated.leave_p_out(values_gc, n, k)
  return _divide(centred_gn, jnp.std(values_gc, axis=-1, keepdims=True))


def normalized(rewards_gn: jax.Array, aggregator: str, k: int, values_k=None) -> jax.Array:
  """Chen et al.'s normalised k-subset advantages, k < n, [G, n].

  Args:
    rewards_gn: [G, n], measured from the group maximum (exact zeros for equal rewards).
    aggregator: "pass_at_k" or "mean" (closed forms), or an enumerated one with `values_k`.
    k: subset size, 1 <= k < n.
    values_k: f on every k-subset [G, C(n, k)], for majority_vote and softmax.
  """
  n = rewards_gn.shape[-1]
  if aggregator == "pass_at_k":
    return _divide(pass_at_k.centred(rewards_gn, k), pass_at_k.subset_std(rewards_gn, k))
  if aggregator == "mean":
    return _divide(mean.centred(rewards_gn, k), mean.subset_std(rewards_gn, k))
  return _enumerated_normalized(values_k, n, k)


@jax.jit
def verl_grpo_passk(rewards_gn: jax.Array, eps: float | jax.Array) -> jax.Array:
  """verl's grpo_passk with norm_adv_by_std_in_grpo, n = k >= 2, [G, n]."""
  n = rewards_gn.shape[-1]
  top_two_g2, _ = jax.lax.top_k(rewards_gn, 2)
  gap_g1 = top_two_g2[:, :1] - top_two_g2[:, 1:]
  first_max_g1 = jnp.argmax(rewards_gn, axis=-1, keepdims=True)  # the first index on ties
  weights_gn = jnp.where(jnp.arange(n) == first_max_g1, gap_g1, 0)
  return weights_gn / (jnp.std(rewards_gn, axis=-1, keepdims=True, ddof=1) + eps)
