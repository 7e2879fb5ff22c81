"""Fuzzing a run's checkpoint directories as the eval binary reads them (`ksjax.run.checkpoints`).
What every reader must do with garbage: `tests/support/fuzz.py`."""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ksjax.run import checkpoints as run_checkpoints
from ksjax.run.directory import RunDirectory
from tests.support.fuzz import (SCALE, apply_damage, damage_to, input_error_or_result,
                                relative_files)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A run's checkpoints/ with two steps (manifests included), as the trainer saves them."""
  import grain  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  workdir = tmp_path_factory.mktemp("run")
  checkpointer = run_checkpoints.Checkpointer(str(workdir / "checkpoints"), save_every=1, keep=2,
                                              use_async=False)
  iterator = grain.MapDataset.source(list(range(8))).batch(2).to_iter_dataset().__iter__()
  for step in (1, 2):
    next(iterator)
    state = {"params": {"w": jnp.full((16,), float(step)), "b": jnp.zeros((2, 3))},
             "step": jnp.int32(step)}
    checkpointer.save(step, state, iterator, {"step": step})
  checkpointer.close()
  return str(workdir)


@settings(max_examples=25 * SCALE, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_run_checkpoint_directories_as_the_eval_binary_reads_them(run_dir, data):
  """The eval binary's checks before it writes anything: the step list, then the manifest and
  the parameters' shapes of each selected step."""
  import jax  # pylint: disable=g-import-not-at-top
  actions = data.draw(damage_to(relative_files(run_dir)))
  target = {"w": jax.ShapeDtypeStruct((16,), np.float32),
            "b": jax.ShapeDtypeStruct((2, 3), np.float32)}
  with tempfile.TemporaryDirectory() as root:
    workdir = os.path.join(root, "run")
    shutil.copytree(run_dir, workdir)
    apply_damage(workdir, actions)
    run = RunDirectory(workdir)
    available = input_error_or_result(run_checkpoints.steps, run, where=root, memory_bytes=None)
    for step in available or ():
      input_error_or_result(run_checkpoints.check_shapes, run, step, target, "the model",
                            where=root, memory_bytes=None)
