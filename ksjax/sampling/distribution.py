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

import math

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


def draw(keys_b: jax.Array, z_bv: jax.Array) -> tuple[jax.Array, jax.Array]:
  """One token per row from softmax(z) (z: float32 [B, V], -inf for excluded tokens), by inverse
  CDF. Returns the tokens int32 [B] and logsumexp(z) float32 [B].

  Row b draws u ~ U[0, 1) from keys_b[b] and returns the token whose cumulative-probability
  interval contains u. Why by hand: `jax.random.categorical` (Gumbel-max) needs V random numbers
  and two logarithms per entry, more than a whole decode step of a small model on CPU; this needs
  one uniform per row. The search is two-level, over blocks of ~sqrt(V) tokens and then within one
  block, because a cumulative sum over all V entries is itself slow on CPU (and less exact).
  Excluded tokens have zero width and are not returned. Float32 sums move the interval boundaries
  by ~1e-7 of the mass, far below sampling noise; the log-probs reported are the tokens' exact log q.
  """
  b, v = z_bv.shape
  block = 1 << max(0, math.isqrt(v - 1).bit_length())  # a power of two >= sqrt(V)
  blocks = -(-v // block)
  max_b1 = jnp.max(z_bv, axis=-1, keepdims=True)
  w_bv = jnp.exp(z_bv - max_b1)  # unnormalised probabilities, the largest 1
  w_bnk = jnp.pad(w_bv, ((0, 0), (0, blocks * block - v))).reshape(b, blocks, block)
  block_cdf_bn = jnp.cumsum(w_bnk.sum(axis=-1), axis=-1)
  total_b = block_cdf_bn[:, -1]
  x_b = jax.vmap(jax.random.uniform)(keys_b) * total_b  # u < 1, so x < total
  j_b = jnp.minimum(jnp.sum(block_cdf_bn <= x_b[:, None], axis=-1), blocks - 1)
  before_b = jnp.where(j_b > 0, jnp.take_along_axis(block_cdf_bn, j_b[:, None] - 1, -1)[:, 0], 0.0)
  w_bk = jnp.take_along_axis(w_bnk, j_b[:, None, None], axis=1)[:, 0]  # the chosen block
  i_b = jnp.sum(jnp.cumsum(w_bk, axis=-1) <= (x_b - before_b)[:, None], axis=-1)
  # Rounding can step past the block's last positive weight: take that token instead.
  last_b = block - 1 - jnp.argmax((w_bk > 0)[:, ::-1], axis=-1)
  i_b = jnp.where(jnp.take_along_axis(w_bk, jnp.minimum(i_b, block - 1)[:, None], -1)[:, 0] > 0,
                  jnp.minimum(i_b, block - 1), last_b)
  return (j_b * block + i_b).astype(jnp.int32), max_b1[:, 0] + jnp.log(total_b)


def choose(logits_bv: jax.Array, keys_b: jax.Array,
           cfg: SamplerConfig) -> tuple[jax.Array, jax.Array]:
  """Next token of each row and its log-prob (see module doc): int32 [B], float32 [B].

  `keys_b` holds one PRNG key per row, so a row's draw does not depend on the batch around it
  (its padding, its sharding).
  """
  if cfg.greedy:
    z_bv = logits_bv.astype(jnp.float32)
    # argmax as the first index of the maximum (XLA's CPU argmax reduction is several times slower)
    max_b1 = jnp.max(z_bv, axis=-1, keepdims=True)
    vocab_v = jnp.arange(z_bv.shape[-1], dtype=jnp.int32)
    token_b = jnp.min(jnp.where(z_bv == max_b1, vocab_v, z_bv.shape[-1] - 1), axis=-1)
    lse_b = max_b1[:, 0] + jnp.log(jnp.sum(jnp.exp(z_bv - max_b1), axis=-1))
  else:
    z_bv = truncated_logits(logits_bv, cfg.temperature, cfg.top_k, cfg.top_p)
    token_b, lse_b = draw(keys_b, z_bv)
  return token_b, jnp.take_along_axis(z_bv, token_b[:, None], axis=-1)[:, 0] - lse_b
