"""Decode attention over a prompt cache shared by groups of rows (`layers.attend_shared_prompt`)
against softmax attention over each row's own copy of its prompt and its generated slots,
computed in float64 by hand (float32 results within 2e-6)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ksjax.model import layers


def case(p, n, kv_heads, groups, t, s, seed=0):
  rng = np.random.RandomState(seed)
  b, h = p * n, 8
  q = rng.normal(size=(b, 1, kv_heads * groups, h))
  pk, pv = rng.normal(size=(p, kv_heads, h, t)), rng.normal(size=(p, kv_heads, t, h))
  k, v = rng.normal(size=(b, kv_heads, h, s)), rng.normal(size=(b, kv_heads, s, h))
  pmask = np.zeros((p, t), bool)
  for i in range(p):  # left padding: prompt i has t - i real tokens (at least one)
    pmask[i, min(i, t - 1):] = True
  mask = rng.rand(b, s) < 0.5
  mask[:, 0] = True  # the slot a step writes is always on
  return q, pk, pv, pmask, k, v, mask


def reference(q, pk, pv, pmask, k, v, mask, n):
  """float64 softmax attention of each row over its own copy of its prompt and its slots."""
  rows = lambda x: np.repeat(x, n, axis=0)
  keys = np.concatenate([rows(pk), k], axis=3)          # [B, K, H, T + S]
  values = np.concatenate([rows(pv), v], axis=2)        # [B, K, T + S, H]
  valid = np.concatenate([rows(pmask), mask], axis=1)   # [B, T + S]
  b, _, heads, h = q.shape
  kv = keys.shape[1]
  out = np.zeros((b, heads, h))
  for r in range(b):
    for head in range(heads):
      j = head // (heads // kv)
      scores = q[r, 0, head] @ keys[r, j] / np.sqrt(h)
      scores = np.where(valid[r], scores, -np.inf)
      w = np.exp(scores - scores.max())
      out[r, head] = (w / w.sum()) @ values[r, j]
  return out[:, None]


@pytest.mark.parametrize("p,n,kv_heads,groups,t,s", [
    (2, 4, 3, 3, 5, 4),   # SmolLM2's 9 heads over 3 kv heads
    (3, 1, 2, 1, 6, 3),   # n = 1: a per-row prompt cache (after a shrink)
    (1, 8, 1, 4, 7, 1),   # one prompt, one generated slot
])
def test_equals_attention_over_the_concatenated_cache(p, n, kv_heads, groups, t, s):
  arrays = case(p, n, kv_heads, groups, t, s)
  expected = reference(*arrays, n)
  f32 = [jnp.asarray(x, jnp.float32) if x.dtype != bool else jnp.asarray(x) for x in arrays]
  attend_shared = jax.jit(layers.attend_shared_prompt)  # eager, each operation compiles alone
  shared = np.asarray(attend_shared(*f32))
  assert shared.shape == expected.shape
  np.testing.assert_allclose(shared, expected, rtol=0, atol=2e-6)
  # The dense attention the per-row cache used agrees to the same tolerance.
  q, pk, pv, pmask, k, v, mask = f32
  rows = lambda x: jnp.repeat(x, n, axis=0)
  attend_dense = jax.jit(layers.attend_dense, static_argnames="v_layout")
  dense = attend_dense(q, jnp.concatenate([rows(pk), k], axis=3),
                       jnp.concatenate([rows(pv), v], axis=2),
                       jnp.concatenate([rows(pmask), mask], axis=1)[:, None, :], v_layout="bksh")
  np.testing.assert_allclose(np.asarray(dense), expected, rtol=0, atol=2e-6)
  # It depends on the prompt's values: not a constant or the generated part alone.
  other = attend_shared(q, pk, pv * 2.0, pmask, k, v, mask)
  assert np.abs(np.asarray(other) - shared).max() > 1e-3


def test_masked_prompt_slots_do_not_count():
  q, pk, pv, pmask, k, v, mask = (x if x.dtype == bool else x.astype(np.float32)
                                  for x in case(2, 2, 1, 2, 6, 3))
  out = layers.attend_shared_prompt(q, pk, pv, pmask, k, v, mask)
  pk2, pv2 = np.where(pmask[:, None, None, :], pk, 1e3), np.where(pmask[:, None, :, None], pv, 1e3)
  changed = layers.attend_shared_prompt(q, pk2, pv2, pmask, k, v, mask)
  np.testing.assert_allclose(np.asarray(changed), np.asarray(out), atol=1e-6)


def test_rejects_more_than_one_query_per_row():
  q, pk, pv, pmask, k, v, mask = case(1, 2, 1, 1, 4, 2)
  with pytest.raises(ValueError, match="one query per row"):
    layers.attend_shared_prompt(np.concatenate([q, q], axis=1), pk, pv, pmask, k, v, mask)
