"""The mean aggregator, f = (1/k) sum of the k rewards: closed forms without a sort.

f is linear, so its subset averages (see `ksjax.objectives.advantages`) are
phi_m(i) = (r_i + (m - 1) rbar_{-i}) / m and psi_m(i) = rbar_{-i}, with rbar_{-i} the mean of the
other n - 1 rewards. Hence

  none:            w_i = (k/n) phi_k(i) = (r_i + (k - 1) rbar_{-i}) / n
  every leave-out: w_i = (k/n)(phi_k - psi_{k-1}) = (m/n)(phi_m - psi_m) = (r_i - rbar) / (n - 1),

the last independent of k and p: RLOO's advantage r_i - rbar_{-i} times 1/n (the paper's 1/k
factor when n = k).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnames="k")
def none(rewards_gn: jax.Array, k: int) -> jax.Array:
  """REINFORCE weights (k/n) phi_k(i), [G, n]."""
  n = rewards_gn.shape[-1]
  if k == 1:  # The 1-sample objective: each sample's weight is its reward, averaged over n.
    return rewards_gn / n
  others_mean_gn = (jnp.sum(rewards_gn, axis=-1, keepdims=True) - rewards_gn) / (n - 1)
  return (rewards_gn + (k - 1) * others_mean_gn) / n


@jax.jit
def leave_out(rewards_gn: jax.Array) -> jax.Array:
  """Weights of loo, loo_demeaned and leave_p_out, all equal for the mean: (r_i - rbar)/(n - 1)."""
  n = rewards_gn.shape[-1]
  return (rewards_gn - jnp.mean(rewards_gn, axis=-1, keepdims=True)) / (n - 1)


def objective(rewards_gn: jax.Array) -> jax.Array:
  """U-statistic estimate of E[f(y_1..y_k)] for every k: the group mean, [G]."""
  return jnp.mean(rewards_gn, axis=-1)


@functools.partial(jax.jit, static_argnames="k")
def centred(rewards_gn: jax.Array, k: int) -> jax.Array:
  """phi_k(i) - rbar = (n-k)/(k(n-1)) (r_i - rbar), k < n, [G, n] (`normalized.py`)."""
  n = rewards_gn.shape[-1]
  return (n - k) / k * leave_out(rewards_gn)


@functools.partial(jax.jit, static_argnames="k")
def subset_std(rewards_gn: jax.Array, k: int) -> jax.Array:
  """Standard deviation of the mean of k rewards over the C(n, k) k-subsets, [G, 1]: a sample
  mean drawn without replacement, variance (n-k)/(k(n-1)) times the group's population variance."""
  n = rewards_gn.shape[-1]
  return jnp.sqrt((n - k) / (k * (n - 1)) * jnp.var(rewards_gn, axis=-1, keepdims=True))
