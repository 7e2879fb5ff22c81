"""The policy a run describes: its LlamaConfig (shapes only) and its starting weights.

`policy_config` is the one place that turns a `ModelSpec` into a `LlamaConfig`, so that whatever
reads a run's checkpoints (the eval binary, the memory plan) sees the shapes the trainer trains.
`build_model` makes the starting policy: a Hugging Face directory (init_hf), a ksjax.model
checkpoint (init_checkpoint), a GGUF file (init_gguf) or a fresh preset with the spec's changes; for PPO with a scalar
value head (zero-initialised when the starting point has none).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import jax
import numpy as np
from flax import nnx

from ksjax import distributed, model
from ksjax.config_validation import ConfigError
from ksjax.model import checkpoint as model_checkpoint
from ksjax.model import gguf_io, hf_io
from ksjax.run.spec import LoraSpec, ModelSpec


def policy_config(spec: ModelSpec, vocab_size: int, *, value_head: bool) -> model.LlamaConfig:
  """The LlamaConfig of the policy a run trains (no weights read or built).

  Args:
    spec: the run's model spec.
    vocab_size: the task tokenizer's vocabulary, used by a fresh preset.
    value_head: whether the policy carries PPO's value head (`LossSpec.value_head`).
  """
  dtype = spec.model.dtype
  try:
    if spec.init_hf:
      cfg = hf_io.read_config(spec.init_hf, dtype=dtype)
    elif spec.init_gguf:
      cfg = gguf_io.read_gguf_config(spec.init_gguf, dtype=dtype)
    elif spec.init_checkpoint:
      cfg = dataclasses.replace(model_checkpoint.load_config(spec.init_checkpoint),
                                param_dtype=dtype, dtype=dtype)
    else:
      cfg = model.preset(spec.model.preset, vocab_size=vocab_size, param_dtype=dtype,
                         dtype=dtype, **spec.model.preset_overrides)
  except (FileNotFoundError, model.CheckpointError) as e:
    raise ConfigError(f"config.{spec.start}: {e}") from None
  if cfg.vocab_size < vocab_size:
    raise ConfigError(f"the model's vocab_size={cfg.vocab_size} is smaller than the task "
                      f"tokenizer's {vocab_size}; expected a model for this tokenizer")
  return dataclasses.replace(cfg, value_head=value_head, remat=spec.model.remat,
                             matmul_dtype=spec.model.matmul_dtype)


def with_value_head(llama: model.Llama) -> model.Llama:
  """`llama` with a scalar value head added (zero-initialised, so V(x) = 0 at the start)."""
  if llama.cfg.value_head:
    return llama
  cfg = dataclasses.replace(llama.cfg, value_head=True)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: model.Llama(cfg, rngs=nnx.Rngs(0))))
  loaded = dict(nnx.to_flat_state(nnx.state(llama)))
  flat = {}
  for path, variable in nnx.to_flat_state(abstract):
    value = loaded[path][...] if path in loaded else np.zeros(variable.shape, variable.dtype)
    flat[path] = variable.replace(value)
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def build_model(spec: ModelSpec, vocab_size: int, mesh: jax.sharding.Mesh, *, value_head: bool,
                seed: int) -> model.Llama:
  """The starting policy, every parameter placed on `mesh` by its partition spec (`seed`
  initialises a fresh preset)."""
  cfg = policy_config(spec, vocab_size, value_head=value_head)
  dtype = spec.model.dtype
  if spec.init_hf:
    llama, _ = model.load_hf(spec.init_hf, mesh, dtype=dtype, value_head=cfg.value_head)
  elif spec.init_gguf:
    llama, _ = model.load_gguf(spec.init_gguf, mesh, dtype=dtype, value_head=cfg.value_head)
  elif spec.init_checkpoint:
    llama, _ = model.load_checkpoint(spec.init_checkpoint, mesh, dtype=dtype)
    if cfg.value_head:
      llama = model.shard(with_value_head(llama), mesh)
  else:
    llama = distributed.create_sharded(lambda: model.Llama(cfg, rngs=nnx.Rngs(seed)), mesh)
  # How it computes (not its parameters) comes from the spec, whatever file it was read from.
  changes = {f: getattr(cfg, f) for f in ("remat", "matmul_dtype")
             if getattr(llama.cfg, f) != getattr(cfg, f)}
  return model.with_config(llama, **changes) if changes else llama


# ---------------------------------------------------------------------------------------------
# Low-rank adapters (config.lora)
# ---------------------------------------------------------------------------------------------

def base_record(spec: ModelSpec, llama: model.Llama) -> dict[str, str]:
  """What a LoRA run records of the base its adapters belong to (`ksjax.model.lora.base_record`):
  the file it was read from, with that file's sha256; for a fresh preset (no file), the sha256
  of its parameters' bytes, which its config and seed rebuild."""
  from ksjax.model import lora  # pylint: disable=import-outside-toplevel
  if spec.start is not None:
    return lora.base_record(getattr(spec, spec.start), spec.model.dtype)
  digest = hashlib.sha256()
  for path, variable in sorted(nnx.to_flat_state(nnx.state(llama, nnx.Param))):
    digest.update(".".join(map(str, path)).encode() + b"\0")
    digest.update(np.ascontiguousarray(jax.device_get(variable[...])).tobytes())
  return {"path": "", "name": f"preset {spec.model.preset}", "sha256": digest.hexdigest(),
          "dtype": spec.model.dtype}


def adapt(llama: model.Llama, spec: LoraSpec, seed: int) -> model.Llama:
  """`llama` with the adapters `spec` describes (QLoRA: its base quantized), the adapters'
  initial A drawn from `seed`; `llama` itself when LoRA is off."""
  from ksjax.model import lora  # pylint: disable=import-outside-toplevel
  return lora.apply(llama, spec, rngs=nnx.Rngs(seed))


def check_base(recorded: Any, base: dict[str, str], where: str, *,
               base_is: str = "this run's base", error: type[Exception] = ConfigError) -> None:
  """`error` (one line) unless `recorded` (what a checkpoint says of its base) is `base`: adapters
  computed on other weights compute nonsense. `base_is` names where `base` came from; `error` is
  the caller's type for a bad input (the eval binary's: its checkpoints')."""
  have = recorded.get("sha256") if isinstance(recorded, dict) else None
  if have != base["sha256"]:
    name = (recorded.get("name") if isinstance(recorded, dict) else None) or "(not recorded)"
    raise error(
        f"{where} holds adapters for the base {name!r} (sha256 {str(have)[:16]}), but {base_is} "
        f"{base['name']!r} has sha256 {base['sha256'][:16]}; expected the base the adapters "
        "were trained on")
