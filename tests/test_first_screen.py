"""The first screen of a run: ksjax's own line comes first, not a library's INFO line (jax's
"Unable to initialize backend 'tpu'" on every CPU host), unless the user asked for log lines; and
a resume with nothing to resume from says, once, that it starts fresh.

The runs go through the binaries as a user starts them: without the suite's JAX_PLATFORMS=cpu
(with it, jax never probes for a TPU and the line this is about never comes) and without its
TF_CPP_MIN_LOG_LEVEL.
"""

import logging
import re
import subprocess
import sys

import pytest
from absl import logging as absl_logging

from ksjax import errors
from tests import support
from tests.trainer import test_run

# A log line in absl's format ("I1126 10:50:22.242253 1398... xla_bridge.py:849] ...") or in
# Python logging's default one, which jax's own handler uses ("INFO:2026-11-26 ...:jax._src...").
LOG_LINE = re.compile(r"^([IWEF]\d{4} |(DEBUG|INFO|WARNING|ERROR|CRITICAL):)")
ABSL_INFO = re.compile(r"^I\d{4} ")
# Where a user's environment could already ask for (or silence) log lines.
LOGGING_ENV = ("JAX_PLATFORMS", "TF_CPP_MIN_LOG_LEVEL", "JAX_LOGGING_LEVEL",
               "JAX_DEBUG_LOG_MODULES")


def _env(**extra):
  env = {k: v for k, v in test_run._env().items() if k not in LOGGING_ENV}
  return {**env, **extra}


def _run(command, env, timeout=300):
  """stdout and stderr as one stream, in the order written (ksjax prints with flush=True, absl's
  handler flushes each record)."""
  result = subprocess.run(command, cwd=support.REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout, check=False)
  assert result.returncode == 0, result.stdout
  return [line for line in result.stdout.splitlines() if line.strip()]


def _plan(*flags):
  """`ksjax.tools.plan --exact_only`: an entry point through the same boundary that starts jax's
  backends, in seconds."""
  return [sys.executable, "-m", "ksjax.tools.plan", "--config=configs/pass_at_k.py",
          "--exact_only", *flags]


def _assert_first_line_is_ksjax(lines, first):
  assert lines and lines[0].startswith(first), "\n".join(lines[:5])
  assert not any(ABSL_INFO.match(line) for line in lines), "\n".join(lines)


@pytest.mark.slow  # a whole trainer run (about 25 s); the plan test below checks the same boundary
def test_a_trainer_run_opens_with_its_own_line_and_a_resume_of_nothing_says_fresh_once(tmp_path):
  workdir = tmp_path / "run"
  lines = _run(test_run._main(str(workdir), num_steps=1, resume=True), _env())
  _assert_first_line_is_ksjax(lines, "model: ")
  said = [line for line in lines if "no checkpoint" in line]
  assert said == [f"resume=True: {workdir} holds no checkpoint; starting a fresh run"], lines


def test_a_plan_opens_with_its_own_line():
  _assert_first_line_is_ksjax(_run(_plan(), _env()), "model: ")


@pytest.mark.parametrize("flags,env,expected", [
    (("--verbosity=0",), {}, r"^I\d{4} .*xla_bridge\.py"),
    (("--logtostderr",), {}, r"^I\d{4} .*xla_bridge\.py"),
    ((), {"JAX_LOGGING_LEVEL": "INFO"}, r"jax\._src\.xla_bridge"),
], ids=["verbosity", "logtostderr", "JAX_LOGGING_LEVEL"])
def test_library_log_lines_come_when_asked_for(flags, env, expected):
  lines = _run(_plan(*flags), _env(**env))
  assert any(re.search(expected, line) for line in lines), "\n".join(lines)


def test_the_boundary_leaves_logging_alone_outside_app_run():
  """In a process absl's app.run did not start (a test, a library user), the logging levels are
  the process's own: the boundary changes neither the root logger's nor absl's verbosity."""
  root, verbosity = logging.getLogger().level, absl_logging.get_verbosity()
  errors.boundary("test", lambda argv: None)(["test"])
  assert (logging.getLogger().level, absl_logging.get_verbosity()) == (root, verbosity)
