"""Told to stop, the trainer saves where it is; a full disk loses nothing (#66).

SIGTERM at random steps, then `resume=True`, ends with the parameters of an uninterrupted run bit
for bit, in lockstep and with rollouts sampled one step ahead; each SIGTERM loses at most the
step in progress. A checkpoint save or a step-log write that fails for want of space (the file
size limit, RLIMIT_FSIZE, stands in for a full disk: the process ignores SIGXFSZ and sees EFBIG)
is one line naming what failed and its size, leaves the previous checkpoint whole and the newest,
and a resume once space is back continues bitwise. "Bitwise" compares two runs on this machine.
"""

import contextlib
import os
import random
import shutil
import signal
import subprocess
import time

import jax
import numpy as np
import pytest

from ksjax import errors, stopping
from ksjax.run import checkpoints
from ksjax.run.directory import RunDirectory
from ksjax.trainer import async_rollouts, loop, metrics
from ksjax.run import config as run_config
from tests import support
from tests.support import eval_run, full_disk
from tests.trainer import test_run
from tests.trainer.test_run import _final_params, _main

# Updates that move the parameters (the mean's weights are never all zero); a checkpoint only
# when a signal asks for one (and Orbax's save of a fresh run's first step).
MOVING = {"aggregator": "mean", "baseline": "none", "checkpoint_every": 1000,
          "keep_checkpoints": 3}
ASYNC = {"max_lag": 1, "sampler_devices": 4, "mesh": (-1, 1, 1), "is_cap": np.inf}


def _tiny_config(workdir, **fields):
  """The tiny run of tests/trainer/test_run.py as `_main` runs it (configs/pass_at_k.py's
  config), in this process."""
  config = run_config.embedded_task_config()
  config.aggregator, config.baseline = "pass_at_k", "loo"  # configs/pass_at_k.py
  config.workdir = str(workdir)
  eval_run.set_fields(config, {**test_run.TINY, **fields})
  return config


def _lines(workdir) -> list[dict]:
  return metrics.read_jsonl(RunDirectory(str(workdir)).metrics_jsonl)


def _assert_same_run(straight, stopped) -> None:
  a, b = _final_params(str(straight)), _final_params(str(stopped))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)
  want, got = _lines(straight), _lines(stopped)
  assert [line["step"] for line in got] == [line["step"] for line in want]
  for name in ("loss/total", "reward/mean"):
    assert [line[name] for line in got] == [line[name] for line in want], name


def _signal_steps(seed: int, count: int) -> list[int]:
  """`count` random steps to signal at, each at least two after the last (a run signalled at step
  s stops after s + 1 at most, and its resume's first step is the next one)."""
  rng = random.Random(seed)
  steps = [rng.randint(1, 2)]
  while len(steps) < count:
    steps.append(steps[-1] + rng.randint(2, 3))
  return steps


@contextlib.contextmanager
def _signal_at(monkeypatch, step: int, signum: int = signal.SIGTERM):
  """Sends this process `signum` once the step log holds step `step`: mid-run, from the trainer's
  own thread, so at a step that does not depend on the machine's speed."""
  write = metrics.MetricsWriter.write

  def sending(self, s, scalars):
    write(self, s, scalars)
    if s == step:
      os.kill(os.getpid(), signum)

  with monkeypatch.context() as m:
    m.setattr(metrics.MetricsWriter, "write", sending)
    yield


@pytest.mark.parametrize("variant", ["lockstep", "async_lag_1"])
def test_sigterm_at_random_steps_then_resume_ends_bitwise_as_an_uninterrupted_run(
    tmp_path, monkeypatch, capsys, variant):
  fields = {**MOVING, **(ASYNC if variant == "async_lag_1" else {})}
  signals = _signal_steps(seed=66, count=3)
  steps = signals[-1] + 2
  straight, stopped = tmp_path / "straight", tmp_path / "stopped"
  loop.run(_tiny_config(straight, num_steps=steps, **fields))
  for i, signalled in enumerate(signals):
    with _signal_at(monkeypatch, signalled), pytest.raises(stopping.Stopped) as stop:
      loop.run(_tiny_config(stopped, num_steps=steps, resume=i > 0, **fields))
    assert stop.value.code == 143
    saved = max(checkpoints.steps(RunDirectory(str(stopped))))
    # At most the step in progress is lost: the checkpoint holds every step the log had when the
    # signal came, and the run stopped right after the step in progress.
    assert signalled <= saved <= signalled + 1
    assert stop.value.message == (
        f"stopped by SIGTERM after step {saved}: checkpoint {saved} is saved in "
        f"{stopped / 'checkpoints'}; the same command with --config.resume=True continues "
        "from it")
    assert stop.value.message in capsys.readouterr().out
    assert checkpoints.verify_manifest(str(stopped / "checkpoints" / str(saved)))
    assert not (stopped / "final").exists()
    if variant == "async_lag_1":  # the rollouts sampled ahead were saved with it
      assert (stopped / async_rollouts.ROLLOUTS_DIR / f"{saved}.rollouts").exists()
  loop.run(_tiny_config(stopped, num_steps=steps, resume=True, **fields))
  _assert_same_run(straight, stopped)


def test_sigint_stops_the_same_way_with_status_130_and_handlers_are_put_back(tmp_path,
                                                                            monkeypatch):
  before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
  with _signal_at(monkeypatch, 1, signal.SIGINT), pytest.raises(stopping.Stopped) as stop:
    loop.run(_tiny_config(tmp_path / "run", num_steps=4, **MOVING))
  assert stop.value.code == 130 and "stopped by SIGINT after step 2" in stop.value.message
  assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def _env(*, cache_writes: bool = True) -> dict:
  """The binary's environment: this process's (its devices, and the session's compilation cache,
  which holds the programs the runs in this process compiled); without `cache_writes`, the
  cache is read but never written (under a file size limit JAX would warn that it cannot)."""
  env = dict(os.environ)
  if not cache_writes:
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "1e9"
  return env


def test_a_sigterm_from_outside_saves_the_step_and_exits_143_with_one_line(tmp_path):
  workdir = tmp_path / "run"
  log = RunDirectory(str(workdir)).metrics_jsonl
  run = subprocess.Popen(_main(str(workdir), num_steps=200, **MOVING), cwd=support.REPO,
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  while time.time() < deadline and run.poll() is None:
    if os.path.exists(log) and len(metrics.read_jsonl(log)) >= 2:
      break
    time.sleep(0.01)
  done = len(metrics.read_jsonl(log))  # steps complete when the signal is sent (or more)
  run.send_signal(signal.SIGTERM)
  out, err = run.communicate(timeout=120)
  assert run.returncode == 143, err[-3000:]
  saved = max(checkpoints.steps(RunDirectory(str(workdir))))
  assert saved >= done  # nothing complete was lost
  assert out.splitlines()[-1] == (
      f"stopped by SIGTERM after step {saved}: checkpoint {saved} is saved in "
      f"{workdir / 'checkpoints'}; the same command with --config.resume=True continues from it")
  assert "Traceback" not in err
  assert err.splitlines()[-1].startswith("ksjax: SIGTERM: finishing the step in progress")
  assert checkpoints.verify_manifest(str(workdir / "checkpoints" / str(saved)))


# ---------------------------------------------------------------------------------------------
# A full disk
# ---------------------------------------------------------------------------------------------

FULL_DISK = {**MOVING, "checkpoint_every": 1}
STEPS = 4


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
  """(a run stopped after 2 of STEPS steps, checkpoints 1 and 2; the same run uninterrupted)."""
  tmp = tmp_path_factory.mktemp("full_disk")
  loop.run(_tiny_config(tmp / "straight", num_steps=STEPS, **FULL_DISK))
  loop.run(_tiny_config(tmp / "two", num_steps=2, **FULL_DISK))
  return tmp / "two", tmp / "straight"


def _files_outside_checkpoints(folder) -> dict[str, int]:
  checkpoint_folders = {"checkpoints", "start", "final"}
  return {os.path.join(root, name): os.path.getsize(os.path.join(root, name))
          for root, _, names in os.walk(folder)
          if not checkpoint_folders & set(os.path.relpath(root, folder).split(os.sep))
          for name in names}


def test_a_checkpoint_that_does_not_fit_is_one_line_and_the_previous_one_resumes_bitwise(
    two_steps, tmp_path):
  base, straight = two_steps
  workdir = tmp_path / "run"
  shutil.copytree(base, workdir)
  # Smaller than the tree metadata every checkpoint of this state writes (the same bytes at each
  # step), larger than every file the run writes outside its checkpoints. Not a fraction of the
  # data file: how many data files TensorStore writes, and so their sizes, depends on timing.
  limit = os.path.getsize(workdir / "checkpoints" / "2" / "state" / "_METADATA") - 1
  outside = _files_outside_checkpoints(straight)
  assert max(outside.values()) < limit, (limit, outside)
  command = full_disk.limited(limit, _main(str(workdir), num_steps=STEPS, resume=True,
                                            **FULL_DISK))
  result = subprocess.run(command, cwd=support.REPO, env=_env(cache_writes=False),
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == errors.EXIT_DISK_FULL, result.stderr[-3000:]
  assert "Traceback" not in result.stderr and "Error" not in result.stderr, result.stderr[-3000:]
  lines = [line for line in result.stderr.splitlines() if line.startswith("ksjax")]
  assert len(lines) == 1 and result.stderr.splitlines()[-1] == lines[0], result.stderr[-3000:]
  assert lines[0].startswith(f"ksjax: saving checkpoint 3 in {workdir / 'checkpoints'} failed "
                             "(File too large")
  assert "it needs " in lines[0] and " KiB, " in lines[0]
  assert lines[0].endswith("checkpoint 2 is whole, and --config.resume=True continues from it "
                           "once space is freed")
  run = RunDirectory(str(workdir))
  assert checkpoints.steps(run) == [1, 2]  # the failed save left no step behind
  assert checkpoints.verify_manifest(run.step_dir(2))
  loop.run(_tiny_config(workdir, num_steps=STEPS, resume=True, **FULL_DISK))
  _assert_same_run(straight, workdir)


def test_a_step_log_line_that_does_not_fit_is_cut_off_and_the_run_resumes_bitwise(two_steps,
                                                                                 tmp_path):
  base, straight = two_steps
  workdir = tmp_path / "run"
  shutil.copytree(base, workdir)
  log = RunDirectory(str(workdir)).metrics_jsonl
  before = open(log, "rb").read()
  with full_disk.file_size_limit(len(before) + 100), pytest.raises(Exception) as failure:
    loop.run(_tiny_config(workdir, num_steps=STEPS, resume=True, **FULL_DISK))
  line = errors.disk_full_line(failure.value)
  assert line is not None and line.startswith(
      f"writing step 3's line of the step log {log} failed (File too large"), line
  assert "it needs 1." in line or "it needs 2." in line  # a line of about 2 KiB
  assert line.endswith("checkpoint 2 is whole, and --config.resume=True continues from it once "
                       "space is freed")
  assert open(log, "rb").read() == before  # no half line
  assert checkpoints.steps(RunDirectory(str(workdir))) == [1, 2]
  loop.run(_tiny_config(workdir, num_steps=STEPS, resume=True, **FULL_DISK))
  _assert_same_run(straight, workdir)


@pytest.mark.slow  # three runs of the binary: about half a minute of 2 cores
def test_a_second_sigterm_exits_at_once_and_leaves_every_checkpoint_whole(tmp_path):
  """Two SIGTERMs 20 ms apart, with a checkpoint saved at every step: the second one ends the
  process wherever it is (often inside the save the first one asked for); every step Orbax lists
  is whole, and a resume from the newest ends as an uninterrupted run, bitwise."""
  steps, fields = 12, {**MOVING, "checkpoint_every": 1}
  straight, killed = tmp_path / "straight", tmp_path / "killed"
  run_straight = subprocess.Popen(_main(str(straight), num_steps=steps, **fields),
                                  cwd=support.REPO, env=_env(), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True)
  run = subprocess.Popen(_main(str(killed), num_steps=steps, **fields), cwd=support.REPO,
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  log = RunDirectory(str(killed)).metrics_jsonl
  deadline = time.time() + 300
  while time.time() < deadline and run.poll() is None:
    if os.path.exists(log) and len(metrics.read_jsonl(log)) >= 3:
      break
    time.sleep(0.01)
  run.send_signal(signal.SIGTERM)
  time.sleep(0.02)
  sent = time.time()
  run.send_signal(signal.SIGTERM)
  _, err = run.communicate(timeout=120)
  assert run.returncode == 143 and time.time() - sent < 5, err[-3000:]
  assert "ksjax: a second SIGTERM: stopping now" in err and "Traceback" not in err
  assert not (killed / "final").exists()
  directory = RunDirectory(str(killed))
  for step in checkpoints.steps(directory):  # each whole (the newest may lack its manifest)
    checkpoints.verify_manifest(directory.step_dir(step))
  resumed = subprocess.run(_main(str(killed), num_steps=steps, resume=True, **fields),
                           cwd=support.REPO, env=_env(), capture_output=True, text=True,
                           timeout=600)
  assert resumed.returncode == 0 and "resumed from step" in resumed.stdout, resumed.stderr[-3000:]
  _, err = run_straight.communicate(timeout=600)
  assert run_straight.returncode == 0, err[-3000:]
  _assert_same_run(straight, killed)
