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


def test_compare_verdicts(tradeoff):
  clear = tradeoff.compare([0.6, 0.61, 0.59], [0.5, 0.51, 0.49])
  assert clear["verdict"] == "reproduces"
  assert clear["difference"] == pytest.approx(0.1)
  # se = sqrt(var_a / 3 + var_b / 3) with sample variances
  assert clear["standard_error"] == pytest.approx(np.sqrt(2 * np.var([0.6, 0.61, 0.59],
                                                                      ddof=1) / 3))
  assert tradeoff.compare([0.6, 0.4, 0.5], [0.45, 0.5, 0.49])["verdict"] == (
      "same direction, within noise")
  assert tradeoff.compare([0.4, 0.41], [0.5, 0.52])["verdict"] == "does not reproduce"
  # robustness: on how many seeds (same-seed pairs) the first is above the second
  assert {k: clear[k] for k in ("seeds_holding", "seeds")} == {"seeds_holding": 3, "seeds": 3}
  assert tradeoff.compare([0.6, 0.4, 0.5], [0.45, 0.5, 0.49])["seeds_holding"] == 2
  assert tradeoff.compare([1.0, 1.0], [1.0, 1.0])["verdict"].startswith("no difference")


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


def _final(pass1, pass10, kl, maj4=0.5, seeds=3):
  out = {"pass@1": [pass1] * seeds, "pass@4": [pass10] * seeds, "pass@10": [pass10] * seeds,
         "maj@4": [maj4] * seeds, "kl": [kl] * seeds,
         "level1/pass@10": [pass10] * seeds, "level3/pass@10": [pass10] * seeds}
  return {k: list(np.asarray(v) + np.asarray([0.0, 0.001, -0.001][:seeds])) for k, v in
          out.items()}


def test_claims_read_the_papers_direction(tradeoff):
  final = {"pg_mean": _final(0.6, 0.7, kl=2.0, maj4=0.6),
           "pg_pass_at_k": _final(0.5, 0.8, kl=1.0, maj4=0.5),
           "pg_biased_pass_at_k": _final(0.55, 0.75, kl=1.5),
           "pg_majority_vote": _final(0.55, 0.7, kl=1.0, maj4=0.7)}
  curve = lambda kl, p4: {"kl": [0.0, kl], "metrics": {"pass@4": [0.3, p4]}}
  curves = {"pg_mean": [curve(2.0, 0.7)] * 3, "pg_pass_at_k": [curve(1.0, 0.8)] * 3,
            "pg_biased_pass_at_k": [curve(1.5, 0.75)] * 3}
  found = tradeoff.claims(final, curves, "pg", 4, (1, 4, 10))
  verdicts = {c["claim"]: c["verdict"] for c in found}
  assert verdicts["training for pass@k raises pass@10 more than training for the mean"] == (
      "reproduces")
  assert verdicts["training for the mean gives the higher pass@1 (pass@k training pays for "
                  "its pass@k in pass@1)"] == "reproduces"
  kl_claim = next(c for c in found if c["claim"].startswith("pass@k is more KL-efficient"))
  # at KL 1.0 the mean's curve is at 0.3 + (0.7 - 0.3) / 2 = 0.5, pass@k's at 0.8
  assert kl_claim["b_mean"] == pytest.approx(0.5)
  assert kl_claim["a_mean"] == pytest.approx(0.8)
  assert verdicts["training for majority voting raises maj@4 more than training for the mean"] \
      == "reproduces"
  # Swap the roles: the same statements now fail.
  swapped = dict(final, pg_mean=final["pg_pass_at_k"], pg_pass_at_k=final["pg_mean"])
  verdicts = {c["claim"]: c["verdict"] for c in
              tradeoff.claims(swapped, curves, "pg", 4, (1, 4, 10))}
  assert verdicts["training for pass@k raises pass@10 more than training for the mean"] == (
      "does not reproduce")


def test_run_configs_share_budget_and_start(tradeoff):
  study = tradeoff.study_config()
  runs = tradeoff.runs_of(study)
  assert len(runs) == 6 * 2 * 3
  configs = [tradeoff.run_config(study, run) for run in runs]
  for run, config in zip(runs, configs):
    assert config.batch_prompts * (config.n or config.k) == 64
    assert config.init_checkpoint.endswith(os.path.join("runs", "start", "start"))
    assert config.num_steps == study.steps and config.k == study.k
    assert config.algorithm == run.algorithm and config.seed == run.seed
  pkpo = tradeoff.run_config(study, tradeoff.Run("pg", "pkpo_pass_at_k", 0))
  assert pkpo.n == 2 * study.k
  ppo = tradeoff.run_config(study, tradeoff.Run("ppo", "biased_majority_vote", 1))
  assert (ppo.aggregator, ppo.baseline, ppo.sparse_updates) == ("majority_vote",
                                                                 "loo_demeaned", False)


def _study(out, *extra):
  return subprocess.run(
      [sys.executable, SCRIPT, "--study.quick=True", f"--study.out={out}", *extra],
      capture_output=True, text=True, timeout=600, cwd=REPO, check=False)


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
