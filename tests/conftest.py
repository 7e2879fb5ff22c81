"""Test-session set-up: 8 fake CPU devices for every test, float64 available on request, one
compilation cache per session, and a failed Orbax restore's leftovers kept from crashing the
session (`pytest_configure`).

XLA_FLAGS must be set before jax is first imported, so it happens here at collection time. Tests that
need a single device simply do not shard; multi-device tests build meshes from `jax.devices()`.

The persistent compilation cache (`ksjax.compilation_cache`) goes to a temporary directory
made by the session's first process and removed when it ends: the suite never writes to the
user's cache, and its processes (xdist workers, which inherit the variable and switch the
cache on here, and the binaries tests start) compile each program once. A
KSJAX_COMPILATION_CACHE already set is kept.
"""

import atexit
import os
import shutil
import tempfile

import pytest

from tests import support

os.environ.setdefault("XLA_FLAGS", support.xla_flags(8))  # its processes inherit them
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Fewer threads per test process: the suite runs with pytest-xdist on small machines.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
if "KSJAX_COMPILATION_CACHE" not in os.environ:
  os.environ["KSJAX_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="ksjax-tests-jax-cache-")
  atexit.register(shutil.rmtree, os.environ["KSJAX_COMPILATION_CACHE"], ignore_errors=True)
# The test processes themselves use the same cache, as the binaries do: many tests compile the
# same programs (a tiny model's update, sampler and evaluation), and the two xdist workers and
# the binaries each compiled them again (17% of the suite's wall time on a 2-core EPYC).
from ksjax import compilation_cache, errors  # pylint: disable=g-import-not-at-top

compilation_cache.configure("pytest")


@pytest.hookimpl(trylast=True)  # after pytest's own unraisable-exception plugin installs its hook
def pytest_configure(config):
  """Drops failed Orbax restores' leftovers (`ksjax.errors.is_orbax_leftover`) before pytest's
  unraisable hook sees them: for every test and the whole session, as they arrive late (during a
  later test, or at the session's end) and from any test that makes a restore fail (the fuzz,
  checksum and eval binary tests damage checkpoints on purpose).

  A failed restore leaves TensorStore reads running; their callbacks, on TensorStore's own threads
  and after the exception, report "Event loop is closed" to sys.unraisablehook. pytest's hook
  formats them with Python 3.11's caret anchors, i.e. ast.parse; when that races pytest's own
  ast.parse of a traceback on the main thread (an xfail's, a failure's), CPython 3.11 (3.11.7
  here) raises "AST constructor recursion depth mismatch" and the session ends in an
  INTERNALERROR. The abandoned read coroutines, finalized later by the garbage collector, would
  only add warnings about a failure the test expected (an unraisable exception each, and a
  RuntimeWarning for one never awaited). Any other unraisable exception or warning is reported as
  before.
  """
  config.addinivalue_line(
      "filterwarnings",
      "ignore:coroutine '_read_array_index_and_device_put' was never awaited:RuntimeWarning")
  errors.drop_orbax_leftovers()  # the binaries' own hook (their boundary installs it too)
