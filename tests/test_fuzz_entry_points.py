"""Fuzzing the entry points' config overrides, `--config.<field>=<garbage>`: every one ends in the
config or in one line and exit status 2, writing nothing (`tests/support/fuzz.py` says why).

The subprocess cases (`python -m ksjax.main`) cost seconds each, so the config overrides are
fuzzed in process through the same parser and validation `ksjax.main` uses, and a handful of
them also through the binary.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import pytest
from absl import flags
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from ml_collections import config_dict, config_flags

from ksjax import config_validation, errors
from ksjax.run import config as run_config
from ksjax.run import spec as spec_lib
from tests import support
from tests.support import REPO
from tests.support.fuzz import SCALE, bounded

CONFIG_FILE = str(REPO / "configs" / "pass_at_k.py")


def _leaf_fields(config, prefix=""):
  out = []
  for key in sorted(config.keys()):
    value = config[key]
    if isinstance(value, config_dict.ConfigDict):
      out += _leaf_fields(value, f"{prefix}{key}.")
    else:
      out.append(prefix + key)
  return out


FIELDS = _leaf_fields(run_config.embedded_task_config())
# What a user might type: numbers of every kind, tuples, Python literals, text; no NUL (argv
# cannot hold it).
override_values = st.one_of(
    st.integers().map(str), st.floats().map(repr), st.sampled_from(
        ["None", "True", "False", "''", "()", "(0,)", "(1,2,3)", "(-1,1,1)", "[]", "{}", "(",
         "1e999", "-0", "nan", "inf", "-1", "0", "1" * 5000, "0x10", "1_000", "Level 2",
         "pass_at_k", "loo", "math", "bandit", "float16", "/nonexistent", "a,b", "1,2", ",",
         "'a'", "\"", "(1,)*1000"]),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
            max_size=12))


def _parse(argv):
  """`ksjax.main`'s flag parsing in process: the config flag and its overrides (on a FlagValues
  of their own), through `config_validation.parse_flags_or_exit`. (config, None) or (None,
  (exit status, stderr))."""
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "config file", flag_values=values,
                                  lock_config=True, sys_argv=argv)
  stderr = io.StringIO()
  saved, flags.FLAGS = flags.FLAGS, values
  try:
    with contextlib.redirect_stderr(stderr):
      config_validation.parse_flags_or_exit(argv)
    return values.config, None
  except SystemExit as e:
    return None, (e.code, stderr.getvalue())
  finally:
    flags.FLAGS = saved


def _validate(config):
  """What `ksjax.main` does with a parsed trainer config before anything else, through its
  error boundary: the TrainSpec, or (exit status, stderr)."""
  stderr = io.StringIO()
  try:
    with contextlib.redirect_stderr(stderr):
      return errors.boundary("ksjax", lambda argv: spec_lib.from_config(config))(["ksjax"]), None
  except SystemExit as e:
    return None, (e.code, stderr.getvalue())


def _one_line_exit_2(failure):
  code, stderr = failure
  lines = [line for line in stderr.splitlines() if line.strip()]
  assert code == 2 and len(lines) == 1 and lines[0].startswith("ksjax: "), (code, stderr)


@pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")  # ml_collections
@settings(max_examples=300 * SCALE, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(overrides=st.lists(st.tuples(st.sampled_from(FIELDS), override_values), min_size=1,
                          max_size=3))
def test_config_overrides_in_process(overrides, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("cwd", numbered=True)
  argv = ["ksjax", f"--config={CONFIG_FILE}"] + [f"--config.{f}={v}" for f, v in overrides]
  with contextlib.chdir(workdir), bounded():
    config, failure = _parse(argv)
    if config is not None:
      spec, failure = _validate(config)
      assert (spec is None) == (failure is not None)
  event("accepted" if failure is None else "refused by the parser" if config is None else
        "refused by the validation")
  if failure is not None:
    _one_line_exit_2(failure)
  assert os.listdir(workdir) == []  # nothing written (the default workdir is relative)


@pytest.mark.parametrize("override, named", [
    ("--config.k=two", "config.k=two"),              # refused by the parser
    ("--config.eval.ks=(0,)", "config.eval.ks=(0,)"),  # refused by the validation
])
def test_config_overrides_through_the_binary(override, named, tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO),
         "XLA_FLAGS": support.xla_flags(1)}
  result = subprocess.run([sys.executable, "-m", "ksjax.main", f"--config={CONFIG_FILE}",
                           override], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=env)
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
  assert named in lines[0]
  assert os.listdir(tmp_path) == []
