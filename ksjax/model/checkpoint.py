"""Orbax checkpoints of Llama parameters, with the LlamaConfig stored in the checkpoint metadata.

A checkpoint is one Orbax directory: the parameters as a plain nested dict (so it does not depend
on how NNX flattens its Variables) and, in its custom metadata, the config that shapes them. So
`load(path, mesh)` needs nothing else, and restores every array straight onto its mesh sharding.
Orbax writes to a temporary directory and renames it on success, so a checkpoint on disk is whole.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
import orbax.checkpoint as ocp
from flax import nnx

from ksjax import errors
from ksjax.model import sharding
from ksjax.model.config import LlamaConfig
from ksjax.model.llama import Llama

CONFIG_KEY = "llama_config"
# What a ksjax.model checkpoint is, for the messages that refuse a directory.
EXPECTED = ("expected a model checkpoint written by ksjax.model.checkpoint.save (convert_hf, "
            "convert_gguf, a run's final policy)")
# What Orbax and TensorStore raise on a damaged checkpoint directory: a file missing, cut or of
# another content (JSON of another shape is read with .get and [], garbage parsed as lengths).
_ORBAX_READ_ERRORS = (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError)
_T = TypeVar("_T")


class CheckpointError(ValueError):
  """A checkpoint on disk does not describe the model its config announces."""


def config_to_json(cfg: LlamaConfig) -> dict[str, Any]:
  out = dataclasses.asdict(cfg)
  out["rope_scaling"] = cfg.rope_scaling_dict
  return out


def config_from_json(data: dict[str, Any]) -> LlamaConfig:
  if not isinstance(data, Mapping):
    raise CheckpointError(f"checkpoint config is a {type(data).__name__}; expected a JSON object of "
                          "LlamaConfig fields")
  fields = {f.name for f in dataclasses.fields(LlamaConfig)}
  unknown = sorted(set(map(str, data)) - fields)
  if unknown:
    raise CheckpointError(f"checkpoint config has unknown fields {unknown}")
  try:
    return LlamaConfig(**data)
  except (TypeError, ValueError, AttributeError) as e:  # ConfigError included: named here
    raise CheckpointError(f"checkpoint config does not describe a Llama ({errors.one_line(e)}); "
                          "expected the LlamaConfig fields of a saved model") from None


def abstract_model(cfg: LlamaConfig) -> Llama:
  """The model with ShapeDtypeStructs for parameters: no memory allocated."""
  return nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))


def save(path: str, llama: Llama) -> None:
  """Writes `llama`'s parameters and config to the new Orbax directory `path`."""
  if os.path.exists(path):
    raise FileExistsError(f"{path!r} exists; checkpoints are never overwritten")
  params = nnx.to_pure_dict(nnx.state(llama, nnx.Param))
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.path.abspath(path), params,
                    custom_metadata={CONFIG_KEY: config_to_json(llama.cfg)})
  checkpointer.wait_until_finished()


def _read(path: str, read: Callable[[], _T], expected: str = EXPECTED) -> _T:
  """`read()`, an Orbax read of the checkpoint at `path`: its errors on a damaged directory
  become one CheckpointError naming `path` and what was `expected` (and Orbax's log lines about
  it are dropped)."""
  try:
    with errors.quiet_if_it_fails():
      return read()
  except Exception as e:  # pylint: disable=broad-except
    # Orbax raises a shard's read error (a data file cut or garbled) as a bare Exception whose
    # cause is the error.
    cause = e if isinstance(e, _ORBAX_READ_ERRORS) else e.__cause__
    if not isinstance(cause, _ORBAX_READ_ERRORS):
      raise
    raise CheckpointError(f"{path!r} cannot be read as a checkpoint ({type(cause).__name__}: "
                          f"{errors.one_line(cause)[:200]}); {expected}") from None


def load_config(path: str) -> LlamaConfig:
  if not os.path.isdir(path):
    raise CheckpointError(f"{path!r} is not a checkpoint directory")
  metadata = _read(path, lambda: ocp.StandardCheckpointer().metadata(os.path.abspath(path)))
  custom = metadata.custom_metadata
  if not isinstance(custom, Mapping) or CONFIG_KEY not in custom:
    raise CheckpointError(f"{path!r} has no {CONFIG_KEY!r} in its metadata; {EXPECTED}")
  try:
    return config_from_json(custom[CONFIG_KEY])
  except CheckpointError as e:
    raise CheckpointError(f"{path!r}: {e}") from None


def load(path: str, mesh: jax.sharding.Mesh | None = None,
         dtype: str | None = None) -> tuple[Llama, LlamaConfig]:
  """Restores (llama, cfg) from `path`, each parameter placed by its spec on `mesh`.

  `dtype` (optional) overrides the stored param_dtype/dtype; Orbax casts while restoring.
  """
  cfg = load_config(path)
  if dtype is not None:
    cfg = dataclasses.replace(cfg, param_dtype=dtype, dtype=dtype)
  if mesh is not None:
    sharding.check_divisible(cfg, mesh)
  checkpointer = ocp.StandardCheckpointer()
  stored = _read(path, lambda: checkpointer.metadata(os.path.abspath(path)).item_metadata)
  abstract = abstract_model(cfg)
  graphdef, state = nnx.split(abstract)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

  def target(path_, leaf):
    return jax.ShapeDtypeStruct(
        leaf.shape, leaf.dtype,
        sharding=device if mesh is None else jax.sharding.NamedSharding(
            mesh, sharding.partition_spec(path_)))

  targets = nnx.map_state(target, nnx.state(abstract, nnx.Param))
  target_dict = nnx.to_pure_dict(targets)
  _check_matches(target_dict, dict(stored) if stored is not None else {})
  restored = _read(path, lambda: checkpointer.restore(os.path.abspath(path), target_dict))
  nnx.replace_by_pure_dict(state, restored)
  return nnx.merge(graphdef, state), cfg


def _check_matches(target: dict, stored: dict) -> None:
  """One clear error for the first parameter missing, extra or misshapen in the checkpoint."""
  flat_target = dict(nnx.traversals.flatten_mapping(target))
  flat_stored = dict(nnx.traversals.flatten_mapping(stored))
  name = lambda p: ".".join(map(str, p))
  for p, leaf in flat_target.items():
    sp = p if p in flat_stored else tuple(str(x) for x in p)
    if sp not in flat_stored:
      raise CheckpointError(f"checkpoint lacks parameter {name(p)!r}")
    if tuple(flat_stored[sp].shape) != tuple(leaf.shape):
      raise CheckpointError(f"checkpoint parameter {name(p)!r} has shape "
                            f"{tuple(flat_stored[sp].shape)}; the config implies {leaf.shape}")
  wanted = {tuple(str(x) for x in p) for p in flat_target}
  extra = [p for p in flat_stored if tuple(str(x) for x in p) not in wanted]
  if extra:
    raise CheckpointError(f"checkpoint has unexpected parameter {name(extra[0])!r}")
