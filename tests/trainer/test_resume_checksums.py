"""Resuming: a damaged newest checkpoint is caught by its checksums and the previous one used; a
resume with nothing to resume from starts fresh and says so."""

import os
import shutil

import jax
import numpy as np

from ksjax.trainer import loop
from tests.run.test_checkpoint_checksums import flip_middle_of_largest_file
from tests.trainer.test_run import _final_params, _tiny_config


def test_resume_of_an_empty_workdir_starts_fresh_and_says_so(tmp_path, capsys):
  workdir = tmp_path / "run"
  loop.run(_tiny_config(workdir, num_steps=1, resume=True))
  out = capsys.readouterr().out
  said = [line for line in out.splitlines() if "holds no checkpoint" in line]
  assert said == [f"resume=True: {workdir} holds no checkpoint; starting a fresh run"], out
  assert "resumed from step" not in out
  assert sorted(os.listdir(workdir / "checkpoints")) == ["1"]


def test_flipped_bytes_in_the_newest_checkpoint_resume_from_the_previous_one(tmp_path, capsys):
  workdir = tmp_path / "run"
  loop.run(_tiny_config(workdir, num_steps=2))
  assert "holds no checkpoint" not in capsys.readouterr().out  # resume=False: no such line
  checkpoints = workdir / "checkpoints"
  flipped = flip_middle_of_largest_file(str(checkpoints / "2"))
  assert os.sep + "state" + os.sep in flipped
  shutil.rmtree(workdir / "final")  # so that the resumed run writes its own

  loop.run(_tiny_config(workdir, num_steps=3, resume=True))
  out = capsys.readouterr().out
  warnings = [line for line in out.splitlines() if line.startswith("warning: checkpoint")]
  assert len(warnings) == 1 and "checkpoint 2 cannot be restored" in warnings[0], out
  assert "checksum" in warnings[0] and flipped in warnings[0]
  assert "resumed from step 1" in out
  assert any(name.startswith("corrupt_2_") for name in os.listdir(checkpoints))
  assert sorted(n for n in os.listdir(checkpoints) if n.isdigit()) == ["2", "3"]  # saved anew
  for leaf in jax.tree.leaves(_final_params(str(workdir))):
    assert np.all(np.isfinite(leaf))
