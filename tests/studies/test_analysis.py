"""ksjax.studies' pure parts: values along a curve, the statements' per-seed values, the
registration's verdicts, provenance and the dirty-tree refusal."""

import json
import subprocess

import numpy as np
import pytest

from ksjax.evaluation import preregistration
from ksjax.studies import analysis
from ksjax.studies import store
from ksjax.studies import StudyError


def test_at_kl_interpolates_along_the_curve():
  kl, values = [0.0, 1.0, 3.0], [0.2, 0.4, 0.8]
  assert analysis.at_kl(kl, values, 0.5) == pytest.approx(0.3)
  assert analysis.at_kl(kl, values, 2.0) == pytest.approx(0.6)
  assert analysis.at_kl(kl, values, 3.0) == pytest.approx(0.8)
  assert np.isnan(analysis.at_kl(kl, values, 3.5))


def _data(seeds=8):
  """Two arms' per-seed final values and curves, one machine; pass@k above the mean at pass@4 on
  every seed by 0.05 with seed noise, the mean above at pass@1."""
  rng = np.random.default_rng(0)
  noise = lambda: list(rng.normal(0.0, 0.01, seeds))
  final = {"mean": {"pass@1": 0.3 + np.array(noise()), "pass@4": 0.5 + np.array(noise()),
                    "pass@64": 0.9 + np.array(noise())},
           "pass_at_k": {"pass@1": 0.25 + np.array(noise()), "pass@4": 0.55 + np.array(noise()),
                         "pass@64": 0.9 + np.array(noise())}}
  final = {arm: {m: list(v) for m, v in values.items()} for arm, values in final.items()}
  curve = lambda kl, p4: {"kl": [0.0, kl], "metrics": {"pass@4": [0.3, p4]}}
  return {"final": final,
          "curves": {"mean": [curve(2.0, 0.7)] * seeds, "pass_at_k": [curve(1.0, 0.8)] * seeds},
          "seeds": {arm: list(range(seeds)) for arm in final},
          "machines": {arm: ["cpu A"] * seeds for arm in final}}


def _prereg(tmp_path, primary, secondary=()):
  path = tmp_path / "prereg.json"
  path.write_text(json.dumps({
      "study": "t", "seeds": list(range(8)), "arms": {"mean": "", "pass_at_k": ""},
      "decision_rule": {"test": "paired_t", "alpha": 0.05, "correction": "holm"},
      "primary": list(primary), "secondary": list(secondary)}))
  return preregistration.load(str(path))


def test_statement_values_read_the_last_checkpoint_and_the_measured_kl_curve(tmp_path):
  prereg = _prereg(tmp_path, [
      {"id": "P1", "text": "", "a": "pass_at_k", "b": "mean", "metric": "pass@4"}], [
      {"id": "S1", "text": "", "a": "pass_at_k", "b": "mean", "metric": "pass@4", "at": "kl"},
      {"id": "S2", "text": "", "a": "pass_at_k", "b": "mean", "metric": "maj@4"}])
  data = _data()
  values, left_out = analysis.statement_values(prereg, data)
  assert values["P1"] == (data["final"]["pass_at_k"]["pass@4"], data["final"]["mean"]["pass@4"])
  # at KL 1.0 (the smallest final KL) the mean's curve is halfway: 0.3 + (0.7 - 0.3) / 2
  np.testing.assert_allclose(values["S1"][1], [0.5] * 8)
  np.testing.assert_allclose(values["S1"][0], [0.8] * 8)
  assert "S2" not in values and left_out == {}  # not measured: the report says so
  data["machines"]["mean"][3] = "cpu B"
  values, left_out = analysis.statement_values(prereg, data)
  assert len(values["P1"][0]) == 7 and list(left_out["P1"]) == [3]


def test_matched_kl_per_seed_reads_each_seed_at_the_kl_its_two_runs_reach(tmp_path):
  prereg = _prereg(tmp_path, [
      {"id": "P1", "text": "", "a": "pass_at_k", "b": "mean", "metric": "pass@4", "at": "kl"}])
  data = _data(seeds=2)
  curve = lambda kl, p4: {"kl": [0.0, kl], "metrics": {"pass@4": [0.3, p4]}}
  # Seed 0's runs reach KL 1.0 and 2.0, seed 1's 3.0 and 4.0 (pass@4 0.3 at KL 0).
  data["curves"] = {"pass_at_k": [curve(1.0, 0.5), curve(3.0, 0.9)],
                    "mean": [curve(2.0, 0.7), curve(4.0, 0.7)]}
  one, _ = analysis.statement_values(prereg, data)  # every seed at KL 1.0
  np.testing.assert_allclose(one["P1"], [[0.5, 0.3 + 0.6 / 3], [0.5, 0.3 + 0.4 / 4]])
  per_seed, _ = analysis.statement_values(prereg, data, kl_match="seed")  # 1.0, then 3.0
  np.testing.assert_allclose(per_seed["P1"], [[0.5, 0.9], [0.5, 0.3 + 0.4 * 3 / 4]])


def test_a_run_that_touched_two_machines_pairs_with_neither():
  data = {"seeds": {"a": [0, 1], "b": [0, 1]},
          "machines": {"a": [["cpu A"], ["cpu A", "cpu B"]], "b": ["cpu A", "cpu B"]}}
  used, left_out = analysis.paired_seeds(data, "a", "b", [0, 1])
  assert used == [0] and left_out == {1: "a ran on cpu A; cpu B, b on cpu B"}


def test_the_verdicts_are_paired_over_seeds_with_holm(tmp_path):
  from scipy import stats
  prereg = _prereg(tmp_path, [
      {"id": "P1", "text": "", "a": "pass_at_k", "b": "mean", "metric": "pass@4"},
      {"id": "P2", "text": "", "a": "pass_at_k", "b": "mean", "metric": "pass@1"},
      {"id": "P3", "text": "", "a": "pass_at_k", "b": "mean", "metric": "pass@64"}])
  data = _data()
  values, _ = analysis.statement_values(prereg, data)
  rows = {r["id"]: r for r in preregistration.judge(prereg, values)}
  a, b = data["final"]["pass_at_k"]["pass@4"], data["final"]["mean"]["pass@4"]
  assert rows["P1"]["p_value"] == pytest.approx(stats.ttest_rel(a, b).pvalue)
  assert rows["P1"]["verdict"].startswith("supported: pass_at_k above mean")
  assert rows["P2"]["verdict"].startswith("supported: pass_at_k below mean")
  assert rows["P3"]["verdict"].startswith("not supported")


def test_provenance_is_the_commit_that_made_the_runs(tmp_path, monkeypatch):
  """A study directory without runs takes the current commit; a resumed study keeps its first
  commit and machine and lists the others."""
  head = {"rev-parse": "a" * 40, "status": ""}
  monkeypatch.setattr(store, "git", lambda root, *args: head[args[0]])
  monkeypatch.setattr(store.machine, "describe", lambda: "cpu A")
  (tmp_path / "provenance.json").write_text(json.dumps({"commit": "0" * 40}))
  (tmp_path / "timing.json").write_text(json.dumps({"runs": 5498.3}))
  store.record_provenance(str(tmp_path), str(tmp_path))
  read = lambda: json.loads((tmp_path / "provenance.json").read_text())
  assert read() == {"commit": "a" * 40, "uncommitted_changes": False, "machine": "cpu A"}
  assert not (tmp_path / "timing.json").exists()  # the new study's times start from zero
  (tmp_path / "runs").mkdir()
  head["rev-parse"] = "b" * 40
  store.record_provenance(str(tmp_path), str(tmp_path))
  store.record_provenance(str(tmp_path), str(tmp_path))
  monkeypatch.setattr(store.machine, "describe", lambda: "cpu B")
  store.record_provenance(str(tmp_path), str(tmp_path))
  assert read() == {"commit": "a" * 40, "uncommitted_changes": False, "machine": "cpu A",
                    "resumed_at": ["b" * 40], "resumed_on": ["cpu B"]}


def test_a_session_that_runs_refuses_a_dirty_tree_but_not_its_own_outputs(tmp_path):
  def git(*args):
    subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=test@example.com", *args],
                   cwd=tmp_path, check=True, capture_output=True)
  (tmp_path / "code.py").write_text("a = 1\n")
  (tmp_path / "results").mkdir()
  (tmp_path / "results" / "table.md").write_text("old\n")
  git("init", "-q")
  git("add", ".")
  git("commit", "-q", "-m", "start")
  (tmp_path / "results" / "table.md").write_text("new\n")  # a resumed study's own output
  (tmp_path / "notes.txt").write_text("untracked\n")
  store.refuse_dirty_tree(str(tmp_path), str(tmp_path / "results"), "t")
  (tmp_path / "code.py").write_text("a = 2\n")
  with pytest.raises(StudyError, match=r"uncommitted changes to 1 tracked file\(s\) \(code.py\)"):
    store.refuse_dirty_tree(str(tmp_path), str(tmp_path / "results"), "t")


def test_a_study_sent_to_slurm_does_not_name_the_login_node_as_its_machine(tmp_path, monkeypatch):
  monkeypatch.setattr(store.machine, "describe", lambda: "login node")
  store.record_provenance(str(tmp_path), str(tmp_path), None)
  assert json.loads((tmp_path / "provenance.json").read_text())["machine"] == store.SLURM_MACHINE
