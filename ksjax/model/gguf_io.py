"""GGUF files (llama.cpp's single-file checkpoints) in: a ksjax Llama and its tokenizer.

A GGUF holds the config as metadata, the tokenizer as metadata (vocabulary, merges, token types,
special ids, chat template) and every tensor, possibly block-quantized. Loading goes the way of
`hf_io.load_hf`, of which this is a front end: the whole file is checked first (architecture,
metadata, tensor names, types and shapes) from its header alone, then each tensor is dequantized
to float32 on the host, renamed to its Hugging Face name, and placed by `hf_io.place_tensors`. So
a bad file fails with one `GGUFError` before any device memory is used.

What llama.cpp's converter (convert_hf_to_gguf.py) changed, and is undone here:
  * Names: `blk.N.attn_q.weight` for `model.layers.N.self_attn.q_proj.weight` and so on.
  * Dimension order: GGUF lists dims innermost first ([in, out] for a linear); the reader already
    hands out data in numpy order ([out, in], the HF layout), as `gguf.quants.dequantize` expects.
  * Q and K rows are permuted from HF's half-split RoPE pairs (i, i + H/2) to llama.cpp's
    interleaved pairs (2i, 2i + 1), per head (`_unpermute`).
  * llama3 RoPE scaling is stored as a per-frequency divisor tensor `rope_freqs.weight` instead of
    its four parameters (`_llama3_scaling` recovers and checks them).
  * Tied embeddings: `output.weight` is simply absent.

Dequantized weights are exact copies of what llama.cpp computes with; a model loaded from a
quantized file is the quantized model, not the original it was made from.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from typing import Any

import gguf
import jax
import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from ksjax.config_validation import ConfigError
from ksjax.model import hf_io, sharding
from ksjax.model.checkpoint import CheckpointError
from ksjax.model.config import LLAMA31_ROPE_SCALING, LLAMA32_ROPE_SCALING, LlamaConfig
from ksjax.model.config import from_hf_config
from ksjax.model.llama import Llama


class GGUFError(CheckpointError):
  """A file that is not a GGUF Llama this module can load. One line: the file, what was found and
  what is accepted."""


ARCHITECTURES = ("llama",)
# Tensor types read (all through `gguf.quants.dequantize`, as llama.cpp and transformers do). Any
# other type (the I-quants, integer tensors) is refused by name before anything is read.
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
                "Q4_K", "Q5_K", "Q6_K")
TOKENIZER_MODELS = ("gpt2",)

_BLOCK_NAMES = {  # GGUF block tensor -> Hugging Face module under model.layers.N
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_HF_BLOCK_NAMES = {hf: short for short, hf in _BLOCK_NAMES.items()}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_ROPE_FREQS = "rope_freqs.weight"
# The llama3 scalings released checkpoints use; `rope_freqs.weight` is checked against these.
_LLAMA3_CANDIDATES = (LLAMA31_ROPE_SCALING, LLAMA32_ROPE_SCALING)


def gguf_name(hf_name: str) -> str:
  """The GGUF tensor name of a Hugging Face Llama tensor name (KeyError for any other name)."""
  if hf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[hf_name]
  parts = hf_name.split(".")  # model.layers.N.<module>.weight
  short = _HF_BLOCK_NAMES.get(".".join(parts[3:-1]))
  if parts[:2] != ["model", "layers"] or parts[-1] != "weight" or short is None:
    raise KeyError(hf_name)
  return f"blk.{parts[2]}.{short}.weight"


# ---------------------------------------------------------------------------------------------
# The file and its metadata
# ---------------------------------------------------------------------------------------------

class _BoundedReader(gguf.GGUFReader):
  """gguf's reader, refusing what lies past the end of the file.

  gguf's own returns a read past the end short (an empty array, for a length field cut off) and
  reads an array's elements one by one, a Python object each: a corrupt array length (a flipped
  byte: billions) then loops and allocates for as many elements as it says, past the end of the
  file as well. Here a short read is an error, and so is an array whose elements, at their
  smallest, cannot fit in the rest of the file.

  It also reads through a plain ndarray view of its memory map, where gguf's slices the np.memmap
  itself: np.memmap's Python-level __getitem__ and __array_finalize__ then run for each of the
  metadata's parts (about a million views for SmolLM2's vocabulary and merges, half of a parse's
  seconds). The parts are the same bytes, still views of the mapped file.
  """

  def _get(self, offset, dtype, count=1, override_order=None):
    if getattr(self, "_mapped", None) is not self.data:  # self.data is set by gguf's __init__
      self._plain, self._mapped = self.data.view(np.ndarray), self.data
    count, dtype = int(count), np.dtype(dtype)
    arr = self._plain[offset:offset + dtype.itemsize * count].view(dtype)[:count]
    out = arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None
                                          else override_order))
    if len(out) != count:
      raise ValueError(f"{count} x {dtype.name} at byte {offset} run past the end "
                       f"of the file ({len(self.data)} bytes)")
    return out

  def _get_field_parts(self, orig_offs, raw_type):
    if raw_type == gguf.GGUFValueType.ARRAY:
      item_type = int(self._get(orig_offs, np.uint32)[0])
      count = int(self._get(orig_offs + 4, np.uint64)[0])
      scalar = self.gguf_scalar_to_np.get(item_type)
      smallest = (np.dtype(scalar).itemsize if scalar is not None else  # a string: its length;
                  8 if item_type == gguf.GGUFValueType.STRING else 12)  # an array: type, length
      if count * smallest > len(self.data) - orig_offs - 12:
        raise ValueError(f"an array at byte {orig_offs} claims {count} elements, more than the "
                         f"{len(self.data)}-byte file holds")
      if item_type == gguf.GGUFValueType.STRING:
        return self._string_array_parts(orig_offs, count)
    return super()._get_field_parts(orig_offs, raw_type)

  def _string_array_parts(self, orig_offs: int, count: int):
    """gguf's parts of an array of strings (its type, its length, then each string's length and
    bytes; `data` indexes the bytes), read in one loop: gguf's recursion per element builds a
    GGUFValueType and four views for each of a vocabulary's tokens and merges."""
    parts = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
    data, offs = [], orig_offs + 12
    for _ in range(count):
      length = self._get(offs, np.uint64)
      data.append(len(parts) + 1)
      parts += (length, self._get(offs + 8, np.uint8, length[0]))
      offs += 8 + int(length[0])
    kinds = [gguf.GGUFValueType.ARRAY] + [gguf.GGUFValueType.STRING] * bool(count)
    return offs - orig_offs, parts, data, kinds


def open_gguf(path: str) -> gguf.GGUFReader:
  """Parses the header of `path` (tensor data stays memory-mapped); GGUFError if it cannot.

  Every public function here takes a path or this reader, so a caller that needs the model and
  the tokenizer parses the header once; and a file parsed before in this process, unchanged since
  (the same inode, size and modification time), is not parsed again (`_parsed`).
  """
  if not os.path.isfile(path):
    raise GGUFError(f"{path}: no such file; expected a GGUF file")
  try:
    with open(path, "rb") as fp:
      magic = fp.read(4)
  except OSError as e:  # e.g. no permission to read it
    raise GGUFError(f"{path}: cannot be read ({e.strerror or e}); expected a readable GGUF "
                    "file") from None
  if magic != b"GGUF":
    raise GGUFError(f"{path}: not a GGUF file (starts with {magic!r}; a GGUF starts with b'GGUF')")
  try:
    info = os.stat(path)
    return _parsed(os.path.realpath(path), info.st_ino, info.st_size, info.st_mtime_ns)
  except (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError) as e:
    # The reader indexes past the end of a truncated memory map (or reads garbage as lengths).
    raise GGUFError(f"{path}: truncated or corrupt GGUF file ({type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else 'no detail'}); expected a complete "
                    "GGUF v2/v3 file") from None


@functools.lru_cache(maxsize=4)
def _parsed(path: str, inode: int, size: int, mtime_ns: int) -> gguf.GGUFReader:
  """The reader of `path` as it is on disk (the file's identity and state are the key; a failed
  parse is not kept). gguf's reader builds its metadata element by element, a NumPy view each:
  SmolLM2's 49,152-token vocabulary and its merges are 589k parts, seconds of Python per parse
  (`read_gguf_tokenizer`'s profile), and a run's set-up reads the tokenizer, its chat template and
  the model from the one file. The reader is only read (its tensor data a read-only memory map),
  so sharing it is safe."""
  del inode, size, mtime_ns  # the cache's key only
  return _BoundedReader(path)


def forget_parsed() -> None:
  """Drops the readers `open_gguf` kept, for a process that reads its GGUF files no more (a
  run after its set-up): a parsed file holds its metadata's Python objects and its mapped tensors,
  which would otherwise stay resident to the run's end (docs/benchmarks.md, "The compiled
  programs in the plan")."""
  _parsed.cache_clear()


def _reader(path: str | gguf.GGUFReader) -> tuple[gguf.GGUFReader, str]:
  """(reader, file name for messages) of a path or an open reader."""
  if isinstance(path, gguf.GGUFReader):
    return path, str(path.data.filename)
  return open_gguf(path), path


_REQUIRED = object()


def _value(field) -> Any:
  """A reader field as a Python value: str, int, float, bool, or a list of them for arrays.
  (`ReaderField.contents` does this in newer gguf releases; this works from gguf 0.10 on.)"""
  string = lambda part: bytes(part).decode("utf-8")  # noqa: E731
  if field.types[0] == gguf.GGUFValueType.ARRAY:
    if field.types[-1] == gguf.GGUFValueType.STRING:
      return [string(field.parts[i]) for i in field.data]
    return [v for i in field.data for v in field.parts[i].tolist()]
  if field.types[0] == gguf.GGUFValueType.STRING:
    return string(field.parts[-1])
  return field.parts[-1].tolist()[0]


def _meta(reader: gguf.GGUFReader, path: str, key: str, default: Any = _REQUIRED,
          kind: type | tuple[type, ...] | None = None) -> Any:
  """Metadata value `key` as a Python value (lists for arrays)."""
  field = reader.fields.get(key)
  if field is None:
    if default is _REQUIRED:
      raise GGUFError(f"{path}: metadata lacks {key!r}; a llama GGUF has it")
    return default
  try:
    value = _value(field)
  except UnicodeDecodeError as e:
    raise GGUFError(f"{path}: metadata {key!r} holds text that is not UTF-8 ({e.reason} at byte "
                    f"{e.start}); expected UTF-8, as GGUF strings are") from None
  if kind is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is int):
    raise GGUFError(f"{path}: metadata {key!r} is {value!r} ({type(value).__name__}); expected "
                    f"{getattr(kind, '__name__', kind)}")
  return value


def _list(reader: gguf.GGUFReader, path: str, key: str, element: type,
          default: Any = _REQUIRED) -> list[Any]:
  """Metadata array `key`, every element of type `element` (bool is no int here)."""
  value = _meta(reader, path, key, default=default, kind=list)
  bad = next((v for v in value if not isinstance(v, element) or isinstance(v, bool)), None)
  if bad is not None:
    raise GGUFError(f"{path}: metadata {key!r} holds {bad!r} ({type(bad).__name__}); expected a "
                    f"list of {element.__name__}")
  return value


def _float(value: float) -> float:
  """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not
  9.999999747378752e-06): the same float32 where it is used, and the value the model was
  configured with, so a config.json written from it reads as the original."""
  return float(str(np.float32(value)))


def _tensor_shape(t) -> tuple[int, ...]:
  """numpy (and Hugging Face) order: GGUF lists dimensions innermost first."""
  return tuple(int(d) for d in reversed(t.shape.tolist()))


def _architecture(reader: gguf.GGUFReader, path: str) -> str:
  arch = _meta(reader, path, "general.architecture", default=None)
  if arch not in ARCHITECTURES:
    raise GGUFError(f"{path}: general.architecture is {arch!r}; accepted: "
                    f"{', '.join(map(repr, ARCHITECTURES))}")
  return arch


def _llama3_scaling(freqs: np.ndarray, head_dim: int, theta: float,
                    path: str) -> dict[str, Any] | None:
  """llama3 rope_scaling parameters that reproduce llama.cpp's `rope_freqs.weight`.

  llama.cpp divides each RoPE frequency by this tensor and writes nothing else about the scaling,
  so its parameters are recovered by matching the released llama3 scalings (Llama 3.1, 3.2); all
  ones means no scaling. Anything else is refused rather than approximated.
  """
  if freqs.shape != (head_dim // 2,):
    raise GGUFError(f"{path}: tensor {_ROPE_FREQS!r} has shape {freqs.shape}; expected "
                    f"({head_dim // 2},) (head_dim / 2)")
  if np.allclose(freqs, 1.0, rtol=0, atol=1e-6):
    return None
  inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
  wavelen = 2 * math.pi / inv_freq
  for scaling in _LLAMA3_CANDIDATES:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    smooth = (old / wavelen - low) / (high - low)
    expected = np.where(wavelen < old / high, 1.0,
                        np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    if np.allclose(freqs, expected, rtol=1e-5, atol=0):
      return dict(scaling)
  raise GGUFError(f"{path}: tensor {_ROPE_FREQS!r} holds RoPE divisors {np.round(freqs, 4)} that "
                  "match no llama3 scaling; accepted: all ones, or the Llama 3.1 / 3.2 scalings")


def _config(reader: gguf.GGUFReader, path: str, dtype: str) -> LlamaConfig:
  _architecture(reader, path)
  key = lambda name, **kw: _meta(reader, path, f"llama.{name}", **kw)  # noqa: E731
  tensors = {t.name: t for t in reader.tensors}
  if "token_embd.weight" not in tensors:
    raise GGUFError(f"{path}: file lacks tensor 'token_embd.weight'; a llama GGUF has it")
  embedding_shape = _tensor_shape(tensors["token_embd.weight"])
  if len(embedding_shape) != 2:
    raise GGUFError(f"{path}: tensor 'token_embd.weight' has shape {embedding_shape}; expected 2 "
                    "dimensions (vocabulary, embedding)")
  vocab_size, hidden = embedding_shape
  tokens = reader.fields.get("tokenizer.ggml.tokens")
  if tokens is not None and len(tokens.data) > vocab_size:
    raise GGUFError(f"{path}: the tokenizer has {len(tokens.data)} tokens but token_embd.weight "
                    f"only {vocab_size} rows; expected at most as many tokens as rows")
  heads = key("attention.head_count", kind=int)
  embedding = key("embedding_length", kind=int)
  head_dim = key("attention.key_length", default=None, kind=int) or embedding // max(heads, 1)
  for other in ("attention.value_length", "rope.dimension_count"):
    value = key(other, default=head_dim, kind=int)
    if value != head_dim:
      raise GGUFError(f"{path}: llama.{other}={value} differs from the head size {head_dim}; "
                      "accepted: equal (full rotary, equal key and value heads)")
  scaling_type = key("rope.scaling.type", default="none", kind=str)
  if scaling_type != "none":
    raise GGUFError(f"{path}: llama.rope.scaling.type={scaling_type!r} is not supported; accepted: "
                    "'none' (llama3 scaling comes as rope_freqs.weight)")
  theta = _float(key("rope.freq_base", default=10000.0, kind=(int, float)))
  scaling = None
  if _ROPE_FREQS in tensors:
    scaling = _llama3_scaling(_dequantize(tensors[_ROPE_FREQS], path), head_dim, theta, path)
  hf = {
      "model_type": "llama",
      "vocab_size": vocab_size,
      "hidden_size": embedding,
      "num_hidden_layers": _block_count(key("block_count", kind=int), tensors, path),
      "num_attention_heads": heads,
      "num_key_value_heads": key("attention.head_count_kv", default=heads, kind=int),
      "head_dim": head_dim,
      "intermediate_size": key("feed_forward_length", kind=int),
      "max_position_embeddings": key("context_length", default=8192, kind=int),
      "rope_theta": theta,
      "rope_scaling": scaling,
      "rms_norm_eps": _float(key("attention.layer_norm_rms_epsilon", kind=(int, float))),
      "tie_word_embeddings": "output.weight" not in tensors,
  }
  if hidden != embedding:
    raise GGUFError(f"{path}: tensor 'token_embd.weight' has shape {(vocab_size, hidden)}; "
                    f"llama.embedding_length implies {(vocab_size, embedding)}")
  try:
    return from_hf_config(hf, param_dtype=dtype, dtype=dtype)
  except ConfigError as e:
    raise GGUFError(f"{path}: {e}") from None


_BLOCK_TENSOR = re.compile(r"blk\.([0-9]+)\.")


def _block_count(count: int, tensors: dict[str, Any], path: str) -> int:
  """llama.block_count, checked against the blk.N tensors present before anything is built per
  block (a flipped byte can make it millions, and the per-block name and shape lists with it)."""
  blocks = {int(m.group(1)) for name in tensors if (m := _BLOCK_TENSOR.match(name))}
  if count != len(blocks) or blocks and max(blocks) != count - 1:
    present = (f"blocks {min(blocks)} to {max(blocks)} ({len(blocks)} distinct)" if blocks else
               "no blk.N tensors")
    raise GGUFError(f"{path}: llama.block_count={count} but the file has tensors of {present}; "
                    "expected blocks blk.0 to blk.<block_count - 1>, each present")
  return count


def read_gguf_config(path: str | gguf.GGUFReader, dtype: str = "float32") -> LlamaConfig:
  """The LlamaConfig a GGUF file describes, from its metadata and tensor list (no weights read).

  Raises GGUFError for a file that is not a GGUF, not architecture 'llama', or lacks or
  contradicts the metadata a Llama needs.
  """
  reader, path = _reader(path)
  return _config(reader, path, dtype)


# ---------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------

def _dequantize(t, path: str) -> np.ndarray:
  """Tensor `t` as float32 in numpy order (for F32 files, a view of the memory-mapped file)."""
  shape = _tensor_shape(t)
  try:
    x = gguf.quants.dequantize(t.data, t.tensor_type)
  except (NotImplementedError, ValueError) as e:
    raise GGUFError(f"{path}: tensor {t.name!r} of type {t.tensor_type.name} cannot be read ({e}); "
                    f"accepted types: {', '.join(TENSOR_TYPES)}") from None
  if x.shape != shape:  # the reader's layout is what dequantize assumes; never reshape blindly
    raise AssertionError(f"{t.name}: dequantized to {x.shape}, header says {shape}")
  return np.asarray(x, np.float32)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's Q/K row permutation ([heads * H, D]; `heads` = KV heads for K).

  llama.cpp reshapes each head's H rows as (2, H/2) and swaps the two axes, so that RoPE pairs
  become neighbours; this reshapes them as (H/2, 2) and swaps back.
  """
  half = w.shape[0] // heads // 2
  return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check_tensors(reader: gguf.GGUFReader, path: str, cfg: LlamaConfig) -> dict[str, Any]:
  """hf name -> GGUF tensor, after checking names, types and shapes; GGUFError at the first bad."""
  tensors = {t.name: t for t in reader.tensors}
  out = {}
  for m in hf_io.tensor_maps(cfg):
    name = gguf_name(m.hf_name)
    if name not in tensors:
      raise GGUFError(f"{path}: file lacks tensor {name!r}; a llama GGUF with "
                      f"{cfg.num_layers} blocks has it")
    out[m.hf_name] = tensors[name]
  expected = {gguf_name(n) for n in out} | {_ROPE_FREQS}
  extra = [n for n in tensors if n not in expected]
  if extra:
    raise GGUFError(f"{path}: file has unexpected tensor {extra[0]!r} (shape "
                    f"{_tensor_shape(tensors[extra[0]])}); a llama GGUF with this metadata has "
                    "no such tensor")
  for m in hf_io.tensor_maps(cfg):
    t = out[m.hf_name]
    if t.tensor_type.name not in TENSOR_TYPES:
      raise GGUFError(f"{path}: tensor {t.name!r} has type {t.tensor_type.name}; accepted types: "
                      f"{', '.join(TENSOR_TYPES)}")
    if _tensor_shape(t) != m.hf_shape:
      raise GGUFError(f"{path}: tensor {t.name!r} has shape {_tensor_shape(t)} (numpy order); "
                      f"the metadata implies {m.hf_shape}")
  return out


def check_gguf(path: str | gguf.GGUFReader, dtype: str = "float32") -> LlamaConfig:
  """Every check `load_gguf` makes (metadata, tensor names, types and shapes), from the header
  alone; returns the config. For tools that want to fail on a bad file before starting JAX."""
  reader, path = _reader(path)
  cfg = _config(reader, path, dtype)
  _check_tensors(reader, path, cfg)
  return cfg


def load_gguf(path: str | gguf.GGUFReader, mesh: jax.sharding.Mesh | None = None,
              dtype: str = "float32", value_head: bool = False) -> tuple[Llama, LlamaConfig]:
  """Loads a llama GGUF file onto `mesh` (or the default device when None), like `load_hf`.

  Quantized tensors are dequantized to float32 on the host one at a time, then cast to `dtype`
  ("float32" or "bfloat16"). `value_head=True` adds a zero-initialised value head. Raises
  GGUFError for anything the file lacks or holds that a Llama cannot take, before any parameter
  is placed.
  """
  reader, path = _reader(path)
  cfg = dataclasses.replace(_config(reader, path, dtype), value_head=value_head)
  tensors = _check_tensors(reader, path, cfg)
  if mesh is not None:
    sharding.check_divisible(cfg, mesh)

  def read(m: hf_io.TensorMap) -> np.ndarray:
    w = _dequantize(tensors[m.hf_name], path)
    if m.hf_name.endswith("self_attn.q_proj.weight"):
      w = _unpermute(w, cfg.num_heads)
    elif m.hf_name.endswith("self_attn.k_proj.weight"):
      w = _unpermute(w, cfg.num_kv_heads)
    return w

  return hf_io.place_tensors(cfg, read, mesh), cfg


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

# llama.cpp token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the regex text is split with before byte-level BPE; None: GPT-2's own
# (ByteLevel's built-in). As transformers' GGUF converter (integrations/gguf), for the names a
# llama-architecture file carries; an unknown name is refused rather than guessed.
PRE_TOKENIZERS: dict[str, str | None] = {
    "default": None, "gpt2": None, "gpt-2": None, "smollm": None,
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT, "pixtral": _LLAMA3_SPLIT,
    "tekken": _TEKKEN_SPLIT,
}


@dataclasses.dataclass(frozen=True)
class GGUFTokenizer:
  """The tokenizer a GGUF file describes.

  Attributes:
    tok: the `tokenizers.Tokenizer` (byte-level BPE; CONTROL tokens are added special tokens,
      USER_DEFINED ones added plain tokens, so both are matched whole in text).
    bos_id, eos_ids, pad_id, unk_id: special ids (eos_ids: EOS, then EOT and EOM when the file
      names them); None when the file names none.
    add_bos: whether the model expects BOS prepended (tokenizer.ggml.add_bos_token).
    chat_template: the Jinja chat template (tokenizer.chat_template), or None.
  """
  tok: tokenizers.Tokenizer
  bos_id: int | None
  eos_ids: tuple[int, ...]
  pad_id: int | None
  unk_id: int | None
  add_bos: bool
  chat_template: str | None

  def token(self, i: int | None) -> str | None:
    return None if i is None else self.tok.id_to_token(i)

  def tokenizer_config(self) -> dict[str, Any]:
    """A Hugging Face tokenizer_config.json for `tok` (written next to tokenizer.json)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": self.token(self.bos_id),
        "eos_token": self.token(self.eos_ids[0] if self.eos_ids else None),
        "pad_token": self.token(self.pad_id),
        "unk_token": self.token(self.unk_id),
        "add_bos_token": self.add_bos,
        "add_eos_token": False,
        "chat_template": self.chat_template,
        "clean_up_tokenization_spaces": False,
    }


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character table, in which byte-level vocabularies are spelled."""
  bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1)))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


def read_gguf_tokenizer(path: str | gguf.GGUFReader) -> GGUFTokenizer:
  """Builds the tokenizer of a GGUF file whose tokenizer.ggml.model is 'gpt2' (byte-level BPE).

  Matches transformers' GGUF conversion (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`):
  the vocabulary with any token not spelled in the byte alphabet respelled into it, the file's
  merges, the pre-tokenizer split named by tokenizer.ggml.pre, ByteLevel decoding; CONTROL tokens
  as special added tokens except those not spelled in the byte alphabet (llama.cpp mislabels),
  USER_DEFINED tokens as plain added tokens. The post-processor prepends BOS when add_bos, for
  users of tokenizer.json; ksjax adds BOS itself.
  """
  reader, path = _reader(path)
  key = lambda name, **kw: _meta(reader, path, f"tokenizer.{name}", **kw)  # noqa: E731
  kind = key("ggml.model", default=None)
  if kind not in TOKENIZER_MODELS:
    raise GGUFError(f"{path}: tokenizer.ggml.model is {kind!r}; accepted: "
                    f"{', '.join(map(repr, TOKENIZER_MODELS))} (byte-level BPE)")
  pre = key("ggml.pre", default="default", kind=str)
  if pre not in PRE_TOKENIZERS:
    raise GGUFError(f"{path}: tokenizer.ggml.pre is {pre!r}; accepted: "
                    f"{', '.join(map(repr, PRE_TOKENIZERS))}")
  tokens = _list(reader, path, "tokenizer.ggml.tokens", str)
  types = _list(reader, path, "tokenizer.ggml.token_type", int, default=[NORMAL] * len(tokens))
  merges = _list(reader, path, "tokenizer.ggml.merges", str)
  if len(types) != len(tokens):
    raise GGUFError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for "
                    f"{len(tokens)} tokens; expected one per token")

  spelling = _bytes_to_unicode()
  alphabet = set(spelling.values())
  respell = lambda t: "".join(spelling[b] for b in t.encode("utf-8"))  # noqa: E731
  vocab = {t if set(t) <= alphabet else respell(t): i for i, t in enumerate(tokens)}
  pairs = [tuple(m.split(" ")) for m in merges]
  bad = next((m for m, p in zip(merges, pairs) if len(p) != 2), None)
  if bad is not None:
    raise GGUFError(f"{path}: tokenizer.ggml.merges holds {bad!r}; expected 'left right'")
  for merge, (left, right) in zip(merges, pairs):
    unknown = next((t for t in (left, right, left + right) if t not in vocab), None)
    if unknown is not None:  # tokenizers' own error would be a bare Exception
      raise GGUFError(f"{path}: tokenizer.ggml.merges holds {merge!r}, whose {unknown!r} is not in "
                      "tokenizer.ggml.tokens; expected merges of tokens in the vocabulary into one")
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None,
                                        continuing_subword_prefix="", end_of_word_suffix="",
                                        fuse_unk=False))
  split = PRE_TOKENIZERS[pre]
  tok.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else
                       pre_tokenizers.Sequence([
                           pre_tokenizers.Split(Regex(split), behavior="isolated"),
                           pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
  tok.decoder = decoders.ByteLevel()
  control = [AddedToken(t, normalized=False, special=True) for t, y in zip(tokens, types)
             if y == CONTROL and set(t) <= alphabet]
  if control:
    tok.add_special_tokens(control)
  user = [AddedToken(t, normalized=False, special=False) for t, y in zip(tokens, types)
          if y == USER_DEFINED and t in vocab]
  if user:
    tok.add_tokens(user)

  def special(name):
    i = key(f"ggml.{name}_token_id", default=None, kind=int)
    if i is not None and not 0 <= i < len(tokens):
      raise GGUFError(f"{path}: tokenizer.ggml.{name}_token_id={i} is outside the vocabulary; "
                      f"expected 0 <= id < {len(tokens)}")
    return i

  bos, pad, unk = special("bos"), special("padding"), special("unknown")
  eos_ids = tuple(dict.fromkeys(i for i in (special("eos"), special("eot"), special("eom"))
                                if i is not None))
  add_bos = bool(key("ggml.add_bos_token", default=False, kind=bool))
  if add_bos and bos is not None:
    b = tok.id_to_token(bos)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{b} $A", pair=f"{b} $A {b}:1 $B:1", special_tokens=[(b, bos)])
  return GGUFTokenizer(tok=tok, bos_id=bos, eos_ids=eos_ids, pad_id=pad, unk_id=unk,
                       add_bos=add_bos and bos is not None,
                       chat_template=key("chat_template", default=None, kind=str))


__all__ = ["ARCHITECTURES", "TENSOR_TYPES", "PRE_TOKENIZERS", "GGUFError", "GGUFTokenizer",
           "gguf_name", "open_gguf", "check_gguf", "read_gguf_config", "read_gguf_tokenizer",
           "load_gguf"]
