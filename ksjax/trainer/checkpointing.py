"""Training checkpoints with Orbax's CheckpointManager: everything needed to continue exactly.

A checkpoint at step s is one directory `<workdir>/checkpoints/<s>` with three items:
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
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

import grain
import orbax.checkpoint as ocp
from absl import logging


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
                                 item_names=("state", "data", "config"))

  def steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: Any, data_iterator: grain.DatasetIterator,
           config: Mapping[str, Any], *, force: bool = False) -> bool:
    """Starts saving step `step` if it is due (or `force`); returns whether it did."""
    if step in self._manager.all_steps():
      return False
    return self._manager.save(
        step, force=force,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                data=grain.checkpoint.CheckpointSave(data_iterator),
                                config=ocp.args.JsonSave(dict(config))))

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
            step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=grain.checkpoint.CheckpointRestore(data_iterator),
                config=ocp.args.JsonRestore()))
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
      return step, restored["state"], dict(restored["config"] or {})
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


def config_json(config: Any) -> dict[str, Any]:
  """The ConfigDict as plain JSON-ready data (tuples become lists)."""
  return json.loads(config.to_json_best_effort(sort_keys=True))
