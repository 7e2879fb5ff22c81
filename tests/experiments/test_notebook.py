"""experiments/analysis.ipynb runs headless (nbclient, kernel "python3") on a tiny trainer run
that the eval binary has evaluated, and shows its figures, table and sampled completions."""

from __future__ import annotations

import re

import nbformat
import pytest
from nbclient import NotebookClient

from tests.support import eval_run

NOTEBOOK = eval_run.REPO / "experiments" / "analysis.ipynb"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, worker_id):
  return eval_run.tiny_run(eval_run.session_dir(tmp_path_factory, worker_id))


def _outputs(cell, kind):
  return [o for o in cell.get("outputs", []) if o["output_type"] == kind]


def test_notebook_runs_on_a_tiny_run(run_dir, tmp_path, monkeypatch):
  monkeypatch.setenv("KSJAX_RUN_DIRS", str(run_dir))
  monkeypatch.setenv("KSJAX_SAMPLE_PROMPTS", "2")
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  # The first code cell installs ksjax only in Colab; the parameters cell is tagged for papermill.
  code = [c for c in notebook.cells if c.cell_type == "code"]
  assert "google.colab" in code[0].source and "pip install" in code[0].source
  assert "parameters" in code[1].metadata.get("tags", [])
  NotebookClient(notebook, kernel_name="python3", timeout=240,
                 resources={"metadata": {"path": str(tmp_path)}}).execute()

  code = [c for c in notebook.cells if c.cell_type == "code"]
  assert not any(_outputs(c, "error") for c in code)
  images = [o for c in code for o in _outputs(c, "display_data") if "image/png" in o["data"]]
  assert len(images) == 3  # metric vs step, metric vs KL, pass@k vs k
  table = [o["data"]["text/markdown"] for c in code for o in _outputs(c, "display_data")
           if "text/markdown" in o["data"]]
  assert len(table) == 1
  header, _, row = table[0].splitlines()
  assert header.split(" | ")[-3:] == ["pass@1", "pass@10", "pass@100 |"]
  # n = 4 samples per problem: pass@1 is a number, pass@10 and pass@100 cannot be estimated.
  assert "eval_tiny_run (pass_at_k/loo)" in row and "6 x 4" in row and "n/a (n = 4)" in row
  printed = "".join(o.get("text", "") for c in code for o in _outputs(c, "stream"))
  assert "evaluated checkpoints [1, 2, 3]" in printed
  completions = [line for line in printed.splitlines() if re.match(r"  \[[+-]\d\] ['\"]", line)]
  assert "step 3: " in printed and len(completions) == 4  # 2 problems x 2 completions
