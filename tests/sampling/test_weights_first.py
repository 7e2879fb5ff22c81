"""The decode step's products with the weights on the left (`sampler.weights_first`,
`layers.project_weights_first`): the same products as the plain ones, the same samples, taken only
where the sampler says, and counted by the memory plan."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ksjax import machine, model, sampling
from ksjax.model import layers, lora
from ksjax.sampling import sampler
from tests.support import tolerances

CFG = model.preset("tiny", vocab_size=97, max_position_embeddings=64)
# One layer where a test's subject is not the layers' loop (the tied-head test keeps two, so a
# copy handed to the wrong layer would show): half the compiling.
ONE_LAYER = dataclasses.replace(CFG, num_layers=1)
PROMPTS = [[5, 17, 3], [8, 1, 2, 9, 33, 4, 60], [70]]


def scaled(cfg: model.LlamaConfig, seed: int = 0) -> model.Llama:
  """A tiny random model with weights scaled up so its distributions are not near-uniform."""
  llama = model.Llama(cfg, rngs=nnx.Rngs(seed))
  nnx.update(llama, jax.tree.map(lambda x: 3.0 * x, nnx.state(llama)))
  return llama


def both_ways(llama, monkeypatch, layers_first=True, **kwargs):
  """The samples with the weights first (the default) and with the plain products; asserts that
  the first traced the layers' products with the weights first (`layers_first`) and the second
  did not."""
  traced = []
  original = layers.project_weights_first
  monkeypatch.setattr(layers, "project_weights_first",
                      lambda *a, **k: traced.append(1) or original(*a, **k))
  outs = []
  for rows in (sampling.SamplerConfig().weights_first_rows, 0):
    sampler.forget_programs()  # traced afresh, so that the spy sees the products
    traced.clear()
    cfg = sampling.SamplerConfig(max_new_tokens=10, weights_first_rows=rows, **kwargs)
    outs.append(sampler.sample(llama, PROMPTS, cfg, num_samples=4, seed=5))
    assert bool(traced) == (bool(rows) and layers_first), rows
  return outs


@pytest.mark.parametrize("matmul_dtype", [None, "bfloat16"])
def test_the_weights_first_product_is_the_plain_one(matmul_dtype):
  rng = np.random.default_rng(0)
  attn = layers.Attention(dataclasses.replace(CFG, matmul_dtype=matmul_dtype), nnx.Rngs(0))
  x = jnp.asarray(rng.standard_normal((2, 3, CFG.hidden_size)), jnp.float32)
  q_t = attn.q_proj[...].reshape(CFG.hidden_size, -1).T
  plain = attn.product("q_proj", x, "btd,dnh->btnh")
  first = attn.product("q_proj", x, "btd,dnh->btnh", weight_t=q_t)
  assert first.shape == plain.shape == (2, 3, CFG.num_heads, CFG.head_dim)
  assert first.dtype == plain.dtype
  # The same products of the same (rounded) operands, summed in another order.
  np.testing.assert_allclose(first, plain, rtol=1e-5, atol=1e-5)
  heads = jnp.asarray(rng.standard_normal((2, 3, CFG.num_heads, CFG.head_dim)), jnp.float32)
  o_t = attn.o_proj[...].reshape(-1, CFG.hidden_size).T
  np.testing.assert_allclose(attn.out(heads, o_t), attn.out(heads), rtol=1e-5, atol=1e-5)
  # The copy's orientation matters (q's matrix is square here): the untransposed one differs.
  wrong = attn.product("q_proj", x, "btd,dnh->btnh",
                       weight_t=attn.q_proj[...].reshape(CFG.hidden_size, -1))
  assert not np.allclose(wrong, plain, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("tie", [False, True])
def test_the_same_samples_with_the_weights_first_tied_head_or_not(tie, monkeypatch):
  llama = scaled(dataclasses.replace(CFG, tie_embeddings=tie))
  assert sampler.weights_first_applies(sampling.SamplerConfig(), sampler.model_mesh(llama),
                                       len(PROMPTS) * 4)
  copies = sampler.weights_first(nnx.state(llama), llama.cfg)
  assert (copies["lm_head"] is None) == tie  # a tied head is [V, D] already
  assert copies["layers"][0]["self_attn"]["o_proj"].shape == (CFG.hidden_size,
                                                               CFG.num_heads * CFG.head_dim)
  first, plain = both_ways(llama, monkeypatch, temperature=0.8)  # greedy: the bfloat16 test
  np.testing.assert_array_equal(first.tokens, plain.tokens)
  np.testing.assert_array_equal(first.lengths, plain.lengths)
  np.testing.assert_allclose(first.logprobs, plain.logprobs, atol=2e-5, rtol=0)


def test_bfloat16_operands_give_the_same_samples_weights_first(monkeypatch):
  """Greedy samples with bfloat16 operands, as a CPU without bfloat16 dots takes them (float32
  dots of the rounded operands) and, on a CPU with them, as it takes them (bfloat16 dots); the
  log-probs within the bound of tests/support/tolerances.py (another summation order moves an
  activation across a bfloat16 rounding boundary now and then), against the float32 model's
  log-probs of the same tokens."""
  llama = model.with_config(scaled(CFG), matmul_dtype="bfloat16")
  for lacks in sorted({True, machine.lacks_bfloat16_dots()}):
    monkeypatch.setattr(machine, "lacks_bfloat16_dots", lambda *a, lacks=lacks: lacks)
    first, plain = both_ways(llama, monkeypatch, temperature=0.0)
    np.testing.assert_array_equal(first.tokens, plain.tokens)
    tokens, mask = plain.sequences()
    t = plain.prompt_tokens.shape[1]
    logp32, _ = nnx.jit(model.token_logprobs, static_argnames="temperature")(
        scaled(CFG), tokens, mask, temperature=1.0)  # greedy: log-probs at temperature 1
    tolerances.assert_same_bfloat16_computation(first.logprobs, plain.logprobs, logp32[:, t:],
                                                float32_atol=1e-5, where=mask[:, t:] > 0)


@pytest.mark.slow  # two adapted models sampled both ways; the plain products are the default run's
def test_adapters_and_a_quantized_base_keep_their_products(monkeypatch):
  base = scaled(ONE_LAYER)
  for spec in (lora.LoraSpec(rank=4, alpha=8.0), lora.LoraSpec(rank=4, quantize_base="int4")):
    adapted = lora.apply(base, spec, rngs=nnx.Rngs(1))
    # Adapters away from zero, so that a product that dropped them would show.
    nnx.update(adapted, jax.tree.map(lambda x: x + 0.3, nnx.state(adapted, nnx.LoRAParam)))
    copies = sampler.weights_first(nnx.state(adapted), adapted.cfg)
    layer = copies["layers"][0]
    if spec.quantize_base == "none":
      assert set(layer["self_attn"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    else:  # quantized weights are dequantized where they are used: no copy
      assert layer == {} or all(name not in layer.get(m, {}) for m, name, _ in
                                sampler._TRANSPOSED)  # pylint: disable=protected-access
    first, plain = both_ways(adapted, monkeypatch, spec.quantize_base == "none",
                             temperature=0.8)
    np.testing.assert_array_equal(first.tokens, plain.tokens)
    np.testing.assert_allclose(first.logprobs, plain.logprobs, atol=2e-5, rtol=0)


def test_where_the_weights_first_are_taken():
  single = sampler.model_mesh(model.Llama(CFG, rngs=nnx.Rngs(0)))
  eight = model.make_mesh((8, 1, 1))
  applies = lambda cfg=sampling.SamplerConfig(), mesh=single, rows=12: (
      sampler.weights_first_applies(cfg, mesh, rows))
  assert applies() and applies(rows=128)  # 128 rows shrink to 32 and fewer
  assert not applies(sampling.SamplerConfig(compact_rows=0), rows=128)  # never at <= 32 rows
  assert applies(sampling.SamplerConfig(compact_rows=0), rows=32)
  assert not applies(sampling.SamplerConfig(weights_first_rows=0))
  assert not applies(mesh=eight)


def test_a_decode_batch_above_the_threshold_takes_the_plain_products():
  llama = scaled(ONE_LAYER)
  cfg = sampling.SamplerConfig(max_new_tokens=10, weights_first_rows=4, compact_rows=0)
  plain = sampler.sample(llama, PROMPTS, dataclasses.replace(cfg, weights_first_rows=0),
                         num_samples=4, seed=5)
  # 12 rows > 4: the copies are not made, and the decode program ignores any it is given.
  assert not sampler.weights_first_applies(cfg, sampler.model_mesh(llama), 12)
  out = sampler.sample(llama, PROMPTS, cfg, num_samples=4, seed=5)
  np.testing.assert_array_equal(out.logprobs, plain.logprobs)


@pytest.mark.parametrize("rows", [-1, 2.5, True])
def test_weights_first_rows_is_validated(rows):
  with pytest.raises(ValueError, match=r"weights_first_rows=.* is not accepted; expected an "
                                       r"integer >= 0"):
    sampling.SamplerConfig(weights_first_rows=rows)
