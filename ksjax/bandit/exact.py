"""Exact (not sampled) quantities of a softmax policy on a bandit with deterministic rewards.

The bandit study plots these instead of Monte Carlo estimates so that its curves carry no evaluation
noise, and the gradient-variance table measures every estimator against the exact gradient of the
objective it is unbiased for. Everything here is a pure function of the logits `theta` [A] (the
policy is pi = softmax(theta)) and the per-action rewards [A], differentiable in `theta`.

Targets of the k-sample estimators (paper section 3 and appendix, with f the aggregator):
  * baseline "none" or "loo": E[f(y_1..y_k)];
  * baseline "loo_demeaned": E[(1/k) sum_i f(y_-i)] = E[f of k-1 draws], since each y_-i is k-1
    independent draws; for pass@k this is the paper's E[((k-1)/k) r_(k) + (1/k) r_(k-1)];
  * baseline "leave_p_out": E[(1/C(k,p)) sum_|s|=p f(y_-s)] = E[f of k-p draws].
So every target is "E[f of m draws]" for some m, which is closed form for mean (E[r] for any m) and
pass@k (sum over sorted rewards), and for softmax and majority voting is summed exactly over all
multisets of m actions (each weighted by its multinomial probability).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ksjax import objectives
from ksjax.bandit.variants import Variant

# Above this many multisets the softmax / majority-vote targets are not enumerated (time, memory).
MAX_MULTISETS = 10_000_000
_CHUNK = 1 << 16  # multisets summed per step of the enumeration


def expected_reward(theta_a: jax.Array, rewards_a: jax.Array) -> jax.Array:
  """E_pi[r], a scalar."""
  return jnp.sum(jax.nn.softmax(theta_a) * rewards_a)


def expected_max(theta_a: jax.Array, rewards_a: jax.Array, m: int) -> jax.Array:
  """E[max of m independent draws from pi] (pass@m of pi for real-valued rewards), a scalar.

  With the actions sorted by reward and F_j the probability of the j lowest-reward actions,
  P(max = r_(j)) = F_j^m - F_{j-1}^m. Equal rewards need no special case: over a run of tied actions
  these terms telescope to P(max equals the tied value), whatever order the sort gave the run.
  """
  order = jnp.argsort(rewards_a)
  pi_sorted = jax.nn.softmax(theta_a)[order]
  cdf = jnp.cumsum(pi_sorted)
  cdf = cdf / cdf[-1]  # exactly 1 at the top despite float rounding
  cdf_below = jnp.concatenate([jnp.zeros_like(cdf[:1]), cdf[:-1]])
  return jnp.sum(rewards_a[order] * (cdf**m - cdf_below**m))


def kl_divergence(theta_a: jax.Array, reference_theta_a: jax.Array) -> jax.Array:
  """KL(pi || pi_ref) for pi = softmax(theta), pi_ref = softmax(reference_theta), a scalar."""
  log_pi = jax.nn.log_softmax(theta_a)
  return jnp.sum(jnp.exp(log_pi) * (log_pi - jax.nn.log_softmax(reference_theta_a)))


def target_draws(variant: Variant) -> int:
  """m such that the variant's estimator is unbiased for E[f of m draws] (module docstring)."""
  if variant.baseline in ("none", "loo"):
    return variant.k
  if variant.baseline == "loo_demeaned":
    return variant.k - 1
  return variant.k - variant.p  # leave_p_out


def target_description(variant: Variant) -> str:
  m = target_draws(variant)
  f = {"mean": "mean r", "pass_at_k": "max r", "softmax": f"softmax_{variant.beta:g}-weighted r",
       "majority_vote": "r(majority)"}[variant.aggregator]
  scaled = " (group_std scaling: biased)" if variant.scale != "none" else ""
  return ("E[r]" if variant.aggregator == "mean" else f"E[{f} of {m}]") + scaled


def num_multisets(num_actions: int, m: int) -> int:
  return math.comb(num_actions + m - 1, m)


def is_closed_form(variant: Variant) -> bool:
  """Whether the target is a closed form (O(A log A)) rather than a sum over multisets."""
  return variant.aggregator in ("mean", "pass_at_k")


def has_exact_target(variant: Variant, num_actions: int) -> bool:
  """Whether `target_objective` can evaluate the variant's target for this many actions."""
  return (is_closed_form(variant)
          or num_multisets(num_actions, target_draws(variant)) <= MAX_MULTISETS)


def target_objective(theta_a: jax.Array, rewards_a: jax.Array, variant: Variant) -> jax.Array:
  """The exact objective the variant's (unscaled) estimator is an unbiased gradient of, a scalar.

  With scale="group_std" no such objective exists; the unscaled estimator's target is returned and
  the difference shows up as bias. Raises ValueError where enumeration would exceed MAX_MULTISETS.
  """
  m = target_draws(variant)
  if variant.aggregator == "mean":
    return expected_reward(theta_a, rewards_a)
  if variant.aggregator == "pass_at_k":
    return expected_max(theta_a, rewards_a, m)
  num_actions = theta_a.shape[-1]
  if not has_exact_target(variant, num_actions):
    raise ValueError(f"the exact target of {variant.key} sums over "
                     f"{num_multisets(num_actions, m):,} multisets; at most {MAX_MULTISETS:,} are "
                     "enumerated")
  actions_cm, log_count_c = _multisets(num_actions, m)
  return _sum_over_multisets(theta_a, rewards_a, actions_cm, log_count_c, variant)


def tuple_value(rewards_tm: jax.Array, actions_tm: jax.Array, variant: Variant) -> jax.Array:
  """f(y_1..y_m) for a batch of tuples of actions [T, m] with their rewards [T, m] -> [T].

  f itself is the library's (`objective_value` of m samples with k = m is f of those samples); on a
  bandit each action is its own answer class for majority voting.
  """
  return objectives.objective_value(
      rewards_tm, aggregator=variant.aggregator, k=rewards_tm.shape[-1], beta=variant.beta,
      answer_ids=actions_tm if variant.aggregator == "majority_vote" else None)


def _multisets(num_actions: int, m: int) -> tuple[np.ndarray, np.ndarray]:
  """All multisets of m actions as sorted rows [C, m], and log of each one's number of orderings."""
  actions = np.arange(num_actions, dtype=np.int32)[:, None]
  for _ in range(m - 1):
    last = actions[:, -1]
    repeats = num_actions - last  # the next action is >= the last one
    rows = np.repeat(actions, repeats, axis=0)
    offsets = np.arange(len(rows)) - np.repeat(np.cumsum(repeats) - repeats, repeats)
    actions = np.concatenate([rows, (np.repeat(last, repeats) + offsets)[:, None]], axis=1)
  # Orderings = m! / prod(run lengths!); sum_i log(1 + #{j < i: a_j = a_i}) = sum_runs log(len!).
  earlier_equal = np.zeros(actions.shape, dtype=np.int64)
  for i in range(1, m):
    same = actions[:, i] == actions[:, i - 1]
    earlier_equal[:, i] = np.where(same, earlier_equal[:, i - 1] + 1, 0)
  log_count = math.lgamma(m + 1) - np.log1p(earlier_equal).sum(1)
  return actions, log_count


def _sum_over_multisets(theta_a, rewards_a, actions_cm, log_count_c, variant):
  """sum_c count_c * prod_j pi(a_cj) * f(a_c), in chunks of _CHUNK multisets."""
  num = len(actions_cm)
  padded = -(-num // _CHUNK) * _CHUNK
  valid = np.arange(padded) < num
  actions = np.pad(actions_cm, ((0, padded - num), (0, 0))).reshape(-1, _CHUNK, actions_cm.shape[1])
  log_count = np.pad(log_count_c, (0, padded - num)).reshape(-1, _CHUNK)
  log_pi_a = jax.nn.log_softmax(theta_a)

  def chunk_sum(chunk):
    actions_tm, log_count_t, valid_t = chunk
    log_prob_t = log_count_t.astype(log_pi_a.dtype) + log_pi_a[actions_tm].sum(-1)
    value_t = tuple_value(rewards_a[actions_tm], actions_tm, variant)
    return jnp.sum(jnp.where(valid_t, jnp.exp(log_prob_t) * value_t, 0.0))

  return jnp.sum(jax.lax.map(chunk_sum, (actions, log_count, valid.reshape(-1, _CHUNK))))
