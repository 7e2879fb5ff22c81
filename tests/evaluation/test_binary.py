"""`python -m ksjax.eval` on checkpoints written by the real trainer: results, sharded restore,
watch mode, and every bad input as one line, exit status 2 and nothing written."""

from __future__ import annotations

import csv
import json
import os
import pathlib
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from ksjax import model
from ksjax.config_validation import ConfigError
from ksjax.evaluation import results, runner
from ksjax.objectives import estimates as estimators
from ksjax.run import checkpoints
from ksjax.run.directory import locate
from ksjax.evaluation import settings as settings_lib

from tests.support import eval_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, worker_id) -> pathlib.Path:
  return eval_run.tiny_run(eval_run.session_dir(tmp_path_factory, worker_id))


def _eval_dir(run: pathlib.Path) -> pathlib.Path:
  (only,) = (run / "eval").iterdir()
  return only


_copy_run = eval_run.copy_run


def _tree(path: pathlib.Path) -> dict[str, tuple[int, int]]:
  return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
          for p in path.rglob("*")}


def test_every_step_evaluated_with_consistent_files(run_dir):
  out = _eval_dir(run_dir)
  assert out.name == "test_n4_t1_p1"
  records = results.load_records(str(out))
  assert [r["step"] for r in records] == [1, 2, 3]
  for record in records:
    assert record["num_problems"] == 6 and record["num_samples"] == 4
    assert record["sampling"]["temperature"] == 1.0 and record["sampling"]["split"] == "test"
    problems = record["problems"]
    assert problems["level"] == [1, 1, 1, 2, 2, 2]
    # Every metric is the mean of its per-problem estimate, recomputed from the stored counts.
    c = np.asarray(problems["num_correct"])
    for k in (1, 2, 4):
      assert record["metrics"][f"pass@{k}"] == pytest.approx(
          estimators.pass_at_k(c, 4, k).mean(), abs=1e-12)
      maj = [estimators.majority_at_k(tuple(tuple(x) for x in sorted(cls)), k)
             for cls in problems["classes"]]
      assert record["metrics"][f"maj@{k}"] == pytest.approx(np.mean(maj), abs=1e-12)
    for level in (1, 2):
      group = record["groups"][f"level={level}"]
      assert group["num_problems"] == 3
      rows = slice(0, 3) if level == 1 else slice(3, 6)
      assert group["pass@1"] == pytest.approx(c[rows].mean() / 4, abs=1e-12)
    assert sum(size for cls in problems["classes"] for size, _ in cls) == 6 * 4
  with open(out / "results.csv", newline="") as f:
    table = list(csv.DictReader(f))
  assert [(r["step"], r["group"]) for r in table] == [
      (str(s), g) for s in (1, 2, 3) for g in ("all", "level=1", "level=2")]
  assert float(table[0]["pass@4"]) == pytest.approx(records[0]["metrics"]["pass@4"])
  for png in ("pass_at_k.png", "metrics_vs_step.png"):
    assert (out / png).read_bytes()[:8] == PNG_SIGNATURE
  stdout = (run_dir / "eval_stdout.txt").read_text()
  assert "step 3: 6 problems x 4 samples in" in stdout and "samples/s" in stdout
  assert "mesh {'data': 1, 'fsdp': 2, 'tensor': 2}" in stdout


_configured = eval_run.configured


def test_last_n_reuses_records_and_writes_their_average(run_dir, tmp_path, capsys):
  run = _copy_run(run_dir, tmp_path / "run")
  runner.run(_configured(run, steps="last:2"))
  assert capsys.readouterr().out.count("evaluated before with these settings") == 2
  out = _eval_dir(run)
  averaged = json.loads((out / "average_last2.json").read_text())
  steps = {r["step"]: r for r in results.load_records(str(out))}
  assert averaged["steps"] == [2, 3]
  for name, value in averaged["metrics"].items():
    assert value == pytest.approx((steps[2]["metrics"][name] + steps[3]["metrics"][name]) / 2)
  assert averaged["groups"]["level=2"]["pass@2"] == pytest.approx(
      (steps[2]["groups"]["level=2"]["pass@2"] + steps[3]["groups"]["level=2"]["pass@2"]) / 2)
  with open(out / "average_last2.csv", newline="") as f:
    assert [r["group"] for r in csv.DictReader(f)] == ["all", "level=1", "level=2"]


def test_restore_is_the_trained_policy_sharded_on_the_eval_mesh(run_dir):
  mesh = model.make_mesh((1, 2, 2))
  final, cfg = model.load_checkpoint(str(run_dir / "final"))
  run = locate(str(run_dir))
  assert checkpoints.steps(run) == [1, 2, 3]
  graphdef, target = checkpoints.abstract_policy(cfg, mesh)
  restored = checkpoints.restore_policy(run, 3, graphdef, target)
  want = nnx.to_flat_state(nnx.state(final))
  got = dict(nnx.to_flat_state(nnx.state(restored)))
  assert len(want) == len(got)
  for path, variable in want:
    np.testing.assert_array_equal(np.asarray(got[path][...]), np.asarray(variable[...]))
  q = restored.layers[0].self_attn.q_proj[...]
  assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)
  assert len(q.sharding.device_set) == 4


def _evaluator(run: pathlib.Path, **overrides) -> runner.Evaluator:
  config = _configured(run, **overrides)
  s = settings_lib.validate(config)
  task = runner.open_task(s)
  cfg = runner.policy_config(s.run, task.tokenizer.vocab_size)
  return runner.Evaluator(s, locate(str(run)), task, task.prompts("test"), cfg,
                          model.make_mesh((1, 1, 1)), str(run / "eval" / "watch"))


def test_watch_evaluates_each_checkpoint_as_it_lands(run_dir, tmp_path, monkeypatch):
  run = _copy_run(run_dir, tmp_path / "run", steps=(1,), with_eval=False)
  evaluator = _evaluator(run, watch=True, idle_timeout_s=5.0, poll_interval_s=1.0)
  evaluated, now = [], [0.0]

  def evaluate(step):
    evaluated.append((step, now[0]))

  def sleep(seconds):  # the trainer saves steps 2 and 3 while the evaluator waits
    now[0] += seconds
    if now[0] in (2.0, 3.0):
      step = int(now[0])
      shutil.copytree(run_dir / "checkpoints" / str(step), run / "checkpoints" / str(step))

  monkeypatch.setattr(evaluator, "evaluate", evaluate)
  runner.follow(evaluator, evaluator.settings, done=set(), clock=lambda: now[0], sleep=sleep)
  assert evaluated == [(1, 0.0), (2, 2.0), (3, 3.0)]
  assert now[0] == 8.0  # stopped once 5 s passed after the last new checkpoint


def test_watch_mode_stops_when_idle(run_dir, tmp_path, capsys):
  run = _copy_run(run_dir, tmp_path / "run")
  runner.run(_configured(run, watch=True, idle_timeout_s=0.0, poll_interval_s=0.1))
  out = capsys.readouterr().out
  assert out.count("evaluated before with these settings") == 3
  assert "no new checkpoint for 0s; stopping" in out


def test_a_step_that_is_not_there_is_refused_before_writing(run_dir, tmp_path):
  run = _copy_run(run_dir, tmp_path / "run", with_eval=False)
  with pytest.raises(ConfigError, match=r"config.steps='2,7': no checkpoint of step 7 in .*; "
                     "the steps there are 1, 2, 3"):
    runner.run(_configured(run, steps="2,7"))
  assert not os.path.exists(run / "eval")


BAD_INPUTS = {
    "missing directory": ("{tmp}/no_such_run", (), "does not exist"),
    "no checkpoints": ("{tmp}/empty", (), "holds no checkpoints"),
    "other model shape": ("{run}", ("--config.run.model.hidden_size=32",),
                          "has parameter 'embed_tokens' of shape (100, 64)"),
    "k larger than n": ("{run}", ("--config.num_samples=2",),
                        "config.ks=(1, 2, 4) is not accepted with config.num_samples=2"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2_and_nothing_written(case, run_dir, tmp_path):
  run = _copy_run(run_dir, tmp_path / "run", with_eval=False)
  (tmp_path / "empty").mkdir()
  directory, extra, message = BAD_INPUTS[case]
  before = _tree(tmp_path)
  result = eval_run.run_eval(directory.format(tmp=tmp_path, run=run), *extra)
  assert result.returncode == 2, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("ksjax.eval: ") and message in lines[0], lines
  assert _tree(tmp_path) == before
  assert not os.path.exists(run / "eval")
