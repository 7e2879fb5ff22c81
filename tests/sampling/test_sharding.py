"""The sampler on ("data", "fsdp", "tensor") meshes of 8 fake CPU devices: the same greedy samples
on every mesh, and the cache and rows sharded as documented."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from ksjax import model, sampling
from ksjax.model import sharding
from ksjax.sampling import batching, sampler
from tests.support import tolerances

CFG = model.preset("tiny", vocab_size=96, max_position_embeddings=64)
PROMPTS = [[5, 17, 3], [8, 1, 2, 9, 33, 4, 60], [70], [12, 13, 14, 15]]
SETTINGS = dict(num_samples=2, max_new_tokens=10, temperature=0.0, eos_id=None)


def scaled_llama(cfg: model.LlamaConfig = CFG) -> model.Llama:
  llama = model.Llama(cfg, rngs=nnx.Rngs(1))
  nnx.update(llama, jax.tree.map(lambda x: 3.0 * x, nnx.state(llama)))
  return llama


@pytest.fixture(scope="module")
def unsharded():
  return sampling.generate(scaled_llama(), PROMPTS, **SETTINGS)


@pytest.mark.parametrize("shape", [(1, 1, 1), (8, 1, 1), (2, 2, 2)])
def test_greedy_samples_are_identical_on_every_mesh(shape, unsharded):
  mesh = model.make_mesh(shape)
  llama = model.shard(scaled_llama(), mesh)
  out = sampling.generate(llama, PROMPTS, **SETTINGS)  # mesh taken from the parameters
  np.testing.assert_array_equal(out.tokens, unsharded.tokens)
  np.testing.assert_array_equal(out.lengths, unsharded.lengths)
  np.testing.assert_allclose(out.logprobs, unsharded.logprobs, atol=1e-5)
  assert len({tuple(row) for row in np.asarray(out.tokens).tolist()}) > 1

  # The state the programs hand over: the cache as `sharding.cache_sharding` says (rows over
  # data x fsdp, kv heads over tensor), the rows of the outputs over data x fsdp.
  cfg = sampling.SamplerConfig(**{k: v for k, v in SETTINGS.items() if k != "num_samples"})
  n = SETTINGS["num_samples"]
  batch_shards = sharding.batch_shards(mesh)
  batch = batching.pad_prompts(batching.validate_prompts(PROMPTS, CFG.vocab_size), n,
                               batch_shards, 0)
  shapes = sampler.Shapes(batch.tokens_pt.shape[0], n, batch.tokens_pt.shape[1])
  graphdef, params = nnx.split(llama)
  prefill, _ = sampler.programs(graphdef, cfg, mesh, shapes)
  misses = sampler.programs.cache_info().misses
  prompt, state = prefill(params, batch.tokens_pt, batch.mask_pt, np.int32(len(PROMPTS) * n),
                          np.uint32(0))
  assert sampler.programs.cache_info().misses == misses  # the program generate compiled
  prompts_split = shapes.prompt_rows % batch_shards == 0
  for kind in ("k", "v"):
    for layer in state.cache[kind]:
      assert layer.sharding.spec == sharding.cache_sharding(mesh)[kind].spec
      assert layer.addressable_shards[0].data.shape[0] == shapes.rows // batch_shards
    # One prompt cache per prompt: split over the batch shards where they divide the prompts.
    for layer in prompt.cache[kind]:
      assert layer.shape[0] == shapes.prompt_rows
      assert layer.addressable_shards[0].data.shape[0] == (
          shapes.prompt_rows // batch_shards if prompts_split else shapes.prompt_rows)
  assert state.tokens_bn.sharding.spec == P(sharding.BATCH, None)


def test_shrinking_on_a_mesh_gives_the_unsharded_samples():
  """The decode batch shrinks on a (2, 2, 2) mesh (rows over 4 batch shards) as it does on one
  device, and the samples are those of one loop over the whole batch."""
  from tests.sampling.test_sampler import shrinking_case  # pylint: disable=g-import-not-at-top
  llama = scaled_llama()
  whole, _ = shrinking_case(llama, compact_rows=0)
  mesh = model.make_mesh((2, 2, 2))
  out, shrunk = shrinking_case(model.shard(scaled_llama(), mesh), mesh=mesh, compact_rows=2)
  assert shrunk and min(shrunk) >= 4 and all(b % 4 == 0 for b in shrunk), shrunk
  np.testing.assert_array_equal(out.tokens, whole.tokens)
  np.testing.assert_array_equal(out.lengths, whole.lengths)
  np.testing.assert_allclose(out.logprobs, whole.logprobs, atol=1e-5, rtol=0)


def test_weights_cast_once_keep_their_shardings_and_the_samples():
  """With bfloat16 operands the sampler casts the weight matrices once per call
  (`sampler.operand_params`): on a (2, 2, 2) mesh the cast copies keep each parameter's
  sharding, and greedy samples equal the unsharded bfloat16 model's."""
  mixed = lambda llama: model.with_config(llama, matmul_dtype="bfloat16")
  reference = sampling.generate(mixed(scaled_llama()), PROMPTS, **SETTINGS)
  mesh = model.make_mesh((2, 2, 2))
  llama = mixed(model.shard(scaled_llama(), mesh))
  state = nnx.state(llama)
  cast = sampler.operand_params(state, llama.cfg)
  for name in ("q_proj", "down_proj"):
    kind = "self_attn" if name == "q_proj" else "mlp"
    held, copy = state["layers"][0][kind][name][...], cast["layers"][0][kind][name][...]
    assert copy.dtype == jax.numpy.bfloat16
    assert copy.sharding.is_equivalent_to(held.sharding, copy.ndim)
    assert len(held.sharding.device_set) == 8 and held.sharding.spec != P()
  out = sampling.generate(llama, PROMPTS, **SETTINGS)
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  # A sharded contraction adds its float32 partial sums in another order, and where that moves
  # an activation across a bfloat16 rounding boundary the operand changes by one bfloat16
  # spacing: the bound is derived in tests/support/tolerances.py, against the float32 model's
  # log-probs of the same tokens.
  tokens, mask = reference.sequences()
  t = reference.prompt_tokens.shape[1]
  logp32, _ = nnx.jit(model.token_logprobs, static_argnames="temperature")(
      scaled_llama(), tokens, mask, temperature=1.0)  # greedy: log-probs at temperature 1
  tolerances.assert_same_bfloat16_computation(out.logprobs, reference.logprobs, logp32[:, t:],
                                              float32_atol=1e-5, where=mask[:, t:] > 0)


def test_decoding_in_phases_on_a_mesh_gives_the_one_loop_samples():
  """100 new tokens decode in two phases (64, then 99 slots of the rows' cache); on a (2, 2, 2)
  mesh the phase's slot copy and its write-back keep the cache's sharding, and the samples are
  those of one loop over all slots on one device."""
  llama = lambda: scaled_llama(model.preset("tiny", vocab_size=96, max_position_embeddings=128))
  settings = dict(max_new_tokens=100, temperature=1.0)
  one_loop = sampling.sample(llama(), PROMPTS, sampling.SamplerConfig(
      **settings, cache_phases=1), num_samples=2, seed=4)
  mesh = model.make_mesh((2, 2, 2))
  phased = sampling.SamplerConfig(**settings, cache_phases=3)
  assert sampler.phase_slots(sampler.new_slots(phased), phased.cache_phases) == (64, 99)
  out = sampling.sample(model.shard(llama(), mesh), PROMPTS, phased, num_samples=2, seed=4)
  np.testing.assert_array_equal(out.tokens, one_loop.tokens)
  np.testing.assert_allclose(out.logprobs, one_loop.logprobs, atol=1e-5, rtol=0)
  assert len({tuple(row) for row in np.asarray(out.tokens).tolist()}) > 1


def test_a_rematerialised_prefill_on_fsdp_gathers_one_layer_at_a_time():
  """The prefill runs under the mesh's activation shardings (rows over data x fsdp), and with
  cfg.remat its layers as a scan (`Llama.prefill`): on an FSDP mesh its compiled temporaries
  grow with depth by less than one layer's weights (without the shardings XLA kept the weights
  split and all-reduced every MLP's [rows, T, F] activations whole on each device; unrolled,
  XLA:CPU gathered every layer's weights up front). Its greedy samples are the unsharded
  model's without remat."""
  mesh = model.make_mesh((1, 8, 1))
  wide = dataclasses.replace(CFG, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                             intermediate_size=2048, remat=True)
  cfg = sampling.SamplerConfig(max_new_tokens=4)
  shapes = sampler.Shapes(prompt_rows=8, num_samples=2, prompt_len=16)
  temps = {}
  for layers in (2, 4):
    llama = model.shard(model.Llama(dataclasses.replace(wide, num_layers=layers),
                                    rngs=nnx.Rngs(1)), mesh)
    graphdef, params = nnx.split(llama)
    prefill, _ = sampler.programs(graphdef, cfg, mesh, shapes)
    rows = sampler.prompt_shardings(mesh, shapes.prompt_rows).mask_pt
    tokens = jax.ShapeDtypeStruct((8, 16), np.int32, sharding=rows)
    mask = jax.ShapeDtypeStruct((8, 16), np.bool_, sharding=rows)
    compiled = prefill.lower(params, tokens, mask, jax.ShapeDtypeStruct((), np.int32),
                             jax.ShapeDtypeStruct((), np.uint32)).compile()
    temps[layers] = compiled.memory_analysis().temp_size_in_bytes
  layer_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(llama.layers[0])))
  assert (temps[4] - temps[2]) / 2 < 0.5 * layer_bytes, (temps, layer_bytes)
  settings = dict(SETTINGS, max_new_tokens=4)
  expected = sampling.generate(
      model.Llama(dataclasses.replace(wide, num_layers=4, remat=False), rngs=nnx.Rngs(1)),
      PROMPTS, **settings)
  out = sampling.generate(llama, PROMPTS, **settings)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  np.testing.assert_allclose(out.logprobs, expected.logprobs, atol=1e-5)
