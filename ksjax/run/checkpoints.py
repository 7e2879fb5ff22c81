"""A run's step checkpoints (Orbax): written by the trainer, read by anyone.

"Checkpoint" in ksjax means one of these: a step directory `<workdir>/checkpoints/<s>` (names in
`ksjax.run.directory`) holding everything needed to continue exactly, three items:
  * state:  the TrainState (parameters, optimizer state, step, skipped-step count, random key),
            restored straight onto the mesh shardings of an abstract target;
  * data:   the grain iterator's position, through grain's own Orbax handler (one file per JAX
            process, so every host resumes its own shard);
  * config: the run's config as JSON, so that a checkpoint says what produced it.

Saves are asynchronous (the device-to-host copy blocks, the writing does not) every
`save_every` steps, keeping the last `keep` ones. Orbax writes into a temporary directory and
renames it when every item is complete, so a run killed mid-save leaves no step behind (the
temporary directory is removed when the manager is next opened). A step directory that is
complete but unreadable (a file lost or truncated afterwards) is skipped with a warning by
`restore_latest`, moved aside as `corrupt_<step>`, and the previous good one is used.

Reading without touching (`steps`, `check_shapes`, `restore_policy`): evaluation needs only the
parameters, so it restores `state.params` alone (Orbax's partial restore), each array straight
onto its sharding on the evaluation mesh: the optimizer state, twice the parameters' size under
Adam, is never read. It does not use the `Checkpointer`, which opens a CheckpointManager that
creates the directory, removes temporary step directories and moves unreadable steps aside: the
right things for the process that owns the run and the wrong ones for a second process following
it while it trains. The step list comes from Orbax's listing of finalized step directories (a save
in progress is a temporary directory and is not listed).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from flax import nnx

from ksjax import model
from ksjax.model import checkpoint as model_checkpoint
from ksjax.model import sharding
from ksjax.run.directory import (CHECKPOINT_ITEMS, CONFIG_ITEM, DATA_ITEM, PARAMS_FIELD,
                                 STATE_ITEM, RunDirectory)


class CheckpointError(RuntimeError):
  """No checkpoint in the directory can be restored."""


class Checkpointer:
  """Saves and restores (TrainState, data iterator, config) under `directory`.

  Args:
    directory: where step directories go (created on first use).
    save_every: save when step % save_every == 0 (and always when asked with force=True).
    keep: how many of the most recent checkpoints to keep.
    use_async: write in a background thread.
  """

  def __init__(self, directory: str, *, save_every: int, keep: int, use_async: bool = True):
    self.directory = os.path.abspath(directory)
    self._options = ocp.CheckpointManagerOptions(
        save_interval_steps=save_every, max_to_keep=keep, create=True,
        enable_async_checkpointing=use_async, cleanup_tmp_directories=True)
    self._manager = self._open()

  def _open(self) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(self.directory, options=self._options,
                                 item_names=CHECKPOINT_ITEMS)

  def steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: Any, data_iterator: grain.DatasetIterator,
           config: Mapping[str, Any], *, force: bool = False) -> bool:
    """Starts saving step `step` if it is due (or `force`); returns whether it did."""
    if step in self._manager.all_steps():
      return False
    return self._manager.save(
        step, force=force,
        args=ocp.args.Composite(**{
            STATE_ITEM: ocp.args.StandardSave(state),
            DATA_ITEM: grain.checkpoint.CheckpointSave(data_iterator),
            CONFIG_ITEM: ocp.args.JsonSave(dict(config))}))

  def restore_latest(self, abstract_state: Any,
                     data_iterator: grain.DatasetIterator) -> tuple[int, Any, dict] | None:
    """(step, state, config) of the newest readable checkpoint, with `data_iterator` moved to
    its position; None when there is no checkpoint at all.

    An unreadable checkpoint is logged, moved aside and the next older one tried; CheckpointError
    if none can be read.
    """
    steps = self.steps()
    if not steps:
      return None
    failures = []
    for step in reversed(steps):
      try:
        restored = self._manager.restore(
            step, args=ocp.args.Composite(**{
                STATE_ITEM: ocp.args.StandardRestore(abstract_state),
                DATA_ITEM: grain.checkpoint.CheckpointRestore(data_iterator),
                CONFIG_ITEM: ocp.args.JsonRestore()}))
      except Exception as e:  # pylint: disable=broad-except
        # Orbax, tensorstore and grain raise many types for a damaged directory; any of them
        # means this step cannot be resumed from, and the next older one may be whole.
        reason = f"{type(e).__name__}: {str(e)[:300]}"
        logging.warning("checkpoint %d in %s cannot be restored (%s); trying the previous one",
                        step, self.directory, reason)
        print(f"warning: checkpoint {step} cannot be restored ({reason}); using the previous one",
              flush=True)
        failures.append((step, reason))
        self._quarantine(step)
        continue
      return step, restored[STATE_ITEM], dict(restored[CONFIG_ITEM] or {})
    raise CheckpointError(f"no checkpoint in {self.directory} can be restored: " + "; ".join(
        f"step {s}: {r}" for s, r in failures))

  def _quarantine(self, step: int) -> None:
    """Moves a damaged step directory aside so that later saves of that step do not collide."""
    self._manager.wait_until_finished()
    path = os.path.join(self.directory, str(step))
    if os.path.isdir(path):
      os.rename(path, os.path.join(self.directory, f"corrupt_{step}_{int(time.time())}"))
    self._manager.close()
    self._manager = self._open()

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


# ---------------------------------------------------------------------------------------------
# Reading without touching (the eval binary, the studies)
# ---------------------------------------------------------------------------------------------

class CheckpointInputError(ValueError):
  """The checkpoint directory, or a checkpoint in it, is not what evaluation can read."""


def steps(run: RunDirectory) -> list[int]:
  """The finalized checkpoint steps, ascending."""
  return sorted(ocp.utils.checkpoint_steps(run.steps_dir))


def abstract_policy(cfg: model.LlamaConfig, mesh: jax.sharding.Mesh) -> tuple[nnx.GraphDef,
                                                                             nnx.State]:
  """The policy's graph and its parameters as ShapeDtypeStructs carrying their mesh shardings."""
  sharding.check_divisible(cfg, mesh)
  graphdef, state = nnx.split(model_checkpoint.abstract_model(cfg))
  shardings = sharding.state_shardings(state, mesh)
  target = jax.tree.map(
      lambda variable, s: variable.replace(
          jax.ShapeDtypeStruct(variable.shape, variable.dtype, sharding=s)),
      state, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return graphdef, target


def _shapes(tree) -> dict[str, tuple[int, ...]]:
  """Parameter name ("layers.0.mlp.up_proj") -> shape, from a state or Orbax's metadata tree."""
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
  out = {}
  for path, leaf in flat:
    keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    if keys and keys[-1] == "value":  # nnx.Variable's own level
      keys = keys[:-1]
    out[".".join(keys)] = tuple(leaf.shape)
  return out


def check_shapes(run: RunDirectory, step: int, target: nnx.State, what: str) -> None:
  """One clear error for the first parameter that the checkpoint lacks, has in another shape,
  or has in excess of the model `what` describes."""
  path = run.state_dir(step)
  try:
    stored = ocp.PyTreeCheckpointHandler().metadata(epath.Path(path))
  except (FileNotFoundError, ValueError, KeyError, OSError) as e:
    raise CheckpointInputError(f"checkpoint {path!r} cannot be read ({type(e).__name__}: "
                               f"{str(e)[:200]}); expected a ksjax trainer checkpoint") from None
  if stored is None or PARAMS_FIELD not in stored:
    raise CheckpointInputError(f"checkpoint {path!r} holds no {PARAMS_FIELD!r}; expected a ksjax "
                               "trainer checkpoint")
  have = _shapes(dict(stored[PARAMS_FIELD]))
  want = _shapes(target)
  where = f"checkpoint step {step} in {run.steps_dir}"
  for name, shape in want.items():
    if name not in have:
      raise CheckpointInputError(f"{where} lacks parameter {name!r} of {what}; expected a "
                                 "checkpoint of that model (evaluate with the run's config)")
    if have[name] != shape:
      raise CheckpointInputError(f"{where} has parameter {name!r} of shape {have[name]}; {what} "
                                 f"implies {shape} (evaluate with the run's config)")
  extra = sorted(set(have) - set(want))
  if extra:
    raise CheckpointInputError(f"{where} has parameter {extra[0]!r}, which {what} lacks "
                               "(evaluate with the run's config)")


def restore_policy(run: RunDirectory, step: int, graphdef: nnx.GraphDef,
                   target: nnx.State) -> model.Llama:
  """The policy at `step`, its parameters restored onto the shardings `target` carries."""
  item = {PARAMS_FIELD: target}
  # The item's handler itself, not a Checkpointer: the trainer's step-level metadata sits one
  # directory up, and a Checkpointer would warn that the item directory lacks it.
  restored = ocp.PyTreeCheckpointHandler().restore(
      epath.Path(run.state_dir(step)),
      args=ocp.args.PyTreeRestore(item=item,
                                  restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                                  partial_restore=True))
  return nnx.merge(graphdef, restored[PARAMS_FIELD])
