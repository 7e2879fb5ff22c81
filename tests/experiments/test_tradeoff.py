"""experiments/tradeoff.py, a declaration over ksjax.studies: it matches its registration, its runs
share budget and start, and it regenerates the published report byte for byte, training nothing.
(The library's own properties: tests/studies/.)"""

import dataclasses
import filecmp
import json
import os
import shutil

import pytest
from tests import support

from ksjax.evaluation import preregistration
from ksjax.studies import cli
from ksjax.studies import declaration
from ksjax.studies import verdicts

SCRIPT = str(support.REPO / "experiments" / "tradeoff.py")
PUBLISHED = support.REPO / "experiments" / "results" / "tradeoff"


@pytest.fixture(scope="module")
def tradeoff():
  return declaration.load(SCRIPT)


def test_the_declaration_runs_as_registered(tradeoff):
  prereg = preregistration.load(tradeoff.path(tradeoff.registration))
  declaration.check(tradeoff, prereg)
  assert verdicts.departures(tradeoff, prereg, list(tradeoff.arms), tradeoff.seeds) == []
  assert verdicts.departures(tradeoff, prereg, ["mean", "pass_at_k"], (0, 1, 2))[0].startswith(
      "seeds=(0, 1, 2)")
  steps = dict(tradeoff.settings, steps=300)
  departed = verdicts.departures(dataclasses.replace(tradeoff, settings=steps), prereg,
                                 list(tradeoff.arms), tradeoff.seeds)
  assert departed == ["steps=300 (registered: 200)"]


def test_run_configs_share_budget_and_start(tradeoff, tmp_path):
  from ksjax.tasks import synthetic
  work = tradeoff.work
  start = work.start_config(str(tmp_path))
  assert start.num_steps == 0 and start.sft_warmup.steps == 400
  for run in declaration.runs_of(tradeoff, list(tradeoff.arms), tradeoff.seeds):
    config = work.run_config(str(tmp_path), run.name, tradeoff.arms[run.arm], run.seed)
    assert config.batch_prompts * (config.n or config.k) == 64
    assert config.init_checkpoint == os.path.join(str(tmp_path), "runs", "start", "start")
    assert (config.num_steps, config.k, config.seed) == (200, 4, run.seed)
    assert config.synthetic.modulus == 50 and tuple(config.synthetic.levels) == (2, 3)
    # room for the longest level-3 solution and its EOS
    assert config.max_new_tokens >= synthetic.max_solution_chars(50, 3) + 1
  assert config.aggregator == "pass_at_k" and config.baseline == "loo_demeaned"  # biased


def test_the_published_report_regenerates_byte_for_byte_training_nothing(tradeoff, tmp_path,
                                                                          capsys):
  out = tmp_path / "tradeoff"
  shutil.copytree(PUBLISHED, out)
  cli.main(tradeoff, SCRIPT, ["--out", str(out)])
  assert "runs to train" not in capsys.readouterr().out
  compared = filecmp.dircmp(PUBLISHED, out)
  assert compared.diff_files == [] and compared.left_only == compared.right_only == []
  for name in ("README.md", "summary.json", "provenance.json", "timing.json", "table.md",
               "metrics_vs_step.png", "metrics_vs_kl.png", "pass_at_k_vs_k.png"):
    assert (out / name).read_bytes() == (PUBLISHED / name).read_bytes(), name
  verdict = {r["id"]: r["verdict"] for r in json.loads((out / "summary.json").read_text())[
      "statements"]}
  assert verdict["P2"] == "supported: pass_at_k below mean (Holm p = 0.0196)"


def test_an_unknown_arm_is_one_line_and_exit_2(tradeoff, tmp_path, capsys):
  with pytest.raises(SystemExit) as exited:
    cli.main(tradeoff, SCRIPT, ["--out", str(tmp_path / "bad"), "--arms", "mean,best_of_n"])
  err = capsys.readouterr().err
  assert exited.value.code == 2 and err.count("\n") == 1
  assert "--arms='mean,best_of_n'; expected a comma-separated subset of" in err
  assert not (tmp_path / "bad").exists()


def test_a_bad_override_is_one_line_before_anything_runs(tradeoff, tmp_path, capsys):
  arms = {**tradeoff.arms, "mean": {"config": "configs/mean.py", "lerning_rate": 1e-3}}
  with pytest.raises(SystemExit) as exited:
    cli.main(dataclasses.replace(tradeoff, arms=arms), SCRIPT, ["--out", str(tmp_path / "o")])
  err = capsys.readouterr().err
  assert exited.value.code == 2 and err.count("\n") == 1
  assert err.startswith("study tradeoff: arm 'mean': config.lerning_rate is not a field")
  assert not (tmp_path / "o").exists()
