"""Why pass@k training moved less KL per step under Adam on the embedded task but not on SmolLM2's
12 steps (ksjax/bandit/movement.py): on a bandit with two right answers of twenty (start
p(right) 0.15), pass@4 leave-one-out against the mean (RLOO), 256 seeds of 60 updates of 4
groups. Under SGD the step follows the gradient's norm and pass@4's is about twice the mean's,
so it moves several times the KL per step from the first step on; under Adam its first steps move
no further than the mean's (the magnitudes cancel), and once its estimate is zero in a share of
the steps (no group with exactly one right answer) it moves less. Ratios of means over 256
seeds, with margins far wider than their seed-to-seed spread, so no CPU's rounding decides."""

import jax
import jax.numpy as jnp
import optax

from ksjax.bandit import movement
from ksjax.bandit.variants import Variant


def _moved(optimizer):
  rewards = jnp.zeros(20).at[:2].set(1.0)
  theta = jnp.zeros(20).at[:2].set(0.5)
  return {agg: movement.movement(Variant(agg, "loo", k=4), optimizer, theta, rewards, steps=60,
                                 groups=4, n=4, seeds=256, key=jax.random.key(0))
          for agg in ("mean", "pass_at_k")}


def _ratio(moved, what, lo, hi):
  """pass@k's mean over steps lo..hi-1 and seeds over the mean's."""
  return float(moved["pass_at_k"][what][:, lo:hi].mean() / moved["mean"][what][:, lo:hi].mean())


def test_sgd_moves_pass_at_k_further_per_step_with_its_larger_gradients():
  sgd = _moved(optax.sgd(0.3))
  assert _ratio(sgd, "grad_norm", 0, 3) > 1.8  # about 2.4
  assert _ratio(sgd, "kl", 0, 3) > 4.0  # about 7.7: the squared norm ratio's order


def test_adam_cancels_the_magnitudes_first_and_moves_pass_at_k_less_once_its_signal_is_sparse():
  adam = _moved(optax.adam(0.02))
  assert 0.75 < _ratio(adam, "kl", 0, 3) < 1.4  # about 1.07, against 7.7 under SGD
  assert _ratio(adam, "nonzero", 30, 60) < 0.9  # pass@4's estimate is zero more often
  assert _ratio(adam, "kl", 30, 60) < 0.85  # about 0.65: less KL per step
