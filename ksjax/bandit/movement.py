"""How far each update moves the policy, by estimator and optimizer: the KL-per-step question.

Two studies disagreed on whether pass@k training moves further from the start per step than
mean training (less on the embedded task at 200 steps under Adam, more, not significantly, on
SmolLM2 at 12 steps). The explanation tested here: the size of a plain gradient step follows the
gradient's norm, and pass@k's leave-one-out weights are larger than the mean's (the lone correct
sample of a group gets r_max - r_second, against (r_i - mean of the others) / k for the mean), so
under SGD pass@k moves further per step; Adam divides each coordinate by the root of its running
second moment, so in its first steps (bias-corrected, m/sqrt(v) = g/|g|) it moves every touched
coordinate by the learning rate whatever the objective and the magnitudes cancel, and later a
coordinate whose gradient is zero in a share of the steps moves less (m/sqrt(v) about p/sqrt(p)
= sqrt(p) for a gradient present in a share p of the steps): pass@k's weights are zero in every
group without exactly one correct sample, so under Adam it moves no further, then less.

`movement` trains many seeds of one softmax bandit with an optax optimizer and returns, per step,
the KL from the policy before the update to the policy after it, the gradient estimate's norm
and whether it was zero: what the regime map's optimizer cells measure on the language model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ksjax.bandit import policy_gradient
from ksjax.bandit.variants import Variant


def _kl(after_a: jax.Array, before_a: jax.Array) -> jax.Array:
  """KL(softmax(after) || softmax(before))."""
  log_after = jax.nn.log_softmax(after_a)
  return jnp.sum(jnp.exp(log_after) * (log_after - jax.nn.log_softmax(before_a)))


def movement(variant: Variant, optimizer: optax.GradientTransformation, theta_a: jax.Array,
             rewards_a: jax.Array, *, steps: int, groups: int, n: int, seeds: int,
             key: jax.Array) -> dict[str, np.ndarray]:
  """Ascends the estimator's objective from theta for `steps` updates of `groups` groups of `n`
  samples, on `seeds` independent streams; per step ([seeds, steps]): "kl" (the update's KL),
  "grad_norm" (the mean estimate's norm) and "nonzero" (whether any weight was non-zero)."""

  def run(stream):
    def step(carry, t):
      theta, state = carry
      grad = policy_gradient.gradient_estimates(jax.random.fold_in(stream, t), theta, rewards_a,
                                                variant, groups, n).mean(0)
      updates, state = optimizer.update(-grad, state, theta)  # optax descends: ascend J
      after = optax.apply_updates(theta, updates)
      return (after, state), (_kl(after, theta), jnp.linalg.norm(grad), jnp.any(grad != 0))
    _, out = jax.lax.scan(step, (theta_a, optimizer.init(theta_a)), jnp.arange(steps))
    return out

  kl, norm, nonzero = jax.jit(jax.vmap(run))(jax.random.split(key, seeds))
  return {"kl": np.asarray(kl), "grad_norm": np.asarray(norm), "nonzero": np.asarray(nonzero)}
