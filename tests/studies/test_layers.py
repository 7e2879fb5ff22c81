"""ksjax.studies imports nothing from experiments/ or tests/: a declaration imports the library,
never the other way round. (Its place above the trainer and the eval binary, with nothing below
importing it: tests/run/test_layers.py.)"""

import ast

from tests import support


def _imports(path) -> set[str]:
  names = set()
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
  return names


def test_the_studies_import_no_experiment_and_no_test():
  mine = list((support.REPO / "ksjax" / "studies").glob("*.py"))
  assert mine and not [str(p) for p in mine
                       if any(n.split(".")[0] in ("experiments", "tests") for n in _imports(p))]
