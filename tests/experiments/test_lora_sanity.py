"""experiments/lora_sanity.py: which full run a seed's LoRA run is set beside, read from the
committed records (no training)."""

import json
import os
import shutil

import pytest
from tests import support

SCRIPT = os.path.join(str(support.REPO), "experiments", "lora_sanity.py")
RESULTS = os.path.join(str(support.REPO), "experiments", "results")


@pytest.fixture(scope="module")
def sanity():
  return support.load_module(SCRIPT, "ksjax_experiments_lora_sanity")


def _copy_run(src: str, out: str, name: str, machines=None) -> str:
  target = os.path.join(out, name)
  shutil.copytree(src, target)
  if machines is not None:  # the same records, published as from another machine
    path = os.path.join(target, "published.json")
    pub = json.load(open(path, encoding="utf-8"))
    json.dump({**pub, "machines": machines}, open(path, "w", encoding="utf-8"))
  return target


def test_a_seeds_full_run_is_the_first_published_on_its_lora_runs_machine(sanity, tmp_path):
  lora_out, study, pilot = (str(tmp_path / d) for d in ("lora", "study", "pilot"))
  lora = _copy_run(os.path.join(RESULTS, "lora_sanity", "pass_at_k_lora_s0"), lora_out,
                   "pass_at_k_lora_s0")
  machines = json.load(open(os.path.join(lora, "published.json")))["machines"]
  full_src = os.path.join(RESULTS, "decisive_study_7f27d15", "pass_at_k_s0")
  outs = [study, pilot, lora_out]
  d = sanity.lora_design()

  assert sanity.full_run(0, machines, outs) is None
  assert "seed 0: no full run on its LoRA run's machine yet" in sanity.report(d, lora_out, outs,
                                                                               [0])
  _copy_run(full_src, pilot, "pass_at_k_s0")
  # A run of the same seed in the study, but from another machine, is passed over.
  _copy_run(full_src, study, "pass_at_k_s0", machines=["another CPU"])
  assert sanity.full_run(0, machines, outs) == pilot
  text = sanity.report(d, lora_out, outs, [0])
  full_row = next(line for line in text.splitlines() if line.startswith("| 0 | full |"))
  assert "| 7f27d15 |" in full_row and "pilot/pass_at_k_s0" in text
  lora_row = next(line for line in text.splitlines() if line.startswith("| 0 | LoRA r16 |"))
  assert "| d2b5d4f |" in lora_row
  diff = next(line for line in text.splitlines() if line.startswith("| 0 | LoRA − full |"))
  cells = lambda row: [c.strip() for c in row.split("|")[3:8]]  # noqa: E731
  assert [float(x) for x in cells(diff)] == pytest.approx(
      [float(a) - float(b) for a, b in zip(cells(lora_row), cells(full_row))], abs=1.5e-3)

  # The study's own run on the LoRA run's machine comes first.
  shutil.rmtree(os.path.join(study, "pass_at_k_s0"))
  _copy_run(full_src, study, "pass_at_k_s0")
  assert sanity.full_run(0, machines, outs) == study
  # A publication cut short (no published.json) is not taken for one.
  os.remove(os.path.join(study, "pass_at_k_s0", "published.json"))
  assert sanity.full_run(0, machines, outs) == pilot


def test_train_full_trains_only_where_the_lora_run_ran_here_and_has_no_full_run(
    sanity, tmp_path, capsys, monkeypatch):
  lora_out = str(tmp_path / "lora")
  src = os.path.join(RESULTS, "lora_sanity", "pass_at_k_lora_s0")
  _copy_run(src, lora_out, "pass_at_k_lora_s0", machines=["a CPU that is not this one"])
  _copy_run(src, lora_out, "pass_at_k_lora_s1", machines=[sanity.machine.describe()])
  trained = []
  monkeypatch.setattr(sanity, "_train_and_publish", lambda *a: trained.append(a[1:3]))
  sanity.train_full(None, str(tmp_path / "runs"), lora_out, [0, 1, 2], [lora_out])
  assert trained == [("pass_at_k", 1)]  # seed 2 has no LoRA run
  assert "seed 0's LoRA run ran on ['a CPU that is not this one']" in capsys.readouterr().out
  # Once seed 1's full run is published beside it, nothing is trained again.
  _copy_run(os.path.join(RESULTS, "decisive_study_7f27d15", "pass_at_k_s0"), lora_out,
            "pass_at_k_s1", machines=[sanity.machine.describe()])
  trained.clear()
  sanity.train_full(None, str(tmp_path / "runs"), lora_out, [1], [lora_out])
  assert trained == []
