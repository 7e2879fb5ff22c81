"""`LlamaConfig.matmul_dtype`: the weight matmuls take bfloat16 operands, accumulate in float32,
and everything else stays in the compute dtype; without it the model computes exactly as before.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ksjax import model, sampling
from ksjax.config_validation import ConfigError
from ksjax.model.layers import project
from ksjax.run import config as run_config
from ksjax.run import policy
from ksjax.run import spec as spec_lib
from tests.support import tolerances

CFG = model.preset("tiny", vocab_size=97, max_position_embeddings=64)
MIXED = dataclasses.replace(CFG, matmul_dtype="bfloat16")
PROMPTS = [[5, 17, 3], [8, 1, 2, 9, 33, 4, 60], [70]]


def bf16_rounded(x) -> np.ndarray:
  return np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


@pytest.fixture(scope="module")
def llama():
  llama = model.Llama(CFG, rngs=nnx.Rngs(0))
  nnx.update(llama, jax.tree.map(lambda x: 3.0 * x, nnx.state(llama)))
  return llama


def test_project_rounds_the_operands_and_accumulates_in_float32():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((4, 3, 512)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((512, 96)), jnp.float32)
  out = project(x, w, "float32", "bfloat16")
  assert out.dtype == jnp.float32 and out.shape == (4, 3, 96)
  exact = bf16_rounded(x) @ bf16_rounded(w)  # the rounded operands' product, in float64
  # float32 accumulation over 512 terms: ~1e-6 relative. A bfloat16 accumulator or result would
  # be off by ~1e-2 relative, and float32 operands by ~1e-3 (the operands' own rounding).
  scale = np.abs(exact).max()
  assert np.abs(np.asarray(out) - exact).max() < 1e-5 * scale
  unrounded = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  assert np.abs(np.asarray(out) - unrounded).max() > 1e-4 * scale


@pytest.mark.parametrize("matmul_dtype", [None, "float32"])
def test_without_a_lower_matmul_dtype_project_is_the_plain_product(matmul_dtype):
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((2, 5, 64)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
  np.testing.assert_array_equal(jax.jit(lambda x, w: project(x, w, "float32", matmul_dtype))(x, w),
                                jax.jit(lambda x, w: x @ w)(x, w))


def test_with_config_keeps_the_parameters_and_changes_the_computation(llama):
  mixed = model.with_config(llama, matmul_dtype="bfloat16")
  assert mixed.cfg == MIXED and llama.cfg == CFG  # the original is unchanged
  assert mixed.layers[0].mlp.matmul_dtype == "bfloat16"
  assert mixed.layers[0].self_attn.matmul_dtype == "bfloat16"
  for a, b in zip(jax.tree.leaves(nnx.state(llama)), jax.tree.leaves(nnx.state(mixed))):
    assert a is b  # the same arrays, not copies
  tokens = jnp.asarray([[5, 17, 3, 9, 1, 44]])
  full, low = np.asarray(llama(tokens)), np.asarray(mixed(tokens))
  scale = np.abs(full).max()
  assert 1e-4 * scale < np.abs(full - low).max() < 5e-2 * scale  # active, and close


def test_mixed_sampler_logprobs_equal_the_mixed_full_forward(llama):
  """The sampler's log-probs are the trainer's (`token_logprobs`) under the same config."""
  mixed = model.with_config(llama, matmul_dtype="bfloat16")
  out = sampling.generate(mixed, PROMPTS, num_samples=2, max_new_tokens=8, temperature=0.7,
                          seed=3)
  tokens, mask = out.sequences()
  logp, _ = nnx.jit(model.token_logprobs, static_argnames="temperature")(
      mixed, tokens, mask, temperature=0.7)
  t = out.prompt_tokens.shape[1]
  logp32, _ = nnx.jit(model.token_logprobs, static_argnames="temperature")(
      llama, tokens, mask, temperature=0.7)
  # The same computation up to summation order, and not the float32 model's (the setting
  # reaches the sampler): the derivation is in tests/support/tolerances.py.
  tolerances.assert_same_bfloat16_computation(
      out.logprobs, logp[:, t:], logp32[:, t:], float32_atol=1e-5, where=mask[:, t:] > 0)


def test_a_loaded_model_takes_the_specs_matmul_dtype(tmp_path, llama):
  model.save_checkpoint(str(tmp_path / "start"), llama)
  c = run_config.base_config()
  c.init_checkpoint = str(tmp_path / "start")
  c.model.matmul_dtype = "bfloat16"
  spec = spec_lib.from_config(c)
  mesh = model.make_mesh((1, 1, 1))
  built = policy.build_model(spec.model, CFG.vocab_size, mesh, value_head=False, seed=0)
  assert built.cfg.matmul_dtype == "bfloat16"
  assert built.layers[-1].mlp.matmul_dtype == "bfloat16"
  assert policy.policy_config(spec.model, CFG.vocab_size, value_head=False).matmul_dtype == (
      "bfloat16")


def test_a_bad_matmul_dtype_is_one_config_error():
  c = run_config.base_config()
  c.model.matmul_dtype = "float16"
  with pytest.raises(ConfigError, match=r"model\.matmul_dtype") as e:
    spec_lib.from_config(c)
  assert "\n" not in str(e.value) and "bfloat16" in str(e.value)
  with pytest.raises(ConfigError, match="matmul_dtype"):
    dataclasses.replace(CFG, matmul_dtype="int8")


def test_the_sampler_casts_the_weights_once_and_samples_exactly_as_before(llama, monkeypatch):
  """`sampler.operand_params` gives every program bfloat16 weight matrices, cast once per call;
  the samples and log-probs are those of programs that cast float32 weights themselves."""
  from ksjax.sampling import sampler  # pylint: disable=g-import-not-at-top
  mixed = model.with_config(llama, matmul_dtype="bfloat16")
  cast = sampler.operand_params(nnx.state(mixed), mixed.cfg)
  assert cast["layers"][0]["mlp"]["down_proj"][...].dtype == jnp.bfloat16
  assert cast["layers"][0]["self_attn"]["q_proj"][...].dtype == jnp.bfloat16
  assert cast["embed_tokens"][...].dtype == jnp.float32  # the tied embedding's lookup
  assert cast["layers"][0]["input_layernorm"]["scale"][...].dtype == jnp.float32
  state = nnx.state(llama)
  assert sampler.operand_params(state, llama.cfg) is state  # float32 products: nothing to cast
  kwargs = dict(num_samples=2, max_new_tokens=8, temperature=0.7, seed=3)
  once = sampling.generate(mixed, PROMPTS, **kwargs)
  monkeypatch.setattr(sampler, "operand_params", lambda params, cfg: params)
  per_program = sampling.generate(mixed, PROMPTS, **kwargs)
  np.testing.assert_array_equal(once.tokens, per_program.tokens)
  np.testing.assert_array_equal(once.logprobs, per_program.logprobs)
