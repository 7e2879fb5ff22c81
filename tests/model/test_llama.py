"""Behaviour of the Llama module beyond reference parity: padding invariance, value head, remat,
bfloat16 compute."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ksjax import model

CFG = model.preset("tiny", vocab_size=128)


@nnx.jit
def forward(llama, tokens, mask=None):
  """The model under jit: eager dispatch compiles every op separately and is slower in tests."""
  return llama(tokens, attention_mask=mask)


def test_left_padding_does_not_change_the_logits_of_real_tokens():
  llama = model.Llama(CFG, rngs=nnx.Rngs(0))
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, 128, (1, 7)), jnp.int32)
  padded = jnp.concatenate([jnp.zeros((1, 5), jnp.int32), tokens], axis=1)
  mask = jnp.asarray([[0] * 5 + [1] * 7])
  np.testing.assert_allclose(forward(llama, padded, mask)[:, 5:], forward(llama, tokens),
                             atol=1e-5, rtol=0)


def test_value_head_gives_float32_scalars_per_token():
  llama = model.Llama(dataclasses.replace(CFG, value_head=True), rngs=nnx.Rngs(0))
  tokens = jnp.zeros((2, 5), jnp.int32)
  values = nnx.jit(lambda m, t: m.value(m.hidden(t)))(llama, tokens)
  assert values.shape == (2, 5) and values.dtype == jnp.float32
  with pytest.raises(ValueError, match="value_head"):
    model.Llama(CFG, rngs=nnx.Rngs(0)).value(llama.hidden(tokens))


def test_remat_changes_neither_logits_nor_gradients():
  tokens = jnp.asarray(np.random.RandomState(1).randint(0, 128, (2, 6)), jnp.int32)
  loss = lambda m: jnp.sum(m(tokens) ** 2)
  plain = model.Llama(CFG, rngs=nnx.Rngs(0))
  remat = model.Llama(dataclasses.replace(CFG, remat=True), rngs=nnx.Rngs(0))
  grad = nnx.jit(nnx.grad(loss))
  g_plain, g_remat = grad(plain), grad(remat)
  for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_remat)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)  # same maths, other fusion order


def test_bfloat16_params_and_compute_stay_close_to_float32():
  tokens = jnp.asarray(np.random.RandomState(2).randint(0, 128, (2, 6)), jnp.int32)
  f32 = model.Llama(CFG, rngs=nnx.Rngs(0))
  bf16 = model.Llama(dataclasses.replace(CFG, param_dtype="bfloat16", dtype="bfloat16"),
                     rngs=nnx.Rngs(0))
  nnx.update(bf16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(f32, nnx.Param)))
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(nnx.state(bf16, nnx.Param)))
  logits = forward(bf16, tokens)
  assert logits.dtype == jnp.float32
  np.testing.assert_allclose(logits, forward(f32, tokens), atol=0.02)
  cache = model.init_cache(bf16.cfg, batch_size=2, max_len=8)
  assert all(c.dtype == jnp.bfloat16 for c in cache["k"] + cache["v"])


@pytest.mark.parametrize("kv_heads,tied,scaling", [
    (1, True, model.config.LLAMA31_ROPE_SCALING), (4, False, None)])
def test_forward_cached_prefill_then_decode_equals_full_forward(kv_heads, tied, scaling):
  """Left-padded prompts prefilled in one call, then decoded one token at a time (1e-5)."""
  cfg = dataclasses.replace(CFG, num_kv_heads=kv_heads, num_heads=4, tie_embeddings=tied,
                            rope_scaling=scaling)
  llama = model.Llama(cfg, rngs=nnx.Rngs(5))
  b, t, prompt_len, max_len = 3, 12, 8, 16
  tokens = np.random.RandomState(2).randint(0, cfg.vocab_size, (b, t)).astype(np.int32)
  mask = (np.arange(t)[None] >= np.array([[0], [4], [10]])).astype(np.int32)
  full = np.asarray(forward(llama, jnp.asarray(tokens), jnp.asarray(mask)))
  positions = np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32)

  step = nnx.jit(lambda m, *a: m.forward_cached(*a))
  cache = model.init_cache(cfg, batch_size=b, max_len=max_len)
  kv_mask = np.zeros((b, max_len), bool)
  kv_mask[:, :prompt_len] = mask[:, :prompt_len]
  logits, cache = step(llama, jnp.asarray(tokens[:, :prompt_len]),
                       jnp.asarray(positions[:, :prompt_len]), cache, jnp.int32(0),
                       jnp.asarray(kv_mask))
  got = [np.asarray(logits)]
  for i in range(prompt_len, t):
    kv_mask[:, i] = mask[:, i]  # row 2 is still padding at slots 8, 9
    logits, cache = step(llama, jnp.asarray(tokens[:, i:i + 1]), jnp.asarray(positions[:, i:i + 1]),
                         cache, jnp.int32(i), jnp.asarray(kv_mask))
    got.append(np.asarray(logits))
  got = np.concatenate(got, axis=1)
  real = mask.astype(bool)
  np.testing.assert_allclose(got[real], full[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("scaling", [model.config.LLAMA31_ROPE_SCALING, None])
def test_rope_table_rows_are_the_rotations_of_their_positions(scaling):
  """The decode loop's lookup table (`Llama.rope_table`) holds bit for bit the cos and sin that
  `cos_sin` computes from the positions, so a step reading it rotates q and k exactly as before."""
  llama = model.Llama(dataclasses.replace(CFG, rope_scaling=scaling), rngs=nnx.Rngs(0))
  positions = np.array([[0, 7, 300], [1, 299, 42]], np.int32)
  cos, sin = jax.jit(llama.cos_sin)(jnp.asarray(positions))
  table_cos, table_sin = jax.jit(llama.rope_table, static_argnums=0)(301)
  assert table_cos.shape == (301, CFG.head_dim)
  np.testing.assert_array_equal(np.asarray(table_cos)[positions], cos)
  np.testing.assert_array_equal(np.asarray(table_sin)[positions], sin)


def test_forward_shared_with_the_rope_table_equals_it_without():
  cfg = dataclasses.replace(CFG, num_kv_heads=2, num_heads=4)
  llama = model.Llama(cfg, rngs=nnx.Rngs(3))
  p, n, t, s = 2, 3, 5, 4
  rng = np.random.RandomState(0)
  prompt = model.init_cache(cfg, batch_size=p, max_len=t)
  prompt = jax.tree.map(lambda c: jnp.asarray(rng.normal(size=c.shape), c.dtype), prompt)
  cache = jax.tree.map(lambda c: jnp.asarray(rng.normal(size=c.shape), c.dtype),
                       model.init_cache(cfg, batch_size=p * n, max_len=s))
  prompt_mask = jnp.asarray(rng.rand(p, t) > 0.3)
  kv_mask = jnp.asarray(rng.rand(p * n, s) > 0.3)
  token = jnp.asarray(rng.randint(0, cfg.vocab_size, p * n), jnp.int32)
  position = jnp.asarray(rng.randint(0, t + s, p * n), jnp.int32)
  step = nnx.jit(lambda m, table: m.forward_shared(token, position, prompt, prompt_mask, cache,
                                                   jnp.int32(1), kv_mask, table))
  direct, _ = step(llama, None)
  looked_up, _ = step(llama, llama.rope_table(t + s))
  np.testing.assert_array_equal(looked_up, direct)
