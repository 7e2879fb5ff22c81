"""`sampling.sample(..., keys_from=)`: one call draws what several calls would have drawn, each
prompt's rows keyed as in the call it stands for (the evaluation merges its chunks so:
`ksjax.evaluation.batched`)."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from ksjax import model, sampling


def test_row_keys_give_a_merged_call_the_draws_of_its_chunks():
  """One call of 5 prompts with the chunks' keys (chunks of 2, seed 7 + first problem) draws
  what the three calls of the chunks draw, token for token."""
  cfg = model.LlamaConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8, intermediate_size=64,
                          max_position_embeddings=64)
  llama = model.Llama(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, 64, size=int(rng.integers(3, 9))).tolist() for _ in range(5)]
  sampler_cfg = sampling.SamplerConfig(max_new_tokens=12, eos_id=3)
  n, chunk, seed = 3, 2, 7
  merged = sampling.sample(llama, prompts, sampler_cfg, num_samples=n, seed=seed,
                           keys_from=[(seed + p - p % chunk, (p % chunk) * n)
                                      for p in range(5)])
  for start in range(0, 5, chunk):
    own = sampling.sample(llama, prompts[start:start + chunk], sampler_cfg, num_samples=n,
                          seed=seed + start)
    rows = slice(start * n, (start + len(prompts[start:start + chunk])) * n)
    np.testing.assert_array_equal(np.asarray(merged.tokens)[rows], np.asarray(own.tokens))
    np.testing.assert_array_equal(np.asarray(merged.lengths)[rows], np.asarray(own.lengths))
    np.testing.assert_allclose(np.asarray(merged.logprobs)[rows], np.asarray(own.logprobs),
                               atol=1e-5)


def test_keys_from_is_checked():
  with pytest.raises(ValueError, match="keys_from has 1 entries for 2 prompts"):
    sampling.sampler.row_keys(2, 1, 2, 0, [(0, 0)])
  with pytest.raises(ValueError, match=r"keys_from\[0\]"):
    sampling.sampler.row_keys(1, 1, 1, 0, [(-1, 0)])


def test_the_call_s_own_keys_are_the_default():
  """keys_from (seed, p * n) for every prompt p draws what the call without it draws."""
  cfg = model.LlamaConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4,
                          num_kv_heads=2, head_dim=8, intermediate_size=64,
                          max_position_embeddings=64)
  llama = model.Llama(cfg, rngs=nnx.Rngs(2))
  prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
  sampler_cfg = sampling.SamplerConfig(max_new_tokens=6)
  plain = sampling.sample(llama, prompts, sampler_cfg, num_samples=2, seed=11)
  keyed = sampling.sample(llama, prompts, sampler_cfg, num_samples=2, seed=11,
                          keys_from=[(11, 2 * p) for p in range(3)])
  np.testing.assert_array_equal(np.asarray(keyed.tokens), np.asarray(plain.tokens))
