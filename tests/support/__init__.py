"""Helpers shared by the tests: `from tests.support import REPO, FIXTURES` and the modules
`tests.support.eval_run` (a tiny trained run and its evaluation), `tests.support.resume` (the
kill -9 and resume check), `tests.support.full_disk` (a full disk, simulated),
`tests.support.dataset_files` (small files in the published dataset formats) and
`tests.support.objectives_naive` (literal loop definitions of the k-sample objectives)."""

import importlib.util
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]  # the repository root
FIXTURES = REPO / "tests" / "fixtures"


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for the suite's processes: `devices` fake CPU devices, and LLVM's optimisation
  level 0. The suite's programs are small, so compiling them is most of a test's time
  (tests/model/test_logprobs.py: 88 s against 124 at the default level); the level changes how
  the code generator optimises the kernels, not what a program computes."""
  return f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"


def load_module(path, name: str):
  """The Python file `path` (e.g. a script in experiments/) as module `name`, registered in
  sys.modules as dataclasses need."""
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module
