"""The step log's writers: TensorBoard events without PyTorch in the trainer's process."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir)

# Writes one step through MetricsWriter in a fresh interpreter and reports what it imported.
_WRITE = """
import json, sys
{before}
from ksjax.run.directory import RunDirectory
from ksjax.trainer import metrics
w = metrics.MetricsWriter(RunDirectory(sys.argv[1]))
w.write(1, {{"reward/mean": 0.25}})
w.close()
print(json.dumps({{"torch": "torch" in sys.modules and sys.modules["torch"] is not None}}))
"""


def _write_one_step(workdir, before=""):
  out = subprocess.run([sys.executable, "-c", _WRITE.format(before=before), str(workdir)],
                       cwd=ROOT, check=True, capture_output=True, text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def test_tensorboard_events_are_written_without_importing_torch(tmp_path):
  pytest.importorskip("torch")  # the test extra installs it: what tensorboardX would import
  imported = _write_one_step(tmp_path)
  assert not imported["torch"]
  events = os.listdir(tmp_path / "tensorboard")
  assert len(events) == 1 and events[0].startswith("events.out.tfevents")
  assert b"reward/mean" in (tmp_path / "tensorboard" / events[0]).read_bytes()
  with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:
    assert json.loads(f.readline()) == {"step": 1, "reward/mean": 0.25}


def test_a_process_that_imported_torch_keeps_it(tmp_path):
  pytest.importorskip("torch")
  imported = _write_one_step(tmp_path, before="import torch")
  assert imported["torch"]
