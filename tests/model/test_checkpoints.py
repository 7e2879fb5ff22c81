"""Checkpoint I/O: HF safetensors (sharded index, mesh placement, bad input) and Orbax."""

import gc
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from ksjax import model
from ksjax.config_validation import ConfigError
from ksjax.model import checkpoint, sharding
from ksjax.tools import convert_hf

CFG = model.preset("tiny", vocab_size=128, tie_embeddings=False,
                   rope_scaling=model.config.LLAMA31_ROPE_SCALING, rope_theta=20000.0)
TOKENS = jnp.asarray(np.random.RandomState(0).randint(0, 128, (4, 9)), jnp.int32)


@nnx.jit
def forward(llama, tokens, mask=None):
  """The model under jit: eager dispatch compiles every op separately and is slower in tests."""
  return llama(tokens, attention_mask=mask)


@pytest.fixture(scope="module")
def original():
  return model.Llama(CFG, rngs=nnx.Rngs(7))


@pytest.fixture(scope="module")
def hf_dir(original, tmp_path_factory):
  path = str(tmp_path_factory.mktemp("hf") / "llama")
  model.save_hf(original, CFG, path)
  return path


def _copy_checkpoint(src, dst, edit_tensors=None, edit_config=None):
  os.makedirs(dst)
  with open(os.path.join(src, "config.json")) as f:
    config = json.load(f)
  if edit_config:
    edit_config(config)
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(config, f)
  tensors = load_file(os.path.join(src, "model.safetensors"))
  if edit_tensors:
    edit_tensors(tensors)
  save_file(tensors, os.path.join(dst, "model.safetensors"))
  return dst


def test_save_hf_writes_hf_names_and_config(hf_dir):
  with open(os.path.join(hf_dir, "config.json")) as f:
    config = json.load(f)
  assert config["architectures"] == ["LlamaForCausalLM"] and config["rope_theta"] == 20000.0
  assert config["rope_scaling"]["rope_type"] == "llama3"
  tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
  assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 16, 64)
  assert tensors["lm_head.weight"].shape == (128, 64)
  assert len(tensors) == 2 * 9 + 3


def test_sharded_index_loads_onto_a_mesh(original, tmp_path):
  out = str(tmp_path / "sharded")
  model.save_hf(original, CFG, out, max_shard_bytes=40_000)
  files = sorted(os.listdir(out))
  assert "model.safetensors.index.json" in files and len([f for f in files if "-of-" in f]) > 2
  mesh = model.make_mesh((2, 2, 2))
  llama, cfg = model.load_hf(out, mesh=mesh)
  assert cfg == CFG
  for path, leaf in nnx.to_flat_state(nnx.state(llama, nnx.Param)):
    assert leaf[...].sharding.spec == sharding.partition_spec(path), path
  np.testing.assert_allclose(forward(llama, TOKENS), forward(original, TOKENS), atol=1e-5, rtol=0)
  want = dict(nnx.to_flat_state(nnx.state(original, nnx.Param)))
  for path, leaf in nnx.to_flat_state(nnx.state(llama, nnx.Param)):
    np.testing.assert_array_equal(np.asarray(leaf[...]), np.asarray(want[path][...]))


def test_value_head_is_added_zeroed_and_not_exported(hf_dir, tmp_path):
  llama, cfg = model.load_hf(hf_dir, value_head=True)
  assert cfg.value_head and not np.any(np.asarray(llama.value_head[...]))
  out = str(tmp_path / "export")
  model.save_hf(llama, cfg, out)
  assert "value_head" not in str(load_file(os.path.join(out, "model.safetensors")).keys())


def test_bfloat16_load(hf_dir, original):
  llama, cfg = model.load_hf(hf_dir, dtype="bfloat16")
  assert cfg.param_dtype == cfg.dtype == "bfloat16"
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(nnx.state(llama, nnx.Param)))
  logits = forward(llama, TOKENS)
  assert logits.dtype == jnp.float32
  np.testing.assert_allclose(logits, forward(original, TOKENS), atol=0.05)


def _drop(name):
  return lambda t: t.pop(name)


def _add(name):
  return lambda t: t.__setitem__(name, np.zeros((3,), np.float32))


def _reshape(name):
  return lambda t: t.__setitem__(name, t[name][:-1])


@pytest.mark.parametrize("edit_tensors,edit_config,error,message", [
    (None, lambda c: c.update(model_type="mistral"), ConfigError, "model_type='mistral'"),
    (None, lambda c: c.update(architectures=["GPT2LMHeadModel"]), ConfigError, "GPT2LMHeadModel"),
    (None, lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 2.0}), ConfigError,
     "'yarn'"),
    (_drop("model.layers.1.mlp.up_proj.weight"), None, checkpoint.CheckpointError,
     "lacks tensor 'model.layers.1.mlp.up_proj.weight'"),
    (_add("model.layers.0.self_attn.q_norm.weight"), None, checkpoint.CheckpointError,
     "unexpected tensor 'model.layers.0.self_attn.q_norm.weight'"),
    (_reshape("model.layers.0.self_attn.v_proj.weight"), None, checkpoint.CheckpointError,
     r"'model.layers.0.self_attn.v_proj.weight' has shape \(31, 64\)"),
], ids=["model_type", "architectures", "rope_type", "missing", "extra", "shape"])
def test_bad_checkpoint_fails_before_placing_anything(hf_dir, tmp_path, edit_tensors, edit_config,
                                                       error, message):
  bad = _copy_checkpoint(hf_dir, str(tmp_path / "bad"), edit_tensors, edit_config)
  gc.collect()
  before = len(jax.live_arrays())
  with pytest.raises(error, match=message):
    model.load_hf(bad)
  assert len(jax.live_arrays()) <= before  # nothing was placed on a device


def test_untied_config_with_tied_lm_head_copy_is_accepted_only_when_equal(tmp_path):
  tied_cfg = model.preset("tiny", vocab_size=128, tie_embeddings=True)
  llama = model.Llama(tied_cfg, rngs=nnx.Rngs(0))
  src = str(tmp_path / "tied")
  model.save_hf(llama, tied_cfg, src)
  copy = _copy_checkpoint(src, str(tmp_path / "copy"), lambda t: t.__setitem__(
      "lm_head.weight", t["model.embed_tokens.weight"].copy()))
  loaded, _ = model.load_hf(copy)
  np.testing.assert_array_equal(forward(loaded, TOKENS), forward(llama, TOKENS))
  differs = _copy_checkpoint(src, str(tmp_path / "differs"), lambda t: t.__setitem__(
      "lm_head.weight", t["model.embed_tokens.weight"] + 1))
  with pytest.raises(checkpoint.CheckpointError, match="lm_head.weight"):
    model.load_hf(differs)


def test_mesh_that_does_not_divide_heads_is_refused_before_loading(hf_dir):
  # tensor=8 divides the vocabulary (128) but not the 4 heads.
  with pytest.raises(ConfigError, match="num_heads"):
    model.load_hf(hf_dir, mesh=model.make_mesh((1, 1, 8)))


def test_orbax_round_trip_onto_a_mesh(original, tmp_path):
  path = str(tmp_path / "ckpt")
  model.save_checkpoint(path, original)
  mesh = model.make_mesh((1, 8, 1))
  llama, cfg = model.load_checkpoint(path, mesh=mesh)
  assert cfg == CFG
  for p, leaf in nnx.to_flat_state(nnx.state(llama, nnx.Param)):
    assert leaf[...].sharding.spec == sharding.partition_spec(p), p
  want = dict(nnx.to_flat_state(nnx.state(original, nnx.Param)))
  for p, leaf in nnx.to_flat_state(nnx.state(llama, nnx.Param)):
    np.testing.assert_array_equal(np.asarray(leaf[...]), np.asarray(want[p][...]))
  with pytest.raises(FileExistsError):
    model.save_checkpoint(path, original)


def test_orbax_checkpoint_whose_config_disagrees_names_the_parameter(original, tmp_path):
  path = str(tmp_path / "ckpt")
  model.save_checkpoint(path, original)
  meta_file = os.path.join(path, "_CHECKPOINT_METADATA")  # Orbax's JSON metadata file
  with open(meta_file) as f:
    meta = json.load(f)
  meta["custom_metadata"]["llama_config"]["intermediate_size"] = 96
  with open(meta_file, "w") as f:
    json.dump(meta, f)
  with pytest.raises(checkpoint.CheckpointError, match=r"layers.0.mlp.down_proj' has shape"):
    model.load_checkpoint(path)


def test_convert_hf_writes_a_checkpoint_the_trainer_loads(hf_dir, original, tmp_path):
  out = str(tmp_path / "converted")
  convert_hf.convert(hf_dir, out, "float32", (1, -1, 1))
  llama, cfg = model.load_checkpoint(out)
  assert cfg == CFG
  np.testing.assert_allclose(forward(llama, TOKENS), forward(original, TOKENS), atol=1e-6)
  assert sorted(os.listdir(tmp_path)) == ["converted"]  # no temporary left behind


def test_convert_hf_command_on_bad_input_exits_2_and_writes_nothing(hf_dir, tmp_path):
  bad = _copy_checkpoint(hf_dir, str(tmp_path / "bad"),
                         _drop("model.norm.weight"))
  out = tmp_path / "out"
  proc = subprocess.run(
      [sys.executable, "-m", "ksjax.tools.convert_hf", f"--hf_dir={bad}", f"--out={out}"],
      capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, proc.stderr
  assert "lacks tensor 'model.norm.weight'" in proc.stderr
  assert sorted(os.listdir(tmp_path)) == ["bad"]
