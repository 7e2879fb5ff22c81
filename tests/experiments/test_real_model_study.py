"""experiments/real_model_study.py: the runs' order and flags, the report from evaluation records
(table, statements tested paired by seed, partial reports, the measured KL, the matched-step
single runs, what changed between seeds), the refusal of uncommitted code, and (slow) the whole
pipeline on the tiny model, resumed by a second call that runs nothing. The study is its
declaration over ksjax/studies/equal_cpu.py, which these tests drive with the declaration's Spec."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from scipy import special
from scipy import stats
from tests import support

from ksjax import files
from ksjax.evaluation import results
from ksjax.evaluation import statistics
from ksjax.run import checkpoints
from ksjax.run.directory import RunDirectory
from ksjax.studies import equal_cpu as lib
from ksjax.studies import runs_dir as rd

SCRIPT = os.path.join(str(support.REPO), "experiments", "real_model_study.py")


@pytest.fixture(scope="module")
def study():
  return support.load_module(SCRIPT, "ksjax_experiments_real_model_study").STUDY


def test_runs_are_seed_major_with_one_budget_and_no_trainer_evaluation(study):
  order = lib.runs_of(["mean", "pass_at_k"], [0, 1])
  assert order == [("mean", 0), ("pass_at_k", 0), ("mean", 1), ("pass_at_k", 1)]
  flags = {v: lib.train_overrides(study, v, 2, quick=False) for v in study.variants}
  for variant, given in flags.items():
    assert f"--config.max_cpu_minutes={study.cpu_minutes}" in given
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


def test_the_report_checks_statements_over_seeds_and_says_when_partial(study, tmp_path):
  study = dataclasses.replace(study, evaluation={**study.evaluation, "ks": (1, 4)})
  runs, out = str(tmp_path / "runs"), str(tmp_path / "out")
  start = _record(0, (0.2, 0.5), 0.0)
  # mean: pass@1 up, pass@4 flat; pass@k: pass@4 up on both seeds, pass@1 up less.
  _fake_run(runs, "mean_s0", 20, _record(20, (0.40, 0.50), 2.0), start=start)
  _fake_run(runs, "mean_s1", 18, _record(18, (0.44, 0.52), 2.4))
  _fake_run(runs, "pass_at_k_s0", 30, _record(30, (0.30, 0.70), 1.0))
  _fake_run(runs, "pass_at_k_s1", 31, _record(31, (0.32, 0.66), 1.2))
  variants = ["mean", "pass_at_k"]
  for name in ("mean_s0", "mean_s1", "pass_at_k_s0", "pass_at_k_s1"):
    assert lib.finished_seeds(out, variants, [0, 1, 2]) == (
        [0] if name == "pass_at_k_s1" else [])
    lib.publish(study, runs, out, name)
  assert lib.finished_seeds(out, variants, [0, 1, 2]) == [0, 1]
  shutil.rmtree(runs)  # the report reads only what was published (a new machine has no runs)
  table = lib.status(study, out, variants, [0, 1, 2]).splitlines()
  assert [line.split(" | ")[0] for line in table[2:]] == [
      "| start", "| mean_s0", "| pass_at_k_s0", "| mean_s1", "| pass_at_k_s1"]
  assert "| mean_s0 | 20 | 11.7 | 0.400 | 0.500 |" in table[3]
  lib.report(study, out, variants, [0, 1], quick=False, partial=True)
  readme = open(os.path.join(out, "README.md"), encoding="utf-8").read()
  assert "**Partial:**" in readme
  assert "| mean (RLOO) | 18–20 | 0.420 ± 0.028 | 0.510 ± 0.014 |" in readme
  assert "| pass@k | 30–31 | 0.310 ± 0.014 | 0.680 ± 0.028 |" in readme
  assert "seed 0: cpu A; seed 1: cpu A, cpu B" in readme  # each seed's machines
  summary = json.load(open(os.path.join(out, "summary.json"), encoding="utf-8"))
  claims = {c["claim"]: c for c in summary["claims"]}
  raise_k = claims["training for pass@k raises pass@4 more than training for the mean"]
  assert raise_k["difference"] == pytest.approx(0.17)
  # Paired by seed: differences 0.20 and 0.14, so t = 0.17 / 0.03 with 1 degree of freedom.
  assert raise_k["a_values"] == [0.70, 0.66] and raise_k["b_values"] == [0.50, 0.52]
  assert raise_k["p_value"] == pytest.approx(stats.ttest_rel([0.70, 0.66], [0.50, 0.52]).pvalue)
  assert raise_k["verdict"] == "consistent in sign, not significant (p = 0.11)"
  assert raise_k["seeds_positive"] == 2 and raise_k["n"] == 2
  kl = next(c for c in summary["claims"] if "final KL" in c["claim"])
  assert "at the same CPU budget" in kl["claim"] and kl["seeds_positive"] == 2
  assert summary["pre_registered"] is False
  assert "not pre-registered" in readme and "reproduces" not in readme
  assert not any("reproduc" in c["verdict"] for c in summary["claims"])
  assert "two standard errors" not in readme
  assert ("| training for pass@k raises pass@4 more than training for the mean | 0.680 | 0.510 "
          "| +0.170 |") in readme
  assert summary["steps"] == {"mean": [20, 18], "pass_at_k": [30, 31]}
  # Published files name no path of the machine that ran them.
  config = json.load(open(os.path.join(out, "mean_s1", "config.json"), encoding="utf-8"))
  assert config["workdir"] == os.path.join("<runs_dir>", "mean_s1")
  end = json.load(open(os.path.join(out, "mean_s1", "eval_end.json"), encoding="utf-8"))
  assert end["checkpoint"] == os.path.join("<runs_dir>", "mean_s1", "checkpoints", "18")
  # From one seed nothing is called a result.
  lib.report(study, out, variants, [0], quick=False, partial=True)
  one = json.load(open(os.path.join(out, "summary.json"), encoding="utf-8"))
  assert {c["verdict"] for c in one["claims"]} == {"one seed: no paired test"}
  assert {c["p_value"] for c in one["claims"]} == {None} and one["power"] is None
  provenance = json.load(open(os.path.join(out, "provenance.json"), encoding="utf-8"))
  assert provenance["evaluations"]["mean_s0"] == ["b" * 40]


def test_statements_are_paired_by_seed_not_the_unpaired_rule(study, tmp_path):
  """Seeds far apart in level, with the same small gap on each: the paired test finds it, the old
  unpaired rule (difference of seed means over sqrt(var_a/n + var_b/n)) would not. The report's
  p, interval, Holm and power figures are scipy's and statistics.py's on the per-seed values."""
  study = dataclasses.replace(study, evaluation={**study.evaluation, "ks": (1, 4)})
  runs, out = str(tmp_path / "runs"), str(tmp_path / "out")
  mean, pass_k = [0.30, 0.50, 0.70], [0.35, 0.56, 0.74]
  for seed in range(3):
    _fake_run(runs, f"mean_s{seed}", 10, _record(10, (0.3, mean[seed]), 0.5 + seed),
              start=_record(0, (0.2, 0.25), 0.0) if seed == 0 else None)
    _fake_run(runs, f"pass_at_k_s{seed}", 20, _record(20, (0.2, pass_k[seed]), 1.0 + seed))
  for name in sorted(os.listdir(runs)):
    lib.publish(study, runs, out, name)
  lib.report(study, out, ["mean", "pass_at_k"], [0, 1, 2], quick=False, partial=False)
  summary = json.load(open(os.path.join(out, "summary.json"), encoding="utf-8"))
  readme = open(os.path.join(out, "README.md"), encoding="utf-8").read()
  claim = next(c for c in summary["claims"] if c["metric"] == "pass@4")
  assert claim["a_values"] == pass_k and claim["b_values"] == mean
  paired = stats.ttest_rel(pass_k, mean)
  assert claim["p_value"] == pytest.approx(paired.pvalue, rel=1e-12) and claim["p_value"] < 0.05
  assert stats.ttest_ind(pass_k, mean).pvalue > 0.5  # what an unpaired test would have said
  low, high = paired.confidence_interval(0.95)
  assert (claim["ci_low"], claim["ci_high"]) == (pytest.approx(low), pytest.approx(high))
  assert claim["seeds_positive"] == 3 and claim["differences"] == pytest.approx([.05, .06, .04])
  assert claim["verdict"].startswith("significant at 0.05 (p = ")
  assert "not pre-registered" in claim["verdict"]
  tested = [c["p_value"] for c in summary["claims"] if c["p_value"] is not None]
  assert [c["p_holm"] for c in summary["claims"]] == pytest.approx(
      list(statistics.holm(tested).adjusted))
  assert f"| +0.050 | [{low:+.3f}, {high:+.3f}] |" in readme
  assert "reproduces" not in readme and "standard error" not in readme
  # The power figures: at the pass@4 gap's between-seed sd.
  sd = np.std(np.subtract(pass_k, mean), ddof=1)
  assert summary["power"]["sd_of_differences"] == pytest.approx(sd)
  assert summary["power"]["minimum_detectable_effect"] == pytest.approx(
      statistics.minimum_detectable_effect(sd, 3, 0.8, 0.05))
  assert summary["power"]["seeds_needed"] == statistics.seeds_needed(0.06, sd, 0.8, 0.05)
  # No KL curve was measured: no statement at a common KL, each run's final KL and pass@4 instead.
  assert not any("KL-efficient" in c["claim"] for c in summary["claims"])
  assert "curves" not in summary and "no KL curve was measured" in readme
  assert "| pass@k | 1.00, 0.350 | 2.00, 0.560 | 3.00, 0.740 |" in readme
  # Seed 1's pass@k run was resumed on another machine, and the start evaluated on seed 0's.
  assert "## What changed for seed 1" in readme and "“cpu A”; “cpu B”" in readme
  assert "- **The start** (step 0) was evaluated once, with mean_s0" in readme


def test_the_committed_report_pairs_by_seed_and_says_what_changed_for_seed_2(study, tmp_path,
                                                                            monkeypatch):
  """The report regenerated from the committed study: each statement's values per seed are the
  runs' own end records in seed order, its p the paired t-test's; the matched-step single runs'
  gaps recomputed from their records, paired over problems; seed 2's machine, code and start."""
  out = str(tmp_path / "study")
  shutil.copytree(os.path.join(study.root, study.out), out)
  monkeypatch.setattr(lib, "figure", lambda *unused: None)
  lib.report(study, out, list(study.variants), list(study.seeds), quick=False, partial=False)
  summary = json.load(open(os.path.join(out, "summary.json"), encoding="utf-8"))
  readme = open(os.path.join(out, "README.md"), encoding="utf-8").read()
  end = lambda v, s: json.load(open(os.path.join(out, f"{v}_s{s}", "eval_end.json"),
                                    encoding="utf-8"))["metrics"]
  claim = next(c for c in summary["claims"] if c["claim"].startswith(
      "training for pass@k raises pass@4"))
  assert claim["a_values"] == [end("pass_at_k", s)["pass@4"] for s in study.seeds]
  assert claim["b_values"] == [end("mean", s)["pass@4"] for s in study.seeds]
  for c in summary["claims"]:
    assert c["p_value"] == pytest.approx(stats.ttest_rel(c["a_values"], c["b_values"]).pvalue)
  assert "consistent in sign, not significant (p = 0.22)" in claim["verdict"]
  assert summary["power"]["minimum_detectable_effect"] == pytest.approx(0.186, abs=5e-4)
  assert summary["power"]["seeds_needed"] == 10
  # The matched-step single runs: unbiased pass@4 per problem from the correct counts.
  def pass_at_4(path):
    record = json.load(open(path, encoding="utf-8"))
    n, c = record["num_samples"], np.asarray(record["num_correct"])
    return 1 - special.comb(n - c, 4) / special.comb(n, 4)
  rows = {row["directory"]: row for row in summary["matched_step"]}
  for directory, gap in (("real_model_matmul_bf16", -0.047), ("real_model", -0.095)):
    records = os.path.join(str(support.REPO), "experiments", "results", directory)
    a, b = (pass_at_4(os.path.join(records, f"smollm2_{arm}", "eval_end.json"))
            for arm in ("pass_at_k", "mean"))
    row = rows[f"experiments/results/{directory}"]["comparisons"]["pass@4"]
    assert row["difference"] == pytest.approx(a.mean() - b.mean()) == pytest.approx(gap, abs=5e-4)
    assert row["n"] == 32 and row["p_value"] == pytest.approx(stats.ttest_rel(a, b).pvalue)
  assert "single runs, one seed each" in readme and "| 32 problems | -0.047 |" in readme
  # Seed 2: another machine, another commit (and the sampler's commits between), the start not
  # evaluated there.
  section = readme[readme.index("## What changed for seed 2"):]
  assert "“AMD EPYC, 2 CPUs, avx2”" in section and "amx_bf16" in section
  assert "trained at 80abd13, 2d4223e, seeds 0 and 1 at 98cdaaf" in section
  assert "with mean_s0, at 98cdaaf" in section
  assert "not on seed 2's machine and not with seed 2's code" in section
  history = subprocess.run(["git", "cat-file", "-e", "98cdaaf^{commit}"], cwd=support.REPO,
                           capture_output=True, check=False).returncode == 0
  if history:
    assert "`git log --oneline 98cdaaf..80abd13 -- ksjax/sampling`: 5 commits" in section
    assert "- fdb93ff Sampler: one KV cache per prompt" in section


def test_published_runs_are_not_run_again_where_the_runs_are_gone(study, tmp_path, monkeypatch):
  """A session's machine is replaced when it ends: the study continues from the published
  (committed) runs, training and evaluating only the others; the start is evaluated once."""
  runs, out = str(tmp_path / "runs"), str(tmp_path / "out")
  _fake_run(runs, "mean_s0", 20, _record(20, (0.40, 0.50), 2.0), start=_record(0, (.2, .5), 0.0))
  lib.publish(study, runs, out, "mean_s0")
  shutil.rmtree(runs)
  trained, evaluated = [], []

  def train(root, runs_dir, name, *unused):
    trained.append(name)
    _fake_run(runs_dir, name, 30, _record(30, (0.3, 0.7), 1.0), eval_record=False)

  def evaluate(spec, runs_dir, name, *, include_start, quick):
    del spec, quick
    evaluated.append((name, include_start))
    results.save_step(lib.eval_dir(runs_dir, name), _record(30, (0.3, 0.7), 1.0))
    files.write_json(os.path.join(lib.eval_dir(runs_dir, name), "commits.json"), ["c" * 40])

  monkeypatch.setattr(rd, "train", train)
  monkeypatch.setattr(lib, "evaluate", evaluate)
  lib.run_study(study, runs, out, ["mean", "pass_at_k"], [0], quick=False)
  assert trained == ["pass_at_k_s0"] and evaluated == [("pass_at_k_s0", False)]
  assert lib.published(out, "pass_at_k_s0") and lib.finished_seeds(out, ["mean",
                                                                            "pass_at_k"], [0])
  lib.run_study(study, runs, out, ["mean", "pass_at_k"], [0], quick=False)  # nothing left to run
  assert trained == ["pass_at_k_s0"]


def test_pruning_keeps_only_the_last_checkpoint(study, tmp_path):
  run = RunDirectory(str(tmp_path / "runs" / "mean_s0"))
  for step in (2, 10, 14):
    os.makedirs(os.path.join(run.step_dir(step), "state"))
  os.makedirs(run.start_dir)
  assert checkpoints.steps(run) == [2, 10, 14]
  rd.prune_checkpoints(str(tmp_path / "runs"), "mean_s0")
  assert checkpoints.steps(run) == [14]
  assert os.path.isdir(run.start_dir)  # the start policy stays: it is evaluated as step 0
  rd.prune_checkpoints(str(tmp_path / "runs"), "mean_s0")  # nothing more to prune
  assert checkpoints.steps(run) == [14]


def test_uncommitted_code_is_refused_before_any_run(study, tmp_path, monkeypatch):
  monkeypatch.setattr(rd, "dirty", lambda root: True)
  monkeypatch.setattr(sys, "argv", ["real_model_study.py", f"--runs_dir={tmp_path / 'runs'}",
                                    f"--out={tmp_path / 'out'}"])
  with pytest.raises(SystemExit, match="uncommitted changes"):
    lib.main(study, "", sys.argv[1:])
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
