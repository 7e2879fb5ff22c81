"""Helpers shared by the tests: `from tests.support import REPO, FIXTURES` and the modules
`tests.support.eval_run` (a tiny trained run and its evaluation), `tests.support.resume` (the
kill -9 and resume check), `tests.support.dataset_files`
(small files in the published dataset formats) and `tests.support.objectives_naive` (literal
loop definitions of the k-sample objectives)."""

import importlib.util
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]  # the repository root
FIXTURES = REPO / "tests" / "fixtures"


def load_module(path, name: str):
  """The Python file `path` (e.g. a script in experiments/) as module `name`, registered in
  sys.modules as dataclasses need."""
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module
