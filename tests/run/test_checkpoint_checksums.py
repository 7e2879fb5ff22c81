"""Step checkpoints prove their own integrity: a sha256 manifest per step, written once Orbax has
finalised the step (also for asynchronous saves), checked before every restore."""

import json
import os
import threading

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


def _damage(path, count=8):
  with open(path, "r+b") as f:
    data = f.read(count)
    f.seek(0)
    f.write(bytes(b ^ 0xFF for b in data))


def _hashing_threads():
  return [t for t in threading.enumerate() if t.name.startswith("ksjax-sha256")]


def test_parallel_hashing_writes_the_manifest_sequential_hashing_does(tmp_path, monkeypatch):
  monkeypatch.setattr(checkpointing, "_HASH_THREADS", 3)
  monkeypatch.setattr(checkpointing, "_PARALLEL_MIN_BYTES", 0)  # these files are small
  hashed_by = []
  sha256 = checkpointing._sha256
  monkeypatch.setattr(checkpointing, "_sha256",
                      lambda path: hashed_by.append(threading.current_thread().name) or sha256(path))
  directory = str(tmp_path / "checkpoints")
  _save(directory, (1,), use_async=False)
  assert hashed_by and all(name.startswith("ksjax-sha256") for name in hashed_by)
  step_dir = os.path.join(directory, "1")
  manifest = os.path.join(step_dir, checkpointing.MANIFEST)
  with open(manifest, "rb") as f:
    parallel = f.read()
  monkeypatch.setattr(checkpointing, "_HASH_THREADS", 1)
  checkpointing.write_manifest(step_dir)
  with open(manifest, "rb") as f:
    assert f.read() == parallel
  assert checkpointing.verify_manifest(step_dir)


@pytest.mark.parametrize("threads", [1, 3])
def test_the_first_damaged_file_in_order_is_named_whatever_is_hashed_first(tmp_path, monkeypatch,
                                                                           threads):
  """The parallel hashing starts with the largest files; the error still names the first file
  in the manifest's (sorted) order that differs, as the sequential one did, and no hashing
  thread reads on after it."""
  monkeypatch.setattr(checkpointing, "_HASH_THREADS", threads)
  monkeypatch.setattr(checkpointing, "_PARALLEL_MIN_BYTES", 0)  # these files are small
  directory = str(tmp_path / "checkpoints")
  _save(directory, (1,), use_async=False)
  step_dir = os.path.join(directory, "1")
  with open(os.path.join(step_dir, checkpointing.MANIFEST)) as f:
    listed = sorted(json.load(f)["files"])
  size = lambda rel: os.path.getsize(os.path.join(step_dir, rel))  # noqa: E731
  largest = max(listed, key=size)  # hashed first
  earlier = next(rel for rel in listed[:listed.index(largest)] if size(rel) >= 8)  # e.g. config/
  for rel in (earlier, largest):
    _damage(os.path.join(step_dir, rel))
  with pytest.raises(checkpointing.ChecksumError) as e:
    checkpointing.verify_manifest(step_dir)
  assert str(e.value) == (f"{os.path.join(step_dir, earlier)}: content differs from the checksum "
                          "manifest's sha256")
  assert not _hashing_threads()
