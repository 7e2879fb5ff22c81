"""ksjax.evaluation.preregistration: a study's statements are read from a committed file, judged
paired over seeds with Holm across the primary ones, and never called supported unless the file
was registered before the runs."""

import json
import subprocess

import numpy as np
import pytest
from scipy import stats

from ksjax.config_validation import ConfigError
from ksjax.evaluation import preregistration
from ksjax.evaluation import statistics

RULE = {"test": "paired_t", "alpha": 0.05, "correction": "holm"}
ARMS = {"mean": "mean training", "pass_at_k": "pass@4 training"}


def _write(tmp_path, **overrides):
  data = {"study": "s", "seeds": [0, 1, 2, 3], "arms": ARMS, "decision_rule": RULE,
          "primary": [{"id": "P1", "text": "t", "a": "pass_at_k", "b": "mean",
                       "metric": "pass@4"}], **overrides}
  path = tmp_path / "prereg.json"
  path.write_text(json.dumps(data))
  return str(path)


def test_the_committed_embedded_registration_loads():
  from tests import support
  prereg = preregistration.load(str(support.REPO / "experiments" / "preregistration"
                                    / "embedded_tradeoff.json"))
  assert len(prereg.seeds) >= 8 and [s.id for s in prereg.primary] == ["P1", "P2", "P3"]
  assert {s.metric for s in prereg.primary} == {"pass@4", "pass@1", "pass@64"}


@pytest.mark.parametrize("overrides, match", [
    ({"seeds": [0]}, "seeds"),
    ({"seeds": [0, 0]}, "seeds"),
    ({"decision_rule": {**RULE, "correction": "none"}}, "correction"),
    ({"decision_rule": {**RULE, "alpha": 1.5}}, "alpha"),
    ({"primary": []}, "primary"),
    ({"primary": [{"id": "P1", "text": "t", "a": "best", "b": "mean", "metric": "pass@4"}]},
     "arm 'best'"),
    ({"primary": [{"id": "P1", "text": "t", "a": "mean", "b": "pass_at_k", "metric": "pass@4",
                   "at": "end"}]}, "at='end'"),
    ({"secondary": [{"id": "P1", "text": "t", "a": "mean", "b": "pass_at_k",
                     "metric": "pass@1"}]}, "twice"),
    ({"arms": {**ARMS, "mean": {"seeds": [0]}}}, "arms.mean.seeds"),
    ({"arms": {**ARMS, "mean": {"seeds": [0, 7]}}}, "arms.mean.seeds"),
    ({"arms": {**ARMS, "mean": {"seeds": "0,1"}}}, "arms.mean.seeds"),
])
def test_a_bad_registration_is_one_line(tmp_path, overrides, match):
  with pytest.raises(ConfigError, match=match) as e:
    preregistration.load(_write(tmp_path, **overrides))
  assert "\n" not in str(e.value) and "prereg.json" in str(e.value)


def test_arms_may_run_fewer_seeds_and_a_statement_uses_the_seeds_both_ran(tmp_path):
  arms = {"mean": {"config": "c", "seeds": [3, 0, 1]}, "pass_at_k": "every seed",
          "biased": {"seeds": [2, 3]}}
  prereg = preregistration.load(_write(tmp_path, arms=arms, secondary=[
      {"id": "S1", "text": "t", "a": "biased", "b": "mean", "metric": "pass@4"}]))
  assert prereg.arm_seeds("pass_at_k") == (0, 1, 2, 3)
  assert prereg.arm_seeds("mean") == (3, 0, 1)
  primary, secondary = prereg.statements
  assert prereg.statement_seeds(primary) == (0, 1, 3)  # in the study's order
  assert prereg.statement_seeds(secondary) == (3,)


def test_a_file_that_is_not_json_is_one_line(tmp_path):
  path = tmp_path / "prereg.json"
  path.write_text("{'study': 1}")
  with pytest.raises(ConfigError, match="not JSON") as e:
    preregistration.load(str(path))
  assert "\n" not in str(e.value)


def test_primary_statements_are_holm_adjusted_and_secondary_ones_are_not(tmp_path):
  statement = lambda i, metric: {"id": i, "text": "t", "a": "pass_at_k", "b": "mean",
                                 "metric": metric}
  prereg = preregistration.load(_write(
      tmp_path, primary=[statement("P1", "pass@4"), statement("P2", "pass@1")],
      secondary=[statement("S1", "kl")]))
  a1, b1 = [0.61, 0.58, 0.63, 0.60], [0.55, 0.54, 0.56, 0.52]
  a2, b2 = [0.30, 0.31, 0.29, 0.35], [0.31, 0.29, 0.30, 0.33]
  rows = {r["id"]: r for r in preregistration.judge(
      prereg, {"P1": (a1, b1), "P2": (a2, b2), "S1": (a1, b1)})}
  p1, p2 = stats.ttest_rel(a1, b1).pvalue, stats.ttest_rel(a2, b2).pvalue
  assert rows["P1"]["p_value"] == pytest.approx(p1)
  adjusted, _ = statistics.holm([p1, p2])
  assert [rows["P1"]["p_holm"], rows["P2"]["p_holm"]] == pytest.approx(list(adjusted))
  assert rows["P1"]["verdict"].startswith("supported: pass_at_k above mean")
  assert rows["P2"]["verdict"].startswith("not supported")
  assert "p_holm" not in rows["S1"]  # secondary: uncorrected, and never "supported"
  assert rows["S1"]["verdict"].startswith("significant, uncorrected")
  assert rows["P1"]["seeds_positive"] == 4 and rows["P1"]["df"] == 3
  lo, hi = rows["P1"]["ci_low"], rows["P1"]["ci_high"]
  d = np.subtract(a1, b1)
  half = stats.t.ppf(0.975, 3) * d.std(ddof=1) / 2
  assert (lo, hi) == pytest.approx((d.mean() - half, d.mean() + half))


def test_unregistered_and_unmeasured_statements_are_never_supported(tmp_path):
  prereg = preregistration.load(_write(tmp_path))
  extra = preregistration.Statement("X1", "t", "pass_at_k", "mean", "pass@8")
  big = ([0.9, 0.91, 0.92, 0.93], [0.1, 0.11, 0.1, 0.12])
  rows = {r["id"]: r for r in preregistration.judge(prereg, {"X1": big}, [extra])}
  assert rows["P1"]["verdict"] == "not measured"
  assert rows["X1"]["kind"] == "exploratory" and "supported" not in rows["X1"]["verdict"]
  rows = preregistration.judge(prereg, {"P1": big}, registered=False)
  assert rows[0]["verdict"] == "exploratory (not pre-registered)"
  assert "| P1 | exploratory |" in preregistration.table(rows)


def _git(repo, *args):
  return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                        cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def test_registration_reads_from_git_whether_it_precedes_the_runs(tmp_path):
  repo = tmp_path
  _git(repo, "init", "-q")
  (repo / "code.py").write_text("a = 1\n")
  _git(repo, "add", "code.py")
  _git(repo, "commit", "-q", "-m", "code")
  before = _git(repo, "rev-parse", "HEAD")
  _write(repo)
  _git(repo, "add", "prereg.json")
  _git(repo, "commit", "-q", "-m", "register")
  registered = _git(repo, "rev-parse", "HEAD")
  (repo / "code.py").write_text("a = 2\n")
  _git(repo, "commit", "-q", "-am", "runs start here")
  run = _git(repo, "rev-parse", "HEAD")
  info = preregistration.registration(str(repo), "prereg.json", run)
  assert info["registered_at"] == registered and info["precedes"] is True
  line = preregistration.registration_line(info)
  assert registered[:7] in line and run[:7] in line and "precedes every run" in line
  # Runs made before the file existed: the order does not hold.
  assert preregistration.registration(str(repo), "prereg.json", before)["precedes"] is False
  # An amendment after the runs started breaks it too, and the report names it.
  _write(repo, seeds=[0, 1])
  _git(repo, "commit", "-q", "-am", "amend")
  amended = _git(repo, "rev-parse", "HEAD")
  info = preregistration.registration(str(repo), "prereg.json", run)
  assert info["precedes"] is False and info["changed_at"] == [amended]
  assert "DOES NOT PRECEDE" in preregistration.registration_line(info)
  never = preregistration.registration(str(repo), "other.json", run)
  assert never["registered_at"] is None and "not committed" in (
      preregistration.registration_line(never))
