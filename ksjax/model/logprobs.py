"""Per-token log-probabilities and entropies of given sequences, for RL objectives.

For a 128k vocabulary the [B, T, V] float32 logits of a training batch are larger than the model's
activations, so they are never formed: the sequence is cut into chunks (`jax.lax.map`) and, within
a chunk, the vocabulary into slices (`jax.lax.scan`) over which the log-sum-exp, the chosen logit
and the entropy are accumulated online (running max rescaling, as in flash attention). Both loops
are rematerialised (`jax.checkpoint`) so the backward pass also holds one [B, C, Vc] slice at a
time. All of it is float32: log p = chosen logit - logsumexp.

jax has no fused "cross-entropy over a sharded, chunked vocabulary" primitive (optax's
`softmax_cross_entropy_with_integer_labels` needs the full logits), hence the hand-written loop.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ksjax.model import sharding

DEFAULT_SEQ_CHUNK = 128
DEFAULT_VOCAB_CHUNK = 8192
_MASKED = -1e30


def chunked_logprobs(hidden_bnd: jax.Array, w: jax.Array, vocab_axis: int,
                     targets_bn: jax.Array, temperature: float = 1.0,
                     seq_chunk: int = DEFAULT_SEQ_CHUNK,
                     vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
                     operand_dtype=None) -> tuple[jax.Array, jax.Array]:
  """log softmax(h @ W / temperature)[target] and the entropy of that softmax, float32 [B, N].

  The product h @ W takes both operands in `operand_dtype` (default: h's dtype), accumulated in
  float32, as `Llama.logits` computes it (`LlamaConfig.operand_dtype`).

  `w` is the head matrix, [V, D] when `vocab_axis` is 0 or [D, V] when 1; it is sliced, never
  copied whole. Peak extra memory is O(B * seq_chunk * vocab_chunk) rather than O(B * N * V).

  Under a tracing mesh that splits the vocabulary S ways (tensor parallelism), the vocabulary is
  viewed as [S, V/S] and each step takes `vocab_chunk` columns of every shard ([S, Vc], each
  device its own [Vc]): a dynamic slice across the split axis would make XLA gather the whole head
  onto every device.
  """
  b, n, d = hidden_bnd.shape
  v = w.shape[vocab_axis]
  shards = sharding.axis_size("vocab")
  shards = shards if v % shards == 0 else 1
  vs = v // shards  # columns per shard
  c = min(seq_chunk, n)
  vc = min(vocab_chunk, vs)
  n_chunks, n_vocab = -(-n // c), -(-vs // vc)
  pad = n_chunks * c - n
  operand_dtype = hidden_bnd.dtype if operand_dtype is None else operand_dtype
  h_kbcd = jnp.pad(hidden_bnd.astype(operand_dtype), ((0, 0), (0, pad), (0, 0)))
  h_kbcd = h_kbcd.reshape(b, n_chunks, c, d)
  h_kbcd = h_kbcd.transpose(1, 0, 2, 3)
  tgt_kbc = jnp.pad(targets_bn, ((0, 0), (0, pad))).reshape(b, n_chunks, c).transpose(1, 0, 2)
  inv_temp = 1.0 / temperature
  if vocab_axis == 0:
    w_split, slice_axis, spec = w.reshape(shards, vs, d), 1, "bcd,svd->bcsv"  # [S, V/S, D]
  else:
    w_split, slice_axis, spec = w.reshape(d, shards, vs), 2, "bcd,dsv->bcsv"  # [D, S, V/S]
  shard_start_s = jnp.arange(shards) * vs

  def vocab_step(h_bcd, tgt_bc, carry, i):
    m_bc, s_bc, zs_bc, chosen_bc = carry
    # The last slice is shifted back to stay in range; columns already seen are masked out.
    start = jnp.minimum(i * vc, vs - vc)
    w_slice = jax.lax.dynamic_slice_in_dim(w_split, start, vc, axis=slice_axis)
    z_bcsv = jnp.einsum(spec, h_bcd, w_slice.astype(operand_dtype),
                        preferred_element_type=jnp.float32) * inv_temp
    local_v = start + jnp.arange(vc)
    fresh_v = local_v >= i * vc
    # A finite stand-in for -inf: exp() of it is 0 and, unlike -inf, 0 * it is not NaN in the
    # backward pass.
    z_bcsv = jnp.where(fresh_v, z_bcsv, _MASKED)
    m_new = jnp.maximum(m_bc, z_bcsv.max((-2, -1)))
    rescale = jnp.exp(m_bc - m_new)
    e_bcsv = jnp.exp(z_bcsv - m_new[..., None, None])
    s_bc = s_bc * rescale + e_bcsv.sum((-2, -1))
    zs_bc = zs_bc * rescale + jnp.where(fresh_v, e_bcsv * z_bcsv, 0.0).sum((-2, -1))
    col_sv = shard_start_s[:, None] + local_v[None, :]
    hit_bcsv = (col_sv == tgt_bc[..., None, None]) & fresh_v
    chosen_bc = chosen_bc + jnp.where(hit_bcsv, z_bcsv, 0.0).sum((-2, -1))
    return (m_new, s_bc, zs_bc, chosen_bc), None

  @jax.checkpoint
  def seq_chunk_fn(args):
    h_bcd, tgt_bc = args
    zeros = jnp.zeros(tgt_bc.shape, jnp.float32)
    init = (jnp.full(tgt_bc.shape, -jnp.inf, jnp.float32), zeros, zeros, zeros)
    step = jax.checkpoint(functools.partial(vocab_step, h_bcd, tgt_bc))
    (m_bc, s_bc, zs_bc, chosen_bc), _ = jax.lax.scan(step, init, jnp.arange(n_vocab))
    lse_bc = m_bc + jnp.log(s_bc)
    # H = -sum p z + lse, with sum p z = zs / s.
    return chosen_bc - lse_bc, lse_bc - zs_bc / s_bc

  logp_kbc, ent_kbc = jax.lax.map(seq_chunk_fn, (h_kbcd, tgt_kbc))
  unchunk = lambda x: x.transpose(1, 0, 2).reshape(b, n_chunks * c)[:, :n]
  return unchunk(logp_kbc), unchunk(ent_kbc)


def token_logprobs(llama, tokens_bt: jax.Array, attention_mask_bt: jax.Array | None = None,
                   temperature: float = 1.0, seq_chunk: int = DEFAULT_SEQ_CHUNK,
                   vocab_chunk: int = DEFAULT_VOCAB_CHUNK) -> tuple[jax.Array, jax.Array]:
  """Per-token log-probs and entropies of `tokens` under `llama` at `temperature`, float32 [B, T].

  logp[b, t] = log softmax(logits[b, t-1] / temperature)[tokens[b, t]] and entropy[b, t] is the
  entropy of that distribution, for t >= 1. Both are 0 at t = 0, wherever the mask is 0, and at
  the first real token of a left-padded row (only padding precedes it, so nothing predicts it).
  """
  b, t = tokens_bt.shape
  mask_bt = (jnp.ones((b, t), bool) if attention_mask_bt is None
             else attention_mask_bt.astype(bool))
  hidden_btd = llama.hidden(tokens_bt, attention_mask=mask_bt)
  w, vocab_axis = llama.head_weight()
  logp_bn, ent_bn = chunked_logprobs(hidden_btd[:, :-1], w, vocab_axis, tokens_bt[:, 1:],
                                     temperature, seq_chunk, vocab_chunk,
                                     llama.cfg.operand_dtype)
  keep_bn = mask_bt[:, 1:] & mask_bt[:, :-1]
  pad = jnp.zeros((b, 1), jnp.float32)
  logp_bt = jnp.concatenate([pad, jnp.where(keep_bn, logp_bn, 0.0)], axis=1)
  ent_bt = jnp.concatenate([pad, jnp.where(keep_bn, ent_bn, 0.0)], axis=1)
  return logp_bt, ent_bt


def sharded_token_logprobs(llama, mesh: jax.sharding.Mesh):
  """A jitted `fn(tokens_bt, attention_mask_bt) -> logp_bt`: `token_logprobs` at temperature 1
  with the shardings of `sharding.sharded_forward` (B must divide over the batch axes)."""
  return sharding.sharded_apply(
      llama, mesh, lambda m, tokens_bt, mask_bt: token_logprobs(m, tokens_bt, mask_bt)[0],
      jax.sharding.PartitionSpec(sharding.BATCH, None))
