"""The evaluation's throughput path (`ksjax.evaluation.batched`) gives the records of the
per-chunk path: the same draws (so the same per-problem counts) for the same seed and
batch_prompts, and the same KL within float32 rounding."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from flax import nnx

from ksjax import model
from ksjax.evaluation import batched, runner
from ksjax.evaluation import settings as settings_lib
from ksjax.model import logprobs
from ksjax.run.directory import locate

from tests.support import eval_run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, worker_id) -> pathlib.Path:
  return eval_run.tiny_run(eval_run.session_dir(tmp_path_factory, worker_id))


def test_merged_calls_keep_whole_chunks():
  # 160 x 16 at 8 a chunk: 32 problems (512 rows) a call; the ladder's 2 x 64: 8 problems.
  assert batched.merged_calls(160, 8, 16, 512) == [(s, s + 32) for s in range(0, 160, 32)]
  assert batched.merged_calls(32, 2, 64, 512) == [(s, s + 8) for s in range(0, 32, 8)]
  assert batched.merged_calls(5, 2, 4, 16) == [(0, 4), (4, 5)]
  assert batched.merged_calls(3, 8, 64, 64) == [(0, 3)]  # a chunk is never split
  assert batched.merged_calls(12, 3, 4, 32) == [(0, 6), (6, 12)]  # 8 fit: 6, whole chunks


def test_reference_logprobs_by_width_equal_the_full_forward():
  """Completions of unequal lengths under prompts of unequal lengths, bucketed by width in calls
  of few rows and prompts (so prompts are split over calls and calls padded): equal to
  `continuation_logprobs` over the full width, within float32 rounding, and 0 past each end."""
  cfg = model.LlamaConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8, intermediate_size=64,
                          max_position_embeddings=96)
  llama = model.Llama(cfg, rngs=nnx.Rngs(1))
  rng = np.random.default_rng(1)
  prompts = [rng.integers(1, 64, size=int(rng.integers(3, 20))).astype(np.int32)
             for _ in range(5)]
  group, n = 4, 40
  prompt_of_r = np.repeat(np.arange(5), group)
  completions_rn = rng.integers(1, 64, size=(20, n)).astype(np.int32)
  lengths_r = rng.integers(1, n + 1, size=20)
  lengths_r[:3] = (1, n, 16)
  mesh = model.make_mesh((1, 1, 1))
  got = batched.reference_logprobs(llama, mesh, prompts, prompt_of_r, completions_rn, lengths_r,
                                   rows=6, prompts_per_call=2, width_step=8)
  # The full forward: the prompts left-padded to one width, every row over all n tokens.
  t = 32
  tokens_rt = np.zeros((20, t + n), np.int32)
  mask_rt = np.zeros((20, t + n), bool)
  for r in range(20):
    ids = prompts[prompt_of_r[r]]
    tokens_rt[r, t - len(ids):t], mask_rt[r, t - len(ids):t] = ids, True
    tokens_rt[r, t:] = completions_rn[r]
    mask_rt[r, t:t + lengths_r[r]] = True
  want = np.asarray(logprobs.continuation_logprobs(llama, tokens_rt, mask_rt, t, group))
  valid = np.arange(n)[None, :] < lengths_r[:, None]
  assert (got[~valid] == 0).all()
  np.testing.assert_allclose(got, np.where(valid, want, 0.0), atol=2e-5)


def _records(run: pathlib.Path, out: pathlib.Path, call_rows: int) -> dict:
  config = eval_run.configured(run, steps="3", kl_reference="start", num_samples=6, ks=(1, 2, 6),
                               batch_prompts=2, plots=False, output_dir=str(out))
  config.run.mesh = (1, 2, 2)  # rows and prompts split over fsdp, heads over tensor
  s = settings_lib.validate(config)
  out.mkdir()
  task = runner.open_task(s)
  evaluator = runner.open_evaluator(s, locate(str(run)), task, str(out))
  evaluator.call_rows = call_rows
  evaluator.check(3)
  return evaluator.evaluate(3)


def test_the_records_of_both_paths_are_the_same(run_dir, tmp_path):
  """The tiny run's checkpoint 3, 6 problems x 6 samples in chunks of 2 problems, with the KL to
  its start, on a mesh of 4 devices: per chunk (call_rows 0, the path before) and in merged calls
  of up to 64 rows (all three chunks in one call, padded to 4 problems) give the same per-problem correct counts,
  answer classes and rewards, and the same KL within float32 rounding."""
  old = _records(run_dir, tmp_path / "old", 0)
  new = _records(run_dir, tmp_path / "new", 64)
  assert old["num_problems"] == new["num_problems"] == 6
  assert old["problems"]["num_correct"] == new["problems"]["num_correct"]
  assert old["problems"]["classes"] == new["problems"]["classes"]
  for name in ("kl_k1", "kl_k3"):
    np.testing.assert_allclose(new["problems"][name], old["problems"][name], rtol=1e-4,
                               atol=1e-6)
  for name, value in old["metrics"].items():
    if name.startswith("kl"):
      assert new["metrics"][name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    else:
      assert new["metrics"][name] == value, name
