"""Fuzzing the model files ksjax reads (`ksjax.model`): GGUF headers and the checkpoints
config.init_checkpoint names. What every reader must do with garbage: `tests/support/fuzz.py`."""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
from struct import error as struct_error

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ksjax.model import gguf_io
from ksjax.run import spec as spec_lib
from tests.support.fuzz import (FUZZ, SCALE, apply_damage, assert_input_error, damage_to,
                                input_error_or_result, relative_files)

# ---------------------------------------------------------------------------------------------
# GGUF headers
# ---------------------------------------------------------------------------------------------

GGUF_CFG = dict(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                head_dim=4, intermediate_size=16)
GGUF_TOKENS = ["a", "b", "c", "ab", "abc", "<s>", "</s>", "Ġ"]
GGUF_META = {  # key -> (value, GGUFValueType)
    "llama.block_count": (1, gguf.GGUFValueType.UINT32),
    "llama.context_length": (64, gguf.GGUFValueType.UINT32),
    "llama.embedding_length": (8, gguf.GGUFValueType.UINT32),
    "llama.feed_forward_length": (16, gguf.GGUFValueType.UINT32),
    "llama.attention.head_count": (2, gguf.GGUFValueType.UINT32),
    "llama.attention.head_count_kv": (1, gguf.GGUFValueType.UINT32),
    "llama.attention.key_length": (4, gguf.GGUFValueType.UINT32),
    "llama.rope.freq_base": (10000.0, gguf.GGUFValueType.FLOAT32),
    "llama.attention.layer_norm_rms_epsilon": (1e-5, gguf.GGUFValueType.FLOAT32),
    "tokenizer.ggml.model": ("gpt2", gguf.GGUFValueType.STRING),
    "tokenizer.ggml.pre": ("llama-bpe", gguf.GGUFValueType.STRING),
    "tokenizer.ggml.tokens": (GGUF_TOKENS, gguf.GGUFValueType.ARRAY),
    "tokenizer.ggml.token_type": ([1] * 5 + [3, 3, 1], gguf.GGUFValueType.ARRAY),
    "tokenizer.ggml.merges": (["a b", "ab c"], gguf.GGUFValueType.ARRAY),
    "tokenizer.ggml.bos_token_id": (5, gguf.GGUFValueType.UINT32),
    "tokenizer.ggml.eos_token_id": (6, gguf.GGUFValueType.UINT32),
    "tokenizer.ggml.add_bos_token": (True, gguf.GGUFValueType.BOOL),
    "tokenizer.chat_template": ("{{ messages }}", gguf.GGUFValueType.STRING),
}
SCALAR_TYPES = [gguf.GGUFValueType.UINT32, gguf.GGUFValueType.INT32, gguf.GGUFValueType.INT64,
                gguf.GGUFValueType.UINT64, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.BOOL,
                gguf.GGUFValueType.STRING]
gguf_values = st.one_of(
    st.tuples(st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 9)),
              st.just(gguf.GGUFValueType.UINT32)),
    st.tuples(st.integers(-2**31, 2**31 - 1), st.just(gguf.GGUFValueType.INT32)),
    st.tuples(st.integers(-2**63, 2**63 - 1), st.just(gguf.GGUFValueType.INT64)),
    st.tuples(st.floats(width=32), st.just(gguf.GGUFValueType.FLOAT32)),
    st.tuples(st.booleans(), st.just(gguf.GGUFValueType.BOOL)),
    st.tuples(st.one_of(st.text(max_size=8), st.sampled_from(["llama", "gpt2", "none", "linear"])),
              st.just(gguf.GGUFValueType.STRING)),
    st.tuples(st.lists(st.text(max_size=4), max_size=10), st.just(gguf.GGUFValueType.ARRAY)),
    st.tuples(st.lists(st.integers(-3, 9), min_size=1, max_size=10),
              st.just(gguf.GGUFValueType.ARRAY)),
)


def _gguf_tensors(shape_changes):
  """GGUF name -> float32 zeros of a tiny llama's tensors (numpy order), with `shape_changes`
  (name -> new shape, or None to leave the tensor out)."""
  from ksjax.model import hf_io  # pylint: disable=g-import-not-at-top
  from ksjax.model.config import LlamaConfig  # pylint: disable=g-import-not-at-top
  cfg = LlamaConfig(**GGUF_CFG, tie_embeddings=True)
  tensors = {gguf_io.gguf_name(m.hf_name): m.hf_shape for m in hf_io.tensor_maps(cfg)}
  tensors.update(shape_changes)
  return {name: np.zeros(shape, np.float32) for name, shape in tensors.items() if shape is not None}


def write_tiny_gguf(path, meta, tensors, arch="llama"):
  writer = gguf.GGUFWriter(str(path), arch)
  for key, (value, kind) in meta.items():
    sub = None
    if kind == gguf.GGUFValueType.ARRAY and value and isinstance(value[0], int):
      sub = gguf.GGUFValueType.INT32
    writer.add_key_value(key, value, kind, sub_type=sub)
  for name, array in tensors.items():
    writer.add_tensor(name, array)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


@st.composite
def gguf_files(draw):
  meta = dict(GGUF_META)
  for key in draw(st.lists(st.sampled_from(sorted(GGUF_META)), unique=True, max_size=3)):
    if draw(st.booleans()):
      del meta[key]
    else:
      meta[key] = draw(gguf_values)
  names = sorted(_gguf_tensors({}))
  shape_changes = {}
  for name in draw(st.lists(st.sampled_from(names + ["rope_freqs.weight", "blk.9.x.weight"]),
                            unique=True, max_size=2)):
    shape_changes[name] = draw(st.one_of(st.none(), st.lists(st.integers(1, 9), min_size=1,
                                                             max_size=3).map(tuple)))
  arch = draw(st.sampled_from(["llama", "llama", "llama", "qwen2", ""]))
  return meta, shape_changes, arch, draw(st.sampled_from(["as is", "as is", "cut", "flip"])), \
      draw(st.randoms(use_true_random=False))


@FUZZ
@given(data=gguf_files())
def test_gguf_headers(data):
  meta, shape_changes, arch, damage, rng = data
  with tempfile.TemporaryDirectory() as root:
    path = os.path.join(root, "model.gguf")
    try:
      write_tiny_gguf(path, meta, _gguf_tensors(shape_changes), arch)
    except (ValueError, TypeError, OverflowError, struct_error):  # gguf cannot write it
      return
    content = bytearray(pathlib.Path(path).read_bytes())
    header = min(len(content), 2048)  # the metadata and tensor list, not the weights
    if damage == "cut":
      content = content[:rng.randrange(len(content))]
    elif damage == "flip":
      for _ in range(rng.randint(1, 8)):
        content[rng.randrange(header)] = rng.randrange(256)
    pathlib.Path(path).write_bytes(bytes(content))
    input_error_or_result(gguf_io.check_gguf, path, where=root)
    input_error_or_result(gguf_io.read_gguf_tokenizer, path, where=root)


# Bugs this fuzzing found in the GGUF reader, each pinned by an example.

def _gguf_with(path, *, meta=None, shape_changes=None):
  write_tiny_gguf(path, {**GGUF_META, **(meta or {})}, _gguf_tensors(shape_changes or {}))
  return str(path)


def test_gguf_one_dimensional_embedding_is_an_input_error(tmp_path):
  assert_input_error(gguf_io.check_gguf, _gguf_with(
      tmp_path / "m.gguf", shape_changes={"token_embd.weight": (8,)}),
                     match=r"'token_embd.weight' has shape \(8,\); expected 2 dimensions")


@pytest.mark.parametrize("key", ["tokenizer.ggml.tokens", "tokenizer.ggml.merges"])
def test_gguf_token_lists_of_integers_are_an_input_error(tmp_path, key):
  assert_input_error(gguf_io.read_gguf_tokenizer, _gguf_with(
      tmp_path / "m.gguf", meta={key: ([1] * 8, gguf.GGUFValueType.ARRAY)}),
                     match=rf"metadata '{key}' holds 1 \(int\); expected a list of str")


def test_gguf_string_that_is_not_utf8_is_an_input_error(tmp_path):
  path = _gguf_with(tmp_path / "m.gguf",
                    meta={"tokenizer.ggml.pre": ("llama-bpX", gguf.GGUFValueType.STRING)})
  content = pathlib.Path(path).read_bytes()
  pathlib.Path(path).write_bytes(content.replace(b"llama-bpX", b"llama-bp\xff"))
  assert_input_error(gguf_io.read_gguf_tokenizer, path,
                     match=r"'tokenizer.ggml.pre' holds text that is not UTF-8")


def test_gguf_merge_of_unknown_tokens_is_an_input_error(tmp_path):
  path = _gguf_with(tmp_path / "m.gguf",
                    meta={"tokenizer.ggml.merges": (["a c"], gguf.GGUFValueType.ARRAY)})
  assert_input_error(gguf_io.read_gguf_tokenizer, path,
                     match=r"merges holds 'a c', whose 'ac' is not in tokenizer.ggml.tokens")


@pytest.mark.parametrize("count, match", [
    (9, r"run past the end of the file"),  # one more: the next field read as its last element
    (2**40, r"claims 1099511627776 elements, more than the \d+-byte file holds"),
    (2**64 - 1, r"claims 18446744073709551615 elements, more than the \d+-byte file holds")])
def test_gguf_array_longer_than_the_file_is_an_input_error(tmp_path, count, match):
  """An array length past what the file holds (a flipped byte) made gguf's reader loop over
  that many elements, reading past the end, until the memory ran out."""
  path = _gguf_with(tmp_path / "m.gguf")
  content = bytearray(pathlib.Path(path).read_bytes())
  key = b"tokenizer.ggml.token_type"
  at = content.index(key) + len(key) + 4 + 4  # the value's type (ARRAY), the items' (INT32)
  assert int.from_bytes(content[at:at + 8], "little") == 8
  content[at:at + 8] = count.to_bytes(8, "little")
  pathlib.Path(path).write_bytes(bytes(content))
  for read in (gguf_io.check_gguf, gguf_io.read_gguf_tokenizer):
    assert_input_error(read, path, match=r"truncated or corrupt GGUF file .*" + match)


@pytest.mark.parametrize("count", [0, 2, 4_000_000, 2**32 - 1])
def test_gguf_block_count_is_checked_against_the_blocks_present(tmp_path, count):
  """A block count in the millions (one flipped byte) used to build per-block tensor lists until
  the memory ran out; it is refused from the tensor list, before anything is built per block."""
  path = _gguf_with(tmp_path / "m.gguf",
                    meta={"llama.block_count": (count, gguf.GGUFValueType.UINT32)})
  assert_input_error(gguf_io.check_gguf, path,
                     match=rf"llama.block_count={count} but the file has tensors of blocks 0 to 0")


# ---------------------------------------------------------------------------------------------
# Model checkpoint directories (config.init_checkpoint)
# ---------------------------------------------------------------------------------------------

TINY_LLAMA = dict(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=4, intermediate_size=16)


@pytest.fixture(scope="module")
def model_checkpoint_dir(tmp_path_factory):
  """A ksjax.model checkpoint (what config.init_checkpoint names) of a tiny Llama."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from ksjax import model  # pylint: disable=g-import-not-at-top
  cfg = model.LlamaConfig(**TINY_LLAMA)
  path = str(tmp_path_factory.mktemp("model_checkpoint") / "checkpoint")
  model.save_checkpoint(path, model.Llama(cfg, rngs=nnx.Rngs(0)))
  return path


@settings(max_examples=25 * SCALE, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_init_checkpoint_directories(model_checkpoint_dir, data):
  from ksjax import model  # pylint: disable=g-import-not-at-top
  from ksjax.run import policy  # pylint: disable=g-import-not-at-top
  actions = data.draw(damage_to(relative_files(model_checkpoint_dir)))
  with tempfile.TemporaryDirectory() as root:
    path = os.path.join(root, "checkpoint")
    shutil.copytree(model_checkpoint_dir, path)
    apply_damage(path, actions)
    spec = spec_lib.ModelSpec(init_checkpoint=path)
    cfg = input_error_or_result(policy.policy_config, spec, 16, value_head=False, where=root,
                                memory_bytes=None)
    if cfg is not None:  # the config read: the weights next (ksjax.run.policy.build_model)
      input_error_or_result(model.load_checkpoint, path, where=root, memory_bytes=None)


# Bugs this fuzzing found in ksjax.model.checkpoint, each pinned by an example.

def test_init_checkpoint_with_metadata_of_another_shape_is_an_input_error(model_checkpoint_dir,
                                                                          tmp_path):
  from ksjax.run import policy  # pylint: disable=g-import-not-at-top
  path = tmp_path / "checkpoint"
  shutil.copytree(model_checkpoint_dir, path)
  (path / "_METADATA").write_text('{"x": 1}')
  message = assert_input_error(
      policy.policy_config, spec_lib.ModelSpec(init_checkpoint=str(path)), 16, value_head=False,
      match="cannot be read as a checkpoint", memory_bytes=None)
  assert str(path) in message


def test_init_checkpoint_with_damaged_array_metadata_is_an_input_error(model_checkpoint_dir,
                                                                       tmp_path):
  from ksjax import model  # pylint: disable=g-import-not-at-top
  path = tmp_path / "checkpoint"
  shutil.copytree(model_checkpoint_dir, path)
  (path / "array_metadatas" / "process_0").write_bytes(b"")
  message = assert_input_error(model.load_checkpoint, str(path),
                               match="cannot be read as a checkpoint", memory_bytes=None)
  assert str(path) in message
