"""experiments/decisive_study.py: the registered design and the runs it makes (matched steps,
one start, objective overrides only, the CPU arm's budget), seed-major order, resuming from the
published runs, the statements' values and pairing within a machine, the registration check, the
report (final and interim), the refusals before any run, and (slow) the whole pipeline on the
tiny model. The study is its declaration over the library's registered studies
(ksjax/studies/registered.py), which these tests drive with the declaration's Spec."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats
from tests import support

from ksjax import files
from ksjax.evaluation import statistics
from ksjax.evaluation import results
from ksjax.run import checkpoints
from ksjax.run import config as run_config
from ksjax.run.directory import RunDirectory
from ksjax.studies import registered as lib

SCRIPT = os.path.join(str(support.REPO), "experiments", "decisive_study.py")
EVAL_KS, LADDER_KS = (1, 2, 4, 8, 16), (1, 2, 4, 8, 16, 32, 64)


@pytest.fixture(scope="module")
def study():
  return support.load_module(SCRIPT, "ksjax_experiments_decisive_study").STUDY


@pytest.fixture(scope="module")
def registered(study):
  prereg = study.load_registration()
  return prereg, lib.design(study, prereg)


# The objectives are real_model_study's variants of the same names: their trainer flags.
VARIANTS = {"mean": ("--config.aggregator=mean", "--config.baseline=loo"),
            "pass_at_k": ("--config.aggregator=pass_at_k", "--config.baseline=loo"),
            "biased_pass_at_k": ("--config.aggregator=pass_at_k",
                                 "--config.baseline=loo_demeaned"),
            "majority_vote": ("--config.aggregator=majority_vote", "--config.baseline=loo")}


def _flags(given) -> dict[str, str]:
  return dict(flag[len("--config."):].split("=", 1) for flag in given)


def test_the_registration_fixes_arms_seeds_and_statements(study, registered):
  prereg, d = registered
  assert [s.id for s in prereg.primary] == ["P1", "P2", "P3"]
  assert [s.metric for s in prereg.primary] == ["pass@4", "pass@1", "ladder/pass@64"]
  assert {(s.a, s.b) for s in prereg.primary} == {("pass_at_k", "mean")}
  primary_seeds = d.arm_seeds("pass_at_k")
  assert d.arm_seeds("mean") == primary_seeds and len(primary_seeds) >= 8
  for arm in ("biased_pass_at_k", "majority_vote", "mean_cpu", "pass_at_k_cpu"):
    assert len(d.arm_seeds(arm)) >= 4 and d.arm_seeds(arm) == primary_seeds[:len(
        d.arm_seeds(arm))]  # the first seeds
  assert {a: d.arms[a]["stop"] for a in d.arms if d.arms[a]["stop"] == "cpu"} == {
      "mean_cpu": "cpu", "pass_at_k_cpu": "cpu"}
  # The power claim: 0.06 at the pilot's sd needs 10 seeds; the registered count detects less.
  sd = 0.0568
  assert statistics.seeds_needed(0.06, sd) == 10
  assert statistics.minimum_detectable_effect(sd, len(primary_seeds)) <= 0.06
  assert f"{len(primary_seeds)} seeds" in prereg.raw["power"]["minimum_detectable_effect"]
  assert len(d.checkpoint_steps) >= 3 and d.checkpoint_steps[-1] == d.steps


def test_the_runs_of_a_seed_differ_only_in_their_objective(study, registered):
  _, d = registered
  base = run_config.smollm2_config()
  for seed in (0, 3):
    flags = {arm: _flags(lib.train_overrides(d, arm, seed)) for arm in d.arms}
    for arm, given in flags.items():
      objective = {k: given.pop(k) for k in study.objective_fields}
      assert objective == {k: str(v) for k, v in d.arms[arm]["objective"].items()}
      for field in given:  # every field exists in the config (no typo makes a silent no-op)
        node = base
        for part in field.split("."):
          node = node[part]
      assert not any(f.startswith(("init_", "model.", "learning_rate")) for f in given)
      assert given["seed"] == str(seed) and given["eval.at_end"] == "False"
      assert given["arithmetic.test_per_level"] == str(d.test_per_level) == "40"
      assert int(given["keep_checkpoints"]) > len(d.checkpoint_steps)
      assert int(given["checkpoint_every"]) == d.checkpoint_steps[0]
    matched = [given for arm, given in flags.items() if d.arms[arm]["stop"] == "steps"]
    assert all(given == matched[0] for given in matched)  # identical but for the objective
    assert matched[0]["num_steps"] == str(d.steps) and "max_cpu_minutes" not in matched[0]
    cpu = [given for arm, given in flags.items() if d.arms[arm]["stop"] == "cpu"]
    for given in cpu:  # the matched-steps runs' flags, the CPU budget instead of the steps
      assert given["max_cpu_minutes"] == str(d.cpu_minutes)
      assert int(given["num_steps"]) > d.steps
      rest = {k: v for k, v in given.items() if k not in ("max_cpu_minutes", "num_steps")}
      assert rest == {k: v for k, v in matched[0].items() if k != "num_steps"}
  # The objectives are real_model_study's variants of the same names.
  for arm, variant in (("mean", "mean"), ("pass_at_k", "pass_at_k"), ("mean_cpu", "mean"),
                       ("biased_pass_at_k", "biased_pass_at_k"),
                       ("majority_vote", "majority_vote"), ("pass_at_k_cpu", "pass_at_k")):
    assert lib.train_overrides(d, arm, 0)[:2] == VARIANTS[variant]


def test_runs_are_seed_major_and_each_arm_runs_its_own_seeds(study, registered):
  _, d = registered
  order = lib.runs_of(d, ["mean", "pass_at_k", "mean_cpu"], [0, 1, 5])
  assert order == [("mean", 0), ("pass_at_k", 0), ("mean_cpu", 0), ("mean", 1),
                   ("pass_at_k", 1), ("mean_cpu", 1), ("mean", 5), ("pass_at_k", 5)]
  assert lib.needed(d, "pass_at_k", 12) == {"eval": [4, 8, 12], "ladder": [12]}
  assert lib.needed(d, "mean_cpu", 9) == {"eval": [9]}
  settings, fields = lib.eval_settings(d, "ladder")
  assert settings["num_samples"] == 64 and max(settings["ks"]) == 64
  assert "kl_reference" not in settings and dict(fields) == {"arithmetic.test_per_level": 8}
  settings, fields = lib.eval_settings(d, "eval")
  assert settings["kl_reference"] == "start" and settings["num_samples"] >= 16
  assert dict(fields) == {"arithmetic.test_per_level": 40}


def _record(step, values, kl=None, levels=(1, 2)):
  """An evaluation record with pass@k = values[k] (and maj@4 = pass@1), equal on every level."""
  metrics = {f"pass@{k}": v for k, v in values.items()}
  metrics.update({"maj@4": values[1], "answer_entropy": 0.5})
  if kl is not None:
    metrics.update(kl_k1=kl, kl_k3=kl)
  return {"step": step, "metrics": metrics, "checkpoint": f"<runs_dir>/x/checkpoints/{step}",
          "groups": {f"level={l}": {"num_problems": 1, **metrics} for l in levels},
          "problems": {"id": ["a", "b"], "num_correct": [1, 2]}}


def _ladder(p1):
  return {k: p1 + 0.01 * np.log2(k) for k in LADDER_KS}


def _curve(p4s, kls, step_list=(4, 8, 12)):
  return [(step, {k: (p4 if k == 4 else p4 / 2 if k == 1 else min(1.0, p4 * 1.2))
                  for k in EVAL_KS}, kl) for step, p4, kl in zip(step_list, p4s, kls)]


def _published(out, arm, seed, curve, *, ladder=None, machine="cpu A", commit="a" * 40,
               stop="steps"):
  """A run as `publish` leaves it in `out`."""
  target = os.path.join(out, f"{arm}_s{seed}")
  for which in ("eval", "ladder"):
    os.makedirs(os.path.join(target, which), exist_ok=True)
  for step, values, kl in curve:
    results.save_step(os.path.join(target, "eval"), _record(step, values, kl))
  last = curve[-1][0]
  if ladder is not None:
    results.save_step(os.path.join(target, "ladder"), _record(last, _ladder(ladder)))
  files.write_json(os.path.join(target, "attempts.json"),
                   [{"wall_seconds": 60.0, "commit": commit, "machine": machine}])
  files.write_json(os.path.join(target, "evaluations.json"),
                   [{"what": "eval", "steps": [s for s, _, _ in curve], "start": False,
                     "commit": commit, "machine": machine}])
  files.write_text(os.path.join(target, "metrics.jsonl"),
                   json.dumps({"step": last, "time/cpu_seconds": 600.0}) + "\n")
  files.write_json(os.path.join(target, "config.json"), {"workdir": "<runs_dir>"})
  files.write_json(os.path.join(target, "published.json"), {
      "arm": arm, "seed": seed, "stop": stop, "last_step": last, "cpu_seconds": 600.0,
      "evaluated": {}, "machines": [machine]})


def _start(out):
  os.makedirs(os.path.join(out, "start"), exist_ok=True)
  files.write_json(os.path.join(out, "start", "eval.json"),
                   _record(0, {k: 0.4 if k == 4 else 0.2 for k in EVAL_KS}, 0.01))
  files.write_json(os.path.join(out, "start", "ladder.json"), _record(0, _ladder(0.1)))


# pass@4 and KL at steps 4, 8, 12: seed 2's pass@k run ran on another machine.
MEAN = {0: ([.45, .50, .55], [.2, .4, .6]), 1: ([.44, .48, .52], [.1, .3, .5]),
        2: ([.40, .41, .42], [.1, .2, .3])}
PASS = {0: ([.50, .60, .70], [.3, .6, .9]), 1: ([.46, .55, .60], [.2, .3, .4]),
        2: ([.60, .70, .80], [.5, .6, .7])}


def _three_seeds(out):
  _start(out)
  for seed in range(3):
    _published(out, "mean", seed, _curve(*MEAN[seed]), ladder=0.3 + 0.01 * seed)
    _published(out, "pass_at_k", seed, _curve(*PASS[seed]), ladder=0.35 + 0.02 * seed,
               machine="cpu B" if seed == 2 else "cpu A")


def test_statements_pair_seeds_within_a_machine_and_read_kl_off_the_measured_curves(
    study, registered, tmp_path):
  prereg, d = registered
  out = str(tmp_path / "out")
  _three_seeds(out)
  data = lib.collect(d, out, list(d.arms), list(d.seeds))
  run = data["runs"]["pass_at_k_s0"]
  assert run["steps"] == [0, 4, 8, 12] and run["kl"] == [0.0, .3, .6, .9]
  assert run["metrics"]["pass@4"] == [0.4, .5, .6, .7]  # the start's first
  values, used, left_out = lib.statement_values(prereg, data)
  assert used["P1"] == [0, 1] and list(left_out["P1"]) == [2]
  assert "different machines" in left_out["P1"][2] and "cpu B" in left_out["P1"][2]
  assert values["P1"] == ([.70, .60], [.55, .52])
  assert values["P2"] == ([.35, .30], [.275, .26])
  assert values["P3"] == (pytest.approx([.41, .43]), pytest.approx([.36, .37]))  # pass@64
  assert values["S1"] == ([.9, .4], [.6, .5])
  # pass@4 at the KL both runs of the seed reach (the smaller final KL), interpolated between
  # the measured points around it: seed 0 at KL 0.6 (mean's end; pass@k's step 8 exactly),
  # seed 1 at 0.4 (pass@k's end; mean between steps 8 and 12, 0.48 + 0.5 * 0.04).
  assert values["S2"][0] == pytest.approx([.60, .60])
  assert values["S2"][1] == pytest.approx([.55, .50])
  assert "S3" not in values and "S6" not in values  # arms not run: not measured
  rows = {r["id"]: r for r in lib.judged(study, prereg, data, ["a" * 40], departures=[],
                                           interim=False)["rows"]}
  assert rows["P1"]["p_value"] == pytest.approx(stats.ttest_rel([.70, .60], [.55, .52]).pvalue)
  assert rows["P1"]["seeds_used"] == [0, 1] and list(rows["P1"]["seeds_left_out"]) == ["2"]
  assert rows["S3"]["verdict"] == "not measured"
  # Not registered before these (fake) commits: exploratory, never supported.
  assert rows["P1"]["kind"] == "exploratory"


def test_the_report_names_the_steps_each_machine_bought_with_the_cpu_budget(study):
  runs = {"mean_cpu_s0": {"stop": "cpu", "last_step": 8, "machines": ["cpu A"]},
          "pass_at_k_cpu_s0": {"stop": "cpu", "last_step": 10, "machines": ["cpu A"]},
          "mean_cpu_s2": {"stop": "cpu", "last_step": 38, "machines": ["cpu B"]},
          "mean_s2": {"stop": "steps", "last_step": 12, "machines": ["cpu B"]}}
  lines = lib.cpu_steps_lines({"runs": runs}, list(runs))
  assert "- cpu A: mean_cpu_s0 8, pass_at_k_cpu_s0 10" in lines
  assert "- cpu B: mean_cpu_s2 38" in lines
  assert not any("mean_s2" in line for line in lines)  # matched steps: not a budget's steps
  assert lib.cpu_steps_lines({"runs": {"mean_s2": runs["mean_s2"]}}, ["mean_s2"]) == []


def _git(repo, *args):
  return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                        cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def _registered_repo(study, tmp_path):
  """A git repository where the registration is committed between two commits; returns it and
  (the commit before, the commit after)."""
  repo = tmp_path / "repo"
  repo.mkdir()
  _git(repo, "init", "-q")
  (repo / "code.py").write_text("a = 1\n")
  _git(repo, "add", "code.py")
  _git(repo, "commit", "-q", "-m", "code")
  before = _git(repo, "rev-parse", "HEAD")
  path = repo / study.registration
  path.parent.mkdir(parents=True)
  shutil.copyfile(os.path.join(str(support.REPO), study.registration), path)
  _git(repo, "add", study.registration)
  _git(repo, "commit", "-q", "-m", "register")
  (repo / "code.py").write_text("a = 2\n")
  _git(repo, "commit", "-q", "-am", "the runs")
  return str(repo), before, _git(repo, "rev-parse", "HEAD")


def test_the_registration_must_precede_every_runs_commit(study, registered, tmp_path):
  prereg, d = registered
  repo, before, after = _registered_repo(study, tmp_path)
  at = dataclasses.replace(study, root=repo)  # the study in that repository
  check = lib.registration_check(at, [after])
  assert check["precedes_every_run"] and check["not_preceded"] == []
  check = lib.registration_check(at, [after, before])  # one run trained before it
  assert not check["precedes_every_run"] and check["not_preceded"] == [before]
  assert not lib.registration_check(at, [])["precedes_every_run"]
  out = str(tmp_path / "out")
  _three_seeds(out)
  for seed in range(3):  # the fakes' commit is the run commit of this repository
    for arm in ("mean", "pass_at_k"):
      attempts = os.path.join(out, f"{arm}_s{seed}", "attempts.json")
      files.write_json(attempts, [{"commit": after, "machine": "cpu A" if (arm, seed) != (
          "pass_at_k", 2) else "cpu B"}])
      evaluations = os.path.join(out, f"{arm}_s{seed}", "evaluations.json")
      files.write_json(evaluations, [{**e, "commit": after} for e in json.load(
          open(evaluations, encoding="utf-8"))])
  arms, seeds = ["mean", "pass_at_k"], [0, 1, 2]
  summary = lib.report(at, d, prereg, out, arms, seeds, interim=False, departures=[])
  rows = {r["id"]: r for r in summary["statements"]}
  assert summary["registered"] and rows["P1"]["kind"] == "primary"
  assert "p_holm" in rows["P1"] and rows["P1"]["verdict"].startswith(("supported",
                                                                      "not supported"))
  readme = open(os.path.join(out, "README.md"), encoding="utf-8").read()
  assert "the registration precedes every run" in readme
  assert "The registration precedes each of them." in readme
  assert "| P1 | 0, 1 | seed 2: its two runs ran on different machines" in readme
  assert "INTERIM" not in readme
  # The registration's restarts are printed; none of these runs is at a superseded commit.
  assert "## Restarts" in readme and "the runs at `7f27d15` superseded" in readme
  assert summary["restarts"] == lib.restarts(prereg)
  assert "experiments/results/decisive_study_7f27d15" in {
      r["superseded_results"] for r in summary["restarts"]}
  for name in ("metrics_vs_step.png", "pass4_vs_kl.png", "pass_at_k_vs_k.png", "summary.json"):
    assert os.path.isfile(os.path.join(out, name))
  # The same runs reported as interim, or with a departure: no verdict.
  summary = lib.report(at, d, prereg, out, arms, seeds, interim=True, departures=[])
  assert {r["verdict"] for r in summary["statements"] if "difference" in r} == {"interim"}
  assert "**INTERIM REPORT**" in open(os.path.join(out, "README.md"), encoding="utf-8").read()
  summary = lib.report(at, d, prereg, out, arms, seeds, interim=False, departures=["seeds 0"])
  assert not summary["registered"]
  assert {r["kind"] for r in summary["statements"]} == {"exploratory"}


def test_a_run_at_a_commit_the_study_was_restarted_from_is_not_pooled(study, registered,
                                                                         tmp_path):
  prereg, d = registered
  out = str(tmp_path / "out")
  _three_seeds(out)  # every run at commit "a" * 40
  restart = {"date": "2026-11-27", "superseded_commit": "a" * 7, "decided_at": "b" * 40,
             "superseded_results": "elsewhere", "seen": "seed 0", "reason": "a defect"}
  restarted = dataclasses.replace(prereg, raw={**prereg.raw, "restarts": [restart]})
  summary = lib.report(study, d, restarted, out, ["mean", "pass_at_k"], [0, 1, 2],
                       interim=False, departures=[])
  assert not summary["registered"]
  assert {r["kind"] for r in summary["statements"]} == {"exploratory"}
  assert "mean_s0 ran at `aaaaaaa`, a commit the study was restarted from" in summary[
      "departures"]
  readme = open(os.path.join(out, "README.md"), encoding="utf-8").read()
  assert "Departures from the registration" in readme and "Why: a defect" in readme
  # Without the restart the same runs depart from nothing on that account.
  plain = dataclasses.replace(prereg, raw={**prereg.raw, "restarts": []})
  assert lib.superseded_runs(lib.collect(d, out, ["mean"], [0]), ["mean_s0"],
                               lib.restarts(plain)) == []


def _fake_train(runs_dir, name, last, trained):
  """A finished run in `runs_dir` as the trainer leaves it (evaluated by nothing yet)."""
  trained.append(name)
  run = RunDirectory(os.path.join(runs_dir, name))
  os.makedirs(run.final_dir, exist_ok=True)
  for step in (1, 4, 8, last):
    os.makedirs(os.path.join(run.step_dir(step), "state"), exist_ok=True)
  files.write_text(run.metrics_jsonl,
                   json.dumps({"step": last, "time/cpu_seconds": 700.0}) + "\n")
  files.write_json(run.config_json, {"workdir": run.workdir})
  files.write_json(os.path.join(run.workdir, "attempts.json"),
                   [{"wall_seconds": 1.0, "commit": "a" * 40, "machine": "cpu A"}])


def _fake_evaluate(study, evaluated, killed=lambda calls, step: False):
  """A stand-in for the eval binary's call: appends (name, which, steps, start) to `evaluated`
  and writes a record per checkpoint, as the binary does, then lists the call in
  evaluations.json; raises KeyboardInterrupt before the checkpoint where killed(calls, step)."""
  def evaluate(spec, d_, runs_dir, name, which, steps, *, include_start):
    evaluated.append((name, which, tuple(steps), include_start))
    for step in [0] * include_start + list(steps):
      if killed(len(evaluated), step):
        raise KeyboardInterrupt
      os.makedirs(lib.eval_dir(runs_dir, name, which), exist_ok=True)
      results.save_step(lib.eval_dir(runs_dir, name, which),
                        _record(step, {k: 0.3 for k in EVAL_KS}, 0.1 * step)
                        | {"checkpoint": os.path.join(runs_dir, name, "checkpoints", str(step))})
    path = os.path.join(runs_dir, name, "evaluations.json")
    done = json.load(open(path, encoding="utf-8")) if os.path.exists(path) else []
    files.write_json(path, done + [{"what": which, "steps": steps, "start": include_start,
                                    "commit": "b" * 40, "machine": "cpu A"}])
  return evaluate


def test_runs_resume_from_what_was_published_and_the_start_is_evaluated_once(
    study, registered, tmp_path, monkeypatch, capsys):
  _, d = registered
  runs, out = str(tmp_path / "runs"), str(tmp_path / "out")
  trained, evaluated = [], []

  def train(root, runs_dir, name, config, overrides):
    assert root == study.root and config == d.config
    assert overrides == lib.train_overrides(d, *name.rsplit("_s", 1)[:1],
                                                        int(name.rsplit("_s", 1)[1]))
    _fake_train(runs_dir, name, 12 if "cpu" not in name else 7, trained)

  monkeypatch.setattr(lib.rd, "train", train)
  monkeypatch.setattr(lib, "evaluate", _fake_evaluate(study, evaluated))
  monkeypatch.setattr(lib.machine, "describe", lambda: "cpu A")
  arms = ["mean", "pass_at_k", "mean_cpu"]
  lib.run_study(study, d, runs, out, arms, [0])
  assert trained == ["mean_s0", "pass_at_k_s0", "mean_cpu_s0"]
  assert evaluated == [("mean_s0", "eval", (4, 8, 12), True), ("mean_s0", "ladder", (12,), True),
                       ("pass_at_k_s0", "eval", (4, 8, 12), False),
                       ("pass_at_k_s0", "ladder", (12,), False),
                       ("mean_cpu_s0", "eval", (7,), False)]
  assert lib.finished_seeds(d, out, arms, [0, 1]) == [0]
  assert sorted(os.listdir(os.path.join(out, "mean_s0", "eval"))) == [
      "step_00000004.json", "step_00000008.json", "step_00000012.json"]
  record = json.load(open(os.path.join(out, "mean_s0", "eval", "step_00000008.json"),
                          encoding="utf-8"))
  assert record["problems"]["num_correct"] and record["checkpoint"].startswith("<runs_dir>")
  assert os.path.isfile(lib.start_path(out, "eval"))
  assert os.path.isfile(lib.start_path(out, "ladder"))
  assert checkpoints.steps(RunDirectory(os.path.join(runs, "mean_s0"))) == [12]  # pruned
  # A new machine, no runs directory: nothing published runs again.
  shutil.rmtree(runs)
  lib.run_study(study, d, runs, out, arms, [0])
  assert trained == ["mean_s0", "pass_at_k_s0", "mean_cpu_s0"]
  # Half a seed on another machine: the rest runs, with a warning the report acts on.
  shutil.rmtree(os.path.join(out, "pass_at_k_s0"))
  monkeypatch.setattr(lib.machine, "describe", lambda: "cpu B")
  lib.run_study(study, d, runs, out, arms, [0])
  assert trained[-1] == "pass_at_k_s0"
  assert "warning: seed 0's published runs ran on ['cpu A']" in capsys.readouterr().out


def test_an_evaluation_stopped_part_way_keeps_the_checkpoints_it_finished(
    study, registered, tmp_path, monkeypatch):
  """A session's end kills the eval binary between checkpoints: the next call evaluates only the
  checkpoints without a record (each is sampled with the same seed whatever the call)."""
  _, d = registered
  runs, out = str(tmp_path / "runs"), str(tmp_path / "out")
  evaluated = []

  monkeypatch.setattr(lib.rd, "train",
                      lambda root, runs_dir, name, *unused: _fake_train(runs_dir, name, 12, []))
  # Killed in the first call's second checkpoint.
  killed = lambda calls, step: calls == 1 and step == 8
  monkeypatch.setattr(lib, "evaluate", _fake_evaluate(study, evaluated, killed))
  monkeypatch.setattr(lib.machine, "describe", lambda: "cpu A")
  with pytest.raises(KeyboardInterrupt):
    lib.run_study(study, d, runs, out, ["mean"], [0])
  lib.run_study(study, d, runs, out, ["mean"], [0])
  assert evaluated == [("mean_s0", "eval", (4, 8, 12), True), ("mean_s0", "eval", (8, 12), False),
                       ("mean_s0", "ladder", (12,), True)]
  assert sorted(os.listdir(os.path.join(out, "mean_s0", "eval"))) == [
      "step_00000004.json", "step_00000008.json", "step_00000012.json"]


def test_nothing_runs_where_every_run_is_published_and_the_code_is_checked_before_a_run(
    study, registered, tmp_path, monkeypatch):
  _, d = registered
  out = str(tmp_path / "out")
  _three_seeds(out)
  argv = ["decisive_study.py", "--arms=mean,pass_at_k", "--seeds=0,1,2", f"--out={out}",
          f"--runs_dir={tmp_path / 'runs'}"]
  monkeypatch.setattr(sys, "argv", argv)
  monkeypatch.setattr(lib.rd, "dirty", lambda root: True)
  monkeypatch.setattr(lib.rd, "train",
                      lambda *a, **k: pytest.fail("a published run was run again"))
  lib.main(study, "", sys.argv[1:])  # every run published: a report, no refusal, no run
  readme = open(os.path.join(out, "README.md"), encoding="utf-8").read()
  assert "Departures from the registration" in readme and "**Exploratory**" in readme
  assert not os.path.exists(tmp_path / "runs")
  monkeypatch.setattr(sys, "argv", argv[:2] + ["--seeds=0,1,2,3"] + argv[3:])
  with pytest.raises(SystemExit, match="uncommitted changes"):
    lib.main(study, "", sys.argv[1:])
  monkeypatch.setattr(lib.rd, "dirty", lambda root: False)
  monkeypatch.setattr(lib.preregistration, "registration",
                      lambda *unused: {"registered_at": None, "precedes": None})
  with pytest.raises(SystemExit, match="commit the registration"):
    lib.main(study, "", sys.argv[1:])
  assert not os.path.exists(tmp_path / "runs")
  monkeypatch.setattr(sys, "argv", argv[:1] + ["--partial", "--seeds=0,1,2,3", f"--out={out}"])
  with pytest.raises(SystemExit, match="no seed has finished"):
    lib.main(study, "", sys.argv[1:])  # seeds 0-2 lack their other arms


def _quietly(command) -> str:
  """Runs `command`, fails the test on a nonzero exit; its output."""
  done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


@pytest.mark.slow  # four trainer and eight eval-binary processes: a few minutes on two cores
def test_the_quick_study_end_to_end_and_nothing_twice(tmp_path):
  out = tmp_path / "out"
  command = [sys.executable, SCRIPT, "--quick", "--arms=mean,pass_at_k", "--seeds=0,1",
             f"--runs_dir={tmp_path / 'runs'}", f"--out={out}"]
  _quietly(command)
  readme = (out / "README.md").read_text()
  assert "Smoke run (--quick)" in readme and "| P1 | 0, 1 |" in readme
  summary = json.loads((out / "summary.json").read_text())
  p1 = next(r for r in summary["statements"] if r["id"] == "P1")
  assert p1["kind"] == "exploratory" and p1["n"] == 2
  for name in ("mean_s0", "pass_at_k_s1"):
    assert [r["step"] for r in results.load_records(str(out / name / "eval"))] == [1, 2, 3]
    ladder = results.load_records(str(out / name / "ladder"))
    assert [r["step"] for r in ladder] == [3] and ladder[0]["num_samples"] == 8
    record = results.load_records(str(out / name / "eval"))[-1]
    assert "kl_k3" in record["metrics"] and record["problems"]["num_correct"]
    assert checkpoints.steps(RunDirectory(str(tmp_path / "runs" / name))) == [3]
  assert json.loads((out / "start" / "eval.json").read_text())["step"] == 0
  again = _quietly(command)
  assert "ksjax.main" not in again and "ksjax.eval" not in again
  shutil.rmtree(tmp_path / "runs")  # a new machine: the published runs are all it needs
  again = _quietly(command)
  assert "ksjax.main" not in again and (out / "README.md").read_text() == readme
