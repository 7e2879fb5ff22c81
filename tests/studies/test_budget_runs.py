"""ksjax/studies/budget_runs.py (a study's --budget in the published-run layout): the shortened
runs' measurements projected onto the decisive study's registered design, and a bad request
refused in one line before anything runs."""

import pytest
from tests import support
from tests.experiments import test_decisive_study as helpers

from ksjax.studies import budget_runs as budget
from ksjax.studies import registered


def test_the_budget_projects_shortened_runs_onto_the_registered_design():
  study = support.load_module(helpers.SCRIPT, "ksjax_experiments_decisive_study").STUDY
  d = registered.design(study, study.load_registration())
  measured = {"arms": {"mean": {"cpu": 40.0, "loop_cpu_by_step": [10.0, 20.0, 30.0]}},
              "eval": {"wall": 100.0, "sampling_seconds": 80.0, "cpu": 150.0, "samples": 100},
              "ladder": {"wall": 50.0, "sampling_seconds": 40.0, "cpu": 50.0, "samples": 100}}
  p = budget.projection(d, measured)
  # Start-up: the call's CPU at its rate outside sampling; then CPU-s per sample.
  assert (p["eval_startup"], p["eval_per_sample"]) == pytest.approx((30.0, 1.2))
  assert (p["ladder_startup"], p["ladder_per_sample"]) == pytest.approx((10.0, 0.4))
  # 12 steps: start-up 10, the first step 10, 11 more at 10; one call for the 3 checkpoints of
  # 160 x 16 samples; the ladder's 32 x 64.
  run = 10 + 10 + 11 * 10 + 30 + 3 * 2560 * 1.2 + 10 + 2048 * 0.4
  assert p["matched_steps_run"] == pytest.approx({a: run for a in (
      "mean", "pass_at_k", "biased_pass_at_k", "majority_vote")})
  assert p["equal_cpu_run"] == pytest.approx(10 + 12 * 60 + 30 + 2560 * 1.2)
  assert p["start"] == pytest.approx(30 + 2560 * 1.2 + 10 + 2048 * 0.4)
  assert p["cpu_hours"] * 3600 == pytest.approx(32 * run + 8 * p["equal_cpu_run"] + p["start"])


def test_the_budget_measures_only_matched_steps_arms_and_at_least_two_steps(tmp_path):
  study = support.load_module(helpers.SCRIPT, "ksjax_experiments_decisive_study").STUDY
  d = registered.design(study, study.load_registration())
  for arms, steps in ((["mean_cpu"], 3), (["mean"], 1), ([], 3)):
    with pytest.raises(SystemExit, match="are not accepted for the budget"):
      budget.measure(study, d, str(tmp_path / "runs"), arms, steps, 4, 1)
  assert not (tmp_path / "runs").exists()  # refused before anything ran or was written
