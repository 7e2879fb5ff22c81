"""The binaries' command lines: a misspelled or mistyped override is one line and exit status 2."""

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("binary,config,override,named", [
    ("ksjax.main", "configs/pass_at_k.py", "--config.learning_rat=0.1", "learning_rat"),
    ("ksjax.main", "configs/bandit.py", "--config.num_actions=many", "num_actions"),
    ("ksjax.eval", "configs/eval.py", "--config.num_sample=3", "num_sample"),
])
def test_bad_override_is_one_line_exit_2_and_writes_nothing(tmp_path, binary, config, override,
                                                            named):
  workdir = tmp_path / "run"
  result = subprocess.run(
      [sys.executable, "-m", binary, f"--config={config}", override,
       *([f"--config.workdir={workdir}"] if binary == "ksjax.main" else [])],
      cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  lines = [l for l in result.stderr.splitlines() if l.strip()]
  assert result.returncode == 2, result.stderr
  assert len(lines) == 1 and named in lines[0], result.stderr
  assert not workdir.exists()
