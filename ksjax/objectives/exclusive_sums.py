"""Exclusive cumulative sums along the sample axis: sum_{j<i} x_j and sum_{j>i} x_j, [G, n].

Formed by shifting an inclusive cumulative sum, never by subtracting x_i from it: terms that are
exactly 0 then add exact zeros, which keeps the sort-based pass@k weights exact on ties, and
leave-one-out sums of positive terms cannot cancel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def before(values_gn: jax.Array) -> jax.Array:
  """sum_{j<i} values[:, j], [G, n]."""
  zeros_g1 = jnp.zeros_like(values_gn[:, :1])
  return jnp.concatenate([zeros_g1, jnp.cumsum(values_gn, axis=-1)[:, :-1]], axis=-1)


def after(values_gn: jax.Array) -> jax.Array:
  """sum_{j>i} values[:, j], [G, n]."""
  return jnp.flip(before(jnp.flip(values_gn, axis=-1)), axis=-1)
