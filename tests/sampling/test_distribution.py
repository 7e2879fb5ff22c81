"""The distribution the sampler draws from: truncation against transformers' logits warpers, and
empirical frequencies of many draws against the model's (truncated, renormalised) distribution."""

import numpy as np
import pytest
import scipy.stats

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from transformers.generation import logits_process  # noqa: E402

from ksjax import model, sampling  # noqa: E402
from ksjax.sampling import distribution  # noqa: E402

# (temperature, top_k, top_p)
WARPER_CASES = [(1.0, 0, 0.9), (0.7, 0, 0.5), (1.3, 5, 1.0), (0.8, 7, 0.8), (1.0, 1, 1.0),
                (1.0, 0, 1e-6), (1.0, 50, 0.95)]


def hf_truncated(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
  """transformers' sampling warpers in generate's order: temperature, top-k, top-p."""
  scores = torch.tensor(logits, dtype=torch.float64)
  scores = logits_process.TemperatureLogitsWarper(temperature)(None, scores)
  if top_k:
    scores = logits_process.TopKLogitsWarper(top_k)(None, scores)
  if top_p < 1:
    scores = logits_process.TopPLogitsWarper(top_p)(None, scores)
  return scores.numpy()


@pytest.mark.parametrize("temperature,top_k,top_p", WARPER_CASES)
def test_truncation_keeps_the_tokens_transformers_keeps(temperature, top_k, top_p):
  logits = np.random.RandomState(0).normal(0, 2, (64, 40)).astype(np.float32)
  ours = np.asarray(distribution.truncated_logits(jnp.asarray(logits), temperature, top_k, top_p))
  ref = hf_truncated(logits, temperature, top_k, top_p)
  np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(ref))
  kept = np.isfinite(ref)
  np.testing.assert_allclose(ours[kept], ref[kept], rtol=1e-6, atol=1e-6)
  if top_p < 1 or top_k:
    assert (~kept).any(), "the case truncates nothing; it would test nothing"


def test_truncation_keeps_ties_with_the_last_kept_logit():
  logits = jnp.asarray([[3.0, 1.0, 1.0, 1.0, 0.0]])
  kept = np.isfinite(np.asarray(distribution.truncated_logits(logits, 1.0, 2, 1.0)))
  np.testing.assert_array_equal(kept, [[True, True, True, True, False]])


def test_greedy_returns_argmax_and_the_model_logprob():
  logits = jnp.asarray(np.random.RandomState(1).normal(0, 1, (6, 9)), jnp.float32)
  cfg = sampling.SamplerConfig(temperature=0.0)
  token, logp = distribution.choose(logits, jax.random.split(jax.random.key(0), 6), cfg)
  np.testing.assert_array_equal(token, np.argmax(logits, -1))
  expect = np.asarray(jax.nn.log_softmax(logits))[np.arange(6), np.asarray(token)]
  np.testing.assert_allclose(logp, expect, atol=1e-6)


# --- frequencies of many draws ---------------------------------------------------------------

P_VALUE_FLOOR = 1e-3  # chi-square goodness of fit: fail below this p-value


def test_inverse_cdf_draws_follow_softmax_with_a_ragged_last_block():
  """37 tokens: blocks of 8, the last one padded; some tokens excluded (-inf), one dominant."""
  rows = 20000
  z = np.random.RandomState(2).normal(0, 1.5, 37).astype(np.float32)
  z[[0, 9, 17, 36]] = -np.inf
  draw = jax.jit(distribution.draw)
  tokens, lse = draw(jax.random.split(jax.random.key(0), rows), jnp.broadcast_to(z, (rows, 37)))
  expected = np.exp(z - np.logaddexp.reduce(z.astype(np.float64)))
  np.testing.assert_allclose(np.asarray(lse), np.logaddexp.reduce(z.astype(np.float64)),
                             rtol=1e-6)
  counts = np.bincount(np.asarray(tokens), minlength=37)
  kept = expected > 0
  assert counts[~kept].sum() == 0
  _, p_value = scipy.stats.chisquare(counts[kept], rows * expected[kept])
  assert p_value > P_VALUE_FLOOR, (counts, rows * expected)


VOCAB = 12
DRAWS = 4000


@pytest.fixture(scope="module")
def peaked_llama():
  """A tiny model whose next-token distribution is far from uniform (lm head scaled up)."""
  cfg = model.preset("tiny", vocab_size=VOCAB, tie_embeddings=False)
  llama = model.Llama(cfg, rngs=nnx.Rngs(5))
  llama.lm_head[...] = llama.lm_head[...] * 5.0
  prompt = [3, 1, 4, 1, 5]
  logits = nnx.jit(lambda m, t: m(t))(llama, jnp.asarray([prompt], jnp.int32))
  return llama, prompt, np.asarray(logits)[0, -1].astype(np.float64)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_token_frequencies_match_the_model_distribution(peaked_llama, top_p):
  llama, prompt, logits = peaked_llama
  ref_logits = hf_truncated(logits[None], 1.0, 0, top_p)[0]
  expected = np.exp(ref_logits - np.logaddexp.reduce(ref_logits))  # renormalised, 0 if cut
  kept = expected > 0
  if top_p < 1:
    assert 2 <= kept.sum() <= VOCAB - 2, "top-p should cut some tokens and keep several"
  assert expected.max() > 2.0 / VOCAB, "the distribution should be far from uniform"

  out = sampling.generate(llama, [prompt], num_samples=DRAWS, max_new_tokens=1, temperature=1.0,
                          top_p=top_p, seed=11)
  drawn = np.asarray(out.tokens[:, 0])
  counts = np.bincount(drawn, minlength=VOCAB)
  assert counts[~kept].sum() == 0, "drew a token outside the nucleus"
  _, p_value = scipy.stats.chisquare(counts[kept], DRAWS * expected[kept])
  assert p_value > P_VALUE_FLOOR, (counts, DRAWS * expected)
  # Each draw's log-prob is that of the truncated distribution.
  np.testing.assert_allclose(np.asarray(out.logprobs[:, 0]), np.log(expected[drawn]), atol=1e-5)
