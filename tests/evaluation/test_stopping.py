"""The eval binary told to stop, or short of disk (#66): it finishes (or drops) the record in
progress, never half of one, says where it stopped, and the same command continues from there."""

import os
import pathlib
import signal

import pytest

from ksjax import files, stopping
from ksjax.evaluation import results, runner
from tests.support import eval_run, full_disk


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, worker_id) -> pathlib.Path:
  return eval_run.tiny_run(eval_run.session_dir(tmp_path_factory, worker_id))


def _config(run: pathlib.Path, steps: str):
  config = eval_run.configured(run, steps=steps)
  config.run.mesh = (1, 2, 2)  # as the fixture's binary evaluated it (eval_run.EVAL_MESH)
  return config


def _output(run: pathlib.Path) -> pathlib.Path:
  (only,) = (run / "eval").iterdir()
  return only


def _metrics(output: pathlib.Path) -> dict[int, dict]:
  return {r["step"]: r["metrics"] for r in results.load_records(str(output))}


def test_sigterm_finishes_the_record_in_progress_and_the_same_command_continues(
    run_dir, tmp_path, monkeypatch, capsys):
  run = eval_run.copy_run(run_dir, tmp_path / "run", with_eval=False)
  save_step = results.save_step

  def signalled(output_dir, record):  # SIGTERM while step 1's record is being written
    os.kill(os.getpid(), signal.SIGTERM)
    return save_step(output_dir, record)

  with monkeypatch.context() as m:
    m.setattr(results, "save_step", signalled)
    with pytest.raises(stopping.Stopped) as stop:
      runner.run(_config(run, "1,2"))
  output = _output(run)
  assert stop.value.code == 143
  assert stop.value.message == (
      f"stopped by SIGTERM after the record of step 1: 1 records in {output}; the same command "
      "continues from there (records already written are read back, not sampled again)")
  assert stop.value.message in capsys.readouterr().out
  assert [r["step"] for r in results.load_records(str(output))] == [1]  # whole, and alone
  assert not [name for name in os.listdir(output) if name.startswith(".")]  # no temporary
  first = (output / results.STEP_FILE.format(step=1)).stat().st_mtime_ns
  runner.run(_config(run, "1,2"))
  assert "step 1: evaluated before with these settings" in capsys.readouterr().out
  assert (output / results.STEP_FILE.format(step=1)).stat().st_mtime_ns == first  # read back
  want = _metrics(_output(run_dir))
  assert _metrics(output) == {step: want[step] for step in (1, 2)}  # as if uninterrupted


def test_a_record_that_does_not_fit_is_one_line_and_the_same_command_continues(run_dir,
                                                                              tmp_path):
  run = eval_run.copy_run(run_dir, tmp_path / "run", with_eval=False)
  record = _output(run_dir) / results.STEP_FILE.format(step=1)
  limit = record.stat().st_size // 2
  with full_disk.file_size_limit(limit), pytest.raises(files.DiskFull) as failure:
    runner.run(_config(run, "1"))
  output = _output(run)
  line = str(failure.value)
  assert line.startswith(f"writing {output / record.name} failed (File too large"), line
  assert f"it needs {files.size_text(record.stat().st_size)}, " in line
  assert line.endswith("the records written before it are whole, and the same command continues "
                       "from them once space is freed")
  assert os.listdir(output) == []  # nothing half-written
  runner.run(_config(run, "1"))
  assert _metrics(output) == {1: _metrics(_output(run_dir))[1]}
