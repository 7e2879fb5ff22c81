"""experiments/dynamic_sampling.py: the table from four finished runs (gains, their standard
errors, gains per CPU-minute), the refusal to start from uncommitted code, and (slow) the whole
script on a tiny model, run and then re-run without training again."""

import json
import os

import numpy as np
import pytest

from experiments import dynamic_sampling
from ksjax.run.directory import RunDirectory


@pytest.fixture
def study():
  return dynamic_sampling


def _write(path, data):
  with open(path, "w", encoding="utf-8") as f:
    f.write(data if isinstance(data, str) else json.dumps(data))


def _finished_run(runs_dir, name, start_correct, end_correct, cpu_seconds, steps):
  run = RunDirectory(str(runs_dir / name))
  os.makedirs(run.final_dir)
  for when, correct in (("start", start_correct), ("end", end_correct)):
    _write(run.held_out_json(when), {"num_samples": 16, "metrics": {}, "num_correct": correct})
  rows = [{"step": s, "time/cpu_seconds": cpu_seconds * s / steps} for s in range(1, steps + 1)]
  _write(run.metrics_jsonl, "".join(json.dumps(r) + "\n" for r in rows))
  _write(run.held_out_table, f"table of {name}\n")
  _write(run.config_json, {"workdir": run.workdir})


def test_the_table_has_each_runs_gain_per_cpu_minute(study, tmp_path):
  runs = tmp_path / "runs"
  start = [0, 1, 2, 16]
  ends = {"pass_at_k": [1, 1, 4, 16], "pass_at_k_dynamic": [0, 2, 2, 16],
          "mean": [0, 1, 2, 16], "mean_dynamic": [2, 3, 4, 16]}
  for name, end in ends.items():
    _finished_run(runs, name, start, end, cpu_seconds=240.0, steps=5)
  attempts = {name: [{"commit": "c" * 40, "wall_seconds": 1.0}] for name in ends}
  out = tmp_path / "results"
  text = study.collect(str(runs), str(out), attempts, max_cpu_minutes=4.0, num_steps=10)
  summary = json.loads((out / "summary.json").read_text())
  run = summary["runs"]["pass_at_k"]
  assert run["steps"] == 5 and run["cpu_minutes"] == pytest.approx(4.0)
  pass4 = lambda c: 1 - np.prod([1 - 4 / i for i in range(16 - c + 1, 17)])
  gain = np.mean([pass4(e) - pass4(s) for s, e in zip(start, ends["pass_at_k"])])
  assert run["pass@4"]["gain"] == pytest.approx(gain)
  assert run["pass@4"]["gain_per_cpu_minute"] == pytest.approx(gain / 4.0)
  assert summary["runs"]["mean"]["pass@16"]["gain"] == 0.0
  assert summary["dynamic_minus_static"]["mean"]["pass@4"]["difference"] > 0
  assert "| pass@4 leave-one-out + dynamic sampling | 5 | 4.00 |" in text
  readme = (out / "README.md").read_text()
  assert text in readme and "trained at commit ccccccc" in readme and "smoke" not in readme
  # The trainer records its work directory absolute; the published copy names no local path.
  config = json.loads((out / "mean" / "config.json").read_text())
  assert config["workdir"] == os.path.join("<runs_dir>", "mean")
  assert sorted(os.listdir(out / "mean")) == ["config.json", "eval_end.json", "eval_start.json",
                                              "eval_table.txt", "metrics.jsonl"]


def test_uncommitted_code_is_refused_before_any_run(study, monkeypatch, tmp_path):
  monkeypatch.setattr(study.runs_dir_lib, "dirty", lambda root: True)
  monkeypatch.setattr(study.real_model, "run_config",
                      lambda *a, **k: pytest.fail("a run started from uncommitted code"))
  with pytest.raises(SystemExit, match="uncommitted changes"):
    study.main(["--runs_dir", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
  assert not (tmp_path / "out").exists()


@pytest.mark.slow  # four trainer processes: about a minute on two cores
def test_the_script_runs_the_four_and_a_second_call_trains_nothing(study, tmp_path):
  runs, out = tmp_path / "runs", tmp_path / "out"
  argv = ["--quick", "--runs_dir", str(runs), "--out", str(out)]
  study.main(argv)
  summary = json.loads((out / "summary.json").read_text())
  assert set(summary["runs"]) == set(study.RUNS)
  for name, run in summary["runs"].items():
    # A budget of 0.12 CPU-seconds ends every run after its first step.
    assert run["steps"] == 1 and run["cpu_minutes"] >= study.QUICK_CPU_MINUTES, name
    assert len(summary["attempts"][name]) == 1
  assert "not a measurement" in (out / "README.md").read_text()
  study.main(argv)  # finished runs are collected again, not run again
  again = json.loads((out / "summary.json").read_text())
  assert all(len(a) == 1 for a in again["attempts"].values())
