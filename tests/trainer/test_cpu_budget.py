"""config.max_cpu_minutes: a run stops after the step that spends its CPU budget, checkpoints,
saves and evaluates its final policy as at num_steps; a resumed run continues the budget from its
step log; a bad value is refused.

The budget tests replace the trainer's CPU clock by one that advances 30 s per reading (the loop
reads it once when the steps begin and once after each step), so where a run stops does not
depend on the machine.
"""

import os

import pytest

from ksjax.config_validation import ConfigError
from ksjax.run import spec as spec_lib
from ksjax.run.directory import RunDirectory
from ksjax.trainer import loop, metrics
from tests.trainer.test_run import _tiny_config

EVAL = {"eval.at_end": True, "eval.num_samples": 2, "eval.ks": (1, 2), "eval.num_prompts": 2,
        "eval.batch_prompts": 2}


@pytest.fixture
def clock(monkeypatch):
  """loop.cpu_seconds reads 30, 60, 90, ... CPU seconds."""
  readings = iter(range(30, 10_000, 30))
  monkeypatch.setattr(loop, "cpu_seconds", lambda: float(next(readings)))


def _logged(workdir):
  lines = metrics.read_jsonl(RunDirectory(workdir).metrics_jsonl)
  return [(line["step"], line["time/cpu_seconds"]) for line in lines]


def test_a_budget_stops_the_run_after_the_step_that_spends_it(tmp_path, clock, capsys):
  workdir = tmp_path / "run"
  loop.run(_tiny_config(workdir, num_steps=10, max_cpu_minutes=1.0, **EVAL))
  # The clock starts at 30 s: step 1 ends at 30 s used, step 2 at 60 s = the budget.
  assert _logged(workdir) == [(1, 30.0), (2, 60.0)]
  assert "CPU budget spent: 1.00 of 1.0 CPU-minutes after step 2" in capsys.readouterr().out
  assert 2 in [int(d) for d in os.listdir(workdir / "checkpoints")]
  assert os.path.isdir(workdir / "final") and os.path.isfile(workdir / "eval_end.json")


def test_a_resumed_run_continues_its_budget(tmp_path, clock, capsys):
  workdir = tmp_path / "run"
  loop.run(_tiny_config(workdir, num_steps=10, max_cpu_minutes=1.0, log_every=4))
  final = os.path.getmtime(workdir / "final")
  # With log_every=4 the checkpointed steps 1 and 2 are logged all the same (the resume reads
  # the CPU time there).
  assert _logged(workdir) == [(1, 30.0), (2, 60.0)]
  # The same budget on resume: it is spent already, so no step runs.
  loop.run(_tiny_config(workdir, num_steps=10, max_cpu_minutes=1.0, resume=True))
  assert "was spent by step 2: no more steps" in capsys.readouterr().out
  assert _logged(workdir) == [(1, 30.0), (2, 60.0)]
  # Twice the budget: 60 s more, two steps (counted from 60 s, not from 0, which would be four).
  loop.run(_tiny_config(workdir, num_steps=10, max_cpu_minutes=2.0, resume=True))
  assert _logged(workdir) == [(1, 30.0), (2, 60.0), (3, 90.0), (4, 120.0)]
  assert os.path.getmtime(workdir / "final") > final  # the final policy is step 4's


def test_a_real_budget_of_a_fraction_of_a_second_stops_after_one_step(tmp_path):
  workdir = tmp_path / "run"
  loop.run(_tiny_config(workdir, num_steps=5, max_cpu_minutes=1e-4))
  (step, used), = _logged(workdir)
  assert step == 1 and used > 1e-4 * 60


def test_no_budget_runs_every_step_and_logs_cpu_time(tmp_path):
  workdir = tmp_path / "run"
  loop.run(_tiny_config(workdir, num_steps=3, max_cpu_minutes=0.0))
  used = [seconds for _, seconds in _logged(workdir)]
  assert len(used) == 3 and 0 < used[0] < used[1] < used[2]


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), "3"])
def test_a_bad_budget_is_refused_in_one_line(tmp_path, value):
  config = _tiny_config(tmp_path / "run")
  with config.ignore_type():
    config.max_cpu_minutes = value
  with pytest.raises(ConfigError, match=r"config\.max_cpu_minutes=") as error:
    spec_lib.from_config(config)
  assert "\n" not in str(error.value)
