"""LoRA and QLoRA (ksjax.model.lora, through qwix): the adapted model against its base, its
merge and its adapters-only checkpoints, gradients and optimizer state, the sampler's log-probs,
and the merge tool.

Tolerances: at initialisation (B = 0) the adapters add exact zeros, and with the adapters off the
programs hold no adapter at all, so those logits are compared bit for bit. A merged model
computes x (W + s A B) where the adapted one computes x W + s (x A) B, and a sharded forward sums
its partial products in another order than one device: the same real numbers rounded differently
in float32, so those logits agree to ROUNDING_ATOL. This random model (its weights scaled up, so
that its distributions are not near-uniform) amplifies float32's relative 6e-8 per rounding to
differences that depend on the CPU's vector width: up to 5e-5 on an AVX-512/AMX Xeon and 1.4e-4 on
an AVX2 EPYC, on logits of size ~2-5. ROUNDING_ATOL is 1e-3, seven times the larger; the errors
these comparisons exist to catch (a wrong scale, a transposed factor, a misplaced shard) move the
logits by the adapters' whole effect, about 8 here.
"""

import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from ksjax import model, sampling
from ksjax.config_validation import ConfigError
from ksjax.model import checkpoint, hf_io, lora, sharding
from ksjax.tools import merge_lora

CFG = model.preset("tiny", vocab_size=97, max_position_embeddings=64)
SPEC = lora.LoraSpec(rank=4, alpha=8.0)
ROUNDING_ATOL = 1e-3
_rng = np.random.RandomState(0)
TOKENS = jnp.asarray(_rng.randint(0, CFG.vocab_size, (4, 12)), jnp.int32)
MASK = jnp.asarray(np.arange(12)[None] >= np.array([[0], [3], [0], [5]]), jnp.int32)  # left pads


@nnx.jit
def forward(llama, tokens, mask):
  return llama(tokens, attention_mask=mask)


def token_logprobs(llama, tokens, mask):
  return model.token_logprobs(llama, tokens, mask)[0]


logprobs = nnx.jit(token_logprobs)


def scaled_base(cfg=CFG, seed=0) -> model.Llama:
  """A tiny random model with weights scaled up so its distributions are not near-uniform."""
  llama = model.Llama(cfg, rngs=nnx.Rngs(seed))
  nnx.update(llama, jax.tree.map(lambda x: 3.0 * x, nnx.state(llama)))
  return llama


def perturbed(adapted: model.Llama, seed=1, size=0.3) -> model.Llama:
  """`adapted` with every adapter moved off its initialisation (B no longer 0)."""
  graphdef, trainable, frozen = lora.split(adapted)
  keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(trainable))))
  moved = jax.tree.map(lambda x: x + size * jax.random.normal(next(keys), x.shape, x.dtype),
                       trainable)
  return nnx.merge(graphdef, moved, frozen)


def sizes(tree) -> int:
  return sum(x.size for x in jax.tree.leaves(tree))


@pytest.fixture(scope="module")
def base():
  return scaled_base()


@pytest.fixture(scope="module")
def base_logits(base):
  return np.asarray(forward(base, TOKENS, MASK))


# ---------------------------------------------------------------------------------------------
# The spec
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(rank=-1), r"config.lora.rank=-1 is out of range; expected an integer >= 0"),
    (dict(rank=2.5), r"config.lora.rank=2.5 is not accepted; expected an integer"),
    (dict(rank=4, alpha=0.0), r"config.lora.alpha=0.0 is out of range; expected a number > 0"),
    (dict(rank=4, dropout=1.0), r"config.lora.dropout=1.0 is out of range; .* in \[0.0, 1.0\)"),
    (dict(rank=4, targets="qkv"), r"config.lora.targets='qkv' is not accepted; expected one of "
                                  r"'attention', 'mlp', 'all'"),
    (dict(rank=4, quantize_base="nf4"), r"config.lora.quantize_base='nf4' is not accepted; "
                                        r"expected one of 'none', 'int8', 'int4'"),
    (dict(rank=0, quantize_base="int4"), r"config.lora.quantize_base='int4' needs "
                                         r"config.lora.rank >= 1"),
])
def test_a_bad_spec_is_one_line_naming_its_config_field(kwargs, match):
  with pytest.raises(ConfigError, match=match) as e:
    lora.LoraSpec(**kwargs)
  assert "\n" not in str(e.value)


def test_spec_from_config_and_off_by_default():
  from ksjax.run import config as run_config, spec as spec_lib  # pylint: disable=import-outside-toplevel
  config = run_config.base_config()
  assert spec_lib.from_config(config).lora == lora.LoraSpec() and not lora.LoraSpec().enabled
  config.lora.rank = 16
  config.lora.quantize_base = "int4"
  spec = spec_lib.from_config(config).lora
  assert spec.enabled and spec.scale == 1.0 and spec.quantize_base == "int4"
  assert lora.apply(model.Llama(CFG, rngs=nnx.Rngs(0)), lora.LoraSpec(rank=0),
                    rngs=nnx.Rngs(0)).layers[0].self_attn.lora_scale is None


# ---------------------------------------------------------------------------------------------
# The adapted model against its base
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("targets, matmul_dtype", [
    ("all", None), ("attention", "bfloat16"), ("mlp", "bfloat16"),  # each target, each precision
    pytest.param("all", "bfloat16", marks=pytest.mark.slow),
    pytest.param("attention", None, marks=pytest.mark.slow)])
def test_adapters_at_initialisation_compute_the_base_bitwise(targets, matmul_dtype):
  """Bit for bit on XLA's CPU backend, where the suite runs. Not checked on a GPU, where XLA may
  fuse the adapter's addition into the frozen product's GEMM and autotune that GEMM apart from
  the base's (then equal up to rounding); the adapters-off view, whose programs are the base's,
  does not depend on that."""
  base = model.with_config(scaled_base(), matmul_dtype=matmul_dtype)
  adapted = lora.apply(base, lora.LoraSpec(rank=4, alpha=8.0, targets=targets), rngs=nnx.Rngs(1))
  names = {str(p[-1]) for p, _ in nnx.to_flat_state(nnx.state(adapted, nnx.LoRAParam))}
  assert names == {f"{w}_{ab}" for w in lora.TARGETS[targets] for ab in ("lora_a", "lora_b")}
  # Every frozen weight matrix is stored as its products read it: in the matmul operand dtype.
  stored = {v.dtype for p, v in nnx.to_flat_state(nnx.state(adapted, nnx.Param))
            if p[-1] in lora.TARGETS["all"]}
  assert stored == {np.dtype(base.cfg.operand_dtype)}
  np.testing.assert_array_equal(forward(adapted, TOKENS, MASK), forward(base, TOKENS, MASK))
  np.testing.assert_array_equal(logprobs(adapted, TOKENS, MASK), logprobs(base, TOKENS, MASK))


@pytest.mark.parametrize("matmul_dtype", [None, "bfloat16"])
def test_a_frozen_copy_in_the_operand_dtype_computes_the_same_bits(matmul_dtype):
  """`lora.frozen_operands`, the trainer's reference policy: its attention and MLP matrices in
  the operand dtype (half the bytes under bfloat16 operands), the rest as it was, and the same
  log-probs bit for bit; the abstract form (the memory plan's) has the same dtypes."""
  base = model.with_config(scaled_base(), matmul_dtype=matmul_dtype)
  graphdef, state = nnx.split(base)
  copy = lora.frozen_operands(state, base.cfg)
  dtypes = {str(p[-1]): v.dtype for p, v in nnx.to_flat_state(copy)}
  operand = np.dtype(base.cfg.operand_dtype)
  assert {dtypes[w] for w in lora.TARGETS["all"]} == {operand}
  assert dtypes["embed_tokens"] == dtypes["scale"] == np.float32
  abstract = lora.frozen_operands(jax.eval_shape(lambda: state), base.cfg)
  assert jax.tree.map(lambda v: v.dtype, abstract) == jax.tree.map(lambda v: v.dtype, copy)
  held = sum(v.nbytes for v in jax.tree.leaves(state))
  assert sum(v.nbytes for v in jax.tree.leaves(copy)) < held * (0.9 if matmul_dtype else 1.01)
  np.testing.assert_array_equal(logprobs(nnx.merge(graphdef, copy), TOKENS, MASK),
                                logprobs(base, TOKENS, MASK))
  assert all(a is not b for a, b in zip(jax.tree.leaves(copy), jax.tree.leaves(state)))


def test_only_the_adapters_get_gradients_and_optimizer_state(base, base_logits):
  """A few AdamW steps on the adapters: the loss falls, the base is untouched, the optimizer
  holds two moments for the adapters and nothing for the base, and the merged model computes
  the adapted one's logits."""
  adapted = lora.apply(base, SPEC, rngs=nnx.Rngs(1))
  graphdef, trainable, frozen = lora.split(adapted)
  per_layer = 2 * len(lora.TARGETS["all"])
  assert len(jax.tree.leaves(trainable)) == per_layer * CFG.num_layers
  assert {type(v) for v in jax.tree.leaves(trainable, is_leaf=lambda x: isinstance(
      x, nnx.Variable))} == {nnx.LoRAParam}
  assert sizes(trainable) < sizes(frozen) / 4

  optimizer = optax.adamw(1e-2)
  opt_state = optimizer.init(trainable)
  adam = opt_state[0]
  assert sizes(adam.mu) == sizes(adam.nu) == sizes(trainable)
  assert sizes(opt_state) == 2 * sizes(trainable) + 1  # the moments, and a step count

  def loss(trainable, frozen):
    return -token_logprobs(nnx.merge(graphdef, trainable, frozen), TOKENS, MASK).sum()

  @jax.jit
  def step(trainable, frozen, opt_state):
    value, grads = jax.value_and_grad(loss)(trainable, frozen)
    updates, opt_state = optimizer.update(grads, opt_state, trainable)
    return optax.apply_updates(trainable, updates), opt_state, value, grads

  losses = []
  for _ in range(4):
    trainable, opt_state, value, grads = step(trainable, frozen, opt_state)
    losses.append(float(value))
  assert jax.tree.structure(grads) == jax.tree.structure(trainable)
  assert losses[-1] < losses[0]
  trained = nnx.merge(graphdef, trainable, frozen)
  for p, v in nnx.to_flat_state(nnx.state(trained, nnx.Not(nnx.LoRAParam))):
    assert v[...] is dict(nnx.to_flat_state(nnx.state(adapted)))[p][...]  # the same base arrays
  adapted_logits = np.asarray(forward(trained, TOKENS, MASK))
  assert np.abs(adapted_logits - base_logits).max() > 0.1  # the adapters moved the model

  merged = lora.merge(trained)
  assert not lora.is_adapted(merged)
  plain = nnx.state(model.Llama(CFG, rngs=nnx.Rngs(0)))
  assert jax.tree.structure(nnx.state(merged)) == jax.tree.structure(plain)
  np.testing.assert_allclose(forward(merged, TOKENS, MASK), adapted_logits, atol=ROUNDING_ATOL,
                             rtol=0)

  # Adapters off: the base's logits and log-probs, bit for bit, over the same arrays.
  off = lora.adapters_off(trained)
  assert off.layers[0].self_attn.q_proj[...] is trained.layers[0].self_attn.q_proj[...]
  np.testing.assert_array_equal(forward(off, TOKENS, MASK), base_logits)
  np.testing.assert_array_equal(logprobs(off, TOKENS, MASK), logprobs(base, TOKENS, MASK))
  assert lora.merge(off).layers[0].mlp.up_proj[...] is base.layers[0].mlp.up_proj[...]


@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_a_rematerialised_adapted_model_computes_the_same(base, quantize):
  spec = lora.LoraSpec(rank=4, alpha=8.0, quantize_base=quantize)
  adapted = perturbed(lora.apply(base, spec, rngs=nnx.Rngs(1)))
  remat = lora.apply(model.with_config(base, remat=True), spec, rngs=nnx.Rngs(1))
  nnx.update(remat, nnx.state(adapted, nnx.LoRAParam))
  np.testing.assert_allclose(forward(remat, TOKENS, MASK), forward(adapted, TOKENS, MASK),
                             atol=1e-5, rtol=0)
  with pytest.raises(ValueError, match=r"with_config takes a plain Llama"):
    model.with_config(adapted, remat=True)  # adapt after with_config
  with pytest.raises(ConfigError, match=r"config.lora.dropout=0.1 needs model.remat=False"):
    lora.apply(model.with_config(base, remat=True), lora.LoraSpec(rank=4, dropout=0.1),
               rngs=nnx.Rngs(1))


def test_dropout_is_off_except_in_the_training_view(base, base_logits):
  adapted = perturbed(lora.apply(base, lora.LoraSpec(rank=4, dropout=0.5), rngs=nnx.Rngs(1)))
  eval_logits = np.asarray(forward(adapted, TOKENS, MASK))
  np.testing.assert_array_equal(forward(adapted, TOKENS, MASK), eval_logits)
  train = lora.training(adapted)
  first, second = forward(train, TOKENS, MASK), forward(train, TOKENS, MASK)
  assert not np.allclose(first, eval_logits) and not np.allclose(first, second)  # new masks
  np.testing.assert_array_equal(forward(lora.adapters_off(adapted), TOKENS, MASK), base_logits)


# The quantized base's logits against the float base's: |difference| / |logits| (Frobenius) at
# most this. Rounding to nearest with absmax scales perturbs each weight by about 0.6% (int8) and
# 10% (int4) of its scale's spread; this random model, its weights scaled up, amplifies that
# (2.4% and 36% measured).
QUANTIZED_RTOL = {"int8": 0.05, "int4": 0.5}


@pytest.mark.parametrize("quantize", [pytest.param("int8", marks=pytest.mark.slow), "int4"])
def test_qlora_runs_near_the_base_and_trains_only_adapters(base, base_logits, quantize):
  adapted = lora.apply(base, lora.LoraSpec(rank=4, alpha=8.0, quantize_base=quantize),
                       rngs=nnx.Rngs(1))
  frozen_leaves = jax.tree.leaves(nnx.state(adapted.layers[0].self_attn, nnx.Not(nnx.LoRAParam)))
  assert {str(x.dtype) for x in frozen_leaves} == {quantize, "float32"}  # values, scales
  logits = np.asarray(forward(adapted, TOKENS, MASK))
  # At initialisation: the quantized base itself (dequantized by qwix), bit for bit, and near
  # the float base.
  np.testing.assert_array_equal(logits, forward(lora.merge(adapted), TOKENS, MASK))
  error = np.linalg.norm(logits - base_logits) / np.linalg.norm(base_logits)
  assert 0 < error < QUANTIZED_RTOL[quantize]

  moved = perturbed(adapted)
  graphdef, trainable, frozen = lora.split(moved)
  grads = jax.jit(jax.grad(lambda t, f: -token_logprobs(nnx.merge(graphdef, t, f), TOKENS,
                                                          MASK).sum()))(trainable, frozen)
  assert jax.tree.structure(grads) == jax.tree.structure(trainable)
  assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))  # A and B both
  np.testing.assert_allclose(forward(lora.merge(moved), TOKENS, MASK),
                             forward(moved, TOKENS, MASK), atol=ROUNDING_ATOL, rtol=0)
  np.testing.assert_array_equal(forward(lora.adapters_off(moved), TOKENS, MASK), logits)


def test_adapters_and_a_quantized_base_are_placed_by_partition_spec():
  mesh = sharding.make_mesh((1, 2, 2))
  base = scaled_base(model.preset("tiny", vocab_size=96, max_position_embeddings=64))
  tokens = TOKENS % 96
  single = perturbed(lora.apply(base, lora.LoraSpec(rank=4, quantize_base="int4"),
                                rngs=nnx.Rngs(1)))
  placed = lora.apply(sharding.shard(nnx.merge(*nnx.split(base)), mesh),
                      lora.LoraSpec(rank=4, quantize_base="int4"), rngs=nnx.Rngs(1))
  nnx.update(placed, nnx.state(single, nnx.LoRAParam))
  placed = sharding.shard(placed, mesh)
  attn = placed.layers[0].self_attn
  assert attn.q_proj_lora_a[...].sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
  assert attn.q_proj_lora_b[...].sharding.spec == jax.sharding.PartitionSpec(None, "tensor", None)
  assert attn.q_proj.qvalue[...].sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor",
                                                                             None)
  assert attn.q_proj.scale[...].sharding.spec == jax.sharding.PartitionSpec(None, "tensor", None)
  logits = sharding.sharded_forward(placed, mesh)(tokens, MASK)
  np.testing.assert_allclose(logits, forward(single, tokens, MASK), atol=ROUNDING_ATOL,
                             rtol=0)


@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_the_samplers_logprobs_are_the_trainers_under_lora(base, quantize):
  adapted = perturbed(lora.apply(base, lora.LoraSpec(rank=4, alpha=8.0, quantize_base=quantize),
                                 rngs=nnx.Rngs(1)))
  prompts = [[5, 17, 3], [8, 1, 2, 9, 33, 4, 60], [70]]
  out = sampling.generate(adapted, prompts, num_samples=2, max_new_tokens=8, temperature=0.7,
                          seed=3)
  tokens, mask = out.sequences()
  full = nnx.jit(model.token_logprobs, static_argnames="temperature")(adapted, tokens, mask,
                                                                       temperature=0.7)[0]
  t = out.prompt_tokens.shape[1]
  np.testing.assert_allclose(out.logprobs, np.asarray(full)[:, t:], atol=1e-4, rtol=0)
  off = nnx.jit(model.token_logprobs, static_argnames="temperature")(
      lora.adapters_off(adapted), tokens, mask, temperature=0.7)[0]
  assert np.abs(np.asarray(off)[:, t:] - np.asarray(out.logprobs)).max() > 1e-2  # adapters used


# ---------------------------------------------------------------------------------------------
# Adapter checkpoints and the merge tool
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base_dir(base, tmp_path_factory):
  path = str(tmp_path_factory.mktemp("base") / "llama")
  hf_io.save_hf(base, CFG, path)
  with open(os.path.join(path, "tokenizer.json"), "w") as f:
    f.write("{}")
  return path


@pytest.fixture(scope="module")
def other_base_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("other") / "llama")
  hf_io.save_hf(scaled_base(seed=5), CFG, path)
  return path


@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_adapters_round_trip_onto_their_base(base_dir, tmp_path, quantize):
  spec = lora.LoraSpec(rank=4, alpha=8.0, quantize_base=quantize)
  loaded, _ = hf_io.load_hf(base_dir)
  adapted = perturbed(lora.apply(loaded, spec, rngs=nnx.Rngs(1)))
  path = str(tmp_path / "adapters")
  lora.save(path, adapted, spec, lora.base_record(base_dir, "float32"))
  with pytest.raises(FileExistsError):
    lora.save(path, adapted, spec, lora.base_record(base_dir, "float32"))
  restored, restored_spec = lora.load(path)
  assert restored_spec == spec
  np.testing.assert_array_equal(forward(restored, TOKENS, MASK), forward(adapted, TOKENS, MASK))
  stored = ocp.StandardCheckpointer().metadata(os.path.abspath(path)).item_metadata
  names = {str(p[-1]) for p, _ in nnx.traversals.flatten_mapping(dict(stored)).items()}
  assert names == {f"{w}_{ab}" for w in lora.TARGETS["all"] for ab in ("lora_a", "lora_b")}


def test_adapters_on_another_base_or_missing_are_refused_in_one_line(base_dir, other_base_dir,
                                                                     tmp_path):
  loaded, _ = hf_io.load_hf(base_dir)
  path = str(tmp_path / "adapters")
  lora.save(path, perturbed(lora.apply(loaded, SPEC, rngs=nnx.Rngs(1))), SPEC,
            lora.base_record(base_dir, "float32"))
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"holds adapters for the base 'llama' \(sha256 [0-9a-f]{16}\), but "
                           r".* has sha256 [0-9a-f]{16}; expected the base the adapters were "
                           r"trained on"):
    lora.load(path, base=other_base_dir)
  with pytest.raises(checkpoint.CheckpointError, match=r"base model .* does not exist"):
    lora.load(path, base=str(tmp_path / "nowhere"))
  with pytest.raises(checkpoint.CheckpointError, match=r"adapter checkpoint .* does not exist"):
    lora.load(str(tmp_path / "nothing"))
  checkpoint.save(str(tmp_path / "plain"), loaded)
  with pytest.raises(checkpoint.CheckpointError, match=r"has no adapter metadata"):
    lora.load(str(tmp_path / "plain"))
  damaged = str(tmp_path / "damaged")
  shutil.copytree(path, damaged)
  os.remove(os.path.join(damaged, "manifest.ocdbt"))
  with pytest.raises(checkpoint.CheckpointError, match=r"adapter checkpoint .*damaged': "
                                                       r"checkpoint lacks parameter 'layers.0"):
    lora.load(damaged)
  garbled = str(tmp_path / "garbled")
  shutil.copytree(path, garbled)
  for root, _, names in os.walk(os.path.join(garbled, "ocdbt.process_0", "d")):
    for name in names:
      with open(os.path.join(root, name), "wb") as f:
        f.write(b"not tensorstore data")
  with pytest.raises(checkpoint.CheckpointError, match=r"cannot be read as a checkpoint .*; "
                                                       r"expected an adapter checkpoint"):
    lora.load(garbled)


def test_merge_tool_writes_a_hugging_face_directory_of_the_adapted_model(base_dir, tmp_path):
  loaded, _ = hf_io.load_hf(base_dir)
  adapted = perturbed(lora.apply(loaded, SPEC, rngs=nnx.Rngs(1)))
  path = str(tmp_path / "adapters")
  lora.save(path, adapted, SPEC, lora.base_record(base_dir, "float32"))
  out = str(tmp_path / "merged")
  merge_lora.merge(path, out)
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]
  merged, cfg = hf_io.load_hf(out)
  assert cfg == CFG
  np.testing.assert_allclose(forward(merged, TOKENS, MASK), forward(adapted, TOKENS, MASK),
                             atol=ROUNDING_ATOL, rtol=0)
  assert sorted(os.listdir(tmp_path)) == ["adapters", "merged"]  # no temporary left behind


def test_merge_tool_on_bad_input_exits_2_in_one_line_and_writes_nothing(base_dir, other_base_dir,
                                                                        tmp_path):
  loaded, _ = hf_io.load_hf(base_dir)
  path = str(tmp_path / "adapters")
  lora.save(path, lora.apply(loaded, SPEC, rngs=nnx.Rngs(1)), SPEC,
            lora.base_record(base_dir, "float32"))
  out = tmp_path / "out"
  for args, expected in (
      ([f"--checkpoint={path}", f"--base={other_base_dir}"], "holds adapters for the base"),
      ([f"--checkpoint={tmp_path / 'missing'}"], "adapter checkpoint"),
  ):
    proc = subprocess.run([sys.executable, "-m", "ksjax.tools.merge_lora", *args, f"--out={out}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("merge_lora: ") and expected in lines[0], lines
    assert sorted(os.listdir(tmp_path)) == ["adapters"]
