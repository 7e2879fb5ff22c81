"""The trainer's token-level losses (ksjax.trainer.losses), proven on exact enumerations.

The central check: on a tiny sequence policy whose every sequence can be enumerated, the
policy-gradient loss with token_sum weights, fed the k-sample weights of ksjax.objectives, has an
expected gradient equal to the exact gradient of the k-sample objective (times the constant).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ksjax import objectives
from ksjax.trainer import losses



def _mask(lengths, t):
  return np.arange(t)[None, :] < np.asarray(lengths)[:, None]


def test_token_weights_follow_each_mode_and_skip_padding_rows():
  mask = _mask([3, 1, 0, 4], 5)  # row 2 is a padding row
  seq = np.asarray(losses.token_weights(mask, "seq_mean_token_mean"))
  np.testing.assert_allclose(seq.sum(1), [1 / 3, 1 / 3, 0, 1 / 3], rtol=1e-6)
  np.testing.assert_allclose(seq[0, :3], 1 / 9, rtol=1e-6)
  tok = np.asarray(losses.token_weights(mask, "token_mean"))
  np.testing.assert_allclose(tok[mask], 1 / 8, rtol=1e-6)
  total = np.asarray(losses.token_weights(mask, "token_sum", constant=10.0))
  np.testing.assert_allclose(total[mask], 1 / 30, rtol=1e-6)
  for w in (seq, tok, total):
    assert np.all(w[~mask] == 0)
  np.testing.assert_allclose(losses.sequence_weights(mask), [1 / 3, 1 / 3, 0, 1 / 3], rtol=1e-6)
  with pytest.raises(ValueError, match="constant"):
    losses.token_weights(mask, "token_sum")
  with pytest.raises(ValueError, match="mode"):
    losses.token_weights(mask, "sum")


@pytest.mark.parametrize("aggregator,baseline,k,n", [
    ("pass_at_k", "loo", 2, 2), ("pass_at_k", "loo", 2, 3), ("pass_at_k", "loo_demeaned", 3, 3),
    ("mean", "loo", 2, 2), ("majority_vote", "loo", 3, 3)])
def test_policy_gradient_loss_is_the_k_sample_estimator(aggregator, baseline, k, n):
  """E over n-tuples of sequences of grad(loss) * (n C) = -grad of the estimator's target."""
  with jax.enable_x64(True):
    _check_policy_gradient_loss(aggregator, baseline, k, n)


def _check_policy_gradient_loss(aggregator, baseline, k, n):
  t, v = 2, 2  # 4 sequences of 2 tokens; the answer (majority voting) is the last token
  rng = np.random.default_rng(0)
  theta = jnp.asarray(rng.normal(size=(t, v)))
  seqs = np.asarray(list(itertools.product(range(v), repeat=t)))  # [S, T]
  if aggregator == "majority_vote":
    reward_s = np.where(seqs[:, -1] == 1, 1.0, -1.0)  # one reward per answer class
  else:
    reward_s = rng.choice([-1.0, 1.0], size=len(seqs))
  constant = 5.0
  weights_nt = losses.token_weights(np.ones((n, t), bool), "token_sum", constant=constant)

  def seq_logp(theta):  # [S, T] log pi of each token of each sequence
    return jax.nn.log_softmax(theta, -1)[jnp.arange(t)[None], seqs]

  # Every n-tuple of sequences at once: G = S^n groups of n completions.
  tuples_gn = np.asarray(list(itertools.product(range(len(seqs)), repeat=n)))
  adv_gn = objectives.k_sample_advantages(
      jnp.asarray(reward_s[tuples_gn]), aggregator=aggregator, baseline=baseline, k=k,
      answer_ids=seqs[tuples_gn][..., -1])

  def expected_loss(theta):
    logp_st = seq_logp(theta)
    prob_g = jax.lax.stop_gradient(jnp.exp(logp_st.sum(-1))[tuples_gn].prod(-1))
    loss_g = jax.vmap(lambda logp_nt, adv_n: (weights_nt * losses.policy_gradient(
        logp_nt, adv_n, jnp.ones_like(logp_nt))).sum())(logp_st[tuples_gn], adv_gn)
    return (prob_g * loss_g).sum()

  # The target objective by enumeration: f over k samples (k - 1 for loo_demeaned).
  m = k - 1 if baseline == "loo_demeaned" else k
  subsets = np.asarray(list(itertools.product(range(len(seqs)), repeat=m)))
  r = reward_s[subsets]
  if aggregator == "pass_at_k":
    f = r.max(-1)
  elif aggregator == "mean":
    f = r.mean(-1)
  else:
    f = []
    for row in seqs[subsets][..., -1]:
      counts = np.bincount(row, minlength=v)
      winners = np.flatnonzero(counts == counts.max())
      f.append(np.mean(np.where(winners == 1, 1.0, -1.0)))
    f = np.asarray(f)

  def target(theta):
    return (jnp.exp(seq_logp(theta).sum(-1))[subsets].prod(-1) * f).sum()

  # token_sum weights are 1 / (n C) per token, so grad(loss) = -(1 / (n C)) sum_i w_i grad log pi.
  np.testing.assert_allclose(-jax.grad(expected_loss)(theta) * n * constant,
                             jax.grad(target)(theta), atol=1e-10)


def test_truncated_importance_weight_and_policy_gradient_scale():
  logp = jnp.log(jnp.asarray([[0.5, 0.2, 0.9]]))
  behaviour = jnp.log(jnp.asarray([[0.25, 0.4, 0.3]]))
  w = losses.truncated_is_weight(logp, behaviour, cap=2.5)
  np.testing.assert_allclose(w, [[2.0, 0.5, 2.5]], rtol=1e-6)
  np.testing.assert_array_equal(losses.truncated_is_weight(logp, behaviour, None), 1.0)
  # The weight is a constant: the gradient of rho * A * logp is rho * A.
  grad = jax.grad(lambda lp: losses.policy_gradient(lp, jnp.asarray([3.0]),
                                                    losses.truncated_is_weight(lp, behaviour, 2.5)
                                                    ).sum())(logp)
  np.testing.assert_allclose(grad, -3.0 * np.asarray([[2.0, 0.5, 2.5]]), rtol=1e-6)


@pytest.mark.parametrize("advantage", [2.0, -1.5])
def test_clipped_surrogate_matches_ppo_on_a_ratio_grid(advantage):
  eps = 0.2
  ratios = jnp.linspace(0.5, 1.5, 40)[None]  # no point on the ties at 1 +- eps
  old = jnp.zeros_like(ratios)
  logp = jnp.log(ratios)
  loss, clipped = losses.clipped_surrogate(logp, old, jnp.asarray([advantage]), jnp.ones_like(logp),
                                           eps)
  r = np.asarray(ratios)
  expected = -np.minimum(r * advantage, np.clip(r, 1 - eps, 1 + eps) * advantage)
  np.testing.assert_allclose(loss, expected, rtol=1e-6)
  active = (r > 1 + eps) if advantage > 0 else (r < 1 - eps)
  np.testing.assert_array_equal(clipped, active)
  grad = jax.grad(lambda lp: losses.clipped_surrogate(lp, old, jnp.asarray([advantage]),
                                                      jnp.ones_like(lp), eps)[0].sum())(logp)
  np.testing.assert_array_equal(np.asarray(grad)[active], 0.0)
  np.testing.assert_allclose(np.asarray(grad)[~active], -advantage * r[~active], rtol=1e-6)


def test_clipped_value_loss():
  old = jnp.asarray([0.0, 0.0, 0.0, 1.0])
  values = jnp.asarray([0.1, 0.5, -0.5, 1.1])
  returns = jnp.asarray([1.0, 1.0, 1.0, -1.0])
  loss, clipped = losses.clipped_value_loss(values, old, returns, alpha=0.2)
  v, o, ret = map(np.asarray, (values, old, returns))
  expected = 0.5 * np.maximum((v - ret) ** 2, (o + np.clip(v - o, -0.2, 0.2) - ret) ** 2)
  np.testing.assert_allclose(loss, expected, rtol=1e-6)
  np.testing.assert_array_equal(clipped, [False, True, False, False])
  grad = jax.grad(lambda x: losses.clipped_value_loss(x, old, returns, 0.2)[0].sum())(values)
  assert grad[1] == 0.0  # the clipped branch is constant in V


def test_kl_estimators_are_unbiased_and_k3_is_nonnegative():
  rng = np.random.default_rng(1)
  pi = jax.nn.softmax(jnp.asarray(rng.normal(size=7)))
  ref = jax.nn.softmax(jnp.asarray(rng.normal(size=7)))
  exact = float(jnp.sum(pi * (jnp.log(pi) - jnp.log(ref))))
  for estimator in losses.KL_ESTIMATORS:
    per_token = losses.kl_per_token(jnp.log(pi), jnp.log(ref), estimator)
    np.testing.assert_allclose(float(jnp.sum(pi * per_token)), exact, rtol=1e-5)
  k3 = losses.kl_per_token(jnp.log(pi), jnp.log(ref), "k3")
  assert float(k3.min()) >= 0.0
  assert float(losses.kl_per_token(jnp.log(pi), jnp.log(pi), "k3").max()) == 0.0
  with pytest.raises(ValueError, match="estimator"):
    losses.kl_per_token(jnp.log(pi), jnp.log(ref), "k2")
