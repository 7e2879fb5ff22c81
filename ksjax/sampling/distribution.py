"""The next-token distribution the sampler draws from, and the draw itself (pure functions).

For temperature tau > 0, top-k k and top-p p the sampler draws from

  q(v) = softmax(logits / tau)(v) * [v in S] / Z,   Z = sum_{u in S} softmax(logits / tau)(u),

where S is built in the order of transformers' logits warpers (temperature, then top-k, then top-p):
  * top-k (k > 0): the tokens whose scaled logit is >= the k-th largest (ties with it are kept);
  * top-p (p < 1): of those, by decreasing probability under the top-k-renormalised distribution,
    every token whose predecessors hold less than p of the mass: the smallest prefix holding >= p
    (ties with the last kept logit are kept).
The log-probability returned with each token is log q(token), i.e. AFTER truncation. Without
truncation (k = 0, p = 1) it is log softmax(logits / tau)(token), what `model.token_logprobs`
computes at the same temperature; with truncation it is that minus log Z (Z <= 1).

Greedy decoding (tau = 0) returns argmax(logits) (first index on ties) with log softmax(logits) at
temperature 1: the sampled distribution is a point mass, so its log-prob (0) carries no
information, whereas the model's own log-prob of the greedy token is a useful confidence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ksjax.sampling.config import SamplerConfig


def truncated_logits(logits_bv: jax.Array, temperature: float, top_k: int,
                     top_p: float) -> jax.Array:
  """float32 [B, V]: logits / temperature, -inf outside the top-k and top-p set (see module doc).

  log_softmax of the result is log q. `temperature` must be > 0; `top_k` 0 and `top_p` 1 disable
  their truncation.
  """
  z_bv = logits_bv.astype(jnp.float32) / temperature
  v = z_bv.shape[-1]
  sorted_bk = None  # the kept logits in decreasing order, where a sort was needed anyway
  if 0 < top_k < v:
    sorted_bk = jax.lax.top_k(z_bv, top_k)[0]
    z_bv = jnp.where(z_bv >= sorted_bk[:, -1:], z_bv, -jnp.inf)
  if top_p < 1:
    if sorted_bk is None:
      sorted_bk = jax.lax.top_k(z_bv, v)[0]
    # Probabilities of the sorted logits under the distribution truncated so far (top-k ties
    # included in the normaliser).
    p_bk = jnp.exp(sorted_bk - jax.nn.logsumexp(z_bv, axis=-1, keepdims=True))
    mass_before_bk = jnp.cumsum(p_bk, axis=-1) - p_bk
    keep_bk = mass_before_bk < top_p  # the first token always (mass 0 before it)
    threshold_b1 = jnp.min(jnp.where(keep_bk, sorted_bk, jnp.inf), axis=-1, keepdims=True)
    z_bv = jnp.where(z_bv >= threshold_b1, z_bv, -jnp.inf)
  return z_bv


def choose(logits_bv: jax.Array, keys_b: jax.Array,
           cfg: SamplerConfig) -> tuple[jax.Array, jax.Array]:
  """Next token of each row and its log-prob (see module doc): int32 [B], float32 [B].

  `keys_b` holds one PRNG key per row, so a row's draw does not depend on the batch around it
  (its padding, its sharding).
  """
  if cfg.greedy:
    token_b = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    logq_bv = jax.nn.log_softmax(logits_bv.astype(jnp.float32), axis=-1)
  else:
    z_bv = truncated_logits(logits_bv, cfg.temperature, cfg.top_k, cfg.top_p)
    token_b = jax.vmap(jax.random.categorical)(keys_b, z_bv).astype(jnp.int32)
    logq_bv = jax.nn.log_softmax(z_bv, axis=-1)
  logp_b = jnp.take_along_axis(logq_bv, token_b[:, None], axis=-1)[:, 0]
  return token_b, logp_b
