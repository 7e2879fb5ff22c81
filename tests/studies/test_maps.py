"""ksjax.studies' maps (cells.py, maps.py) on a toy map of the bandit: two cells (k = 2 and k = 4)
x two arms x three seeds. The map runs cell by cell, mirrors each published pair into another
checkout's directory and commits only those paths there, never runs a mirrored run again, and
reports every cell's paired gap with its interval, without a verdict, from whatever is
published."""

import gzip
import json
import os
import subprocess
import textwrap

import numpy as np
import pytest
from scipy import stats

from tests import support

from ksjax.studies import cells
from ksjax.studies import declaration
from ksjax.studies import maps
from ksjax.studies import store

ARMS = ("mean", "pass_at_k")


def _write(tmp_path):
  """A toy map's registration and declaration, as files (worker processes read the latter)."""
  registration = {
      "study": "toy_map", "exploratory": True, "seeds": [0, 1, 2],
      "arms": {f"{c}__{a}": a for c in ("k2", "k4") for a in ARMS},
      "decision_rule": {"test": "paired_t", "alpha": 0.05, "correction": "holm"},
      "primary": [{"id": f"{c}", "text": "", "a": f"{c}__pass_at_k", "b": f"{c}__mean",
                   "metric": "pass@4"} for c in ("k2", "k4")]}
  (tmp_path / "toy_map.json").write_text(json.dumps(registration))
  path = tmp_path / "toy_map.py"
  path.write_text(textwrap.dedent(f"""
      import sys
      from ksjax.studies import cells
      from ksjax.studies.bandit_runs import BanditRuns
      MAP = cells.Map(
          name="toy_map", root={str(tmp_path)!r}, registration="toy_map.json",
          work=BanditRuns(defaults={{"k": 4, "n": 4, "learning_rate": 1.0, "num_actions": 20,
                                    "groups_per_step": 4, "steps": 20, "checkpoint_every": 10,
                                    "ks": (1, 2, 4)}}),
          arms={{"mean": {{"aggregator": "mean", "baseline": "loo"}},
                "pass_at_k": {{"aggregator": "pass_at_k", "baseline": "loo"}}}},
          a="pass_at_k", b="mean", seeds=(0, 1, 2), out="out", command="python toy_map.py",
          cells=[cells.Cell("k4", "centre", "4", {{}}, {{"pass@k": "pass@4", "pass@1": "pass@1"}}),
                 cells.Cell("k2", "k", "2", {{"k": 2, "n": 2}},
                            {{"pass@k": "pass@2", "pass@1": "pass@1"}})],
          title="Toy map", setup="Setup: the bandit.")
      STUDY = cells.study(MAP)
      if __name__ == "__main__":
        cells.main(MAP, __file__, sys.argv[1:])
      """))
  return path


def _git(repo, *args):
  return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                        cwd=repo, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
  """The toy map run whole with a mirror into a git repository (the 'main checkout'), each pair
  committed there."""
  tmp_path = tmp_path_factory.mktemp("map")
  path = _write(tmp_path)
  main = tmp_path / "main"
  main.mkdir()
  _git(main, "init", "-q")
  (main / "other.txt").write_text("another engineer's uncommitted work\n")
  _git(main, "add", "other.txt")  # staged, and must stay out of the map's commits
  m = declaration.load_module(str(path)).MAP
  cells.main(m, str(path), ["--engine", "submitit-debug", "--allow_dirty", "--workers", "1",
                            "--mirror", str(main / "results"), "--commit"])
  return m, path, tmp_path / "out", main


def test_the_map_runs_cell_by_cell_and_commits_each_run_where_the_mirror_is(toy):
  m, _, out, main = toy
  log = _git(main, "log", "--format=%s", "--name-only").split("\n")
  messages = [line for line in log if line.startswith("toy_map")][::-1]
  # one commit per pair, in the declared order: cell k4 (all seeds) before k2; the report once
  # each cell is whole
  assert [msg.split(":")[1].split(" published")[0].strip() for msg in messages
          if " published at " in msg] == [
              f"{c}__{a}_s{s}" for c in ("k4", "k2") for s in (0, 1, 2) for a in ARMS]
  reports = [i for i, msg in enumerate(messages) if "report regenerated" in msg]
  assert [messages[i].split("(")[-1] for i in reports] == ["cell k4 is whole)", "cell k2 is whole)"]
  assert reports == [6, 13]  # right after each cell's last run
  committed = _git(main, "ls-tree", "-r", "--name-only", "HEAD").split()
  assert "other.txt" not in committed  # staged by someone else: not the map's to commit
  assert not [p for p in committed if "/checkpoints/" in p]  # never the checkpoints
  assert "results/runs/k2__mean_s2/study_done.json" in committed
  assert "results/runs/k2__mean_s2/records/step_00000020.json" in committed


def test_the_report_is_the_paired_gap_with_its_interval_in_every_cell(toy):
  m, _, out, main = toy
  summary = json.loads((out / "summary.json").read_text())
  assert summary["exploratory"] is True
  k2 = summary["cells"]["k2"]
  assert k2["finished"] and k2["seeds"] == [0, 1, 2] and k2["steps"] == [0, 10, 20]
  a = [json.loads((out / "runs" / f"k2__pass_at_k_s{s}" / "records" / "step_00000020.json"
                   ).read_text())["metrics"]["pass@2"] for s in (0, 1, 2)]
  b = [json.loads((out / "runs" / f"k2__mean_s{s}" / "records" / "step_00000020.json"
                   ).read_text())["metrics"]["pass@2"] for s in (0, 1, 2)]
  g = k2["gaps"]["pass@k"]["20"]
  assert g["difference"] == pytest.approx(np.mean(a) - np.mean(b))
  assert g["p_value"] == pytest.approx(stats.ttest_rel(a, b).pvalue)
  assert g["ci_low"] < g["difference"] < g["ci_high"]
  readme = (out / "README.md").read_text()
  assert "**Exploratory**" in readme and "supported" in readme and "2 of 2 cells" in readme
  for name in maps.REPORT_FILES:
    assert (out / name).is_file() and (main / "results" / name).is_file(), name
  # the mirror regenerates the same numbers from its committed records alone
  assert json.loads((main / "results" / "summary.json").read_text())["cells"] == summary["cells"]


def test_mirrored_runs_are_never_run_again_and_an_unfinished_cell_is_not_read(toy, tmp_path):
  m, path, out, main = toy
  clone = tmp_path / "clone"  # a fresh clone's empty output directory
  mark = main / "results" / "runs" / "k2__pass_at_k_s2" / store.MARK
  saved = mark.read_text()
  mark.unlink()  # that run is missing from the main checkout: it runs here, nothing else does
  try:
    cells.main(m, str(path), ["--out", str(clone), "--engine", "submitit-debug",
                              "--allow_dirty", "--mirror", str(main / "results"), "--cells",
                              "k4"])
    assert not (clone / "runs" / "k4__mean_s0" / "checkpoints").exists()  # copied, not rerun
    assert not store.is_published(str(clone), "k2__pass_at_k_s2")  # cell k2 was not asked
    summary = json.loads((clone / "summary.json").read_text())
    assert summary["cells"]["k4"]["finished"]
    assert not summary["cells"]["k2"]["finished"] and summary["cells"]["k2"]["seeds"] == [0, 1]
    assert "k2 (2 of 3 seeds paired)" in (clone / "README.md").read_text()
  finally:
    mark.write_text(saved)


def test_a_cell_pairs_a_seed_only_within_a_machine(toy, tmp_path):
  import shutil
  m, _, out, _ = toy
  copy = tmp_path / "copy"
  shutil.copytree(out, copy)
  mark = copy / "runs" / "k4__mean_s1" / store.MARK
  mark.write_text(json.dumps({**json.loads(mark.read_text()), "machine": "another CPU"}))
  s = maps.cell_summary(m, m.cells[0], str(copy))
  assert s["seeds"] == [0, 2] and "another CPU" in s["left_out"]["1"] and not s["finished"]
  # Published from its pair's machine, but resumed there from another: left out too.
  original = json.loads((out / "runs" / "k4__mean_s1" / store.MARK).read_text())
  mark.write_text(json.dumps({**original, "machines": ["another CPU", original["machine"]]}))
  s = maps.cell_summary(m, m.cells[0], str(copy))
  assert s["seeds"] == [0, 2] and "another CPU" in s["left_out"]["1"]


def test_a_map_with_a_bad_cell_is_one_error(toy):
  import dataclasses
  m = toy[0]
  with pytest.raises(declaration.StudyError, match="expected distinct names"):
    cells.study(dataclasses.replace(m, cells=[m.cells[0], m.cells[0]]))
  with pytest.raises(declaration.StudyError, match="expected the two declared arms"):
    cells.study(dataclasses.replace(m, a="best"))


def test_the_training_log_is_read_with_a_window(tmp_path):
  rows = [{"step": s, "kl/k3": float(s), "note": "text"} for s in (1, 2, 3, 4)]
  rows.insert(3, {"step": 3, "kl/k3": 99.0})  # a resumed run logs step 3 again: the last counts
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  log = maps.trainer_log(str(tmp_path), window=2)
  assert log[1] == {"kl/k3": 1.0} and log[2]["kl/k3"] == 1.5 and log[4]["kl/k3"] == (99.0 + 4.0) / 2
  assert maps.trainer_log(str(tmp_path / "none")) == {}
  packed = tmp_path / "packed"
  packed.mkdir()
  (packed / "metrics.jsonl.gz").write_bytes(gzip.compress((tmp_path / "metrics.jsonl").read_bytes()))
  assert maps.trainer_log(str(packed), window=2) == log  # as a mirror keeps it


def test_a_mirror_copies_records_and_logs_never_checkpoints_or_policies(tmp_path):
  out, into = tmp_path / "out", tmp_path / "into"
  for run in ("start", "a_s0"):
    for path in ("config.json", "metrics.jsonl", "eval/test/step_00000001.json",
                 "checkpoints/1/x", "final/x", "start/x", "tensorboard/x", "tokenizer/x",
                 "eval/test/start/x"):
      (out / "runs" / run / path).parent.mkdir(parents=True, exist_ok=True)
      (out / "runs" / run / path).write_text("1")
    store.publish(str(out), run, {"machine": "cpu A"})
  written = cells.mirror(str(out), str(into), ["start", "a_s0", "b_s0"])
  got = sorted(str(p.relative_to(into)) for p in into.rglob("*") if p.is_file())
  run = ["config.json", "eval/test/start/x", "eval/test/step_00000001.json", "metrics.jsonl.gz",
         store.MARK]
  assert got == sorted([f"runs/a_s0/{p}" for p in run] + [f"runs/start/{p}" for p in run]
                       + ["runs/start/start/x"])  # the shared start's policy alone
  assert sorted(written) == sorted(str(into / "runs" / r) for r in ("start", "a_s0"))
  assert cells.mirror(str(out), str(into), ["start", "a_s0"]) == []  # mirrored already
  packed = into / "runs" / "a_s0" / "metrics.jsonl.gz"
  assert gzip.decompress(packed.read_bytes()) == b"1"  # the step log, compressed
  cells.mirror(str(out), str(tmp_path / "again"), ["a_s0"])
  assert (tmp_path / "again" / "runs" / "a_s0" / "metrics.jsonl.gz").read_bytes() == (
      packed.read_bytes())  # the same bytes from the same log


def test_a_refused_commit_is_said_and_made_with_the_next_run(tmp_path, capsys):
  """A mirror its repository ignores is not committed, and the runner says why; once the
  .gitignore makes an exception, the next run's commit takes the earlier run too."""
  import types
  repo, out = tmp_path / "main", tmp_path / "out"
  repo.mkdir()
  _git(repo, "init", "-q")
  (repo / ".gitignore").write_text("runs/\n")
  into = repo / "results"
  m = types.SimpleNamespace(name="toy")
  names = ["start", "a_s0", "b_s0"]
  for name in names[1:]:
    (out / "runs" / name).mkdir(parents=True)
    (out / "runs" / name / "config.json").write_text(name)
  store.publish(str(out), "a_s0", {"commit": "c" * 40, "machine": "cpu A"})
  cells._mirror_and_commit(m, str(out), str(into), names, True)  # pylint: disable=protected-access
  assert "ignored by a .gitignore" in capsys.readouterr().out
  assert _git(repo, "log", "--oneline", "--all") == ""  # nothing committed
  (repo / ".gitignore").write_text("runs/\n!/results/runs/\n")
  store.publish(str(out), "b_s0", {"commit": "c" * 40, "machine": "cpu A"})
  cells._mirror_and_commit(m, str(out), str(into), names, True)  # pylint: disable=protected-access
  assert _git(repo, "log", "--format=%s").startswith("toy (#65): a_s0, b_s0 published at cccccc")
  assert "results/runs/a_s0/config.json" in _git(repo, "ls-tree", "-r", "--name-only", "HEAD")


def test_a_mirrored_record_names_no_path_of_the_runner(tmp_path):
  """The eval binary records the checkpoint it read, absolute; the mirror writes the runner's
  output directory as a placeholder, and copies every other byte as it is."""
  out, into = tmp_path / "clone" / "results", tmp_path / "main" / "results"
  run = out / "runs" / "k4__mean_s0"
  (run / "eval" / "test").mkdir(parents=True)
  record = {"step": 250, "checkpoint": str(run / "checkpoints" / "250"), "metrics": {"pass@1": 0.5}}
  (run / "eval" / "test" / "step_00000250.json").write_text(json.dumps(record))
  (run / store.MARK).write_text(json.dumps({"machine": "a CPU"}))
  cells.mirror(str(out), str(into), ["k4__mean_s0"])
  mirrored = (into / "runs" / "k4__mean_s0" / "eval" / "test" / "step_00000250.json").read_text()
  assert str(tmp_path) not in mirrored
  assert json.loads(mirrored) == {**record, "checkpoint": os.path.join(
      cells.OUT_PLACEHOLDER, "runs", "k4__mean_s0", "checkpoints", "250")}
  assert store.is_published(str(into), "k4__mean_s0")
