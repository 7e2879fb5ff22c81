"""Per-token log-probabilities and entropies of given sequences, for RL objectives.

For a 128k vocabulary the [B, T, V] float32 logits of a training batch are larger than the model's
activations, so they are never formed: the sequence is cut into chunks (`jax.lax.map`) and, within
a chunk, the vocabulary into slices (`jax.lax.scan`) over which the log-sum-exp, the chosen logit
and the entropy are accumulated online (running max rescaling, as in flash attention). The
backward pass is written by hand: it walks the same chunks again, recomputing each slice's logits
once, so it too holds one [B, C, Vc] slice at a time. All of it is float32: log p = chosen logit -
logsumexp.

jax has no fused "cross-entropy over a sharded, chunked vocabulary" primitive (optax's
`softmax_cross_entropy_with_integer_labels` needs the full logits), hence the hand-written loop.
"""

from __future__ import annotations

import dataclasses
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

  The gradient is written by hand (`_chunks_bwd`): one more pass over the chunks recomputes each
  slice's logits once and forms both products' gradients from them. Why not autodiff through
  `jax.checkpoint`ed loops: the nested rematerialisation computed every slice's logits three
  times in the backward pass and transposed each [B * C, Vc] logit gradient before the weight's
  product (benchmarks/real_model.py --parts=train).
  """
  b, n, d = hidden_bnd.shape
  v = w.shape[vocab_axis]
  shards = sharding.axis_size("vocab")
  shards = shards if v % shards == 0 else 1
  vs = v // shards  # columns per shard
  c = min(seq_chunk, n)
  vc = min(vocab_chunk, vs)
  n_chunks = -(-n // c)
  pad = n_chunks * c - n
  operand_dtype = hidden_bnd.dtype if operand_dtype is None else operand_dtype
  h_kbcd = jnp.pad(hidden_bnd.astype(operand_dtype), ((0, 0), (0, pad), (0, 0)))
  h_kbcd = h_kbcd.reshape(b, n_chunks, c, d)
  h_kbcd = h_kbcd.transpose(1, 0, 2, 3)
  tgt_kbc = jnp.pad(targets_bn, ((0, 0), (0, pad))).reshape(b, n_chunks, c).transpose(1, 0, 2)
  if vocab_axis == 0:
    w_split = w.reshape(shards, vs, d)  # [S, V/S, D]
  else:
    w_split = w.reshape(d, shards, vs)  # [D, S, V/S]
  geometry = _Chunks(vocab_axis=vocab_axis, shards=shards, vc=vc, vs=vs,
                     inv_temp=1.0 / temperature, operand_dtype=jnp.dtype(operand_dtype))
  logp_kbc, ent_kbc = _chunks(geometry, h_kbcd, w_split, tgt_kbc)
  unchunk = lambda x: x.transpose(1, 0, 2).reshape(b, n_chunks * c)[:, :n]
  return unchunk(logp_kbc), unchunk(ent_kbc)


@dataclasses.dataclass(frozen=True)
class _Chunks:
  """The static geometry of `chunked_logprobs`' loops: the head's vocabulary axis, the shards S
  of the split view (`w_split`), the slice width `vc` and the columns per shard `vs`,
  1 / temperature, and the products' operand dtype."""
  vocab_axis: int
  shards: int
  vc: int
  vs: int
  inv_temp: float
  operand_dtype: jnp.dtype

  @property
  def n_vocab(self) -> int:
    return -(-self.vs // self.vc)

  @property
  def slice_axis(self) -> int:
    """The axis of `w_split` the vocabulary slices are taken along."""
    return 1 if self.vocab_axis == 0 else 2

  @property
  def w_axes(self) -> str:
    """`w_split`'s axes in einsum letters: [S, V/S, D] or [D, S, V/S]."""
    return "svd" if self.vocab_axis == 0 else "dsv"

  def logits(self, h_bcd: jax.Array, w_split: jax.Array, i: jax.Array):
    """Slice i's float32 logits [B, C, S, Vc] / temperature, its weight slice (operand dtype),
    its start column within each shard, and which of its columns it is the first to see (the
    last slice is shifted back to stay in range; columns already seen are not fresh)."""
    start = jnp.minimum(i * self.vc, self.vs - self.vc)
    w_slice = jax.lax.dynamic_slice_in_dim(w_split, start, self.vc, axis=self.slice_axis)
    w_slice = w_slice.astype(self.operand_dtype)
    z_bcsv = jnp.einsum(f"bcd,{self.w_axes}->bcsv", h_bcd, w_slice,
                        preferred_element_type=jnp.float32) * self.inv_temp
    local_v = start + jnp.arange(self.vc)
    return z_bcsv, w_slice, start, local_v, local_v >= i * self.vc

  def hits(self, tgt_bc: jax.Array, local_v: jax.Array, fresh_v: jax.Array):
    """[B, C, S, Vc]: where a fresh column is the row's target."""
    col_sv = (jnp.arange(self.shards) * self.vs)[:, None] + local_v[None, :]
    return (col_sv == tgt_bc[..., None, None]) & fresh_v


def _chunks_forward(g: _Chunks, h_kbcd, w_split, tgt_kbc):
  """log p of the targets, the entropies and the log-sum-exps, float32 [K, B, C] each: per
  sequence chunk (`lax.map`) a scan over the vocabulary slices that accumulates the running max,
  sum of exponentials, sum of exp * logit and the target's logit (rescaled online, as in flash
  attention)."""

  def chunk(args):
    h_bcd, tgt_bc = args

    def vocab_step(carry, i):
      m_bc, s_bc, zs_bc, chosen_bc = carry
      z_bcsv, _, _, local_v, fresh_v = g.logits(h_bcd, w_split, i)
      # A finite stand-in for -inf: exp() of it is 0.
      z_bcsv = jnp.where(fresh_v, z_bcsv, _MASKED)
      m_new = jnp.maximum(m_bc, z_bcsv.max((-2, -1)))
      rescale = jnp.exp(m_bc - m_new)
      e_bcsv = jnp.exp(z_bcsv - m_new[..., None, None])
      s_bc = s_bc * rescale + e_bcsv.sum((-2, -1))
      zs_bc = zs_bc * rescale + jnp.where(fresh_v, e_bcsv * z_bcsv, 0.0).sum((-2, -1))
      hit_bcsv = g.hits(tgt_bc, local_v, fresh_v)
      chosen_bc = chosen_bc + jnp.where(hit_bcsv, z_bcsv, 0.0).sum((-2, -1))
      return (m_new, s_bc, zs_bc, chosen_bc), None

    zeros = jnp.zeros(tgt_bc.shape, jnp.float32)
    init = (jnp.full(tgt_bc.shape, -jnp.inf, jnp.float32), zeros, zeros, zeros)
    (m_bc, s_bc, zs_bc, chosen_bc), _ = jax.lax.scan(vocab_step, init, jnp.arange(g.n_vocab))
    lse_bc = m_bc + jnp.log(s_bc)
    # H = -sum p z + lse, with sum p z = zs / s.
    return chosen_bc - lse_bc, lse_bc - zs_bc / s_bc, lse_bc

  return jax.lax.map(chunk, (h_kbcd, tgt_kbc))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunks(g: _Chunks, h_kbcd, w_split, tgt_kbc):
  logp, ent, _ = _chunks_forward(g, h_kbcd, w_split, tgt_kbc)
  return logp, ent


def _chunks_fwd(g: _Chunks, h_kbcd, w_split, tgt_kbc):
  logp, ent, lse = _chunks_forward(g, h_kbcd, w_split, tgt_kbc)
  return (logp, ent), (h_kbcd, w_split, tgt_kbc, lse, ent)


def _chunks_bwd(g: _Chunks, residuals, cotangents):
  """With p = softmax(z) and z = h W / temperature, per logit:
  d log p[t] / dz = onehot(t) - p, and dH / dz = -p (log p + H) with log p = z - lse.
  Each slice's logits are recomputed once; dz [B, C, S, Vc] meets the weight slice for dh
  ([B*C, S*Vc] x [S*Vc, D]) and the hidden states, transposed once per chunk, for dW
  ([D, B*C] x [B*C, S*Vc]): both plain matmuls, no transposed copy of dz."""
  h_kbcd, w_split, tgt_kbc, lse_kbc, ent_kbc = residuals
  glogp_kbc, gent_kbc = cotangents
  _, b, c, d = h_kbcd.shape

  def chunk(dw, args):
    h_bcd, tgt_bc, lse_bc, ent_bc, glogp_bc, gent_bc = args
    h_dm = h_bcd.reshape(b * c, d).T
    col = lambda x_bc: x_bc[..., None, None]

    def vocab_step(carry, i):
      dh_bcd, dw = carry
      z_bcsv, w_slice, start, local_v, fresh_v = g.logits(h_bcd, w_split, i)
      p_bcsv = jnp.where(fresh_v, jnp.exp(z_bcsv - col(lse_bc)), 0.0)
      hit_bcsv = g.hits(tgt_bc, local_v, fresh_v)
      dz_bcsv = (col(glogp_bc) * (hit_bcsv - p_bcsv)
                 - col(gent_bc) * p_bcsv * (z_bcsv - col(lse_bc) + col(ent_bc)))
      dz_bcsv = (dz_bcsv * g.inv_temp).astype(g.operand_dtype)
      dh_bcd += jnp.einsum(f"bcsv,{g.w_axes}->bcd", dz_bcsv, w_slice,
                           preferred_element_type=jnp.float32)
      dw_dsv = jnp.einsum("dm,msv->dsv", h_dm, dz_bcsv.reshape(b * c, g.shards, g.vc),
                          preferred_element_type=jnp.float32)
      dw_slice = dw_dsv.transpose(1, 2, 0) if g.vocab_axis == 0 else dw_dsv  # w_split's layout
      # The shifted last slice's stale columns have dz = 0: adding is exact.
      old = jax.lax.dynamic_slice_in_dim(dw, start, g.vc, axis=g.slice_axis)
      dw = jax.lax.dynamic_update_slice_in_dim(dw, old + dw_slice, start, axis=g.slice_axis)
      return (dh_bcd, dw), None

    init = (jnp.zeros(h_bcd.shape, jnp.float32), dw)
    (dh_bcd, dw), _ = jax.lax.scan(vocab_step, init, jnp.arange(g.n_vocab))
    return dw, dh_bcd.astype(h_kbcd.dtype)

  dw, dh_kbcd = jax.lax.scan(
      chunk, jnp.zeros(w_split.shape, jnp.float32),
      (h_kbcd, tgt_kbc, lse_kbc, ent_kbc, glogp_kbc, gent_kbc))
  return dh_kbcd, dw.astype(w_split.dtype), None


_chunks.defvjp(_chunks_fwd, _chunks_bwd)


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
