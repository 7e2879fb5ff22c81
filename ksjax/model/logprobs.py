"""Per-token log-probabilities and entropies of given sequences, for RL objectives.

For a 128k vocabulary the [B, T, V] float32 logits of a training batch are larger than the model's
activations, so they are never formed: the vocabulary is cut into slices and the sequence into
chunks (nested `jax.lax.scan`s, the vocabulary outermost), and each position's log-sum-exp, chosen
logit and entropy are accumulated online over the slices (running max rescaling, as in flash
attention). The backward pass is written by hand: it walks the same slices and chunks again,
recomputing each block's logits once, so it too holds one [B * C, Vc] block at a time. All of it
is float32: log p = chosen logit - logsumexp.

jax has no fused "cross-entropy over a sharded, chunked vocabulary" primitive (optax's
`softmax_cross_entropy_with_integer_labels` needs the full logits), hence the hand-written loop.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ksjax.model import layers, sharding
from ksjax.model.llama import default_positions

# Without a `seq_chunk`, a sequence chunk takes about CHUNK_ROWS positions of all B rows together.
# With slices of DEFAULT_VOCAB_CHUNK columns, each step's float32 logits block ([1024, 2048], 8
# MiB) stays near the caches, and the several passes over it (max, exponentials, sums, the
# gradient) read it from there: the head ran faster than with [B * 128, 8192] blocks, in float32
# and with bfloat16 operands, at 4 and at 32 rows (benchmarks/update_rate.py --parts=head).
CHUNK_ROWS = 1024
DEFAULT_VOCAB_CHUNK = 2048
_MASKED = -1e30


def chunked_logprobs(hidden_bnd: jax.Array, w: jax.Array, vocab_axis: int,
                     targets_bn: jax.Array, temperature: float = 1.0,
                     seq_chunk: int | None = None,
                     vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
                     operand_dtype=None) -> tuple[jax.Array, jax.Array]:
  """log softmax(h @ W / temperature)[target] and the entropy of that softmax, float32 [B, N].

  The product h @ W takes both operands in `operand_dtype` (default: h's dtype), accumulated in
  float32, as `Llama.logits` computes it (`LlamaConfig.operand_dtype`).

  `w` is the head matrix, [V, D] when `vocab_axis` is 0 or [D, V] when 1; it is sliced, never
  copied whole. Peak extra memory is O(B * seq_chunk * vocab_chunk) rather than O(B * N * V);
  `seq_chunk` defaults to CHUNK_ROWS / B positions (at least 1).

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
  c = min(seq_chunk or max(1, CHUNK_ROWS // b), n)
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

  def start(self, i: jax.Array) -> jax.Array:
    """Slice i's first column within each shard (the last slice is shifted back to stay in
    range)."""
    return jnp.minimum(i * self.vc, self.vs - self.vc)

  def columns(self, i: jax.Array, start: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Slice i's columns within each shard [Vc], and which of them it is the first to see (the
    shifted last slice's first columns were seen by the slice before it)."""
    local_v = start + jnp.arange(self.vc)
    return local_v, local_v >= i * self.vc

  def slice_matrix(self, w_split: jax.Array, start: jax.Array) -> jax.Array:
    """The weight slice at `start` in the operand dtype, as a matrix: [S*Vc, D] (vocab_axis 0)
    or [D, S*Vc] (1), both a free reshape of the slice."""
    w_slice = jax.lax.dynamic_slice_in_dim(w_split, start, self.vc, axis=self.slice_axis)
    w_slice = w_slice.astype(self.operand_dtype)
    d = w_slice.shape[-1] if self.vocab_axis == 0 else w_slice.shape[0]
    return w_slice.reshape(-1, d) if self.vocab_axis == 0 else w_slice.reshape(d, -1)

  def logits(self, h_md: jax.Array, w_mat: jax.Array) -> jax.Array:
    """float32 logits [M, S, Vc] / temperature of hidden states [M, D] (operand dtype) against
    a slice's weight matrix (`slice_matrix`).

    One [M, D] x [D, S*Vc] matmul with the weight as it lies: the einsum over [S, Vc, D] made
    XLA copy every slice transposed to [D, S*Vc] first (benchmarks/update_rate.py)."""
    spec = "md,nd->mn" if self.vocab_axis == 0 else "md,dn->mn"
    z_mn = jnp.einsum(spec, *layers.kernel_operands(h_md, w_mat),
                      preferred_element_type=jnp.float32) * self.inv_temp
    return z_mn.reshape(-1, self.shards, self.vc)

  def hits(self, tgt_m: jax.Array, local_v: jax.Array, fresh_v: jax.Array):
    """[M, S, Vc]: where a fresh column is the row's target."""
    col_sv = (jnp.arange(self.shards) * self.vs)[:, None] + local_v[None, :]
    return (col_sv == tgt_m[..., None, None]) & fresh_v


def _chunks_forward(g: _Chunks, h_kbcd, w_split, tgt_kbc):
  """log p of the targets, the entropies and the log-sum-exps, float32 [K, B, C] each: a scan
  over the vocabulary slices and, within each, over the sequence chunks, that accumulates each
  position's running max, sum of exponentials, sum of exp * logit and the target's logit
  (rescaled online, as in flash attention). The vocabulary is the outer loop so that each weight
  slice is cast to the operand dtype once, not once per chunk."""
  k, b, c, d = h_kbcd.shape
  m = b * c

  def vocab_step(stats, i):
    start = g.start(i)
    w_mat = g.slice_matrix(w_split, start)
    local_v, fresh_v = g.columns(i, start)

    def chunk_step(_, args):
      h_md, tgt_m, m_m, s_m, zs_m, chosen_m = args
      # A finite stand-in for -inf: exp() of it is 0.
      z_msv = jnp.where(fresh_v, g.logits(h_md, w_mat), _MASKED)
      m_new = jnp.maximum(m_m, z_msv.max((-2, -1)))
      rescale = jnp.exp(m_m - m_new)
      e_msv = jnp.exp(z_msv - m_new[..., None, None])
      s_m = s_m * rescale + e_msv.sum((-2, -1))
      zs_m = zs_m * rescale + jnp.where(fresh_v, e_msv * z_msv, 0.0).sum((-2, -1))
      hit_msv = g.hits(tgt_m, local_v, fresh_v)
      chosen_m = chosen_m + jnp.where(hit_msv, z_msv, 0.0).sum((-2, -1))
      return None, (m_new, s_m, zs_m, chosen_m)

    _, stats = jax.lax.scan(chunk_step, None,
                            (h_kbcd.reshape(k, m, d), tgt_kbc.reshape(k, m)) + stats)
    return stats, None

  zeros = jnp.zeros((k, m), jnp.float32)
  init = (jnp.full((k, m), -jnp.inf, jnp.float32), zeros, zeros, zeros)
  (m_km, s_km, zs_km, chosen_km), _ = jax.lax.scan(vocab_step, init, jnp.arange(g.n_vocab))
  lse_km = m_km + jnp.log(s_km)
  # H = -sum p z + lse, with sum p z = zs / s.
  return tuple(x.reshape(k, b, c) for x in (chosen_km - lse_km, lse_km - zs_km / s_km, lse_km))


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

  One pass over the vocabulary slices, and within each over the sequence chunks, recomputes each
  slice's logits once per chunk; dz [M, S*Vc] meets the weight slice for dh and the hidden states
  for dW, both matmuls whose transposed operand is a row-major copy (`layers.transposed` for
  lower-precision operands). Why the vocabulary outermost: each weight slice is cast once, and
  each slice's dW is summed over the chunks in a slice-sized accumulator and handed out as the
  scan's output, in the head's own layout, so no [V, D] float32 accumulator is zeroed, updated in
  place per slice or transposed: at a 49k vocabulary those passes over [V, D] took about as long
  as the slices' products (benchmarks/update_rate.py --parts=head)."""
  h_kbcd, w_split, tgt_kbc, lse_kbc, ent_kbc = residuals
  glogp_kbc, gent_kbc = cotangents
  k, b, c, d = h_kbcd.shape
  m, n = b * c, g.shards * g.vc
  rows = tuple(x.reshape(k, m) for x in (tgt_kbc, lse_kbc, ent_kbc, glogp_kbc, gent_kbc))
  # Lower-precision operands: a row-major copy of the transposed operand (`layers.transposed`;
  # the plain transpose crashed XLA:CPU where a loop had one trip). float32 ones: the plain
  # transposes, and the products in the form they had before (the same float32 sums).
  f32 = g.operand_dtype == jnp.float32
  h_kmd = h_kbcd.reshape(k, m, d)
  # Each chunk's h^T, once for all slices (a [K, 0, M] stand-in where no product takes it).
  if f32:
    h_kdm = h_kmd.transpose(0, 2, 1)
  elif g.vocab_axis == 1:
    h_kdm = jax.vmap(layers.transposed)(h_kmd)
  else:
    h_kdm = jnp.zeros((k, 0, m), h_kmd.dtype)
  col = lambda x_m: x_m[..., None, None]
  dw_shape = (n, d) if g.vocab_axis == 0 else (d, n)

  def vocab_step(dh_kmd, i):
    start = g.start(i)
    w_mat = g.slice_matrix(w_split, start)
    local_v, fresh_v = g.columns(i, start)

    def chunk_step(dw_slice, args):
      h_md, h_dm, tgt_m, lse_m, ent_m, glogp_m, gent_m = args
      z_msv = g.logits(h_md, w_mat)
      p_msv = jnp.where(fresh_v, jnp.exp(z_msv - col(lse_m)), 0.0)
      hit_msv = g.hits(tgt_m, local_v, fresh_v)
      dz_msv = (col(glogp_m) * (hit_msv - p_msv)
                - col(gent_m) * p_msv * (z_msv - col(lse_m) + col(ent_m)))
      dz_mn = (dz_msv * g.inv_temp).astype(g.operand_dtype).reshape(m, n)
      if g.vocab_axis == 0:  # dW [S*Vc, D] = dz^T h, dh = dz W
        if f32:
          dw_slice += jnp.einsum("dm,msv->dsv", h_dm, dz_mn.reshape(m, g.shards, g.vc)
                                 ).transpose(1, 2, 0).reshape(n, d)
        else:  # the transposed operand is dz: its copy is smaller than one of the product
          dw_slice += jnp.dot(*layers.kernel_operands(layers.transposed(dz_mn), h_md),
                              preferred_element_type=jnp.float32)
        dh_md = jnp.dot(*layers.kernel_operands(dz_mn, w_mat),
                        preferred_element_type=jnp.float32)
      else:  # dW [D, S*Vc] = h^T dz, dh = dz W^T
        dw_slice += jnp.dot(*layers.kernel_operands(h_dm, dz_mn),
                            preferred_element_type=jnp.float32)
        dh_md = jnp.einsum("mn,dn->md", *layers.kernel_operands(dz_mn, w_mat),
                           preferred_element_type=jnp.float32)
      return dw_slice, dh_md

    dw_slice, dh_i_kmd = jax.lax.scan(chunk_step, jnp.zeros(dw_shape, jnp.float32),
                                      (h_kmd, h_kdm) + rows)
    return dh_kmd + dh_i_kmd, dw_slice

  dh_kmd, dw_slices = jax.lax.scan(vocab_step, jnp.zeros((k, m, d), jnp.float32),
                                   jnp.arange(g.n_vocab))
  return (dh_kmd.reshape(k, b, c, d).astype(h_kbcd.dtype),
          _assemble(g, dw_slices).astype(w_split.dtype), None)


def _assemble(g: _Chunks, dw_slices: jax.Array) -> jax.Array:
  """The head's gradient in `w_split`'s layout from the slices' [n_vocab, S*Vc, D] (vocab_axis
  0) or [n_vocab, D, S*Vc] (1). A shifted last slice contributes only its fresh columns (its
  others are zero: they were the slice before's). One slice and one shard: a free reshape."""
  nv, vc, s = g.n_vocab, g.vc, g.shards
  if g.vocab_axis == 0:
    d = dw_slices.shape[-1]
    dw = dw_slices.reshape(nv, s, vc, d).transpose(1, 0, 2, 3).reshape(s, nv * vc, d)
  else:
    d = dw_slices.shape[1]
    dw = dw_slices.reshape(nv, d, s, vc).transpose(1, 2, 0, 3).reshape(d, s, nv * vc)
  stale = nv * vc - g.vs
  if stale:
    axis = g.slice_axis
    head = jax.lax.slice_in_dim(dw, 0, (nv - 1) * vc, axis=axis)
    tail = jax.lax.slice_in_dim(dw, (nv - 1) * vc + stale, nv * vc, axis=axis)
    dw = jnp.concatenate([head, tail], axis=axis)
  return dw


_chunks.defvjp(_chunks_fwd, _chunks_bwd)


def token_logprobs(llama, tokens_bt: jax.Array, attention_mask_bt: jax.Array | None = None,
                   temperature: float = 1.0, seq_chunk: int | None = None,
                   vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
                   start: int = 1) -> tuple[jax.Array, jax.Array]:
  """Per-token log-probs and entropies of `tokens` under `llama` at `temperature`, float32 [B, T].

  logp[b, t] = log softmax(logits[b, t-1] / temperature)[tokens[b, t]] and entropy[b, t] is the
  entropy of that distribution, for t >= start (at least 1). Both are 0 before `start`, wherever
  the mask is 0, and at the first real token of a left-padded row (only padding precedes it, so
  nothing predicts it).

  `start` (a static column): the trainer passes its prompt length, since its losses read the
  completions' log-probs only. Every position still runs through the decoder (the completions
  attend to the prompt), but the head, a large share of a token's FLOPs where the vocabulary is
  large beside the width (docs/benchmarks.md), runs on the columns asked for.
  """
  b, t = tokens_bt.shape
  start = max(int(start), 1)
  mask_bt = (jnp.ones((b, t), bool) if attention_mask_bt is None
             else attention_mask_bt.astype(bool))
  hidden_btd = llama.hidden(tokens_bt, attention_mask=mask_bt)
  w, vocab_axis = llama.head_weight()
  logp_bn, ent_bn = chunked_logprobs(hidden_btd[:, start - 1:-1], w, vocab_axis,
                                     tokens_bt[:, start:], temperature, seq_chunk, vocab_chunk,
                                     llama.cfg.operand_dtype)
  keep_bn = mask_bt[:, start:] & mask_bt[:, start - 1:-1]
  pad = jnp.zeros((b, start), jnp.float32)
  logp_bt = jnp.concatenate([pad, jnp.where(keep_bn, logp_bn, 0.0)], axis=1)
  ent_bt = jnp.concatenate([pad, jnp.where(keep_bn, ent_bn, 0.0)], axis=1)
  return logp_bt, ent_bt


def continuation_logprobs(llama, tokens_bt: jax.Array, mask_bt: jax.Array, prompt_len: int,
                          group: int, temperature: float = 1.0) -> jax.Array:
  """`token_logprobs(llama, tokens, mask, temperature)[0][:, prompt_len:]` for rows that come in
  groups sharing one prompt, each prompt run once: float32 log-probs [B, N] of the completions.

  Rows g * group .. g * group + group - 1 hold the same left-padded prompt in columns
  [0, prompt_len) (the caller's contract; not checked) and their own completions after it, as
  `SampleOutput.sequences` lays a sampler call out. The prompts, [B / group, T], go through the
  model once into a KV cache (as the sampler's prefill); the cache is repeated to the group's
  rows, and the completions, [B, N], go through once more over it, layer by layer
  (`Llama.hidden_continuations`, which says why). So the
  weights see B / group * T + B * N positions instead of B * (T + N), and the head only the
  completions' (and each prompt's last). Why: the evaluation's KL scores every sample of a
  problem against a reference, and with its 16 samples per problem and the arithmetic prompts
  longer than their answers, the full forward spent most of its time recomputing each prompt;
  the trainer's reference forward reads a rollout's groups the same way.

  The same sums in another order: equal to the full forward within float32 rounding (tested).
  """
  b, total = tokens_bt.shape
  if b % group:
    raise ValueError(f"{b} rows do not come in groups of {group}")
  t, n = prompt_len, total - prompt_len
  prompt_pt, pmask_pt = tokens_bt[::group, :t], mask_bt[::group, :t].astype(bool)
  positions_pt = default_positions(pmask_pt)
  repeat = lambda x: jnp.repeat(x, group, axis=0)
  completion_bn, mask_bs = tokens_bt[:, t:], mask_bt.astype(bool)
  # Completion token j sits at position (the prompt's length) + j, as in `default_positions` of
  # the whole row and in the sampler.
  positions_bn = repeat(positions_pt[:, -1:] + 1) + jnp.arange(n, dtype=jnp.int32)[None, :]
  hidden_ptd, hidden_bnd = llama.hidden_continuations(prompt_pt, positions_pt, pmask_pt,
                                                      completion_bn, positions_bn, mask_bs, group)
  # Token j is predicted by the position before it: the prompt's last for j = 0.
  before_bnd = jnp.concatenate([repeat(hidden_ptd[:, -1:]), hidden_bnd[:, :-1]], axis=1)
  w, vocab_axis = llama.head_weight()
  logp_bn, _ = chunked_logprobs(before_bnd, w, vocab_axis, completion_bn, temperature,
                                operand_dtype=llama.cfg.operand_dtype)
  keep_bn = mask_bs[:, t:] & mask_bs[:, t - 1:-1]  # as token_logprobs' keep
  return jnp.where(keep_bn, logp_bn, 0.0)


def sharded_continuation_logprobs(llama, mesh: jax.sharding.Mesh, group: int):
  """A jitted `fn(tokens_bt, attention_mask_bt, prompt_len) -> logp_bn`: `continuation_logprobs`
  with the shardings of `sharding.sharded_apply`, compiled once per prompt width."""
  programs = {}

  def fn(tokens_bt, mask_bt, prompt_len: int):
    if prompt_len not in programs:
      programs[prompt_len] = sharding.sharded_apply(
          llama, mesh, lambda m, tokens, mask: continuation_logprobs(m, tokens, mask, prompt_len,
                                                                     group),
          jax.sharding.PartitionSpec(sharding.BATCH, None))
    return programs[prompt_len](tokens_bt, mask_bt)
  return fn


def sharded_token_logprobs(llama, mesh: jax.sharding.Mesh):
  """A jitted `fn(tokens_bt, attention_mask_bt) -> logp_bt`: `token_logprobs` at temperature 1
  with the shardings of `sharding.sharded_forward` (B must divide over the batch axes)."""
  return sharding.sharded_apply(
      llama, mesh, lambda m, tokens_bt, mask_bt: token_logprobs(m, tokens_bt, mask_bt)[0],
      jax.sharding.PartitionSpec(sharding.BATCH, None))
