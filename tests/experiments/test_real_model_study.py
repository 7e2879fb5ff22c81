"""experiments/real_model_study.py: the runs' order and flags, the report from evaluation records
(table, statements, robustness over seeds, partial reports), the refusal of uncommitted code, and
(slow) the whole pipeline on the tiny model, resumed by a second call that runs nothing."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from tests import support

from ksjax import files
from ksjax.evaluation import results
from ksjax.run import checkpoints
from ksjax.run.directory import RunDirectory

SCRIPT = os.path.join(str(support.REPO), "experiments", "real_model_study.py")


@pytest.fixture(scope="module")
def study():
  return support.load_module(SCRIPT, "ksjax_experiments_real_model_study")


def test_runs_are_seed_major_with_one_budget_and_no_trainer_evaluation(study):
  order = study.runs_of(["mean", "pass_at_k"], [0, 1])
  assert order == [("mean", 0), ("pass_at_k", 0), ("mean", 1), ("pass_at_k", 1)]
  flags = {v: study.train_overrides(v, 2, quick=False) for v in study.VARIANTS}
  for variant, given in flags.items():
    assert f"--config.max_cpu_minutes={study.CPU_MINUTES}" in given
    assert "--config.seed=2" in given and "--config.eval.at_end=False" in given
    assert ("--config.dynamic_sampling=True" in given) == (variant == "pass_at_k_dynamic")
  assert "--config.baseline=loo_demeaned" in flags["biased_pass_at_k"]
  assert "--config.aggregator=mean" in flags["mean"]


def _record(step, pass_at, kl, levels=(1, 2)):
  """An evaluation record with the given pass@k (k = 1, 4) and KL, equal on every level."""
  metrics = {"pass@1": pass_at[0], "pass@4": pass_at[1], "maj@4": pass_at[0],
             "answer_entropy": 0.5, "kl_k1": kl, "kl_k3": kl}
  return {"step": step, "metrics": metrics,
          "groups": {f"level={l}": {"num_problems": 1, **metrics} for l in levels}}


def _fake_run(runs_dir, name, step, record, start=None, eval_record=True):
  """A finished run in `runs_dir` as the trainer and the eval binary leave it; its first attempt
  on machine 'cpu A', a resumed one of seed 1's pass@k run on 'cpu B'."""
  run = RunDirectory(os.path.join(runs_dir, name))
  os.makedirs(run.final_dir)
  os.makedirs(run.step_dir(step))
  os.makedirs(study_eval := os.path.join(runs_dir, name, "eval_study"))
  for r in ([start] if start else []) + ([record] if eval_record else []):
    results.save_step(study_eval, {**r, "checkpoint": run.step_dir(r["step"])})
  if eval_record:
    files.write_json(os.path.join(study_eval, "commits.json"), ["b" * 40])
  files.write_text(run.metrics_jsonl, json.dumps({"step": step, "time/cpu_seconds": 700.0}) + "\n")
  files.write_json(run.config_json, {"workdir": run.workdir})
  attempts = [{"wall_seconds": 60.0, "commit": "a" * 40, "machine": "cpu A"}]
  if name == "pass_at_k_s1":
    attempts.append({"wall_seconds": 30.0, "commit": "a" * 40, "machine": "cpu B"})
  files.write_json(os.path.join(run.workdir, "attempts.json"), attempts)


def test_the_report_checks_statements_over_seeds_and_says_when_partial(study, tmp_path,
                                                                        monkeypatch):
  monkeypatch.setattr(study, "EVAL", {**study.EVAL, "ks": (1, 4)})
  runs, out = str(tmp_path / "runs"), str(tmp_path / "out")
  start = _record(0, (0.2, 0.5), 0.0)
  # mean: pass@1 up, pass@4 flat; pass@k: pass@4 up on both seeds, pass@1 up less.
  _fake_run(runs, "mean_s0", 20, _record(20, (0.40, 0.50), 2.0), start=start)
  _fake_run(runs, "mean_s1", 18, _record(18, (0.44, 0.52), 2.4))
  _fake_run(runs, "pass_at_k_s0", 30, _record(30, (0.30, 0.70), 1.0))
  _fake_run(runs, "pass_at_k_s1", 31, _record(31, (0.32, 0.66), 1.2))
  variants = ["mean", "pass_at_k"]
  for name in ("mean_s0", "mean_s1", "pass_at_k_s0", "pass_at_k_s1"):
    assert study.finished_seeds(out, variants, [0, 1, 2]) == (
        [0] if name == "pass_at_k_s1" else [])
    study.publish(runs, out, name)
  assert study.finished_seeds(out, variants, [0, 1, 2]) == [0, 1]
  shutil.rmtree(runs)  # the report reads only what was published (a new machine has no runs)
  table = study.status(out, variants, [0, 1, 2]).splitlines()
  assert [line.split(" | ")[0] for line in table[2:]] == [
      "| start", "| mean_s0", "| pass_at_k_s0", "| mean_s1", "| pass_at_k_s1"]
  assert "| mean_s0 | 20 | 11.7 | 0.400 | 0.500 |" in table[3]
  study.report(out, variants, [0, 1], quick=False, partial=True)
  readme = open(os.path.join(out, "README.md"), encoding="utf-8").read()
  assert "**Partial:**" in readme
  assert "| mean (RLOO) | 18–20 | 0.420 ± 0.028 | 0.510 ± 0.014 |" in readme
  assert "| pass@k | 30–31 | 0.310 ± 0.014 | 0.680 ± 0.028 |" in readme
  assert "seed 0: cpu A; seed 1: cpu A, cpu B" in readme  # each seed's machines
  summary = json.load(open(os.path.join(out, "summary.json"), encoding="utf-8"))
  claims = {c["claim"]: c for c in summary["claims"]}
  raise_k = claims["training for pass@k raises pass@4 more than training for the mean"]
  assert raise_k["difference"] == pytest.approx(0.17)
  assert raise_k["verdict"] == "reproduces" and raise_k["seeds_holding"] == 2
  kl = next(c for c in summary["claims"] if "final KL" in c["claim"])
  assert "at the same CPU budget" in kl["claim"] and kl["seeds_holding"] == 2
  assert summary["steps"] == {"mean": [20, 18], "pass_at_k": [30, 31]}
  # Published files name no path of the machine that ran them.
  config = json.load(open(os.path.join(out, "mean_s1", "config.json"), encoding="utf-8"))
  assert config["workdir"] == os.path.join("<runs_dir>", "mean_s1")
  end = json.load(open(os.path.join(out, "mean_s1", "eval_end.json"), encoding="utf-8"))
  assert end["checkpoint"] == os.path.join("<runs_dir>", "mean_s1", "checkpoints", "18")
  # From one seed nothing is called a result.
  study.report(out, variants, [0], quick=False, partial=True)
  one = json.load(open(os.path.join(out, "summary.json"), encoding="utf-8"))
  assert {c["verdict"] for c in one["claims"]} == {"one seed: no standard error, not tested"}
  provenance = json.load(open(os.path.join(out, "provenance.json"), encoding="utf-8"))
  assert provenance["evaluations"]["mean_s0"] == ["b" * 40]


def test_published_runs_are_not_run_again_where_the_runs_are_gone(study, tmp_path, monkeypatch):
  """A session's machine is replaced when it ends: the study continues from the published
  (committed) runs, training and evaluating only the others; the start is evaluated once."""
  runs, out = str(tmp_path / "runs"), str(tmp_path / "out")
  _fake_run(runs, "mean_s0", 20, _record(20, (0.40, 0.50), 2.0), start=_record(0, (.2, .5), 0.0))
  study.publish(runs, out, "mean_s0")
  shutil.rmtree(runs)
  trained, evaluated = [], []

  def train(name, runs_dir, **unused):
    trained.append(name)
    _fake_run(runs_dir, name, 30, _record(30, (0.3, 0.7), 1.0), eval_record=False)

  def evaluate(runs_dir, name, *, include_start, quick):
    del quick
    evaluated.append((name, include_start))
    results.save_step(study.eval_dir(runs_dir, name), _record(30, (0.3, 0.7), 1.0))
    files.write_json(os.path.join(study.eval_dir(runs_dir, name), "commits.json"), ["c" * 40])

  monkeypatch.setattr(study.real_model(), "run_config", train)
  monkeypatch.setattr(study, "evaluate", evaluate)
  study.run_study(runs, out, ["mean", "pass_at_k"], [0], quick=False)
  assert trained == ["pass_at_k_s0"] and evaluated == [("pass_at_k_s0", False)]
  assert study.published(out, "pass_at_k_s0") and study.finished_seeds(out, ["mean",
                                                                            "pass_at_k"], [0])
  study.run_study(runs, out, ["mean", "pass_at_k"], [0], quick=False)  # nothing left to run
  assert trained == ["pass_at_k_s0"]


def test_pruning_keeps_only_the_last_checkpoint(study, tmp_path):
  run = RunDirectory(str(tmp_path / "runs" / "mean_s0"))
  for step in (2, 10, 14):
    os.makedirs(os.path.join(run.step_dir(step), "state"))
  os.makedirs(run.start_dir)
  assert checkpoints.steps(run) == [2, 10, 14]
  study.prune_checkpoints(str(tmp_path / "runs"), "mean_s0")
  assert checkpoints.steps(run) == [14]
  assert os.path.isdir(run.start_dir)  # the start policy stays: it is evaluated as step 0
  study.prune_checkpoints(str(tmp_path / "runs"), "mean_s0")  # nothing more to prune
  assert checkpoints.steps(run) == [14]


def test_uncommitted_code_is_refused_before_any_run(study, tmp_path, monkeypatch):
  monkeypatch.setattr(study.real_model(), "_dirty", lambda: True)
  monkeypatch.setattr(sys, "argv", ["real_model_study.py", f"--runs_dir={tmp_path / 'runs'}",
                                    f"--out={tmp_path / 'out'}"])
  with pytest.raises(SystemExit, match="uncommitted changes"):
    study.main()
  assert not os.path.exists(tmp_path / "runs")


@pytest.mark.slow  # two trainer and two eval-binary processes: about two minutes on two cores
def test_the_quick_study_runs_end_to_end_and_a_second_call_runs_nothing(tmp_path):
  command = [sys.executable, SCRIPT, "--quick", "--variants=mean,pass_at_k", "--seeds=0",
             f"--runs_dir={tmp_path / 'runs'}", f"--out={tmp_path / 'out'}"]
  first = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
  assert first.returncode == 0, first.stderr[-3000:]
  readme = (tmp_path / "out" / "README.md").read_text()
  assert "| mean (RLOO) |" in readme and "| pass@k |" in readme
  steps = {r["step"] for r in results.load_records(str(tmp_path / "runs" / "mean_s0" /
                                                       "eval_study"))}
  assert 0 in steps and len(steps) == 2  # the start and the last checkpoint
  # A finished, evaluated run keeps its last checkpoint, the one evaluated.
  for name in ("mean_s0", "pass_at_k_s0"):
    run = RunDirectory(str(tmp_path / "runs" / name))
    assert checkpoints.steps(run) == [max(r["step"] for r in results.load_records(
        str(tmp_path / "runs" / name / "eval_study")))]
  record = json.loads((tmp_path / "out" / "pass_at_k_s0" / "eval_end.json").read_text())
  assert "kl_k3" in record["metrics"] and record["sampling"]["kl_reference"] == "start"
  before = {p: os.path.getmtime(p) for p in (tmp_path / "runs").rglob("*.json")
            if "eval_study" in str(p) or p.name == "attempts.json"}
  second = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
  assert second.returncode == 0, second.stderr[-3000:]
  assert "ksjax.main" not in second.stdout and "ksjax.eval" not in second.stdout
  assert {p: os.path.getmtime(p) for p in before} == before
  # On a new machine (no runs directory) the published runs are all it needs: nothing runs.
  readme = (tmp_path / "out" / "README.md").read_text()
  shutil.rmtree(tmp_path / "runs")
  third = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
  assert third.returncode == 0, third.stderr[-3000:]
  assert "ksjax.main" not in third.stdout and "ksjax.eval" not in third.stdout
  assert (tmp_path / "out" / "README.md").read_text() == readme
