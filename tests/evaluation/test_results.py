"""Evaluation records and settings: groups by problem metadata, averages, step selection, and
config fields refused with one line naming them."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from ksjax import config_fields
from ksjax.config_validation import ConfigError
from ksjax.evaluation import results
from ksjax.evaluation import settings as settings_lib

from tests.support import eval_run


def _record(step: int, correct_gn: np.ndarray, metadata, ids_gn=None) -> dict:
  ids_gn = np.where(correct_gn, 0, 1) if ids_gn is None else ids_gn
  return results.step_record(
      step=step, checkpoint=f"ckpt/{step}", sampling={"split": "test"}, ks=(1, 2),
      prompt_ids=[f"p{i}" for i in range(len(metadata))], metadata=metadata,
      breakdown=("level", "subject"), correct_gn=correct_gn, answer_ids_gn=ids_gn,
      rewards_gn=np.where(correct_gn, 1.0, -1.0), seconds=2.0)


METADATA = [{"level": 2, "subject": "Algebra"}, {"level": 10, "subject": "Geometry"},
            {"level": 2, "subject": "Geometry"}, {"level": 1}]


def test_record_groups_by_level_and_subject():
  correct = np.asarray([[1, 1, 0], [0, 0, 0], [1, 0, 0], [1, 1, 1]], bool)
  record = _record(5, correct, METADATA)
  # Levels sort as numbers; a problem without a subject is in no subject group.
  assert list(record["groups"]) == ["level=1", "level=2", "level=10", "subject=Algebra",
                                    "subject=Geometry"]
  assert record["metrics"]["pass@1"] == pytest.approx(np.mean([2 / 3, 0, 1 / 3, 1]))
  assert record["groups"]["level=2"]["pass@1"] == pytest.approx(np.mean([2 / 3, 1 / 3]))
  assert record["groups"]["level=2"]["num_problems"] == 2
  # pass@2 of 1 correct in 3: 1 - C(2,2)/C(3,2) = 2/3.
  assert record["groups"]["subject=Geometry"]["pass@2"] == pytest.approx(np.mean([0, 2 / 3]))
  assert record["metrics"]["reward"] == pytest.approx(np.mean([1 / 3, -1, -1 / 3, 1]))
  assert record["samples_per_second"] == pytest.approx(4 * 3 / 2.0)
  assert record["problems"]["subject"] == ["Algebra", "Geometry", "Geometry", None]
  assert record["problems"]["classes"][0] == [[1, 0], [2, 1]]


def test_maj_uses_the_answer_classes():
  # Two wrong answers (classes 1, 2) and one right (class 0): 0 wins only in a tie.
  correct = np.asarray([[1, 0, 0]], bool)
  record = _record(1, correct, [{}], ids_gn=np.asarray([[0, 1, 2]]))
  assert record["metrics"]["maj@2"] == pytest.approx(1 / 3)  # each pair ties; 0 is in 2 of 3
  record = _record(1, correct, [{}], ids_gn=np.asarray([[0, 1, 1]]))
  assert record["metrics"]["maj@2"] == pytest.approx(1 / 3)  # {0,1} ties twice, {1,1} once


def test_average_and_summary_files(tmp_path):
  a = _record(10, np.asarray([[1, 0], [0, 0]], bool), METADATA[:2])
  b = _record(20, np.asarray([[1, 1], [1, 0]], bool), METADATA[:2])
  averaged = results.average([a, b])
  assert averaged["steps"] == [10, 20]
  assert averaged["metrics"]["pass@1"] == pytest.approx((a["metrics"]["pass@1"]
                                                         + b["metrics"]["pass@1"]) / 2)
  for record in (a, b):
    results.save_step(str(tmp_path), record)
  paths = results.save_summaries(str(tmp_path), [a, b], averaged)
  assert sorted(p.rsplit("/", 1)[1] for p in paths) == [
      "average_last2.csv", "average_last2.json", "results.csv", "results.json"]
  assert [r["step"] for r in results.load_records(str(tmp_path), {"split": "test"})] == [10, 20]
  assert results.load_records(str(tmp_path), {"split": "train"}) == []
  with open(tmp_path / "results.csv", newline="") as f:
    rows = list(csv.DictReader(f))
  assert [(r["step"], r["group"]) for r in rows][:3] == [("10", "all"), ("10", "level=2"),
                                                         ("10", "level=10")]
  assert not list(tmp_path.glob("*.tmp*"))


@pytest.mark.parametrize("spec,want", [("latest", [7]), ("all", [1, 4, 7]), ("last:2", [4, 7]),
                                       ("last:9", [1, 4, 7]), ("7,1", [1, 7])])
def test_select_steps(spec, want):
  assert settings_lib.select_steps(spec, [1, 4, 7], "dir") == want


@pytest.mark.parametrize("spec", ["newest", "last:0", "last:", "1,,2", "-3"])
def test_bad_steps_spec(spec):
  with pytest.raises(ConfigError, match=r"config.steps=.* is not accepted; expected 'latest', "
                     "'all', 'last:N' or step numbers"):
    settings_lib.parse_steps(spec)


@pytest.mark.parametrize("field,value,message", [
    ("num_samples", 0, r"config.num_samples=0 is out of range"),
    ("ks", (1, 30), r"config.ks=\(1, 30\) is not accepted with config.num_samples=20"),
    ("top_p", 0.0, r"config.top_p=0.0 is out of range"),
    ("breakdown", ("level", ""), r"config.breakdown=\('level', ''\) is not accepted"),
    ("checkpoint_dir", None, r"config.checkpoint_dir=None is not accepted"),
])
def test_bad_fields_name_themselves(field, value, message):
  config = eval_run.eval_config("somewhere")
  config[field] = value
  with pytest.raises(ConfigError, match=message):
    settings_lib.validate(config)


def test_run_fields_are_checked_by_the_trainer():
  config = eval_run.eval_config("somewhere")
  config.run.model.preset = "huge"
  with pytest.raises(ConfigError, match=r"config.run.model.preset='huge' is not accepted"):
    settings_lib.validate(config)
  config = eval_run.eval_config("somewhere")
  config.unknown = 1
  with pytest.raises(ConfigError, match="config.unknown is not a field of the evaluation config"):
    settings_lib.validate(config)


def test_default_settings():
  s = settings_lib.validate(eval_run.eval_config("somewhere"))
  assert (s.num_samples, s.steps, s.watch, s.run.run.mesh) == (20, "latest", False, (-1, 1, 1))
  config = eval_run.eval_config("somewhere")
  # None in the eval config: the run's evaluation budget, which defaults to its max_new_tokens.
  assert config.max_new_tokens is None and config.run.eval.max_new_tokens is None
  assert s.max_new_tokens == config.run.max_new_tokens and s.output_name() == "test_n20_t1_p1"


def test_eval_fields_are_declared_once():
  """configs/eval.py's top-level fields are exactly EvalSpec's declarations, plus `run`, each
  with a meaning and its declared default."""
  config = eval_run.eval_config("somewhere")
  declared = {name: f for name, _, f in config_fields.leaves(settings_lib.EvalSpec)}
  assert set(config.keys()) == set(declared) | {"run"}
  defaults = config_fields.config_dict(settings_lib.EvalSpec)
  for name, f in declared.items():
    assert config_fields.declaration(f).meaning.strip(), name
    if name != "checkpoint_dir":
      assert config[name] == defaults[name] == f.default, name
  assert "num_samples = 20  # n completions per problem" in config_fields.describe(
      settings_lib.EvalSpec)


def test_rules_of_several_fields():
  config = eval_run.eval_config("somewhere")
  config.num_samples, config.batch_rows = 512, 256
  with pytest.raises(ConfigError, match="config.num_samples=512 is not accepted with "
                                        "config.batch_rows=256"):
    settings_lib.validate(config)
  config.batch_rows, config.kl_samples = 2048, 513
  with pytest.raises(ConfigError, match=r"config.kl_samples=513 is out of range"):
    settings_lib.validate(config)
  config.kl_samples, config.kl_reference, config.temperature = None, "start", 0.5
  with pytest.raises(ConfigError, match="config.kl_reference='start' is not accepted with "
                                        "temperature 0.5"):
    settings_lib.validate(config)
  config.temperature = 1.0
  s = settings_lib.validate(config)
  # Derived: the ladder up to n, batch_prompts lowered to fit 2048 rows, every sample's KL.
  assert (s.ks[-1], s.batch_prompts, s.kl_samples) == (512, 4, 512)
  # A spec made in Python is resolved the same way, and resolving again changes nothing.
  assert settings_lib.EvalSpec(**{**s.values(), "ks": None, "batch_prompts": 8}) == s
