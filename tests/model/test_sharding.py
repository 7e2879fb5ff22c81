"""Sharding of the Llama over ("data", "fsdp", "tensor") meshes of 8 fake CPU devices."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ksjax import model
from ksjax.config_validation import ConfigError
from ksjax.model import logprobs, sharding

CFG = model.preset("tiny", vocab_size=256, tie_embeddings=False, value_head=True)
MESHES = [(8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 1, 1)]


def _batch(b=8, t=10, seed=0):
  rng = np.random.RandomState(seed)
  tokens = rng.randint(0, CFG.vocab_size, (b, t)).astype(np.int32)
  mask = (np.arange(t)[None] >= rng.randint(0, t - 1, (b, 1))).astype(np.int32)
  return jnp.asarray(tokens), jnp.asarray(mask)


@pytest.fixture(scope="module")
def reference_logits():
  llama = model.Llama(CFG, rngs=nnx.Rngs(3))
  tokens, mask = _batch()
  return np.asarray(nnx.jit(lambda m, t, k: m(t, attention_mask=k))(llama, tokens, mask))


def test_make_mesh_fills_minus_one_and_uses_auto_axes():
  mesh = model.make_mesh((1, -1, 2))
  assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


@pytest.mark.parametrize("shape,shards", [((2, 2, 2), 4), ((1, 8, 1), 8), ((8, 1, 1), 8),
                                          ((1, 1, 8), 1), ((2, 1, 4), 2), ((1, 1, 1), 1)])
def test_batch_shards_is_data_times_fsdp(shape, shards):
  assert sharding.batch_shards(model.make_mesh(shape)) == shards


@pytest.mark.parametrize("shape", [(3, -1, 1), (4, 4, 1), (1, -1, -1), (0, 8, 1), (1, 2)])
def test_make_mesh_rejects_shapes_that_do_not_fit_8_devices(shape):
  with pytest.raises(ConfigError, match="mesh"):
    model.make_mesh(shape)


@pytest.mark.parametrize("shape", MESHES)
def test_sharded_logits_agree_across_meshes(shape, reference_logits):
  mesh = model.make_mesh(shape)
  llama = model.shard(model.Llama(CFG, rngs=nnx.Rngs(3)), mesh)
  for path, leaf in nnx.to_flat_state(nnx.state(llama, nnx.Param)):
    assert leaf[...].sharding == jax.sharding.NamedSharding(mesh, sharding.partition_spec(path)), path
  tokens, mask = _batch()
  logits = sharding.sharded_forward(llama, mesh)(tokens, mask)
  assert logits.sharding.spec == jax.sharding.PartitionSpec(sharding.BATCH, None, "tensor")
  np.testing.assert_allclose(np.asarray(logits), reference_logits, atol=1e-5, rtol=0)


def test_fsdp_8_puts_one_eighth_of_the_parameters_on_each_device():
  mesh = model.make_mesh((1, 8, 1))
  llama = model.shard(model.Llama(CFG, rngs=nnx.Rngs(0)), mesh)
  state = nnx.state(llama, nnx.Param)
  total = sum(x[...].nbytes for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
      x, nnx.Variable)))
  per_device = sharding.per_device_bytes(state)
  assert len(per_device) == 8
  for nbytes in per_device.values():
    assert abs(nbytes - total / 8) <= 0.01 * total / 8


def test_every_parameter_has_a_spec_of_its_rank():
  abstract = nnx.eval_shape(lambda: model.Llama(CFG, rngs=nnx.Rngs(0)))
  for path, leaf in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
    assert len(sharding.partition_spec(path)) == len(leaf.shape), path


@pytest.mark.parametrize("shape,overrides,field", [
    ((1, 1, 4), {}, "num_kv_heads"),            # 2 kv heads over tensor=4
    ((1, 1, 8), {}, "num_heads"),               # 4 heads over tensor=8
    ((1, 1, 2), {"vocab_size": 101}, "vocab_size"),
    ((1, 8, 1), {"hidden_size": 68, "head_dim": 16}, "hidden_size"),
])
def test_mesh_that_does_not_divide_names_the_field(shape, overrides, field):
  cfg = dataclasses.replace(CFG, **overrides)
  llama = nnx.eval_shape(lambda: model.Llama(cfg, rngs=nnx.Rngs(0)))
  with pytest.raises(ConfigError, match=f"LlamaConfig.{field}="):
    model.shard(llama, model.make_mesh(shape))


def test_cache_sharding_matches_init_cache_rank():
  mesh = model.make_mesh((2, 2, 2))
  cache = model.init_cache(CFG, batch_size=4, max_len=8)
  placed = jax.device_put(cache, sharding.cache_sharding(mesh))
  assert len(placed["k"]) == len(placed["v"]) == CFG.num_layers
  for kind in ("k", "v"):
    for layer, whole in zip(placed[kind], cache[kind]):
      assert layer.sharding.spec == jax.sharding.PartitionSpec(
          sharding.BATCH, "tensor", None, None)
      assert math.prod(layer.addressable_shards[0].data.shape) == whole.size // 8


def test_sharded_forward_cached_with_donated_cache_matches_unsharded(reference_logits):
  """The sampler's path: prefill on a (2, 2, 2) mesh with a sharded, donated cache."""
  mesh = model.make_mesh((2, 2, 2))
  llama = model.shard(model.Llama(CFG, rngs=nnx.Rngs(3)), mesh)
  tokens, mask = _batch()
  graphdef, state = nnx.split(llama)
  cache_shardings = sharding.cache_sharding(mesh)
  data = sharding.batch_sharding(mesh)

  def prefill(state, tokens, positions, cache, kv_mask):
    return nnx.merge(graphdef, state).forward_cached(tokens, positions, cache, 0, kv_mask)

  step = jax.jit(prefill, donate_argnums=3,
                 in_shardings=(sharding.state_shardings(state, mesh), data, data, cache_shardings,
                               data),
                 out_shardings=(sharding.batch_sharding(mesh, 3), cache_shardings))
  cache = jax.device_put(model.init_cache(CFG, tokens.shape[0], 16), cache_shardings)
  kv_mask = jnp.zeros((tokens.shape[0], 16), bool).at[:, :tokens.shape[1]].set(mask.astype(bool))
  logits, cache = step(state, tokens, model.default_positions(mask), cache, kv_mask)
  real = np.asarray(mask).astype(bool)
  np.testing.assert_allclose(np.asarray(logits)[real], reference_logits[real], atol=1e-5, rtol=0)
  assert all(c.sharding.spec == cache_shardings[kind].spec
             for kind in ("k", "v") for c in cache[kind])


@pytest.mark.parametrize("constrained", [False, True])
def test_token_logprobs_on_a_mesh_match_unsharded(constrained):
  """The trainer's path: chunked log-probs with a vocabulary-split head on a (2, 2, 2) mesh;
  constrained, as the Updater traces it (the vocabulary walked per tensor shard, [2, 128])."""
  tokens, mask = _batch()
  logprobs = lambda m, t, k: model.token_logprobs(m, t, k, seq_chunk=4, vocab_chunk=96)
  want = nnx.jit(logprobs)(model.Llama(CFG, rngs=nnx.Rngs(3)), tokens, mask)
  mesh = model.make_mesh((2, 2, 2))
  llama = model.shard(model.Llama(CFG, rngs=nnx.Rngs(3)), mesh)
  data = sharding.batch_sharding(mesh)

  def on_mesh(m, t, k):
    if not constrained:
      return logprobs(m, t, k)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      assert sharding.axis_size("vocab") == 2
      return logprobs(m, t, k)

  got = nnx.jit(on_mesh)(llama, jax.device_put(tokens, data), jax.device_put(mask, data))
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=0)


def test_token_logprob_gradients_on_a_mesh_match_unsharded():
  """The chunked log-probs' hand-written backward with the head's vocabulary split over tensor
  (each device walks its own [Vc] slices) and rows over data x fsdp, as the Updater traces it."""
  tokens, mask = _batch()
  weights = jax.random.normal(jax.random.key(1), tokens.shape)

  def loss(m, t, k):
    logp, ent = model.token_logprobs(m, t, k, temperature=0.9, seq_chunk=4, vocab_chunk=96)
    return (weights * logp).sum() + 0.1 * ent.sum()

  want = nnx.jit(nnx.grad(loss))(model.Llama(CFG, rngs=nnx.Rngs(3)), tokens, mask)
  mesh = model.make_mesh((2, 2, 2))
  llama = model.shard(model.Llama(CFG, rngs=nnx.Rngs(3)), mesh)
  data = sharding.batch_sharding(mesh)

  def on_mesh(m, t, k):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      assert sharding.axis_size("vocab") == 2
      return nnx.grad(loss)(m, t, k)

  got = nnx.jit(on_mesh)(llama, jax.device_put(tokens, data), jax.device_put(mask, data))
  for (path, g), (_, w) in zip(nnx.to_flat_state(got), nnx.to_flat_state(want)):
    np.testing.assert_allclose(np.asarray(g[...]), np.asarray(w[...]), atol=2e-5, rtol=1e-4,
                               err_msg=str(path))


def test_activation_specs_come_from_the_one_table():
  assert sharding.activation_spec("btd") == jax.sharding.PartitionSpec(sharding.BATCH, "tensor",
                                                                       None)
  assert sharding.activation_spec("btnh") == jax.sharding.PartitionSpec(
      sharding.BATCH, None, "tensor", None)
  assert sharding.activation_spec("btf") == jax.sharding.PartitionSpec(sharding.BATCH, None,
                                                                       "tensor")
  x = jnp.ones((8, 3, 4))
  assert sharding.constrain(x, "btd") is x  # no mesh set: a no-op, the model runs anywhere


def test_scanned_rematerialised_blocks_on_a_mesh_match_unsharded(reference_logits):
  """cfg.remat runs the blocks as a scan over stacked parameters, under activation constraints
  (rows over data x fsdp, heads and MLP columns over tensor)."""
  mesh = model.make_mesh((2, 2, 2))
  remat = dataclasses.replace(CFG, remat=True)
  llama = model.shard(model.Llama(remat, rngs=nnx.Rngs(3)), mesh)
  tokens, mask = _batch()
  logits = sharding.sharded_forward(llama, mesh)(tokens, mask)
  np.testing.assert_allclose(np.asarray(logits), reference_logits, atol=1e-5, rtol=0)


# slow: the sampler's rematerialised prefill gathers one layer at a time in the default run
@pytest.mark.slow
def test_rematerialised_continuations_gather_one_layer_at_a_time():
  """`continuation_logprobs` runs each layer's prompts and completions back to back, and with
  cfg.remat as a scan: on an FSDP mesh its compiled temporaries grow with depth by less than one
  layer's gathered weights (unrolled, XLA:CPU gathers every layer's weights up front, and the
  two passes kept them all: about one layer's weights per layer). Its log-probs on the mesh are
  the unsharded model's."""
  mesh = model.make_mesh((1, 8, 1))
  wide = dataclasses.replace(CFG, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                             intermediate_size=2048, value_head=False, remat=True)
  group, t = 4, 6
  tokens, mask = _batch(b=8, t=10)
  mask = mask.at[:, t:].set(1)
  tokens = tokens.at[:, :t].set(jnp.repeat(tokens[::group, :t], group, axis=0))
  mask = mask.at[:, :t].set(jnp.repeat(mask[::group, :t], group, axis=0))

  def program(layers):
    llama = model.shard(model.Llama(dataclasses.replace(wide, num_layers=layers),
                                    rngs=nnx.Rngs(3)), mesh)
    apply = lambda m, x, k: logprobs.continuation_logprobs(m, x, k, t, group)
    return llama, sharding.sharded_apply(llama, mesh, apply, jax.sharding.PartitionSpec())

  temps = {}
  for layers in (2, 4):
    llama, fn = program(layers)
    temps[layers] = fn.lower(tokens, mask).compile().memory_analysis().temp_size_in_bytes
  layer_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(llama.layers[0])))
  assert (temps[4] - temps[2]) / 2 < 0.5 * layer_bytes, (temps, layer_bytes)
  unsharded = nnx.merge(*nnx.split(llama))
  expected = nnx.jit(lambda m, x, k: logprobs.continuation_logprobs(m, x, k, t, group))(
      jax.device_put(unsharded, jax.devices()[0]), tokens, mask)
  np.testing.assert_allclose(np.asarray(fn(tokens, mask)), np.asarray(expected), atol=1e-5,
                             rtol=0)
