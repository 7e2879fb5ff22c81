"""Token-level policy-gradient losses, pure: arrays in, arrays out.

A batch holds R completions (rows) of length T; a completion's tokens are the positions where
`weight_rt > 0`. Every loss here is written as a weighted *sum* over tokens,

  loss = sum_{r,t} c_rt * l_rt,

with the per-token weights c_rt fixed by `token_weights` from the whole batch before it is cut
into micro-batches or before rows are dropped. Two things follow, and the trainer relies on both:
gradient accumulation is a plain sum of micro-batch gradients, and a row whose every l_rt is 0
(advantage exactly 0, no value or KL term) can be left out of the backward pass without changing
the update (`ksjax.trainer.sparse`).

Aggregation modes (ESTIMATORS.md, "Token-level losses"), B the number of completions in the batch
and L_r the length of completion r:
  * "seq_mean_token_mean" (GRPO): c_rt = 1 / (B L_r), the mean over sequences of token means;
  * "token_mean" (DAPO): c_rt = 1 / sum_r L_r, the mean over every token of the batch;
  * "token_sum" (Dr. GRPO): c_rt = 1 / (B C) for a constant C (the generation budget). With it the
    policy-gradient loss is -(1 / (B C)) sum_r A_r log pi(y_r): exactly the k-sample estimator
    sum_i w_i grad log pi(y_i) of `ksjax.objectives`, scaled by a constant, so the estimator's
    (un)biasedness survives. The two mean modes reweight sequences by 1 / L_r and do not.

Per-token terms:
  * plain policy gradient: l_t = -rho_t A log pi(y_t), rho_t = min(pi(y_t) / mu(y_t), C_is) held
    constant (truncated importance sampling, Yao et al. 2025 "TIS"), mu the policy that sampled;
    rho = 1 turns it off. On-policy rho = 1 and the gradient is the REINFORCE one.
  * clipped surrogate (PPO, GRPO, Dr. GRPO; paper appendix):
    l_t = -rho_t min(q_t A, clip(q_t, 1 - eps, 1 + eps) A), q_t = pi(y_t) / pi_old(y_t), and the
    truncated weight rho_t = min(pi_old / mu, C_is) corrects the sampler's mismatch with the learner.
  * group-level importance weights (`group_is_weight`): one weight for every token of a prompt's
    n completions, rho = min(prod over the group's tokens of pi / mu, C_is). A k-sample weight
    w_i depends on all n samples of its group, so per-token weights correct only the sample's own
    factor of the group's probability and leave the others at mu: unbiased for the mean
    objective, biased for pass@k or majority voting (tests/trainer/test_async_rollouts.py shows
    both by exact enumeration). The group's whole likelihood ratio is unbiased at C_is = inf, at
    the price of a variance that grows with the group's length.
  * value loss (PPO): 0.5 max((V - R)^2, (clip(V, V_old - alpha, V_old + alpha) - R)^2) per
    completion, V = V(x) read at the prompt's last token, R the k-sample advantage.
  * KL to the reference policy per token: k1 = log pi - log pi_ref (unbiased for KL(pi, pi_ref)
    when y ~ pi, can be negative), k3 = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1
    (unbiased, never negative, lower variance; Schulman 2020).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ksjax.run.spec import KL_ESTIMATORS, LOSS_AGGREGATIONS

# The choices, named once with the spec that selects them.
AGGREGATIONS = LOSS_AGGREGATIONS


def token_weights(mask_rt: jax.Array, mode: str, *, constant: float | None = None) -> jax.Array:
  """Per-token loss weights c_rt, float32 [R, T], from a whole batch's completion mask.

  Args:
    mask_rt: bool [R, T], True on the tokens the loss trains (the completions). Rows without any
      token (batch padding) get weight 0 and are not counted as sequences.
    mode: one of AGGREGATIONS.
    constant: the C of "token_sum" (e.g. max_new_tokens); required by it, ignored otherwise.
  """
  if mode not in AGGREGATIONS:
    raise ValueError(f"mode={mode!r} is not accepted; expected one of {', '.join(AGGREGATIONS)}")
  mask_rt = mask_rt.astype(jnp.float32)
  lengths_r = mask_rt.sum(-1)
  num_seqs = jnp.maximum((lengths_r > 0).sum(), 1).astype(jnp.float32)
  if mode == "seq_mean_token_mean":
    return mask_rt / (num_seqs * jnp.maximum(lengths_r, 1.0))[:, None]
  if mode == "token_mean":
    return mask_rt / jnp.maximum(lengths_r.sum(), 1.0)
  if constant is None or not constant > 0:
    raise ValueError(f"constant={constant!r} is not accepted with mode='token_sum'; expected > 0")
  return mask_rt / (num_seqs * constant)


def sequence_weights(mask_rt: jax.Array) -> jax.Array:
  """float32 [R]: 1 / B for each of the B rows that hold a completion, 0 for padding rows (the
  mean over completions of a per-completion term such as the value loss)."""
  has_tokens_r = mask_rt.any(-1).astype(jnp.float32)
  return has_tokens_r / jnp.maximum(has_tokens_r.sum(), 1.0)


def truncated_is_weight(logp_rt: jax.Array, behaviour_logp_rt: jax.Array,
                        cap: float | None) -> jax.Array:
  """min(exp(logp - behaviour_logp), cap) without gradient; 1 everywhere when cap is None."""
  if cap is None:
    return jnp.ones_like(logp_rt)
  ratio_rt = jnp.exp(jax.lax.stop_gradient(logp_rt) - behaviour_logp_rt)
  return jnp.minimum(ratio_rt, cap)


def group_is_weight(log_ratio_r: jax.Array, group_size: int, cap: float) -> jax.Array:
  """min(exp(sum of the group's log-ratios), cap) for every row, float32 [R].

  Args:
    log_ratio_r: [R] per-row sums over completion tokens of log pi - log mu, rows prompt-major
      (groups of `group_size` consecutive rows).
    group_size: n, the completions of one prompt.
    cap: C_is; inf for the untruncated weight.
  """
  log_w_g = log_ratio_r.reshape(-1, group_size).sum(-1)
  # The minimum is taken in log space: exp of a long group's sum overflows before the cap.
  w_g = jnp.exp(jnp.minimum(log_w_g, jnp.log(cap)))
  return jnp.repeat(w_g, group_size)


def policy_gradient(logp_rt: jax.Array, advantage_r: jax.Array, is_weight_rt: jax.Array) -> jax.Array:
  """Per-token REINFORCE loss -rho A log pi(y_t), float32 [R, T] (weight it with token_weights)."""
  return -jax.lax.stop_gradient(is_weight_rt) * advantage_r[:, None] * logp_rt


def clipped_surrogate(logp_rt: jax.Array, old_logp_rt: jax.Array, advantage_r: jax.Array,
                      is_weight_rt: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
  """PPO's per-token clipped loss -rho min(q A, clip(q, 1-eps, 1+eps) A), and where the clip is
  active (the gradient of that token is 0), both [R, T]."""
  ratio_rt = jnp.exp(logp_rt - old_logp_rt)
  a_r1 = advantage_r[:, None]
  unclipped_rt = ratio_rt * a_r1
  clipped_rt = jnp.clip(ratio_rt, 1.0 - eps, 1.0 + eps) * a_r1
  loss_rt = -jax.lax.stop_gradient(is_weight_rt) * jnp.minimum(unclipped_rt, clipped_rt)
  return loss_rt, clipped_rt < unclipped_rt


def clipped_value_loss(values_r: jax.Array, old_values_r: jax.Array, returns_r: jax.Array,
                       alpha: float) -> tuple[jax.Array, jax.Array]:
  """0.5 max((V - R)^2, (clip(V, V_old - alpha, V_old + alpha) - R)^2) per row, and whether the
  clipped branch is the larger (its gradient is then 0), both [R]."""
  clipped_r = old_values_r + jnp.clip(values_r - old_values_r, -alpha, alpha)
  plain_r = jnp.square(values_r - returns_r)
  bounded_r = jnp.square(clipped_r - returns_r)
  return 0.5 * jnp.maximum(plain_r, bounded_r), bounded_r > plain_r


def kl_per_token(logp_rt: jax.Array, ref_logp_rt: jax.Array, estimator: str) -> jax.Array:
  """Per-token estimate of KL(pi, pi_ref) from tokens sampled from pi, [R, T]."""
  log_ratio_rt = ref_logp_rt - logp_rt
  if estimator == "k1":
    return -log_ratio_rt
  if estimator == "k3":
    return jnp.expm1(log_ratio_rt) - log_ratio_rt  # expm1: exact near 0, never negative
  raise ValueError(f"estimator={estimator!r} is not accepted; expected one of "
                   f"{', '.join(KL_ESTIMATORS)}")
