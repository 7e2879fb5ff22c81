"""Hugging Face Llama checkpoints (config.json + *.safetensors) in and out.

Loading never builds the model on one device: the model is created abstractly (`nnx.eval_shape`),
every tensor's name, shape and dtype is checked against it from the safetensors headers alone, and
only then is each tensor read on the host, converted to our layout, and placed straight onto its
mesh sharding (`jax.make_array_from_callback`, which hands each device only its slice). So a bad
checkpoint fails with one error naming the tensor before any device memory is used.

Layout: HF stores `nn.Linear` weights as [out, in]; we keep [in, out] with the head axis separate
(`q_proj` [D, N, H]). Both use half-split RoPE, so conversion is a transpose and a reshape and never
a permutation of rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from ksjax.model import sharding
from ksjax.model.checkpoint import CheckpointError
from ksjax.model.config import LlamaConfig, from_hf_config, to_hf_config
from ksjax.model.llama import Llama

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MAX_SHARD_BYTES = 5 * 2**30  # as transformers' save_pretrained default


@dataclasses.dataclass(frozen=True)
class TensorMap:
  """One HF tensor <-> one of our parameters."""
  hf_name: str
  path: tuple[Any, ...]                 # our nnx state path
  hf_shape: tuple[int, ...]
  to_ours: Callable[[np.ndarray], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]


def tensor_maps(cfg: LlamaConfig) -> list[TensorMap]:
  """Every HF tensor of a Llama with config `cfg`, in checkpoint order."""
  d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
  n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  same = lambda x: x
  t = lambda x: x.T

  def heads_in(count):   # HF [count*H, D] <-> ours [D, count, H]
    return (lambda x: x.T.reshape(d, count, h), lambda x: x.reshape(d, count * h).T)

  o_in = (lambda x: x.T.reshape(n, h, d), lambda x: x.reshape(n * h, d).T)  # [D, N*H] <-> [N,H,D]
  maps = [TensorMap("model.embed_tokens.weight", ("embed_tokens",), (v, d), same, same)]
  for i in range(cfg.num_layers):
    pre = f"model.layers.{i}."
    layer = ("layers", i)
    maps += [
        TensorMap(pre + "input_layernorm.weight", layer + ("input_layernorm", "scale"), (d,),
                  same, same),
        TensorMap(pre + "self_attn.q_proj.weight", layer + ("self_attn", "q_proj"), (n * h, d),
                  *heads_in(n)),
        TensorMap(pre + "self_attn.k_proj.weight", layer + ("self_attn", "k_proj"), (k * h, d),
                  *heads_in(k)),
        TensorMap(pre + "self_attn.v_proj.weight", layer + ("self_attn", "v_proj"), (k * h, d),
                  *heads_in(k)),
        TensorMap(pre + "self_attn.o_proj.weight", layer + ("self_attn", "o_proj"), (d, n * h),
                  *o_in),
        TensorMap(pre + "post_attention_layernorm.weight",
                  layer + ("post_attention_layernorm", "scale"), (d,), same, same),
        TensorMap(pre + "mlp.gate_proj.weight", layer + ("mlp", "gate_proj"), (f, d), t, t),
        TensorMap(pre + "mlp.up_proj.weight", layer + ("mlp", "up_proj"), (f, d), t, t),
        TensorMap(pre + "mlp.down_proj.weight", layer + ("mlp", "down_proj"), (d, f), t, t),
    ]
  maps.append(TensorMap("model.norm.weight", ("norm", "scale"), (d,), same, same))
  if not cfg.tie_embeddings:
    maps.append(TensorMap("lm_head.weight", ("lm_head",), (v, d), t, t))
  return maps


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------

def _read_json(path: str, what: str) -> dict[str, Any]:
  """The JSON object in `path`; CheckpointError naming the file for anything else (binary
  garbage, broken JSON, a list, an unreadable file), so a damaged download is one clear line."""
  try:
    with open(path, encoding="utf-8") as fp:
      data = json.load(fp)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{path!r} is not JSON text ({type(e).__name__}: {str(e)[:120]}); "
                          f"expected {what}") from None
  except OSError as e:
    raise CheckpointError(f"{path!r} cannot be read ({e.strerror or e}); expected {what}") from None
  if not isinstance(data, dict):
    raise CheckpointError(f"{path!r} holds a JSON {type(data).__name__}; expected {what} (a JSON "
                          "object)")
  return data


@contextlib.contextmanager
def _safetensors(file: str):
  """safe_open, with a truncated or corrupt file (SafetensorError) or an unreadable one turned
  into one CheckpointError naming it."""
  try:
    with safe_open(file, framework="np") as f:
      yield f
  except (SafetensorError, OSError) as e:
    raise CheckpointError(f"{file!r} is not a readable safetensors file ({type(e).__name__}: "
                          f"{str(e)[:160]}); expected a complete safetensors file (re-download "
                          "or re-convert it)") from None


def read_config(hf_dir: str, dtype: str = "float32") -> LlamaConfig:
  path = os.path.join(hf_dir, "config.json")
  if not os.path.isfile(path):
    raise CheckpointError(f"{hf_dir!r} has no config.json; expected a Hugging Face Llama directory")
  hf = _read_json(path, "a Hugging Face Llama config.json")
  return from_hf_config(hf, param_dtype=dtype, dtype=dtype)


def _weight_files(hf_dir: str) -> dict[str, str]:
  """tensor name -> safetensors file, from the sharded index or the file headers."""
  index = os.path.join(hf_dir, INDEX_FILE)
  if os.path.isfile(index):
    weight_map = _read_json(index, "a safetensors index with a 'weight_map'").get("weight_map")
    if not isinstance(weight_map, dict):
      raise CheckpointError(f"{index!r} has no 'weight_map'")
    files = {name: os.path.join(hf_dir, file) for name, file in weight_map.items()}
    for file in set(files.values()):
      if not os.path.isfile(file):
        raise CheckpointError(f"{index!r} names {os.path.basename(file)!r}, which does not exist")
    return files
  names = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
  if not names:
    raise CheckpointError(f"{hf_dir!r} has no *.safetensors files (and no {INDEX_FILE})")
  files = {}
  for name in names:
    with _safetensors(os.path.join(hf_dir, name)) as f:
      for key in f.keys():
        if key in files:
          raise CheckpointError(f"tensor {key!r} appears in two files of {hf_dir!r}")
        files[key] = os.path.join(hf_dir, name)
  return files


def _headers(files: dict[str, str]) -> dict[str, tuple[tuple[int, ...], str]]:
  """tensor name -> (shape, safetensors dtype), reading headers only."""
  out = {}
  by_file: dict[str, list[str]] = {}
  for name, file in files.items():
    by_file.setdefault(file, []).append(name)
  for file, names in by_file.items():
    with _safetensors(file) as f:
      present = set(f.keys())
      for name in names:
        if name not in present:
          raise CheckpointError(f"tensor {name!r} is listed for {os.path.basename(file)!r} but is "
                                "not in it")
        s = f.get_slice(name)
        out[name] = (tuple(s.get_shape()), s.get_dtype())
  return out


_FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")


def _validate(cfg: LlamaConfig, maps: list[TensorMap],
              headers: dict[str, tuple[tuple[int, ...], str]]) -> set[str]:
  """Checks names, shapes and dtypes; returns tensors present but not needed that may be skipped."""
  expected = {m.hf_name: m for m in maps}
  missing = [name for name in expected if name not in headers]
  if missing:
    raise CheckpointError(f"checkpoint lacks tensor {missing[0]!r}"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
  skippable = set()
  extra = [name for name in headers if name not in expected]
  for name in extra:
    # Tied checkpoints sometimes still carry lm_head.weight (a copy of the embedding), and old
    # conversions carry RoPE buffers; both are derived data.
    if name == "lm_head.weight" and cfg.tie_embeddings:
      skippable.add(name)
    elif name.endswith("rotary_emb.inv_freq"):
      skippable.add(name)
    else:
      raise CheckpointError(f"checkpoint has unexpected tensor {name!r} (shape "
                            f"{headers[name][0]}); a Llama with this config.json has no such "
                            "tensor")
  for name, m in expected.items():
    shape, dtype = headers[name]
    if shape != m.hf_shape:
      raise CheckpointError(f"tensor {name!r} has shape {shape}; config.json implies {m.hf_shape}")
    if dtype not in _FLOAT_DTYPES:
      raise CheckpointError(f"tensor {name!r} has dtype {dtype}; expected one of {_FLOAT_DTYPES}")
  if "lm_head.weight" in skippable and headers["lm_head.weight"][0] != (cfg.vocab_size,
                                                                       cfg.hidden_size):
    raise CheckpointError(f"tensor 'lm_head.weight' has shape {headers['lm_head.weight'][0]}; "
                          f"expected {(cfg.vocab_size, cfg.hidden_size)}")
  return skippable


def _read(file: str, name: str) -> np.ndarray:
  with _safetensors(file) as f:
    return f.get_tensor(name)


def _default_sharding() -> jax.sharding.Sharding:
  return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def load_hf(path: str, mesh: jax.sharding.Mesh | None = None, dtype: str = "float32",
            value_head: bool = False) -> tuple[Llama, LlamaConfig]:
  """Loads a Hugging Face Llama directory onto `mesh` (or the default device when None).

  Parameters are stored and computed in `dtype` ("float32" or "bfloat16"). `value_head=True` adds
  a zero-initialised scalar value head (PPO critic), which HF checkpoints do not have. Raises
  ConfigError for a config.json that is not a supported Llama, CheckpointError for
  missing/unexpected/misshapen tensors; in both cases before any parameter is placed.
  """
  cfg = dataclasses.replace(read_config(path, dtype), value_head=value_head)
  if mesh is not None:
    sharding.check_divisible(cfg, mesh)
  maps = tensor_maps(cfg)
  files = _weight_files(path)
  headers = _headers(files)
  skippable = _validate(cfg, maps, headers)

  if "lm_head.weight" in skippable:
    embed = _read(files["model.embed_tokens.weight"], "model.embed_tokens.weight")
    if not np.array_equal(embed, _read(files["lm_head.weight"], "lm_head.weight")):
      raise CheckpointError("checkpoint has tensor 'lm_head.weight' different from the embedding "
                            "but config.json says tie_word_embeddings=true")
    del embed

  return place_tensors(cfg, lambda m: _read(files[m.hf_name], m.hf_name), mesh), cfg


def place_tensors(cfg: LlamaConfig, read: Callable[[TensorMap], np.ndarray],
                  mesh: jax.sharding.Mesh | None = None) -> Llama:
  """The Llama of `cfg` with every tensor of `tensor_maps(cfg)` read by `read` and placed.

  `read(m)` returns tensor `m.hf_name` on the host in the Hugging Face layout (`m.hf_shape`) and
  any float dtype; it is called once per tensor, and each is converted to our layout, cast to
  `cfg.param_dtype` and handed to `mesh` (the default device when None) before the next is read,
  so the host holds one tensor at a time. Shared by every importer (`load_hf`, `gguf_io`), which
  validate their files first. A zero value head is added when `cfg.value_head`.
  """
  dtype = jnp.dtype(cfg.param_dtype)
  maps = tensor_maps(cfg)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
  abstract_params = dict(nnx.to_flat_state(abstract))
  new_params = {("value_head",), ("value_bias",)} if cfg.value_head else set()
  if set(abstract_params) != {m.path for m in maps} | new_params:  # table and model must agree
    raise AssertionError("hf_io.tensor_maps is out of date with Llama's parameters")

  def target(path_):
    return (_default_sharding() if mesh is None
            else jax.sharding.NamedSharding(mesh, sharding.partition_spec(path_)))

  placed = {p: jax.device_put(jnp.zeros(abstract_params[p].shape, dtype), target(p))
            for p in new_params}
  for m in maps:
    leaf = abstract_params[m.path]
    host = m.to_ours(read(m)).astype(dtype)
    if host.shape != leaf.shape:
      raise AssertionError(f"{m.hf_name}: converted to {host.shape}, model wants {leaf.shape}")
    placed[m.path] = jax.make_array_from_callback(host.shape, target(m.path),
                                                  lambda idx, h=host: h[idx])
    del host

  state = nnx.from_flat_state({p: abstract_params[p].replace(placed[p]) for p in placed})
  return nnx.merge(graphdef, state)


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------

def _hf_tensors(llama: Llama, cfg: LlamaConfig) -> Iterator[tuple[str, np.ndarray]]:
  params = dict(nnx.to_flat_state(nnx.state(llama, nnx.Param)))
  for m in tensor_maps(cfg):
    yield m.hf_name, np.ascontiguousarray(m.to_hf(np.asarray(jax.device_get(params[m.path][...]))))


def save_hf(llama: Llama, cfg: LlamaConfig, out_path: str,
            max_shard_bytes: int = _MAX_SHARD_BYTES) -> None:
  """Writes config.json and safetensors (sharded with an index above `max_shard_bytes`).

  Only the language model is written (HF Llama has no value head). Tensors are fetched to the
  host one at a time. The directory is written under a temporary name
  and renamed into place, so `out_path` either holds a complete checkpoint or is left untouched.
  """
  if os.path.exists(out_path) and os.listdir(out_path):
    raise FileExistsError(f"{out_path!r} exists and is not empty; save_hf writes a new directory")
  parent = os.path.dirname(os.path.abspath(out_path))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".tmp_save_hf_", dir=parent)
  try:
    # Shards are written as they fill (host memory holds one shard), then renamed once the count
    # is known, as transformers names them.
    files: list[str] = []
    weight_map: dict[str, int] = {}
    current: dict[str, np.ndarray] = {}
    total_size = 0

    def flush():
      files.append(os.path.join(tmp, f"shard-{len(files)}.safetensors"))
      save_file(current, files[-1], metadata={"format": "pt"})
      current.clear()

    for name, array in _hf_tensors(llama, cfg):
      if current and sum(a.nbytes for a in current.values()) + array.nbytes > max_shard_bytes:
        flush()
      current[name] = array
      weight_map[name] = len(files)
      total_size += array.nbytes
    flush()
    total = len(files)
    names = ([SINGLE_FILE] if total == 1 else
             [f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i in range(total)])
    for file, name in zip(files, names):
      os.rename(file, os.path.join(tmp, name))
    if total > 1:
      index = {"metadata": {"total_size": total_size},
               "weight_map": {k: names[i] for k, i in weight_map.items()}}
      with open(os.path.join(tmp, INDEX_FILE), "w") as fp:
        json.dump(index, fp, indent=2)
    with open(os.path.join(tmp, "config.json"), "w") as fp:
      json.dump(to_hf_config(cfg), fp, indent=2)
    if os.path.exists(out_path):
      os.rmdir(out_path)
    os.rename(tmp, out_path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


__all__ = ["CheckpointError", "TensorMap", "tensor_maps", "read_config", "load_hf", "place_tensors",
           "save_hf"]
