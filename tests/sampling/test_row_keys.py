"""`sampling.sample(..., keys_from=)`: one call draws what several calls would have drawn, each
prompt's rows keyed as in the call it stands for (the evaluation merges its chunks so:
`ksjax.evaluation.batched`)."""

from __future__ import annotations

import jax
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


def test_with_bfloat16_operands_a_merged_call_draws_from_the_same_distribution():
  """With bfloat16 matmul operands (the SmolLM2 configs'), a product's float32 result depends on
  the batch it runs in by a last bit, which the next product's bfloat16 rounding can widen to one
  of its ulps: a merged call's logits differ from its chunks' calls' by rounding, and a row whose
  uniform falls near a boundary of the inverse CDF can draw another token (SmolLM2, 80 tokens: 3
  of 32 rows). What must hold is the distribution: on independent seeds, the first two tokens'
  frequencies of 4 prompts x 256 samples drawn by a merged call and by the chunks' own calls pass
  a chi-square test of homogeneity (p > 0.001; the same test tells two of the prompts apart, so it
  has the power to see a row drawn for the wrong prompt), and on the same seed almost every row
  is the same."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  cfg = model.LlamaConfig(vocab_size=8, hidden_size=32, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8, intermediate_size=64,
                          max_position_embeddings=32, matmul_dtype="bfloat16")
  llama = model.Llama(cfg, rngs=nnx.Rngs(3))
  # A random model's next-token distributions are close to uniform whatever the prompt; larger
  # weights make them differ from prompt to prompt (the test's power below).
  graphdef, state = nnx.split(llama)
  llama = nnx.merge(graphdef, jax.tree.map(lambda x: x * 3.0, state))
  prompts = [[1, 2, 3], [4, 5], [6, 7, 1, 2], [3, 3, 5]]
  sampler_cfg = sampling.SamplerConfig(max_new_tokens=2, temperature=0.5)
  n = 256

  def chunked(seed):  # chunks of one prompt, each its own call with seed + its first problem
    return np.concatenate([np.asarray(sampling.sample(llama, [p], sampler_cfg, num_samples=n,
                                                      seed=seed + i).tokens)
                           for i, p in enumerate(prompts)])

  def merged(seed):
    return np.asarray(sampling.sample(llama, prompts, sampler_cfg, num_samples=n, seed=seed,
                                      keys_from=[(seed + i, 0) for i in range(4)]).tokens)

  def homogeneity_p(a_rn, b_rn) -> float:
    """Chi-square test that two sets of rows [R, 2] draw their two tokens from one
    distribution (categories seen in neither dropped)."""
    code = lambda t: t[:, 0] * cfg.vocab_size + t[:, 1]
    table = np.stack([np.bincount(code(a_rn), minlength=cfg.vocab_size ** 2),
                      np.bincount(code(b_rn), minlength=cfg.vocab_size ** 2)])
    return stats.chi2_contingency(table[:, table.sum(0) > 0])[1]

  old, new = chunked(0), merged(1000)
  for p in range(4):
    rows = slice(p * n, (p + 1) * n)
    assert homogeneity_p(old[rows], new[rows]) > 1e-3, p
  assert homogeneity_p(old[:n], old[n:2 * n]) < 1e-6  # prompts 0 and 1 differ: the test's power
  assert (chunked(0) == merged(0)).all(1).mean() > 0.95
