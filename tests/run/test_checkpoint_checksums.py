"""Step checkpoints prove their own integrity: a sha256 manifest per step, written once Orbax has
finalised the step (also for asynchronous saves), checked before every restore."""

import json
import os

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ksjax.run import checkpoints as checkpointing
from ksjax.run.directory import RunDirectory

RECORDS = list(range(100))
# Random (incompressible) values, so that the arrays' data file is the step's largest.
WIDTH = 4096


def _iterator():
  return grain.MapDataset.source(RECORDS).batch(4).to_iter_dataset().__iter__()


def _w(step):
  return jax.random.normal(jax.random.PRNGKey(step), (WIDTH,), jnp.float32)


def _state(step):
  return {"w": _w(step), "step": jnp.int32(step)}


ABSTRACT = {"w": jax.ShapeDtypeStruct((WIDTH,), jnp.float32),
            "step": jax.ShapeDtypeStruct((), jnp.int32)}


def _save(directory, steps, *, use_async=True, keep=3):
  checkpointer = checkpointing.Checkpointer(directory, save_every=1, keep=keep,
                                            use_async=use_async)
  iterator = _iterator()
  for step in steps:
    next(iterator)
    assert checkpointer.save(step, _state(step), iterator, {"step": step})
  checkpointer.close()


def flip_middle_of_largest_file(step_dir, count=64):
  """Inverts `count` bytes in the middle of the step's largest file; returns its path."""
  paths = [os.path.join(root, name) for root, _, names in os.walk(step_dir) for name in names
           if name != checkpointing.MANIFEST]
  largest = max(paths, key=os.path.getsize)
  with open(largest, "r+b") as f:
    middle = max(0, os.path.getsize(largest) // 2 - count // 2)
    f.seek(middle)
    data = f.read(count)
    f.seek(middle)
    f.write(bytes(b ^ 0xFF for b in data))
  return largest


@pytest.mark.parametrize("use_async", [True, False])
def test_every_saved_step_carries_a_manifest_of_all_its_items(tmp_path, use_async):
  directory = str(tmp_path / "checkpoints")
  _save(directory, (1, 2, 3), use_async=use_async)
  for step in (1, 2, 3):
    step_dir = os.path.join(directory, str(step))
    with open(os.path.join(step_dir, checkpointing.MANIFEST)) as f:
      listed = json.load(f)["files"]
    items = {rel.split(os.sep)[0] for rel in listed}
    assert {"state", "data", "config"} <= items, sorted(listed)
    assert checkpointing.verify_manifest(step_dir)


def test_flipped_bytes_in_the_newest_step_fall_back_to_the_previous_one(tmp_path, capsys):
  directory = str(tmp_path / "checkpoints")
  _save(directory, (1, 2))
  flipped = flip_middle_of_largest_file(os.path.join(directory, "2"))
  assert os.sep + "state" + os.sep in flipped  # the parameters' bytes, not metadata

  restored_iterator = _iterator()
  step, state, config = checkpointing.Checkpointer(
      directory, save_every=1, keep=3).restore_latest(ABSTRACT, restored_iterator)
  assert step == 1 and config == {"step": 1}
  np.testing.assert_array_equal(state["w"], _w(1))
  np.testing.assert_array_equal(next(restored_iterator), [4, 5, 6, 7])  # where step 1 stood
  warnings = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
  assert len(warnings) == 1, warnings
  assert "checkpoint 2 cannot be restored" in warnings[0] and "checksum" in warnings[0]
  assert any(name.startswith("corrupt_2_") for name in os.listdir(directory))


def test_without_its_manifest_the_same_damage_goes_unnoticed(tmp_path, capsys):
  """What the manifest is for: Orbax itself restores the flipped bytes as parameters."""
  directory = str(tmp_path / "checkpoints")
  _save(directory, (1, 2))
  flip_middle_of_largest_file(os.path.join(directory, "2"))
  os.remove(os.path.join(directory, "2", checkpointing.MANIFEST))
  step, state, _ = checkpointing.Checkpointer(
      directory, save_every=1, keep=3).restore_latest(ABSTRACT, _iterator())
  assert step == 2
  assert not np.array_equal(np.asarray(state["w"]), np.asarray(_w(2)))
  assert "checkpoint 2 in" in capsys.readouterr().out  # the note: restored unverified


def test_eval_check_refuses_a_step_that_fails_its_checksums(tmp_path):
  workdir = tmp_path / "run"
  _save(str(workdir / "checkpoints"), (1, 2))
  flip_middle_of_largest_file(str(workdir / "checkpoints" / "2"))
  run = RunDirectory(str(workdir))
  checkpointing.verify_manifest(run.step_dir(1), prefix="state" + os.sep)
  with pytest.raises(checkpointing.ChecksumError, match=r"checkpoint step 2 in .* fails its "
                     r"checksums \(.*content differs"):
    checkpointing.check_shapes(run, 2, {}, "the model")
