"""The policy a trainer config describes: its LlamaConfig (shapes only) and its starting weights.

`policy_config` is the one place that turns a config's model fields into a `LlamaConfig`, so that
whatever reads a run's checkpoints (the eval binary, the memory plan) sees the shapes the trainer
trains. `build_model` makes the starting policy: a Hugging Face directory (config.init_hf), a
ksjax.model checkpoint (config.init_checkpoint) or a fresh preset with the config's changes; for
PPO with a scalar value head (zero-initialised when the starting point has none).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx

from ksjax import distributed, model
from ksjax.config_validation import ConfigError
from ksjax.model import checkpoint as model_checkpoint
from ksjax.model import hf_io

# Fields of config.model that change a preset when set (None keeps the preset's value).
PRESET_OVERRIDES = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                    "intermediate_size", "tie_embeddings")


def policy_config(config: Any, vocab_size: int) -> model.LlamaConfig:
  """The LlamaConfig of the policy a run of `config` trains (no weights read or built).

  Args:
    config: a trainer config (`ksjax.trainer.defaults.base_config`).
    vocab_size: the task tokenizer's vocabulary, used by a fresh preset.
  """
  dtype = config.model.dtype
  try:
    if config.init_hf:
      cfg = hf_io.read_config(config.init_hf, dtype=dtype)
    elif config.init_checkpoint:
      cfg = dataclasses.replace(model_checkpoint.load_config(config.init_checkpoint),
                                param_dtype=dtype, dtype=dtype)
    else:
      overrides = {f: config.model[f] for f in PRESET_OVERRIDES if config.model[f] is not None}
      cfg = model.preset(config.model.preset, vocab_size=vocab_size, param_dtype=dtype,
                         dtype=dtype, **overrides)
  except (FileNotFoundError, model.CheckpointError) as e:
    raise ConfigError(f"config.{'init_hf' if config.init_hf else 'init_checkpoint'}: {e}") from None
  if cfg.vocab_size < vocab_size:
    raise ConfigError(f"the model's vocab_size={cfg.vocab_size} is smaller than the task "
                      f"tokenizer's {vocab_size}; expected a model for this tokenizer")
  return dataclasses.replace(cfg, value_head=config.algorithm == "ppo",
                             remat=config.model.remat)


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


def build_model(config: Any, vocab_size: int, mesh: jax.sharding.Mesh) -> model.Llama:
  """The starting policy of `config`, every parameter placed on `mesh` by its partition spec."""
  cfg = policy_config(config, vocab_size)
  dtype = config.model.dtype
  if config.init_hf:
    llama, _ = model.load_hf(config.init_hf, mesh, dtype=dtype, value_head=cfg.value_head)
  elif config.init_checkpoint:
    llama, _ = model.load_checkpoint(config.init_checkpoint, mesh, dtype=dtype)
    if cfg.value_head:
      llama = model.shard(with_value_head(llama), mesh)
  else:
    llama = distributed.create_sharded(lambda: model.Llama(cfg, rngs=nnx.Rngs(config.seed)), mesh)
  if llama.cfg.remat != cfg.remat:
    llama.cfg = dataclasses.replace(llama.cfg, remat=cfg.remat)
  return llama
