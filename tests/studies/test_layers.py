"""ksjax.studies sits above the trainer and the eval binary: nothing else in the package imports
it, and it imports nothing from experiments/."""

import ast
import pathlib

from tests import support


def _imports(path: pathlib.Path) -> set[str]:
  names = set()
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
  return names


def test_nothing_below_imports_the_studies_and_they_import_no_experiment():
  package = support.REPO / "ksjax"
  studies = package / "studies"
  below = [p for p in package.rglob("*.py") if studies not in p.parents]
  assert below and not [str(p) for p in below
                        if any(n.startswith("ksjax.studies") for n in _imports(p))]
  mine = list(studies.glob("*.py"))
  assert mine and not [str(p) for p in mine
                       if any(n.split(".")[0] in ("experiments", "tests") for n in _imports(p))]
