"""Blocked (query-chunked) attention against the dense computation, and what it keeps live.

The dense form (`layers.attend_dense`) is the one the per-module transformers parity test
(test_model_layers.py) checks; the blocked form must give the same values and gradients, in
float32 to 1e-5, with left-padded causal masks and grouped-query heads, whether or not the
chunk size divides the sequence.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ksjax.model import layers

B, T, N, K, H = 3, 10, 4, 2, 8  # 4 query heads on 2 key/value heads


def _inputs(t=T, seed=0):
  rng = np.random.RandomState(seed)
  q_btnh = jnp.asarray(rng.randn(B, t, N, H).astype(np.float32))
  k_bkhs = jnp.asarray(rng.randn(B, K, H, t).astype(np.float32))
  v_bkhs = jnp.asarray(rng.randn(B, K, H, t).astype(np.float32))
  pad_b = np.array([0, 3, t - 1])  # no padding, some, all but the last token
  mask_bt = np.arange(t)[None] >= pad_b[:, None]
  mask_bts = jnp.asarray(mask_bt[:, None, :] & np.tril(np.ones((t, t), bool))[None])
  return q_btnh, k_bkhs, v_bkhs, mask_bts


@pytest.mark.parametrize("chunk", [1, 3, 5])  # 10 queries: 10 blocks, 4 blocks padded, 2 blocks
def test_blocked_attention_equals_dense_in_values_and_gradients(chunk):
  q, k, v, mask = _inputs()
  _assert_same_values_and_gradients(
      lambda q, k, v: layers.attend_bkhs(q, k, v, mask, query_chunk=chunk),
      lambda q, k, v: layers.attend_dense(q, k, v, mask), q, k, v)


def _assert_same_values_and_gradients(got_fn, want_fn, q, k, v):
  """Both functions of (q, k, v) agree to 1e-5 in value and in the gradients of a random linear
  function of their [B, T, N, H] output."""
  cotangent_btnh = jnp.asarray(np.random.RandomState(1).randn(B, T, N, H).astype(np.float32))
  np.testing.assert_allclose(got_fn(q, k, v), want_fn(q, k, v), atol=1e-5, rtol=0)
  loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v) * cotangent_btnh)
  want = jax.grad(loss(want_fn), argnums=(0, 1, 2))(q, k, v)
  got = jax.grad(loss(got_fn), argnums=(0, 1, 2))(q, k, v)
  for name, g, w in zip("qkv", got, want):
    np.testing.assert_allclose(g, w, atol=1e-5, rtol=0, err_msg=name)


def test_attend_takes_keys_in_sequence_layout_and_blocks_long_sequences():
  t = layers.QUERY_CHUNK + 7  # two blocks, the second one padded
  q, k_bkhs, v_bkhs, mask = _inputs(t)
  to_bskh = lambda x_bkhs: x_bkhs.transpose(0, 3, 1, 2)
  np.testing.assert_allclose(layers.attend(q, to_bskh(k_bkhs), to_bskh(v_bkhs), mask),
                             layers.attend_dense(q, k_bkhs, v_bkhs, mask), atol=1e-5, rtol=0)


def test_no_dense_float32_scores_are_live_in_the_backward_pass():
  """The compiled gradient's temporaries stay below one [B, N, T, S] float32 tensor blocked, and
  exceed it dense (so the comparison can fail)."""
  t, chunk = 512, 64
  q, k, v, mask = _inputs(t)
  scores_bytes = B * N * t * t * 4

  def temps(fn):
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2)))
    return grad.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

  assert temps(lambda q, k, v: layers.attend_dense(q, k, v, mask)) > scores_bytes
  blocked = temps(lambda q, k, v: layers.attend_bkhs(q, k, v, mask, query_chunk=chunk))
  assert blocked < scores_bytes / 2


def _plain_attention(q_btnh, k_bkhs, v_bkhs, mask_bts):
  """The textbook form, differentiated by JAX: key/value heads repeated per query head,
  [B, N, T, S] scores, masked softmax."""
  g = q_btnh.shape[2] // k_bkhs.shape[1]
  k_bnhs, v_bnhs = jnp.repeat(k_bkhs, g, axis=1), jnp.repeat(v_bkhs, g, axis=1)
  scores = jnp.einsum("btnh,bnhs->bnts", q_btnh, k_bnhs) / np.sqrt(q_btnh.shape[-1])
  probs = jax.nn.softmax(jnp.where(mask_bts[:, None], scores, jnp.finfo(jnp.float32).min), -1)
  return jnp.einsum("bnts,bnhs->btnh", probs, v_bnhs)


@pytest.mark.parametrize("v_layout", ["bkhs", "bksh"])
def test_hand_written_backward_equals_autodiff_of_the_plain_form(v_layout):
  """`attend_dense`'s custom backward against JAX's autodiff of `_plain_attention`, with the
  values in either cache layout, grouped heads and a row whose padding queries see no key."""
  q, k, v_bkhs, mask = _inputs()
  to_layout = (lambda x: x) if v_layout == "bkhs" else (lambda x: x.swapaxes(2, 3))
  _assert_same_values_and_gradients(
      lambda q, k, v: layers.attend_dense(q, k, to_layout(v), mask, v_layout),
      lambda q, k, v: _plain_attention(q, k, v, mask), q, k, v_bkhs)
