"""Monte Carlo error of each estimator at initialisation, against the exact gradient of its target.

For a variant with target objective J (`exact.target_objective`), the single-group gradient estimate
g has mean squared error E||g - grad J||^2 = tr Cov(g) + ||E g - grad J||^2; for the unbiased
estimators that is their variance. It is measured on each seed's bandit at theta = 0 from
`num_draws` independent groups, with grad J from `jax.grad` of the exact target.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ksjax.bandit import exact
from ksjax.bandit import policy_gradient
from ksjax.bandit.variants import Variant


class GradientError(NamedTuple):
  """Per-bandit statistics of one estimator (each a scalar, or [S] over seeds)."""
  mse: jax.Array  # mean over draws of ||g - grad J||^2
  mse_stderr: jax.Array  # Monte Carlo standard error of `mse`
  exact_sq_norm: jax.Array  # ||grad J||^2
  bias_sq: jax.Array  # ||mean g - grad J||^2 - tr Cov(g) / draws, unbiased for ||E g - grad J||^2


def exact_gradient(rewards_a: jax.Array, variant: Variant) -> jax.Array:
  """grad_theta J at theta = 0: [A]."""
  return jax.grad(exact.target_objective)(jnp.zeros_like(rewards_a), rewards_a, variant)


@functools.partial(jax.jit, static_argnames=("variant", "n", "num_draws"))
def gradient_error(key: jax.Array, rewards_a: jax.Array, exact_grad_a: jax.Array, *,
                   variant: Variant, n: int, num_draws: int) -> GradientError:
  """Statistics of `num_draws` single-group estimates at theta = 0 against `exact_grad_a` [A]."""
  grads_da = policy_gradient.gradient_estimates(key, jnp.zeros_like(rewards_a), rewards_a, variant,
                                                num_draws, n)
  sq_err_d = jnp.sum((grads_da - exact_grad_a) ** 2, -1)
  mean_a = grads_da.mean(0)
  var_a = grads_da.var(0, ddof=1)
  mean_err_a = mean_a - exact_grad_a
  return GradientError(
      mse=sq_err_d.mean(),
      mse_stderr=sq_err_d.std(ddof=1) / jnp.sqrt(num_draws),
      exact_sq_norm=jnp.sum(exact_grad_a**2),
      bias_sq=jnp.sum(mean_err_a**2) - jnp.sum(var_a) / num_draws)


@functools.partial(jax.jit, static_argnames=("variant", "n", "num_draws"))
def gradient_errors(keys_s: jax.Array, rewards_sa: jax.Array, variant: Variant, *, n: int,
                    num_draws: int) -> GradientError:
  """`gradient_error` on every seed's bandit: each field [S]. Seeds run one after another so that
  only one [num_draws, A] block of estimates is alive at a time."""
  exact_grads_sa = jax.lax.map(lambda r: exact_gradient(r, variant), rewards_sa)
  per_seed = functools.partial(gradient_error, variant=variant, n=n, num_draws=num_draws)
  return jax.lax.map(lambda args: per_seed(*args), (keys_s, rewards_sa, exact_grads_sa))
