"""TrainerRuns, the real studies' work, end to end through the library: the trade-off study's
declaration at smoke sizes (tests/studies/tiny_tradeoff.py) makes its start, trains and evaluates
two arms x two seeds with the trainer and the eval binary, reports, and after losing one run
remakes that run alone with the same numbers. Slow (about a minute and a half of compilation on a
2-core machine): the default suite runs the library's mechanics on the toy study
(test_studies.py) and the trade-off declaration's configs and regeneration
(tests/experiments/test_tradeoff.py)."""

import json
import shutil

import pytest
from tests import support

from ksjax.studies import cli
from ksjax.studies import declaration
from ksjax.studies import store

TINY = str(support.REPO / "tests" / "studies" / "tiny_tradeoff.py")


@pytest.mark.slow
def test_the_trade_off_declaration_at_smoke_sizes_runs_reports_and_remakes_a_lost_run(tmp_path,
                                                                                      capsys):
  study = declaration.load(TINY)
  out = tmp_path / "study"
  argv = ["--out", str(out), "--seeds", "0,1", "--arms", "mean,pass_at_k",
          "--engine", "submitit-debug", "--allow_dirty"]
  cli.main(study, TINY, argv)
  summary = json.loads((out / "summary.json").read_text())
  assert set(summary["final"]) == {"pg_mean", "pg_pass_at_k"}
  assert len(summary["final"]["pg_mean"]["pass@1"]) == 2  # one value per seed
  curve = summary["curves"]["pg_mean"][0]
  # the start, the trainer's first step (Orbax saves a run's first step), then every 2 steps
  assert curve["steps"] == [0, 1, 2, 4] and curve["kl"][0] == 0.0
  assert "| policy gradient | mean |" in (out / "table.md").read_text()
  assert "**Exploratory:**" in (out / "README.md").read_text()  # 2 of 8 seeds, 2 of 3 arms
  for name in ("pg_mean_s0", "pg_pass_at_k_s1"):
    assert store.read_mark(str(out), name)["machine"]
  lost = out / "runs" / "pg_pass_at_k_s1"
  shutil.rmtree(lost)
  kept = (out / "runs" / "pg_mean_s0" / store.MARK).stat().st_mtime_ns
  capsys.readouterr()
  cli.main(study, TINY, argv)
  assert "1 of 4 runs to train and evaluate" in capsys.readouterr().out
  assert (out / "runs" / "pg_mean_s0" / store.MARK).stat().st_mtime_ns == kept
  assert json.loads((out / "summary.json").read_text())["final"] == summary["final"]
