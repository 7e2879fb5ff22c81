"""ksjax.studies on the toy study (experiments/toy_study.py: two arms x three seeds on the bandit):
kill anywhere and resume, no verdict on a partial study, pairing only within a machine, no
overwrite of a published run, one line for a bad registration or declaration, and the same records
from every engine (the local pool, submitit's local and debug executors)."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
from tests import support

from ksjax.studies import cli
from ksjax.studies import declaration
from ksjax.studies import jobs
from ksjax.studies import store
from ksjax.studies import StudyError

TOY = str(support.REPO / "experiments" / "toy_study.py")
# What a run's mark records of its making, not of its numbers: times, and the commit (HEAD moves
# while the suite runs in a shared checkout, and with --commit after every run).
MAKING = ("cpu_seconds", "train_seconds", "eval_seconds", "commit", "uncommitted_changes")


@pytest.fixture(scope="module")
def toy():
  return declaration.load(TOY)


@pytest.fixture(scope="module")
def straight(toy, tmp_path_factory):
  """The whole toy study, never stopped, on submitit's debug executor (this process)."""
  out = tmp_path_factory.mktemp("straight") / "study"
  cli.main(toy, TOY, ["--out", str(out), "--engine", "submitit-debug", "--allow_dirty"])
  return out


def _records(out) -> dict:
  """Every run's checkpoints, evaluation records and mark (less MAKING), by path."""
  found = {}
  for dirpath, _, names in os.walk(out / "runs"):
    for name in names:
      path = os.path.join(dirpath, name)
      data = json.loads(open(path, encoding="utf-8").read())
      if name == store.MARK:
        data = {k: v for k, v in data.items() if k not in MAKING}
      found[os.path.relpath(path, out)] = data
  return found


def _published(out) -> dict:
  """The report less what measures time, and every record."""
  summary = json.loads((out / "summary.json").read_text())
  for key in ("timing", "runs"):
    summary.pop(key)
  readme = (out / "README.md").read_text()
  return {"summary": summary, "readme": readme[:readme.index("## Time")],
          "table": (out / "table.md").read_text(), "records": _records(out)}


def test_the_toy_study_is_judged_and_regenerates_without_training(toy, straight, capsys):
  summary = json.loads((straight / "summary.json").read_text())
  assert set(summary["final"]) == {"mean", "pass_at_k"}
  assert len(summary["final"]["mean"]["pass@4"]) == 3  # one value per seed
  assert summary["curves"]["mean"][0]["steps"] == [0, 10, 20, 30, 40]
  assert {r["id"] for r in summary["statements"]} == {"P1", "S1", "S2"}
  assert all(r["n"] == 3 for r in summary["statements"])
  for name in ("README.md", "table.md", "metrics_vs_step.png", "metrics_vs_kl.png",
               "pass_at_k_vs_k.png", "provenance.json", "timing.json"):
    assert (straight / name).is_file(), name
  before = {p: p.read_bytes() for p in straight.rglob("*") if p.is_file()}
  capsys.readouterr()
  cli.main(toy, TOY, ["--out", str(straight)])  # every run published: no training, any tree
  assert "runs to train" not in capsys.readouterr().out
  after = {p: p.read_bytes() for p in straight.rglob("*") if p.is_file()}
  assert after == before  # provenance.json and timing.json too: this session ran nothing


@pytest.mark.parametrize("engine", ["local", "submitit-local"])
def test_every_engine_makes_the_same_records(toy, straight, tmp_path, engine):
  out = tmp_path / engine
  cli.main(toy, TOY, ["--out", str(out), "--engine", engine, "--seeds", "1", "--arms",
                      "pass_at_k", "--workers", "1", "--allow_dirty"])
  mine = _records(out)
  assert [p for p in mine if p.endswith(store.MARK)] == [f"runs/pass_at_k_s1/{store.MARK}"]
  assert mine == {p: v for p, v in _records(straight).items() if p in mine}


def test_no_verdict_until_every_registered_run_is_published(toy, straight, tmp_path, capsys):
  out = tmp_path / "partial"
  shutil.copytree(straight, out)
  (out / "runs" / "pass_at_k_s2" / store.MARK).unlink()
  (out / "README.md").unlink()
  with pytest.raises(SystemExit) as exited:
    cli.main(toy, TOY, ["--out", str(out), "--report"])  # report what is published, run nothing
  err = capsys.readouterr().err
  assert exited.value.code == 2 and err.count("\n") == 1
  assert "1 of 6 registered runs are not published (pass_at_k_s2); expected every run" in err
  assert not (out / "README.md").exists()


def test_seeds_are_paired_only_within_a_machine(toy, straight, tmp_path):
  out = tmp_path / "machines"
  shutil.copytree(straight, out)
  mark = out / "runs" / "mean_s2" / store.MARK
  here = json.loads(mark.read_text())
  assert here["machines"] == [here["machine"]]  # one machine made it
  mark.write_text(json.dumps({**here, "machine": "another CPU", "machines": ["another CPU"]}))
  cli.main(toy, TOY, ["--out", str(out)])
  summary = json.loads((out / "summary.json").read_text())
  assert {r["id"]: r["n"] for r in summary["statements"]} == {"P1": 2, "S1": 2, "S2": 2}
  assert summary["left_out"]["P1"]["2"].endswith(", mean on another CPU")
  assert "P1 leaves out seed 2 (pass_at_k ran on " in (out / "README.md").read_text()
  # A run resumed on another machine touched both: its seed is not paired, although the
  # machine that published it is its pair's.
  mark.write_text(json.dumps({**here, "machines": ["another CPU", here["machine"]]}))
  cli.main(toy, TOY, ["--out", str(out), "--report"])
  summary = json.loads((out / "summary.json").read_text())
  assert {r["id"]: r["n"] for r in summary["statements"]} == {"P1": 2, "S1": 2, "S2": 2}
  both = "; ".join(sorted(["another CPU", here["machine"]]))
  assert summary["left_out"]["P1"]["2"].endswith(f", mean on {both}")


def test_a_run_lists_every_machine_that_worked_on_it(tmp_path, monkeypatch):
  run_dir = str(tmp_path / "runs" / "mean_s0")
  monkeypatch.setattr(jobs.machine, "describe", lambda: "cpu A")
  assert jobs.touch(run_dir) == ["cpu A"] and jobs.touch(run_dir) == ["cpu A"]
  monkeypatch.setattr(jobs.machine, "describe", lambda: "cpu B")  # resumed elsewhere
  assert jobs.touch(run_dir) == ["cpu A", "cpu B"]
  assert json.loads((tmp_path / "runs" / "mean_s0" / jobs.TOUCHED).read_text()) == [
      "cpu A", "cpu B"]


def test_a_published_run_is_never_overwritten(toy, straight):
  mark = straight / "runs" / "mean_s0" / store.MARK
  before = mark.read_bytes(), mark.stat().st_mtime_ns
  with pytest.raises(StudyError, match="already published"):
    store.publish(str(straight), "mean_s0", {"commit": "x"})
  assert jobs.run_job(TOY, str(straight), "mean", 0) == "mean_s0"  # nothing to do
  assert (mark.read_bytes(), mark.stat().st_mtime_ns) == before


@pytest.mark.parametrize("text,expected", [
    ("{not json", "is not JSON"),
    (json.dumps({"study": "t", "seeds": [0], "arms": {}, "decision_rule": {},
                 "primary": []}), "expected a list of two or more distinct integers"),
])
def test_a_bad_registration_is_one_line_and_writes_nothing(toy, tmp_path, capsys, text,
                                                            expected):
  bad = tmp_path / "bad.json"
  bad.write_text(text)
  study = dataclasses.replace(toy, registration=str(bad))
  with pytest.raises(SystemExit) as exited:
    cli.main(study, TOY, ["--out", str(tmp_path / "out")])
  err = capsys.readouterr().err
  assert exited.value.code == 2 and err.count("\n") == 1 and expected in err and str(bad) in err
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change,argv,expected", [
    ({"arms": {"mean": {}}}, [], "the registration's arms ['pass_at_k'] are not declared"),
    ({"arms": {"mean": {}, "pass_at_k": {}, "best": {}}}, [], "arms ['best'] are not in"),
    ({}, ["--seeds", "0,9"], "--seeds='0,9'; expected a comma-separated subset of [0, 1, 2]"),
    ({"arms": {"mean": {"aggregator": "best"}, "pass_at_k": {}}}, [],
     "arm 'mean': bandit runs: arm 'mean' aggregator='best'; expected one of ("),
    ({"arms": {"mean": {"lerning_rate": 1.0}, "pass_at_k": {}}}, [],
     "fields ['lerning_rate'] are not accepted; expected ('aggregator'"),
])
def test_a_bad_declaration_is_one_line(toy, tmp_path, capsys, change, argv, expected):
  with pytest.raises(SystemExit) as exited:
    cli.main(dataclasses.replace(toy, **change), TOY, ["--out", str(tmp_path / "o"), *argv])
  err = capsys.readouterr().err
  assert exited.value.code == 2 and err.count("\n") == 1 and expected in err
  assert not (tmp_path / "o").exists()


def test_carried_records_come_back_only_where_the_run_is_retrained_alike(toy, straight, tmp_path,
                                                                         capsys):
  """An unpublished run's records are saved before its machine goes; the next machine (here: the
  same one, its run directory lost) trains the run again, finds the same states and takes the
  records back; a record carried from another machine is not taken."""
  from ksjax.studies import carry
  out, carried = tmp_path / "study", tmp_path / "carried"
  run = declaration.runs_of(toy, ["pass_at_k"], [1])[0]
  context = jobs.RunContext(str(out), run.name, run.arm, run.seed, toy.arms[run.arm])
  toy.work.train(context)
  toy.work.evaluate(context)  # evaluated, not yet published: the machine went here
  assert carry.save(toy, str(out), str(carried), [run]) == [run.name]
  shutil.rmtree(out)
  assert carry.restore(toy, str(out), str(carried), [run])[run.name].startswith(
      "trained again with the same state at steps [0, 10, 20, 30, 40]: 5 records restored")
  cli.main(toy, TOY, ["--out", str(out), "--seeds", "1", "--arms", "pass_at_k", "--allow_dirty"])
  assert _records(out) == {p: v for p, v in _records(straight).items() if p in _records(out)}
  info = carried / run.name / carry.CARRIED
  info.write_text(json.dumps({**json.loads(info.read_text()), "machine": "another CPU"}))
  shutil.rmtree(out)
  outcome = carry.restore(toy, str(out), str(carried), [run])[run.name]
  assert outcome.startswith("carried from 'another CPU'") and "evaluated afresh" in outcome
  assert not (out / "runs" / run.name / "records").exists()
  assert len((carried / carry.RESTORES).read_text().splitlines()) == 2


def test_the_budget_counts_a_shared_start_once(toy):
  """A study with a shared start: the start's seconds are added once, not per run or seed."""
  from ksjax.studies import budget
  mark = {"train_seconds": 2.0, "eval_seconds": 1.0, "cpu_seconds": 3.0}
  without = budget.projection(toy, {"mean": mark}, 10, 3)
  with_start = budget.projection(toy, {"mean": mark}, 10, 3, start=360.0)
  assert with_start["cpu_hours"] == pytest.approx(without["cpu_hours"] + 0.1)
  assert "counted once: 360 s" in budget.line(with_start, 2)
  assert "counted once" not in budget.line(without, 2)


def test_the_budget_is_measured_on_shortened_runs(toy, tmp_path):
  from ksjax.studies import budget
  measured = budget.measure(toy, TOY, str(tmp_path), ["mean"], 10)
  assert measured["mean"]["cpu_seconds"] > 0
  assert sorted(os.listdir(tmp_path / "runs" / "mean_s0" / "records")) == [
      "step_00000000.json", "step_00000010.json"]  # 10 steps, one checkpoint
  estimate = budget.projection(toy, measured, 10, 3)
  per_run = estimate["arms"]["mean"]["wall_seconds_per_run"]
  # training scales with 40/10 steps, evaluation with 5/2 checkpoints
  assert per_run == pytest.approx(measured["mean"]["train_seconds"] * 4
                                  + measured["mean"]["eval_seconds"] * 2.5)
  assert estimate["cpu_hours"] > 0



def _new_repository(path):
  """A repository holding nothing but the toy study's declaration and registration, committed."""
  (path / "experiments" / "preregistration").mkdir(parents=True)
  shutil.copy(TOY, path / "experiments")
  shutil.copy(support.REPO / "experiments" / "preregistration" / "toy_bandit.json",
              path / "experiments" / "preregistration")
  git = lambda *args: subprocess.run(
      ["git", "-c", "user.name=test", "-c", "user.email=test@example.com", *args], cwd=path,
      check=True, capture_output=True, text=True).stdout
  git("init", "-q")
  git("add", ".")
  git("commit", "-q", "-m", "registration and declaration")
  return git


def test_a_new_study_is_two_files_killed_anywhere_it_resumes_and_commits_each_run(straight,
                                                                                   tmp_path):
  """The toy study's two files alone, in a repository of their own, run as registered. Killed
  (SIGKILL) while training (a run's first checkpoint on disk), while evaluating (its first
  record), between a run's evaluations and its mark, and between summary.json and README.md,
  each rerun resumes; the last publishes the numbers and records of a study never stopped, and
  --commit has committed every run as it was published."""
  repo = tmp_path / "repo"
  git = _new_repository(repo)
  command = [sys.executable, "experiments/toy_study.py", "--engine", "submitit-debug", "--commit"]
  env = {**os.environ, "PYTHONPATH": str(support.REPO), **{
      f"GIT_{who}_{what}": value for who in ("AUTHOR", "COMMITTER")
      for what, value in (("NAME", "t"), ("EMAIL", "t@example.com"))}}
  for phase in ("train", "eval", "publish", "report"):
    killed = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=300,
                            check=False, env={**env, jobs.KILL_ENV: phase})
    assert killed.returncode == -9, (phase, killed.stdout[-2000:], killed.stderr[-2000:])
  out = repo / "runs" / "toy_study"
  assert not (out / "README.md").exists()  # the report kill came before it
  final = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=300,
                         check=False, env=env)
  assert final.returncode == 0, final.stdout[-3000:] + final.stderr[-3000:]
  mine, theirs = _published(out), _published(straight)
  assert mine["records"] == theirs["records"] and mine["table"] == theirs["table"]
  for key in ("final", "curves", "start", "departures"):
    assert mine["summary"][key] == theirs["summary"][key], key
  assert "Every statement was judged as pre-registered" in mine["readme"]
  assert "the registration precedes every run" in mine["readme"]
  published = [line for line in git("log", "--format=%s").splitlines() if " published at " in line]
  assert sorted(line.split()[1] for line in published) == sorted(
      f"{arm}_s{seed}" for arm in ("mean", "pass_at_k") for seed in (0, 1, 2))
