"""One k-sample policy-gradient estimate on a softmax bandit.

The policy is pi = softmax(theta) over A actions; a prompt group is n actions drawn from it. The
estimator weights w come from `ksjax.objectives.k_sample_advantages` (the library under study, never
re-implemented here) and the gradient estimate of a group is sum_i w_i grad log pi(y_i), with the
softmax score function grad_theta log pi(y) = e_y - pi written out: it costs O(n + A) per group
instead of the O(n A) of differentiating log_softmax through a one-hot gather.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ksjax import objectives
from ksjax.bandit.variants import Variant


def sample_groups(key: jax.Array, theta_a: jax.Array, num_groups: int, n: int) -> jax.Array:
  """Actions [G, n], i.i.d. from softmax(theta_a), by inverting the CDF.

  `jax.random.categorical` draws one Gumbel per action per sample (G n A of them), which dominates
  the variance measurement's 10^5-10^6 draws; a uniform and a binary search per sample is
  O(G n log A).
  """
  cdf_a = jnp.cumsum(jax.nn.softmax(theta_a))
  uniform_gn = jax.random.uniform(key, (num_groups, n), cdf_a.dtype) * cdf_a[-1]
  actions_gn = jnp.searchsorted(cdf_a, uniform_gn, side="right")
  return jnp.minimum(actions_gn, theta_a.shape[-1] - 1).astype(jnp.int32)


def estimator_weights(rewards_gn: jax.Array, actions_gn: jax.Array, variant: Variant) -> jax.Array:
  """The variant's per-sample weights [G, n]. On a bandit each action is its own answer class."""
  return objectives.k_sample_advantages(
      rewards_gn, aggregator=variant.aggregator, baseline=variant.baseline, k=variant.k,
      p=variant.p, beta=variant.beta, scale=variant.scale,
      answer_ids=actions_gn if variant.aggregator == "majority_vote" else None)


def group_gradients(theta_a: jax.Array, actions_gn: jax.Array, weights_gn: jax.Array) -> jax.Array:
  """sum_i w_i (e_{y_i} - pi) for every group: [G, A]."""
  num_groups, num_actions = actions_gn.shape[0], theta_a.shape[-1]
  pi_a = jax.nn.softmax(theta_a)
  rows_gn = jnp.broadcast_to(jnp.arange(num_groups)[:, None], actions_gn.shape)
  hits_ga = jnp.zeros((num_groups, num_actions), weights_gn.dtype)
  hits_ga = hits_ga.at[rows_gn, actions_gn].add(weights_gn)
  return hits_ga - weights_gn.sum(-1, keepdims=True) * pi_a


def gradient_estimates(key: jax.Array, theta_a: jax.Array, rewards_a: jax.Array, variant: Variant,
                       num_groups: int, n: int) -> jax.Array:
  """Independent single-group gradient estimates at theta: [G, A]."""
  actions_gn = sample_groups(key, theta_a, num_groups, n)
  weights_gn = estimator_weights(rewards_a[actions_gn], actions_gn, variant)
  return group_gradients(theta_a, actions_gn, weights_gn)
