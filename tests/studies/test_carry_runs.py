"""ksjax/studies/carry_runs.py (a study's --carry in the published-run layout, on the decisive
study's declaration): an unfinished run's evaluation records carried to the next machine and
taken back only where the run, trained again there, is the same run (machine, commit, step log,
every evaluated checkpoint's training state); the state digest on real checkpoints."""

import json
import os
import shutil

import pytest
from tests import support
from tests.experiments import test_decisive_study as helpers
from tests.support import eval_run

from ksjax import files
from ksjax.evaluation import results
from ksjax.run.directory import RunDirectory
from ksjax.studies import carry_runs as carry_lib
from ksjax.studies import registered as lib
from ksjax.studies import runs_dir as rd


@pytest.fixture(scope="module")
def carry():
  return carry_lib


@pytest.fixture(scope="module")
def study():
  return support.load_module(helpers.SCRIPT, "ksjax_experiments_decisive_study").STUDY


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, worker_id):
  return eval_run.tiny_run(eval_run.session_dir(tmp_path_factory, worker_id))


def test_the_state_digest_tells_checkpoints_apart_and_not_copies(carry, run_dir, tmp_path):
  steps = run_dir / "checkpoints"
  copy = tmp_path / "copy"
  shutil.copytree(steps / "3", copy)
  assert carry.state_digest(str(copy)) == carry.state_digest(str(steps / "3"))
  # Steps 2 and 3 of the tiny run hold the same parameters (the step's update had no signal);
  # their states differ in the step count and the optimizer's.
  assert carry.state_digest(str(steps / "2")) != carry.state_digest(str(steps / "3"))


def _fake_digests(carry, monkeypatch, tampered=()):
  """Checkpoints the fake trainer makes are empty directories: their digest is their step (or
  another for the steps in `tampered`)."""
  def digest(step_dir):
    step = os.path.basename(step_dir)
    return f"state {step}" + (" changed" if int(step) in tampered else "")
  monkeypatch.setattr(carry, "state_digest", digest)


def _trainer(trained, loss=0.5):
  """The trainer as `run_config` calls it: nothing where the run has finished; else helpers'
  fake run, with a step log of a training figure and a time, its attempt appended."""
  def train(root, runs_dir, name, *unused):
    del root
    run = RunDirectory(os.path.join(runs_dir, name))
    if os.path.isdir(run.final_dir):
      return
    attempts = os.path.join(run.workdir, "attempts.json")
    done = json.load(open(attempts, encoding="utf-8")) if os.path.exists(attempts) else []
    helpers._fake_train(runs_dir, name, 12, trained)
    files.write_text(run.metrics_jsonl, "".join(
        json.dumps({"step": s, "loss/total": loss * s, "time/step": 10.0 + len(trained)})
        + "\n" for s in range(1, 13)))
    files.write_json(attempts, done + [{"commit": "c" * 40, "machine": "cpu A"}])
  return train


def _evaluator(study, evaluated, killed):
  """The eval binary's call as the runner makes it: listed in evaluations.json first, then a
  record per checkpoint; KeyboardInterrupt before the checkpoint where killed(calls, step)."""
  def evaluate(spec, d_, runs_dir, name, which, steps, *, include_start):
    del spec, d_
    evaluated.append((name, which, tuple(steps), include_start))
    path = os.path.join(runs_dir, name, "evaluations.json")
    done = json.load(open(path, encoding="utf-8")) if os.path.exists(path) else []
    files.write_json(path, done + [{"what": which, "steps": steps, "start": include_start,
                                    "commit": "c" * 40, "machine": "cpu A"}])
    for step in [0] * include_start + list(steps):
      if killed(len(evaluated), step):
        raise KeyboardInterrupt
      os.makedirs(lib.eval_dir(runs_dir, name, which), exist_ok=True)
      results.save_step(lib.eval_dir(runs_dir, name, which),
                        helpers._record(step, {k: 0.3 for k in helpers.EVAL_KS}, 0.1 * step)
                        | {"checkpoint": os.path.join(runs_dir, name, "checkpoints", str(step))})
  return evaluate


def _stopped_in_step_8(study, carry, tmp_path, monkeypatch):
  """mean_s0 trained, its evaluation stopped in step 8 (a session's end), then carried."""
  runs, out, into = (str(tmp_path / p) for p in ("runs", "out", "carried"))
  d = lib.design(study, study.load_registration())
  monkeypatch.setattr(lib.machine, "describe", lambda: "cpu A")
  monkeypatch.setattr(rd, "commit", lambda root: "c" * 40)
  trained, evaluated = [], []
  monkeypatch.setattr(rd, "train", _trainer(trained))
  killed = lambda calls, step: calls == 1 and step == 8
  monkeypatch.setattr(lib, "evaluate", _evaluator(study, evaluated, killed))
  with pytest.raises(KeyboardInterrupt):
    lib.run_study(study, d, runs, out, ["mean"], [0])
  assert carry.save_runs(study, runs, into, out) == ["mean_s0"]
  return d, runs, out, into, trained, evaluated


def test_records_carried_to_the_same_machine_and_commit_are_taken_back(study, carry, tmp_path,
                                                                       monkeypatch):
  _fake_digests(carry, monkeypatch)
  d, runs, out, into, trained, evaluated = _stopped_in_step_8(study, carry, tmp_path,
                                                              monkeypatch)
  carried = os.path.join(into, "mean_s0")
  assert sorted(os.listdir(os.path.join(carried, "eval"))) == ["step_00000000.json",
                                                               "step_00000004.json"]
  record = json.load(open(os.path.join(carried, "eval", "step_00000004.json"), encoding="utf-8"))
  assert record["checkpoint"] == "<runs_dir>/mean_s0/checkpoints/4"  # no path of the machine
  info = json.load(open(os.path.join(carried, "carried.json"), encoding="utf-8"))
  assert info == {"machine": "cpu A", "commit": "c" * 40, "digests": {"4": "state 4"}}
  shutil.rmtree(runs)  # the next machine
  outcome = carry.restore_runs(study, runs, into, out)
  assert "2 records restored" in outcome["mean_s0"]  # the start's and step 4's
  assert trained == ["mean_s0", "mean_s0"]
  restored = json.load(open(os.path.join(runs, "mean_s0", "eval", "step_00000004.json"),
                            encoding="utf-8"))
  assert restored["checkpoint"] == os.path.join(runs, "mean_s0", "checkpoints", "4")
  lib.run_study(study, d, runs, out, ["mean"], [0])
  # The runner found the run trained and evaluated only what had no record; the start once.
  assert trained == ["mean_s0", "mean_s0"]
  assert evaluated[1:] == [("mean_s0", "eval", (8, 12), False),
                           ("mean_s0", "ladder", (12,), True)]
  published = os.path.join(out, "mean_s0")
  assert sorted(os.listdir(os.path.join(published, "eval"))) == [
      "step_00000004.json", "step_00000008.json", "step_00000012.json"]
  calls = json.load(open(os.path.join(published, "evaluations.json"), encoding="utf-8"))
  assert [c["steps"] for c in calls] == [[4, 8, 12], [8, 12], [12]]
  assert len(json.load(open(os.path.join(published, "attempts.json"), encoding="utf-8"))) == 2
  carry.save_runs(study, runs, into, out)  # published: no longer carried, its restore's record kept
  assert os.listdir(into) == ["restores.jsonl"]
  log = [json.loads(line) for line in open(os.path.join(into, "restores.jsonl"),
                                           encoding="utf-8")]
  assert [(r["run"], r["machine"], r["carried"]["digests"]) for r in log] == [
      ("mean_s0", "cpu A", {"4": "state 4"})] and "2 records restored" in log[0]["outcome"]


@pytest.mark.parametrize("what", ["machine", "commit", "step log", "state"])
def test_records_are_left_out_where_the_run_trained_again_is_not_the_same(
    study, carry, tmp_path, monkeypatch, what):
  _fake_digests(carry, monkeypatch)
  d, runs, out, into, trained, evaluated = _stopped_in_step_8(study, carry, tmp_path,
                                                              monkeypatch)
  shutil.rmtree(runs)
  if what == "machine":
    monkeypatch.setattr(lib.machine, "describe", lambda: "cpu B")
  elif what == "commit":
    monkeypatch.setattr(rd, "commit", lambda root: "d" * 40)
  elif what == "step log":
    monkeypatch.setattr(rd, "train", _trainer(trained, loss=0.6))
  else:
    _fake_digests(carry, monkeypatch, tampered=(4,))
  outcome = carry.restore_runs(study, runs, into, out)["mean_s0"]
  assert "restored" not in outcome and {"machine": "run afresh", "commit": "run afresh",
                                        "step log": "step log differs",
                                        "state": "step 4's training state differs"}[what] in outcome
  lib.run_study(study, d, runs, out, ["mean"], [0])
  # Every checkpoint again, and the start (its carried record was left out too).
  assert evaluated[1] == ("mean_s0", "eval", (4, 8, 12), True)


def test_a_run_directory_already_there_is_left_as_it_is(study, carry, tmp_path, monkeypatch):
  _fake_digests(carry, monkeypatch)
  _, runs, out, into, trained, _ = _stopped_in_step_8(study, carry, tmp_path, monkeypatch)
  assert "exists: left as it is" in carry.restore_runs(study, runs, into, out)["mean_s0"]
  assert trained == ["mean_s0"]


def test_a_machine_runs_only_the_seeds_no_other_machine_began(study, carry, tmp_path,
                                                              monkeypatch):
  _fake_digests(carry, monkeypatch)
  _, _, out, into, _, _ = _stopped_in_step_8(study, carry, tmp_path, monkeypatch)  # seed 0, cpu A
  helpers._published(out, "mean", 1, helpers._curve(*helpers.MEAN[1]), ladder=0.3,
                     machine="cpu B")
  every = list(lib.design(study, study.load_registration()).seeds)
  assert carry.seeds_here(study, into, out) == (
      [s for s in every if s != 1], {1: "its runs so far ran on cpu B"})
  monkeypatch.setattr(lib.machine, "describe", lambda: "cpu B")
  allowed, why = carry.seeds_here(study, into, out)
  assert allowed == [s for s in every if s != 0] and why == {0: "its runs so far ran on cpu A"}


def test_a_machine_with_nothing_else_to_run_finishes_the_seeds_begun_elsewhere_last(
    study, carry, tmp_path, monkeypatch):
  _fake_digests(carry, monkeypatch)
  _, _, out, into, _, _ = _stopped_in_step_8(study, carry, tmp_path, monkeypatch)  # seed 0, cpu A
  d = lib.design(study, study.load_registration())
  every = list(d.seeds)
  monkeypatch.setattr(lib.machine, "describe", lambda: "cpu B")
  helpers._published(out, "mean", 1, helpers._curve(*helpers.MEAN[1]), ladder=0.3,
                     machine="cpu B")
  # Seeds not yet whole here: seed 0 (begun on cpu A) waits.
  assert carry.seeds_to_run(study, into, out)[0] == [s for s in every if s != 0]
  for seed in every[1:]:
    for arm in d.arms:
      if seed in d.arm_seeds(arm) and not lib.published(out, rd.run_name(arm, seed)):
        helpers._published(out, arm, seed, helpers._curve(*helpers.MEAN[1]), ladder=0.3,
                           machine="cpu B")
  allowed, why = carry.seeds_to_run(study, into, out)
  assert allowed == every[1:] + [0] and "its remaining runs run here" in why[0]
  # Once seed 0 is whole too, it is not named again.
  for arm in d.arms:
    if 0 in d.arm_seeds(arm) and not lib.published(out, rd.run_name(arm, 0)):
      helpers._published(out, arm, 0, helpers._curve(*helpers.MEAN[1]), ladder=0.3,
                         machine="cpu B")
  assert carry.seeds_to_run(study, into, out)[0] == every[1:]


def test_published_runs_are_committed_as_they_finish_and_nothing_else(study, carry, tmp_path,
                                                                     monkeypatch):
  for var in ("GIT_AUTHOR_NAME", "GIT_COMMITTER_NAME"):
    monkeypatch.setenv(var, "t")
  for var in ("GIT_AUTHOR_EMAIL", "GIT_COMMITTER_EMAIL"):
    monkeypatch.setenv(var, "t@example.com")
  monkeypatch.setattr(rd, "commit", lambda root: "c" * 40)
  repo, _, _ = helpers._registered_repo(study, tmp_path)
  out, into = os.path.join(repo, "out"), os.path.join(repo, "carried")
  helpers._published(out, "mean", 0, helpers._curve(*helpers.MEAN[0]), ladder=0.3)
  os.makedirs(os.path.join(out, "pass_at_k_s0", "eval"))  # publishing: no published.json yet
  with open(os.path.join(repo, "code.py"), "w", encoding="utf-8") as f:
    f.write("a = 3\n")
  helpers._git(repo, "add", "code.py")  # staged by someone else: not the runner's to commit
  assert carry.commit_published(study, into, out) == ["mean_s0"]
  message = helpers._git(repo, "log", "-1", "--format=%s")
  assert message.startswith("decisive_study: mean_s0 published at ccccccc on cpu A (1 of 40 "
                            "registered runs)")
  assert helpers._git(repo, "show", "--name-only", "--format=", "HEAD").split() == [
      f"out/mean_s0/{f}" for f in sorted(
          ["attempts.json", "config.json", "evaluations.json", "metrics.jsonl",
           "published.json", "eval/step_00000004.json", "eval/step_00000008.json",
           "eval/step_00000012.json", "ladder/step_00000012.json"])]
  assert helpers._git(repo, "diff", "--cached", "--name-only") == "code.py"
  assert carry.commit_published(study, into, out) == []  # nothing twice
