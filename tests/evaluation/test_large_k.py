"""Large-k evaluation: ks defaulting to the ladder 1, 2, 4, ..., n, the sampler rows cap
(config.batch_rows), records brought up to date from their stored answer classes, pass@k
figures over several checkpoints, and the eval binary with 256 samples on two problems."""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest
from matplotlib.figure import Figure

from ksjax.config_validation import ConfigError
from ksjax.evaluation import plots, results, runner
from ksjax.evaluation import settings as settings_lib
from ksjax.run import scoring

from tests.support import eval_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LADDER_256 = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def _settings(**fields) -> settings_lib.Settings:
  config = eval_run.eval_config("somewhere")
  for key, value in fields.items():
    config[key] = value
  return settings_lib.validate(config)


def test_ks_default_to_the_ladder_and_explicit_ks_still_work():
  assert _settings().ks == (1, 2, 4, 8, 16, 20)
  assert _settings(num_samples=256).ks == tuple(LADDER_256)
  assert _settings(ks=(5, 1, 5)).ks == (1, 5)
  with pytest.raises(ConfigError, match=r"config.ks=\(\) is not accepted; expected a non-empty"):
    _settings(ks=())


@pytest.mark.parametrize("n,batch_prompts,batch_rows,want", [
    (20, 8, 2048, 8),      # the defaults: untouched
    (256, 8, 2048, 8),     # also at 256
    (512, 8, 2048, 4),
    (256, 8, 1024, 4),     # 4 x 256 rows a call
    (256, 8, 256, 1),      # one problem a call
    (256, 8, None, 8),     # no cap
    (300, 2, 1024, 2),
    (200, 8, 1024, 4),     # 5 fit, but 5 prompts are padded to 8
    (20, 6, 140, 4),       # 7 fit, and 6 would be padded to 8
])
def test_batch_rows_lowers_batch_prompts(n, batch_prompts, batch_rows, want):
  assert eval_run.eval_config("somewhere").batch_rows == 2048
  s = _settings(num_samples=n, batch_prompts=batch_prompts, batch_rows=batch_rows)
  assert s.batch_prompts == want and s.sampling()["batch_prompts"] == want


def test_more_samples_than_a_sampler_call_holds_is_refused():
  with pytest.raises(ConfigError, match=r"^config.num_samples=512 is not accepted with "
                     r"config.batch_rows=256; expected num_samples <= batch_rows"):
    _settings(num_samples=512, batch_rows=256)
  with pytest.raises(ConfigError, match=r"config.batch_rows=0 is out of range"):
    _settings(batch_rows=0)


METADATA = [{"level": 1}, {"level": 1}, {"level": 2}]


def _record(ks, ids_gn, correct_gn, step=1):
  return results.step_record(
      step=step, checkpoint="c", sampling={"split": "test"}, ks=ks,
      prompt_ids=["a", "b", "c"], metadata=METADATA, breakdown=("level",),
      correct_gn=correct_gn, answer_ids_gn=ids_gn,
      rewards_gn=np.where(correct_gn, 1.0, -0.5), seconds=1.0)


def _outcomes(n=8, seed=0):
  ids = np.random.default_rng(seed).integers(0, 4, size=(3, n))
  return ids, ids == 0


def test_a_record_of_other_ks_is_rescored_as_if_made_with_the_ladder():
  ids, correct = _outcomes()
  old = _record((1, 3), ids, correct)
  for group in [old["metrics"], *old["groups"].values()]:  # made before diversity existed
    for name in scoring.DIVERSITY:
      del group[name]
  assert not results.is_current(old, scoring.k_ladder(8))
  fresh = _record(scoring.k_ladder(8), ids, correct)
  again = results.rescore(old, scoring.k_ladder(8))
  assert results.is_current(again, scoring.k_ladder(8))
  assert again["ks"] == [1, 2, 4, 8]
  assert list(again["metrics"]) == list(fresh["metrics"])
  for name, value in fresh["metrics"].items():
    assert again["metrics"][name] == pytest.approx(value, abs=1e-12), name
  for group, values in fresh["groups"].items():
    assert again["groups"][group] == pytest.approx(values, abs=1e-12), group
  assert again["problems"] == old["problems"]


def test_average_leaves_out_what_a_record_lacks():
  ids, correct = _outcomes()
  a = _record((1, 2), ids, correct, step=1)
  b = _record((1, 4), ids, correct, step=2)
  averaged = results.average([a, b])
  assert "pass@2" not in averaged["metrics"] and "pass@4" not in averaged["metrics"]
  assert averaged["metrics"]["answer_entropy"] == pytest.approx(a["metrics"]["answer_entropy"])
  assert runner.headline(averaged["metrics"], (1, 2, 4)).startswith("reward ")


def test_pass_at_k_figure_of_several_checkpoints_is_written(tmp_path):
  ids, correct = _outcomes(n=16)
  records = [_record(scoring.k_ladder(16), ids, correct, step=1),
             _record(scoring.k_ladder(16), *_outcomes(n=16, seed=1), step=2),
             _record((1, 3, 16), ids, correct, step=3)]
  paths = plots.save_figures(str(tmp_path), records)
  assert [pathlib.Path(p).name for p in paths] == [plots.PASS_AT_K_PNG, plots.METRICS_PNG]
  for path in paths:
    assert pathlib.Path(path).read_bytes()[:8] == PNG_SIGNATURE
  ax = Figure().subplots()
  plots.pass_at_k_curve(ax, (1, 2, 4, 8), [0.1, 0.2, 0.3, 0.4])
  plots.pass_at_k_curve(ax, (1, 3, 16), [0.1, 0.3, 0.5])
  assert ax.get_xscale() == "log"
  assert list(ax.get_xticks()) == [1, 2, 3, 4, 8, 16]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, worker_id) -> pathlib.Path:
  return eval_run.tiny_run(eval_run.session_dir(tmp_path_factory, worker_id))


@pytest.mark.slow  # a 256-sample evaluation; the ladder's rescoring and the batch limits are above
def test_256_samples_on_two_problems(run_dir, tmp_path, capsys):
  """The binary's run: 2 problems x 256 samples, one problem per sampler call, of two
  checkpoints; the ladder up to pass@256, the diversity, the files and figures. Then the same
  again with explicit ks: the records are reused and rescored, not sampled again."""
  run = tmp_path / "run"
  shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns("1", "eval"))
  out = tmp_path / "out"
  config = eval_run.eval_config(run)
  config.update(dict(num_prompts=2, num_samples=256, batch_rows=256, steps="2,3",
                     output_dir=str(out)))
  runner.run(config)
  stdout = capsys.readouterr().out
  assert "1 problems per sampler call; pass@k for k = 1, 2, 4, 8, 16, 32, 64, 128, 256" in stdout
  assert "step 3: 2 problems x 256 samples in" in stdout
  records = results.load_records(str(out))
  assert [r["step"] for r in records] == [2, 3]
  for record in records:
    assert record["ks"] == LADDER_256 and record["num_samples"] == 256
    assert record["sampling"]["batch_prompts"] == 1
    metrics, problems = record["metrics"], record["problems"]
    assert len(problems["id"]) == 2
    assert [sum(size for size, _ in classes) for classes in problems["classes"]] == [256, 256]
    passes = [metrics[f"pass@{k}"] for k in LADDER_256]
    assert all(a <= b + 1e-12 for a, b in zip(passes, passes[1:]))
    assert metrics["pass@256"] == np.mean([c > 0 for c in problems["num_correct"]])
    assert metrics["pass@1"] == pytest.approx(np.mean(problems["num_correct"]) / 256)
    assert metrics["distinct_answers"] == np.mean([len(c) for c in problems["classes"]])
    assert 0.0 <= metrics["answer_entropy"] <= np.log(256)
    assert all(f"maj@{k}" in metrics for k in LADDER_256)
  for png in (plots.PASS_AT_K_PNG, plots.METRICS_PNG):
    assert (out / png).read_bytes()[:8] == PNG_SIGNATURE
  header = (out / "results.csv").read_text().splitlines()[0].split(",")
  assert {"pass@256", "maj@256", "distinct_answers", "answer_entropy"} <= set(header)

  config.ks = (1, 16)
  runner.run(config)
  assert capsys.readouterr().out.count("evaluated before with these settings") == 2
  again = {r["step"]: r for r in results.load_records(str(out))}
  for record in records:
    stored = json.loads((out / results.STEP_FILE.format(step=record["step"])).read_text())
    assert stored["ks"] == [1, 16] == again[record["step"]]["ks"]
    for name in ("reward", "pass@1", "pass@16", "maj@16", "distinct_answers"):
      assert stored["metrics"][name] == pytest.approx(record["metrics"][name], abs=1e-12)
