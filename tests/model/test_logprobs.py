"""Chunked per-token log-probs and entropies against the direct full-logits computation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ksjax import model
from ksjax.model import logprobs


def _direct(llama, tokens, mask, temperature):
  """The obvious computation: full [B, T, V] logits, log_softmax, shift by one."""
  logits = llama(tokens, attention_mask=mask) / temperature
  logp_all = jax.nn.log_softmax(logits, axis=-1)[:, :-1]
  chosen = jnp.take_along_axis(logp_all, tokens[:, 1:, None], axis=-1)[..., 0]
  entropy = -(jnp.exp(logp_all) * logp_all).sum(-1)
  keep = (mask[:, 1:] * mask[:, :-1]).astype(bool)
  pad = jnp.zeros((tokens.shape[0], 1))
  return (jnp.concatenate([pad, jnp.where(keep, chosen, 0)], 1),
          jnp.concatenate([pad, jnp.where(keep, entropy, 0)], 1))


def _batch(vocab, b=2, t=13, seed=0):
  rng = np.random.RandomState(seed)
  tokens = jnp.asarray(rng.randint(0, vocab, (b, t)), jnp.int32)
  mask = jnp.asarray(np.arange(t)[None] >= np.array([[0], [3]])[:b], jnp.int32)
  return tokens, mask


@pytest.mark.parametrize("tied,temperature,seq_chunk,vocab_chunk", [
    (True, 1.0, 4, 48),    # chunks that do not divide T-1 = 12 ... nor V = 256 (last slice shifted)
    (False, 0.7, 5, 256),  # one vocab slice
    (False, 1.3, 64, 100),
])
def test_chunked_equals_direct(tied, temperature, seq_chunk, vocab_chunk):
  cfg = model.preset("tiny", tie_embeddings=tied)
  llama = model.Llama(cfg, rngs=nnx.Rngs(1))
  tokens, mask = _batch(cfg.vocab_size)
  logp, ent = nnx.jit(lambda m, t, k: model.token_logprobs(
      m, t, k, temperature=temperature, seq_chunk=seq_chunk, vocab_chunk=vocab_chunk))(
          llama, tokens, mask)
  ref_logp, ref_ent = nnx.jit(lambda m, t, k: _direct(m, t, k, temperature))(llama, tokens, mask)
  assert logp.dtype == ent.dtype == jnp.float32 and logp.shape == tokens.shape
  np.testing.assert_allclose(logp, ref_logp, atol=1e-5, rtol=0)
  np.testing.assert_allclose(ent, ref_ent, atol=1e-5, rtol=0)
  assert float(jnp.abs(logp[1, :4]).max()) == 0.0  # padding and the first real token of row 1


@pytest.mark.parametrize("tied,temperature,seq_chunk,vocab_chunk", [
    (False, 1.0, 4, 96),   # the last vocabulary slice shifted back (256 = 2 * 96 + 64)
    (True, 0.7, 5, 48),    # the tied [V, D] head; chunks that divide neither T-1 nor V
    (True, 1.3, 64, 256),  # one sequence chunk, one vocabulary slice
])
def test_gradients_equal_those_of_the_direct_computation(tied, temperature, seq_chunk, vocab_chunk):
  """The hand-written backward of `chunked_logprobs` (log-probs and entropies both weighted)
  against autodiff through the full logits."""
  cfg = model.preset("tiny", tie_embeddings=tied)
  llama = model.Llama(cfg, rngs=nnx.Rngs(2))
  tokens, mask = _batch(cfg.vocab_size)
  weights = jax.random.normal(jax.random.key(0), tokens.shape)

  def loss(fn):
    def f(m):
      logp, ent = fn(m)
      return (weights * logp).sum() + 0.1 * ent.sum()
    return nnx.jit(nnx.grad(f))(llama)

  got = loss(lambda m: model.token_logprobs(m, tokens, mask, temperature, seq_chunk=seq_chunk,
                                            vocab_chunk=vocab_chunk))
  ref = loss(lambda m: _direct(m, tokens, mask, temperature))
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, r, atol=2e-5, rtol=1e-4)


@functools.cache
def _whole_rows():
  """The tiny model, its batch, the whole computation's log-probs and its gradient program (one
  compilation for every start: the weights are an argument)."""
  cfg = model.preset("tiny", tie_embeddings=True)
  llama = model.Llama(cfg, rngs=nnx.Rngs(3))
  tokens, mask = _batch(cfg.vocab_size)
  whole = nnx.jit(lambda m: model.token_logprobs(m, tokens, mask, 1.0, seq_chunk=5))(llama)
  grad = nnx.jit(nnx.grad(lambda m, w: (w * model.token_logprobs(m, tokens, mask, 1.0,
                                                                  seq_chunk=5)[0]).sum()))
  return llama, tokens, mask, whole, grad


@pytest.mark.parametrize("start", [0, 4, 12])  # 0 is 1 (clamped); 12 is T - 1
def test_from_a_start_column_the_log_probs_and_their_gradient_are_the_whole_rows(start):
  """`start` (the trainer's prompt length) runs the head on columns >= start only: those columns
  are the whole computation's, earlier ones 0, and a loss that weights only those columns has
  the whole computation's gradient."""
  llama, tokens, mask, whole, whole_grad = _whole_rows()
  weights = jax.random.normal(jax.random.key(1), tokens.shape)
  weights = jnp.where(jnp.arange(tokens.shape[1])[None] >= start, weights, 0.0)
  part = nnx.jit(lambda m: model.token_logprobs(m, tokens, mask, 1.0, seq_chunk=5,
                                                start=start))(llama)
  for got, ref in zip(part, whole):
    assert got.shape == tokens.shape
    np.testing.assert_allclose(got[:, start:], ref[:, start:], atol=1e-5, rtol=0)
    assert float(jnp.abs(got[:, :max(start, 1)]).max()) == 0.0

  part_grad = nnx.jit(nnx.grad(lambda m: (weights * model.token_logprobs(
      m, tokens, mask, 1.0, seq_chunk=5, start=start)[0]).sum()))(llama)
  for g, r in zip(jax.tree.leaves(part_grad), jax.tree.leaves(whole_grad(llama, weights))):
    np.testing.assert_allclose(g, r, atol=2e-5, rtol=1e-4)


def test_128k_vocabulary_never_holds_the_full_logits():
  """Compiled temporary memory is bounded by a quarter of one [B, T, V] float32 logits array."""
  vocab, b, t = 128256, 2, 256
  cfg = model.preset("tiny", vocab_size=vocab, tie_embeddings=True)
  abstract = nnx.eval_shape(lambda: model.Llama(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  tokens = jax.ShapeDtypeStruct((b, t), jnp.int32)

  def run(state, tokens):
    return model.token_logprobs(nnx.merge(graphdef, state), tokens, None, seq_chunk=64,
                                vocab_chunk=8192)

  def temp_bytes(fn):
    return jax.jit(fn).lower(state, tokens).compile().memory_analysis().temp_size_in_bytes

  full_logits = b * t * vocab * 4
  assert temp_bytes(run) < full_logits / 4
  # The backward pass holds the [V, D] embedding gradient (full_logits / 8 here) and one slice.
  grad = lambda s, x: jax.grad(lambda s: run(s, x)[0].sum())(s)
  assert temp_bytes(grad) < full_logits / 2
  # ... while the direct computation needs at least the full logits.
  direct = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, tokens).compile()
  assert direct.memory_analysis().output_size_in_bytes >= full_logits


def _groups(vocab, prompts, group, t, n, seed=0):
  """Rows in groups of `group` sharing a left-padded prompt (prompt i: t - 2 i real tokens) in
  columns [0, t), and their own completions of 0 .. n tokens, as a sampler call lays them out."""
  rng = np.random.RandomState(seed)
  prompt = rng.randint(0, vocab, (prompts, t))
  pmask = np.arange(t)[None] >= 2 * np.arange(prompts)[:, None]
  tokens = np.concatenate([np.repeat(prompt, group, 0), rng.randint(0, vocab, (prompts * group, n))],
                          axis=1)
  lengths = rng.randint(0, n + 1, prompts * group)
  lengths[0] = n  # one row fills every column
  mask = np.concatenate([np.repeat(pmask, group, 0), np.arange(n)[None] < lengths[:, None]], axis=1)
  return jnp.asarray(tokens, jnp.int32), jnp.asarray(mask), lengths


@pytest.mark.parametrize("tied,prompts,group,t,n,remat", [
    (True, 3, 4, 9, 6, False),    # SmolLM2's tied head; prompts of 9, 7 and 5 tokens
    (False, 2, 1, 5, 8, False),   # a group of one: each row its own prompt
    (True, 1, 8, 12, 1, False),   # one prompt, one completion token
    (False, 2, 4, 7, 5, True),    # the layers as a scan (`Llama.through_layers`)
])
def test_continuation_logprobs_equal_the_full_forward(tied, prompts, group, t, n, remat):
  cfg = model.preset("tiny", tie_embeddings=tied, remat=remat)
  llama = model.Llama(cfg, rngs=nnx.Rngs(2))
  tokens, mask, lengths = _groups(cfg.vocab_size, prompts, group, t, n)
  full = nnx.jit(lambda m, x, k: model.token_logprobs(m, x, k)[0])(llama, tokens, mask)[:, t:]
  continuation = nnx.jit(lambda m, x, k: logprobs.continuation_logprobs(m, x, k, t, group))
  shared = continuation(llama, tokens, mask)
  assert shared.shape == (prompts * group, n) and shared.dtype == jnp.float32
  # The same sums in another order (the prompt's keys read from a cache): float32 rounding of
  # log-probs around -log(V) = -5.5, far below what a wrong position or prompt would move them.
  np.testing.assert_allclose(shared, full, atol=1e-4, rtol=0)
  assert float(jnp.abs(shared).min(initial=1.0, where=np.arange(n)[None] < lengths[:, None])) > 0
  assert float(jnp.abs(jnp.where(np.arange(n)[None] >= lengths[:, None], shared, 0)).max()) == 0
  # It reads the prompt: another prompt for group 0 changes its rows' log-probs.
  other = tokens.at[:group, t - 1].set((tokens[0, t - 1] + 1) % cfg.vocab_size)
  moved = continuation(llama, other, mask)  # compiled once; run eagerly it took seconds
  assert float(jnp.abs(moved[:group] - shared[:group]).max()) > 1e-3


def test_continuation_logprobs_reject_rows_that_are_not_whole_groups():
  cfg = model.preset("tiny")
  tokens, mask, _ = _groups(cfg.vocab_size, 2, 3, 4, 2)
  with pytest.raises(ValueError, match="groups of 4"):
    logprobs.continuation_logprobs(model.Llama(cfg, rngs=nnx.Rngs(0)), tokens, mask, 4, 4)
