"""Policy-gradient training on a softmax bandit, recording exact metrics at every step.

One run is a `lax.scan` over steps; runs for all seeds are vectorised with `jax.vmap` and the whole
thing is one jitted call per estimator. theta starts at 0, so the reference policy (the initial one)
is uniform. Each step draws `groups_per_step` groups of n actions, averages their gradient estimates
and takes an SGD step; plain `theta += lr * g` is the update the paper uses, so optax is not needed.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ksjax.bandit import exact
from ksjax.bandit import policy_gradient
from ksjax.bandit.variants import Variant


class Curves(NamedTuple):
  """Exact metrics of the policy after 0..num_steps updates: each [..., num_steps + 1]."""
  mean_reward: jax.Array  # E_pi[r]
  pass_at_k: jax.Array  # E[max of k draws from pi]
  kl: jax.Array  # KL(pi || pi_ref), pi_ref the initial (uniform) policy


def evaluate(theta_a: jax.Array, rewards_a: jax.Array, k: int) -> Curves:
  reference_a = jnp.zeros_like(theta_a)
  return Curves(mean_reward=exact.expected_reward(theta_a, rewards_a),
                pass_at_k=exact.expected_max(theta_a, rewards_a, k),
                kl=exact.kl_divergence(theta_a, reference_a))


def train_one(key: jax.Array, rewards_a: jax.Array, learning_rate: float, *, variant: Variant,
              n: int, groups_per_step: int, num_steps: int) -> Curves:
  """Trains from theta = 0 on one bandit; returns its exact curves, each [num_steps + 1]."""
  theta_a = jnp.zeros_like(rewards_a)

  def step(theta_a, key):
    grads_ga = policy_gradient.gradient_estimates(key, theta_a, rewards_a, variant,
                                                  groups_per_step, n)
    theta_a = theta_a + learning_rate * grads_ga.mean(0)
    return theta_a, evaluate(theta_a, rewards_a, variant.k)

  _, curves = jax.lax.scan(step, theta_a, jax.random.split(key, num_steps))
  first = evaluate(theta_a, rewards_a, variant.k)
  return jax.tree.map(lambda x0, xs: jnp.concatenate([x0[None], xs]), first, curves)


@functools.partial(jax.jit, static_argnames=("variant", "n", "groups_per_step", "num_steps"))
def train(keys_s: jax.Array, rewards_sa: jax.Array, learning_rate: float, *, variant: Variant,
          n: int, groups_per_step: int, num_steps: int) -> Curves:
  """`train_one` for every seed: keys [S], rewards [S, A] -> curves, each [S, num_steps + 1]."""
  run = functools.partial(train_one, variant=variant, n=n, groups_per_step=groups_per_step,
                          num_steps=num_steps)
  return jax.vmap(run, in_axes=(0, 0, None))(keys_s, rewards_sa, learning_rate)
