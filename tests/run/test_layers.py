"""The package's layers, read from the code: the trainer and the evaluation are siblings over the
run layer, nothing below them imports either, and no module reaches into another package's
private names. Also the run directory's layout and atomic files."""

import ast
import os
import pathlib
import subprocess
import sys

import pytest

from ksjax import files
from ksjax.run import directory
from tests import support

PACKAGE = support.REPO / "ksjax"
BELOW = ("objectives", "model", "sampling", "tasks", "run", "bandit")


def _modules():
  for path in sorted(PACKAGE.rglob("*.py")):
    yield path, ast.parse(path.read_text(), filename=str(path))


def _imports(tree):
  """(module imported, names taken from it) for every import in a file, lazy ones included."""
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield alias.name, ()
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      yield node.module, tuple(alias.name for alias in node.names)


def _package(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE).parts
  return parts[0] if len(parts) > 1 else parts[0][:-3]


def test_nothing_below_the_trainer_and_the_evaluation_imports_either():
  bad = []
  for path, tree in _modules():
    package = _package(path)
    for module, names in _imports(tree):
      targets = [module] + [f"{module}.{n}" for n in names]
      hits_trainer = any(t.startswith("ksjax.trainer") for t in targets) or (
          module == "ksjax" and "trainer" in names)
      hits_evaluation = any(t.startswith("ksjax.evaluation") for t in targets) or (
          module == "ksjax" and "evaluation" in names)
      if package in BELOW and (hits_trainer or hits_evaluation):
        bad.append(f"{path.relative_to(support.REPO)} imports {module}")
      if package == "trainer" and hits_evaluation:
        bad.append(f"{path.relative_to(support.REPO)} imports {module}")
      if package in ("evaluation", "eval") and hits_trainer:
        bad.append(f"{path.relative_to(support.REPO)} imports {module}")
  assert not bad, bad


def test_no_module_imports_a_private_name_of_another_package():
  bad = []
  for path, tree in _modules():
    package = _package(path)
    for module, names in _imports(tree):
      if not module.startswith("ksjax"):
        continue
      other = module.split(".")[1] if "." in module else None
      private = [n for n in names if n.startswith("_") and not n.startswith("__")]
      if private and other != package:
        bad.append(f"{path.relative_to(support.REPO)}: from {module} import {private}")
  assert not bad, bad


def test_the_eval_binary_never_imports_the_trainer():
  code = ("import sys; from ksjax import eval as binary; from ksjax.evaluation import runner; "
          "bad = sorted(m for m in sys.modules if m.startswith('ksjax.trainer')); "
          "assert not bad, bad")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=support.REPO, timeout=120)


def test_the_run_directory_names_every_path(tmp_path):
  run = directory.RunDirectory(str(tmp_path / "run"))
  assert run.steps_dir == str(tmp_path / "run" / "checkpoints")
  assert run.state_dir(7) == str(tmp_path / "run" / "checkpoints" / "7" / "state")
  assert run.held_out_json("end").endswith("eval_end.json")
  with pytest.raises(ValueError, match="'start' or 'end'"):
    run.held_out_json("middle")
  assert not run.has_checkpoints()
  os.makedirs(run.step_dir(3))
  assert run.has_checkpoints()
  # The eval binary accepts the workdir or its checkpoints folder; nothing else is a run.
  assert directory.locate(run.workdir) == run
  assert directory.locate(run.steps_dir) == run
  assert directory.locate(str(tmp_path / "missing")) is None


def test_atomic_files_leave_the_old_file_when_writing_fails(tmp_path):
  path = str(tmp_path / "a.json")
  files.write_json(path, {"x": 1})

  def fail(tmp):
    with open(tmp, "w", encoding="utf-8") as f:
      f.write("half")
    raise OSError("disk full")

  with pytest.raises(OSError, match="disk full"):
    files.atomic_write(path, fail)
  assert pathlib.Path(path).read_text() == '{\n "x": 1\n}\n'
  assert os.listdir(tmp_path) == ["a.json"]  # no temporary file left behind
