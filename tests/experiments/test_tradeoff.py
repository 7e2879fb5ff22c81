"""experiments/tradeoff.py: its analysis (pure functions) and a smoke run end to end with resume."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from tests import support

REPO = str(support.REPO)
SCRIPT = os.path.join(REPO, "experiments", "tradeoff.py")


@pytest.fixture(scope="module")
def tradeoff():
  name = "ksjax_experiments_tradeoff"
  if name not in sys.modules:
    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: its dataclasses look their module up
    spec.loader.exec_module(module)
  return sys.modules[name]


def test_at_kl_interpolates_along_the_curve(tradeoff):
  kl, values = [0.0, 1.0, 3.0], [0.2, 0.4, 0.8]
  assert tradeoff.at_kl(kl, values, 0.5) == pytest.approx(0.3)
  assert tradeoff.at_kl(kl, values, 2.0) == pytest.approx(0.6)
  assert tradeoff.at_kl(kl, values, 3.0) == pytest.approx(0.8)
  assert np.isnan(tradeoff.at_kl(kl, values, 3.5))


def test_kl_at_averages_the_window_before_the_checkpoint(tradeoff):
  rows = [{"step": s, "kl/k3": float(s)} for s in range(1, 11)]
  assert tradeoff.kl_at(rows, 0, 3) == 0.0
  assert tradeoff.kl_at(rows, 10, 3) == pytest.approx(9.0)  # steps 8, 9, 10
  assert tradeoff.kl_at(rows, 2, 5) == pytest.approx(1.5)


def _data(seeds=8):
  """Per-seed final values and curves of three arms; pass@k above the mean at pass@4 on every
  seed by 0.05 with seed noise, the mean above at pass@1."""
  rng = np.random.default_rng(0)
  noise = lambda: rng.normal(0.0, 0.01, seeds)
  final = {"pg_mean": {"pass@1": 0.3 + noise(), "pass@4": 0.5 + noise(), "pass@64": 0.9 + noise(),
                       "kl": 1.0 + noise()},
           "pg_pass_at_k": {"pass@1": 0.25 + noise(), "pass@4": 0.55 + noise(),
                            "pass@64": 0.9 + noise(), "kl": 1.0 + noise()}}
  final = {arm: {m: list(v) for m, v in values.items()} for arm, values in final.items()}
  curve = lambda kl, p4: {"kl": [0.0, kl], "metrics": {"pass@4": [0.3, p4]}}
  curves = {"pg_mean": [curve(2.0, 0.7)] * seeds, "pg_pass_at_k": [curve(1.0, 0.8)] * seeds}
  return {"final": final, "curves": curves}


def _prereg(tmp_path, primary, secondary=()):
  from ksjax.evaluation import preregistration
  path = tmp_path / "prereg.json"
  path.write_text(json.dumps({
      "study": "t", "seeds": list(range(8)), "arms": {"mean": "", "pass_at_k": ""},
      "decision_rule": {"test": "paired_t", "alpha": 0.05, "correction": "holm"},
      "primary": list(primary), "secondary": list(secondary)}))
  return preregistration.load(str(path))


def test_statement_values_read_the_last_checkpoint_and_the_measured_kl_curve(tradeoff,
                                                                             tmp_path):
  prereg = _prereg(tmp_path, [
      {"id": "P1", "text": "", "a": "pass_at_k", "b": "mean", "metric": "pass@4"}], [
      {"id": "S1", "text": "", "a": "pass_at_k", "b": "mean", "metric": "pass@4", "at": "kl"},
      {"id": "S2", "text": "", "a": "pass_at_k", "b": "mean", "metric": "maj@4"}])
  data = _data()
  values = tradeoff.statement_values(prereg, data)
  assert values["P1"] == (data["final"]["pg_pass_at_k"]["pass@4"],
                          data["final"]["pg_mean"]["pass@4"])
  # at KL 1.0 (the smallest final KL) the mean's curve is halfway: 0.3 + (0.7 - 0.3) / 2
  np.testing.assert_allclose(values["S1"][1], [0.5] * 8)
  np.testing.assert_allclose(values["S1"][0], [0.8] * 8)
  assert "S2" not in values  # not measured: the report says so rather than inventing it


def test_the_report_judges_paired_over_seeds_with_holm(tradeoff, tmp_path):
  from scipy import stats
  from ksjax.evaluation import preregistration
  prereg = _prereg(tmp_path, [
      {"id": "P1", "text": "", "a": "pass_at_k", "b": "mean", "metric": "pass@4"},
      {"id": "P2", "text": "", "a": "pass_at_k", "b": "mean", "metric": "pass@1"},
      {"id": "P3", "text": "", "a": "pass_at_k", "b": "mean", "metric": "pass@64"}])
  data = _data()
  rows = {r["id"]: r for r in preregistration.judge(prereg,
                                                    tradeoff.statement_values(prereg, data))}
  a, b = data["final"]["pg_pass_at_k"]["pass@4"], data["final"]["pg_mean"]["pass@4"]
  assert rows["P1"]["p_value"] == pytest.approx(stats.ttest_rel(a, b).pvalue)
  assert rows["P1"]["verdict"].startswith("supported: pass_at_k above mean")
  assert rows["P2"]["verdict"].startswith("supported: pass_at_k below mean")
  assert rows["P3"]["verdict"].startswith("not supported")
  ps = [rows[i]["p_value"] for i in ("P1", "P2", "P3")]
  assert max(rows[i]["p_holm"] for i in ("P1", "P2", "P3")) >= max(ps)
  # Unregistered (a departure from the design, or a registration after the runs): nothing is
  # supported, whatever the p-value.
  exploratory = preregistration.judge(prereg, tradeoff.statement_values(prereg, data),
                                      registered=False)
  assert {r["verdict"] for r in exploratory} == {"exploratory (not pre-registered)"}


def test_a_study_with_other_settings_departs_from_its_registration(tradeoff):
  from ksjax.evaluation import preregistration
  prereg = preregistration.load(os.path.join(REPO, tradeoff.PREREGISTRATION))
  study = tradeoff.study_config()
  assert tradeoff.registered_design(study, prereg) == []
  study.seeds = (0, 1, 2)
  study.steps = 300
  departures = tradeoff.registered_design(study, prereg)
  assert len(departures) == 2 and departures[0].startswith("seeds=")


def test_run_configs_share_budget_and_start(tradeoff):
  study = tradeoff.study_config()
  runs = tradeoff.runs_of(study)
  assert len(runs) == 3 * 1 * 8
  configs = [tradeoff.run_config(study, run) for run in runs]
  for run, config in zip(runs, configs):
    assert config.batch_prompts * (config.n or config.k) == 64
    assert config.init_checkpoint.endswith(os.path.join("runs", "start", "start"))
    assert config.num_steps == study.steps and config.k == study.k
    assert config.algorithm == run.algorithm and config.seed == run.seed
  assert config.init_checkpoint.endswith(os.path.join("runs", "start", "start"))
  pkpo = tradeoff.run_config(study, tradeoff.Run("pg", "pkpo_pass_at_k", 0))
  assert pkpo.n == 2 * study.k
  ppo = tradeoff.run_config(study, tradeoff.Run("ppo", "biased_majority_vote", 1))
  assert (ppo.aggregator, ppo.baseline, ppo.sparse_updates) == ("majority_vote",
                                                                 "loo_demeaned", False)


def _study(out, *extra):
  return subprocess.run(
      [sys.executable, SCRIPT, "--study.quick=True", f"--study.out={out}", *extra],
      capture_output=True, text=True, timeout=600, cwd=REPO, check=False)


# Slow: the decisive study's quick run (tests/experiments/test_decisive_study.py) is the default
# suite's end-to-end study through the same mechanics; this file's unit tests keep the report's.
@pytest.mark.slow
def test_smoke_study_writes_everything_and_resumes(tmp_path):
  out = tmp_path / "study"
  first = _study(out)
  assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
  for name in ("README.md", "table.md", "summary.json", "metrics_vs_step.png",
               "metrics_vs_kl.png", "pass_at_k_vs_k.png", "timing.json", "provenance.json"):
    assert (out / name).is_file(), name
  summary = json.loads((out / "summary.json").read_text())
  head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                        check=False).stdout.strip()
  assert summary["provenance"]["commit"] == (head or None)
  assert set(summary["final"]) == {"pg_mean", "pg_pass_at_k"}
  assert len(summary["final"]["pg_mean"]["pass@1"]) == 2  # one value per seed
  curve = summary["curves"]["pg_mean"][0]
  # the start, the trainer's first step (Orbax saves a run's first step), then every 2 steps
  assert curve["steps"] == [0, 1, 2, 4] and curve["kl"][0] == 0.0
  assert "| policy gradient | mean |" in (out / "table.md").read_text()

  # An interrupted study: one run lost its evaluation and completion mark; the rest is kept.
  lost = out / "runs" / "pg_pass_at_k_s1"
  (lost / "study_done.json").unlink()
  kept = out / "runs" / "pg_mean_s0" / "study_done.json"
  kept_mtime = kept.stat().st_mtime_ns
  second = _study(out)
  assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
  assert "1 of 4 runs to train and evaluate" in second.stdout
  assert kept.stat().st_mtime_ns == kept_mtime
  again = json.loads((out / "summary.json").read_text())
  assert again["final"] == summary["final"]  # evaluation records reused, same numbers


def test_bad_variant_is_one_line_and_exit_2(tmp_path):
  result = _study(tmp_path / "bad", "--study.variants=mean,best_of_n")
  assert result.returncode == 2
  assert "best_of_n" in result.stderr and "expected variants" in result.stderr
  assert not (tmp_path / "bad").exists()


def test_a_study_refuses_a_dirty_tree_but_not_its_own_outputs(tradeoff, tmp_path, monkeypatch,
                                                               capsys):
  def git(*args):
    subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=test@example.com", *args],
                   cwd=tmp_path, check=True, capture_output=True)
  (tmp_path / "code.py").write_text("a = 1\n")
  (tmp_path / "results").mkdir()
  (tmp_path / "results" / "table.md").write_text("old\n")
  git("init", "-q")
  git("add", ".")
  git("commit", "-q", "-m", "start")
  monkeypatch.setattr(tradeoff, "REPO", str(tmp_path))
  study = tradeoff.study_config()
  study.out = str(tmp_path / "results")
  (tmp_path / "results" / "table.md").write_text("new\n")  # a resumed study's own output
  (tmp_path / "notes.txt").write_text("untracked\n")
  tradeoff.refuse_dirty_tree(study)
  (tmp_path / "code.py").write_text("a = 2\n")
  with pytest.raises(SystemExit) as exited:
    tradeoff.refuse_dirty_tree(study)
  assert exited.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "uncommitted changes to 1 tracked file(s) (code.py)" in err
  study.quick = True  # the smoke run is let through
  tradeoff.refuse_dirty_tree(study)


def test_the_modulus_reaches_every_run_with_room_for_its_solutions(tradeoff):
  study = tradeoff.study_config()
  default = tradeoff.start_config(study)
  assert default.synthetic.modulus == study.modulus
  study.modulus = 10
  assert tradeoff.start_config(study).max_new_tokens == 48  # the config's own: unchanged
  study.modulus = 100
  for config in (tradeoff.start_config(study),
                 tradeoff.run_config(study, tradeoff.Run("ppo", "mean", 0))):
    assert config.synthetic.modulus == 100
    assert config.max_new_tokens == 50  # a level-3 solution: 49 characters and its EOS


def test_provenance_is_the_commit_that_made_the_runs(tradeoff, tmp_path, monkeypatch):
  """A study directory holding an earlier study's report but no runs (the published results, to be
  regenerated) takes the current commit; a resumed study keeps its start commit and lists the
  commits it was resumed at."""
  head = {"rev-parse": "a" * 40, "status": ""}
  monkeypatch.setattr(tradeoff, "_git", lambda *args: head[args[0]])
  monkeypatch.setattr(tradeoff.machine, "describe", lambda: "cpu A")
  study = tradeoff.study_config()
  study.out = str(tmp_path)
  (tmp_path / "provenance.json").write_text(json.dumps({"commit": "0" * 40,
                                                        "uncommitted_changes": False}))
  (tmp_path / "timing.json").write_text(json.dumps({"runs": 5498.3}))
  tradeoff._record_provenance(study)  # pylint: disable=protected-access
  read = lambda: json.loads((tmp_path / "provenance.json").read_text())
  assert read() == {"commit": "a" * 40, "uncommitted_changes": False, "machine": "cpu A"}
  assert not (tmp_path / "timing.json").exists()  # the new study's times start from zero
  (tmp_path / "runs").mkdir()
  (tmp_path / "timing.json").write_text(json.dumps({"runs": 60.0}))
  tradeoff._record_provenance(study)  # pylint: disable=protected-access
  assert read() == {"commit": "a" * 40, "uncommitted_changes": False, "machine": "cpu A"}
  head["rev-parse"] = "b" * 40
  tradeoff._record_provenance(study)  # pylint: disable=protected-access
  tradeoff._record_provenance(study)  # pylint: disable=protected-access
  monkeypatch.setattr(tradeoff.machine, "describe", lambda: "cpu B")
  tradeoff._record_provenance(study)  # pylint: disable=protected-access
  assert read() == {"commit": "a" * 40, "uncommitted_changes": False, "machine": "cpu A",
                    "resumed_at": ["b" * 40], "resumed_on": ["cpu B"]}
  assert json.loads((tmp_path / "timing.json").read_text()) == {"runs": 60.0}  # a resume adds


def _published(out) -> dict:
  """The published files' contents, less what only measures time (wall time, seconds), with the
  output directory's own path written as OUT."""
  text = lambda name: (out / name).read_text().replace(str(out), "OUT")
  summary = json.loads(text("summary.json"))
  for key in ("timing", "runs"):
    summary.pop(key)
  readme = text("README.md")
  return {"summary": summary, "table": text("table.md"), "readme": readme[:readme.index("## Time")]}


@pytest.mark.slow
def test_a_study_killed_anywhere_publishes_what_an_uninterrupted_one_does(tmp_path):
  """SIGKILL during training (after a run's first checkpoint), during the eval binary (after
  its first record) and during publishing (between summary.json and README.md); each rerun
  resumes, and the last one publishes the same files as a study that was never stopped."""
  straight = tmp_path / "straight"
  assert _study(straight).returncode == 0
  stopped = tmp_path / "stopped"
  for phase in ("train", "eval", "publish"):
    killed = subprocess.run(
        [sys.executable, SCRIPT, "--study.quick=True", f"--study.out={stopped}"],
        capture_output=True, text=True, timeout=600, cwd=REPO, check=False,
        env={**os.environ, "KSJAX_STUDY_KILL": phase})
    assert killed.returncode != 0, (phase, killed.stdout[-2000:])
  assert not (stopped / "README.md").exists()  # the publish kill came before it
  final = _study(stopped)
  assert final.returncode == 0, final.stdout[-3000:] + final.stderr[-3000:]
  assert _published(stopped)["summary"]["final"] == _published(straight)["summary"]["final"]
  assert _published(stopped) == _published(straight)
