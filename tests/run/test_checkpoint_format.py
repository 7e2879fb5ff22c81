"""How the trainer's step checkpoints are written: the state uncompressed, Orbax's initial save,
and steps written by earlier ksjax (compressed, through Orbax's StandardSave) still restored."""

import os

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from ksjax.run import checkpoints as checkpointing
from ksjax.run.directory import CONFIG_ITEM, DATA_ITEM, STATE_ITEM

ROWS = 512  # 512 x 512 float32: 1 MiB


def _iterator():
  return grain.MapDataset.range(64).batch(4).to_iter_dataset().__iter__()


def _state(value):
  return {"w": jnp.full((ROWS, ROWS), value, jnp.float32), "step": jnp.int32(3)}


ABSTRACT = {"w": jax.ShapeDtypeStruct((ROWS, ROWS), jnp.float32),
            "step": jax.ShapeDtypeStruct((), jnp.int32)}


def _bytes_under(path):
  return sum(os.path.getsize(os.path.join(root, name))
             for root, _, names in os.walk(path) for name in names)


def test_the_state_is_written_uncompressed(tmp_path):
  # Zeros compress to almost nothing: a compressing writer would leave far less than 1 MiB.
  checkpointer = checkpointing.Checkpointer(str(tmp_path), save_every=1, keep=1, use_async=False)
  assert checkpointer.save(1, _state(0.0), _iterator(), {"a": 1})
  checkpointer.close()
  nbytes = ROWS * ROWS * 4
  assert _bytes_under(tmp_path / "1" / STATE_ITEM) >= nbytes


def test_saves_at_the_interval_and_at_a_fresh_runs_first_step(tmp_path):
  checkpointer = checkpointing.Checkpointer(str(tmp_path), save_every=4, keep=4, use_async=False)
  iterator = _iterator()
  saved = [step for step in range(1, 10) if checkpointer.save(step, _state(float(step)),
                                                              iterator, {"a": 1})]
  checkpointer.close()
  assert saved == [1, 4, 8]
  # A resumed run (a checkpoint exists) saves at the interval only.
  checkpointer = checkpointing.Checkpointer(str(tmp_path), save_every=4, keep=4, use_async=False)
  saved = [step for step in range(9, 13) if checkpointer.save(step, _state(float(step)),
                                                              iterator, {"a": 1})]
  checkpointer.close()
  assert saved == [12]


def test_a_step_saved_compressed_by_earlier_ksjax_restores(tmp_path):
  # How ksjax wrote steps before: item names resolved by Orbax, the state through StandardSave
  # (zstd-compressed).
  manager = ocp.CheckpointManager(str(tmp_path), options=ocp.CheckpointManagerOptions(create=True),
                                  item_names=(STATE_ITEM, DATA_ITEM, CONFIG_ITEM))
  iterator = _iterator()
  next(iterator)
  state = {"w": jax.random.normal(jax.random.PRNGKey(0), (ROWS, ROWS)), "step": jnp.int32(3)}
  manager.save(5, args=ocp.args.Composite(**{
      STATE_ITEM: ocp.args.StandardSave(state),
      DATA_ITEM: grain.checkpoint.CheckpointSave(iterator),
      CONFIG_ITEM: ocp.args.JsonSave({"a": 1})}))
  manager.wait_until_finished()
  manager.close()
  assert _bytes_under(tmp_path / "5" / STATE_ITEM) > 0
  expected_next = next(iterator)

  checkpointer = checkpointing.Checkpointer(str(tmp_path), save_every=1, keep=2)
  restored_iterator = _iterator()
  step, restored, config = checkpointer.restore_latest(ABSTRACT, restored_iterator)
  checkpointer.close()
  assert step == 5 and config == {"a": 1}
  np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(state["w"]))
  assert int(restored["step"]) == 3
  np.testing.assert_array_equal(next(restored_iterator), expected_next)
