"""The step log's batch metrics (`rollout.batch_metrics`) on a hand-made rollout: the objective's
pass@k and maj@k, the ladder 1, 2, 4, ..., n, and the answer diversity, overall and per level."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ksjax.trainer import rollout as rollout_lib
from ksjax.tasks.base import Prompt


def _rollout(answer_ids_bn, correct_bn, levels) -> rollout_lib.Rollout:
  """A rollout of B prompts x n samples with the given scores; 3 completion tokens a row."""
  ids = np.asarray(answer_ids_bn, np.int32)
  b, n = ids.shape
  r, t = b * n, 5
  completion = np.zeros((r, t), bool)
  completion[:, 2:] = True
  return rollout_lib.Rollout(
      prompts=tuple(Prompt(id=f"p{i}", text="", tokens=(1,), metadata={"level": lv})
                    for i, lv in enumerate(levels)),
      tokens_rt=np.ones((r, t), np.int32), attention_mask_rt=np.ones((r, t), bool),
      completion_mask_rt=completion, behaviour_logp_rt=np.zeros((r, t), np.float32),
      prompt_len=2, finished_r=np.ones(r, bool), texts=("",) * r,
      rewards_bn=np.where(correct_bn, 1.0, -1.0).astype(np.float32),
      correct_bn=np.asarray(correct_bn, bool), answer_ids_bn=ids)


# Prompt 0 (level 1): answers 1, 1, 2, none (classes 0, 0, 1, 2), the two 1s right.
# Prompt 1 (level 2): one wrong answer four times.
IDS = [[0, 0, 1, 2], [0, 0, 0, 0]]
CORRECT = [[True, True, False, False], [False, False, False, False]]


def test_diversity_overall_and_per_level():
  metrics = rollout_lib.batch_metrics(_rollout(IDS, CORRECT, (1, 2)), k=2)
  h0 = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))  # 1.5 ln 2
  assert metrics["diversity/distinct_answers"] == pytest.approx((3 + 1) / 2)
  assert metrics["diversity/answer_entropy"] == pytest.approx((h0 + 0.0) / 2)
  assert metrics["level1/distinct_answers"] == 3 and metrics["level2/distinct_answers"] == 1
  assert metrics["level1/answer_entropy"] == pytest.approx(h0)
  assert metrics["level2/answer_entropy"] == 0.0


def test_ladder_next_to_the_objectives_k():
  metrics = rollout_lib.batch_metrics(_rollout(IDS, CORRECT, (1, 2)), k=2)
  ladder = [1, 2, 4]
  for k in ladder:
    assert f"batch/pass_at_{k}" in metrics and f"batch/maj_at_{k}" in metrics
  assert "level1/pass_at_1" in metrics and "level1/pass_at_4" not in metrics  # no ladder per level
  # Prompt 0: 2 of 4 right; prompt 1: none. pass@k of prompt 0 = 1 - C(2,k)/C(4,k).
  assert metrics["batch/pass_at_1"] == pytest.approx(0.5 / 2)
  assert metrics["batch/pass_at_2"] == pytest.approx((1 - 1 / 6) / 2)
  assert metrics["batch/pass_at_4"] == pytest.approx(0.5)
  assert metrics["batch/pass_at_k"] == metrics["batch/pass_at_2"]
  assert metrics["batch/maj_at_k"] == metrics["batch/maj_at_2"]
  passes = [metrics[f"batch/pass_at_{k}"] for k in ladder]
  assert passes == sorted(passes)
  # maj@4 of prompt 0: the right answer holds 2 of the 4 votes against 1 and 1, so it wins.
  assert metrics["batch/maj_at_4"] == pytest.approx(0.5)
  # maj@2 of prompt 0: pairs {1,1} win (1 of 6); the 4 mixed pairs with a 1 tie (1/2 each).
  assert metrics["batch/maj_at_2"] == pytest.approx((1 / 6 + 4 / 6 * 0.5) / 2)
  assert metrics["completion/length_mean"] == 3.0


def test_objective_k_off_the_ladder():
  ids = np.tile(np.arange(6) % 3, (2, 1))
  metrics = rollout_lib.batch_metrics(_rollout(ids, ids == 0, (1, 1)), k=3)
  assert [key for key in metrics if key.startswith("batch/pass_at_")] == [
      "batch/pass_at_1", "batch/pass_at_k", "batch/pass_at_2", "batch/pass_at_4",
      "batch/pass_at_6"]
  assert metrics["diversity/distinct_answers"] == 3.0
  assert metrics["diversity/answer_entropy"] == pytest.approx(math.log(3))
