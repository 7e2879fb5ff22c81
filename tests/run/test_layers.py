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
# ksjax's layers, lowest first. A module may import modules of its own package and of lower
# layers only: never one of its own layer (so the trainer and the evaluation, siblings over the
# run layer, never import each other) and never one above. A new top-level module or package
# must be placed here, so that its place is a decision, not an accident.
LAYERS = (
    ("config_validation", "machine", "files"),  # the standard library only
    ("config_fields", "compilation_cache"),
    ("errors", "allocator", "lora_options", "stopping"),
    ("objectives", "model"),  # the mathematics; the Llama and its checkpoints
    ("tokenization", "sampling", "distributed", "bandit"),
    ("tasks",),
    ("run",),  # the run spec, checkpoints, the policy, scoring
    ("trainer", "evaluation"),
    ("tools", "eval", "main", "studies", "__init__"),  # entry points and what drives them
)
LAYER = {package: i for i, packages in enumerate(LAYERS) for package in packages}


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


def _imported_packages(module: str, names) -> list[str]:
  """The ksjax packages or top-level modules an import reaches: `ksjax.run.spec` -> run,
  `from ksjax import trainer, files` -> trainer, files."""
  if module == "ksjax":
    return list(names)
  if module.startswith("ksjax."):
    return [module.split(".")[1]]
  return []


def test_every_module_has_a_layer():
  unplaced = sorted({_package(path) for path, _ in _modules()} - set(LAYER))
  assert not unplaced, f"place these in LAYERS: {unplaced}"


def test_no_module_imports_its_own_layer_or_one_above():
  bad = []
  for path, tree in _modules():
    package = _package(path)
    for module, names in _imports(tree):
      for other in _imported_packages(module, names):
        if other != package and other in LAYER and LAYER[other] >= LAYER.get(package, -1):
          bad.append(f"{path.relative_to(support.REPO)} (layer {LAYER.get(package)}) imports "
                     f"{module} (layer {LAYER[other]})")
  assert not bad, bad


def test_the_layer_check_sees_an_arrow_up(tmp_path):
  """The check itself: an import from the model to the run layer, as lora.py once had, is
  found."""
  tree = ast.parse("from ksjax.run.spec import LoraSpec\nfrom ksjax import trainer\n")
  found = [other for module, names in _imports(tree)
           for other in _imported_packages(module, names)]
  assert found == ["run", "trainer"]
  assert all(LAYER[other] > LAYER["model"] for other in found)


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
