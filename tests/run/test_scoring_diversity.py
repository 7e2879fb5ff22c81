"""The diversity statistics and the pass@k ladder of `ksjax.run.scoring`, on hand-made groups
whose values are worked out by hand, and on answer classes a real task's scoring gives."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ksjax.run import scoring
from ksjax.tasks import synthetic


def _entropy(*counts: int) -> float:
  n = sum(counts)
  return -sum(c / n * math.log(c / n) for c in counts)


def test_distinct_answers_and_entropy_by_hand():
  ids = np.asarray([[0, 0, 1, 2],    # answers 1, 1, 2, none: three classes, sizes 2, 1, 1
                    [0, 0, 0, 0],    # one answer
                    [0, 1, 2, 3],    # all different
                    [0, 1, 0, 1]])   # two halves
  got = scoring.diversity(ids)
  np.testing.assert_array_equal(got["distinct_answers"], [3, 1, 4, 2])
  # 2/4 and 1/4, 1/4: -(1/2 ln 1/2 + 2 * 1/4 ln 1/4) = 1.5 ln 2.
  assert got["answer_entropy"][0] == pytest.approx(1.5 * math.log(2), abs=1e-12)
  assert got["answer_entropy"][0] == pytest.approx(_entropy(2, 1, 1), abs=1e-12)
  assert got["answer_entropy"][1] == 0.0 and not math.copysign(1, got["answer_entropy"][1]) < 0
  assert got["answer_entropy"][2] == pytest.approx(math.log(4), abs=1e-12)
  assert got["answer_entropy"][3] == pytest.approx(math.log(2), abs=1e-12)


def test_class_ids_are_labels_only():
  """Relabelling the classes or reordering the samples changes nothing."""
  a = scoring.diversity(np.asarray([[0, 0, 1, 2, 2, 2]]))
  b = scoring.diversity(np.asarray([[7, 3, 7, 7, 3, 9]]))
  for name in scoring.DIVERSITY:
    np.testing.assert_allclose(a[name], b[name], rtol=0, atol=1e-12)


@pytest.mark.parametrize("bad", [np.zeros((3,), np.int32), np.zeros((2, 0), np.int32)])
def test_diversity_refuses_other_shapes(bad):
  with pytest.raises(ValueError, match="expected \\[G, n\\], n >= 1"):
    scoring.diversity(bad)


def test_unanswered_samples_are_one_class_of_the_real_scoring():
  """The embedded task's scoring puts every completion without a final answer in one class, so
  answers 1, 1, 2 and no answer are 3 distinct answers, and two unanswered ones still 3."""
  task = synthetic.SyntheticTask(seed=0, train_per_level=4, test_per_level=2, levels=(1,))
  prompt = task.prompts("test")[0]
  said = lambda a: f"so the final answer is {a}."
  groups = [[said(1), said(1), said(2), "I give up"],
            [said(1), "no idea", said(2), "still nothing"]]
  scores = task.score([prompt, prompt], groups)
  ids = np.stack([s.answer_ids for s in scores])
  np.testing.assert_array_equal(ids, [[0, 0, 1, 2], [0, 1, 2, 1]])
  got = scoring.diversity(ids)
  np.testing.assert_array_equal(got["distinct_answers"], [3, 3])
  assert got["answer_entropy"] == pytest.approx([_entropy(2, 1, 1), _entropy(1, 2, 1)])


@pytest.mark.parametrize("n,want", [(1, (1,)), (2, (1, 2)), (3, (1, 2, 3)),
                                    (20, (1, 2, 4, 8, 16, 20)),
                                    (256, (1, 2, 4, 8, 16, 32, 64, 128, 256))])
def test_k_ladder(n, want):
  assert scoring.k_ladder(n) == want


@pytest.mark.parametrize("bad", [0, -4, 2.0, True])
def test_k_ladder_refuses_non_counts(bad):
  with pytest.raises(ValueError, match="expected the samples per problem, an integer >= 1"):
    scoring.k_ladder(bad)


def test_per_problem_along_the_ladder():
  """Keys: reward, pass@k and maj@k for every k of the ladder, and the diversity; pass@k grows
  with k to pass@n, 1 exactly where a sample is right; the summary averages every one."""
  rng = np.random.default_rng(0)
  n = 16
  ids = rng.integers(0, 5, size=(6, n))
  correct = ids == 0
  correct[5] = False  # a problem nobody solves
  rewards = np.where(correct, 1.0, -1.0)
  ks = scoring.k_ladder(n)
  values = scoring.per_problem(correct, ids, rewards, ks)
  assert list(values) == scoring.metric_names(ks) + list(scoring.DIVERSITY)
  ladder = np.stack([values[f"pass@{k}"] for k in ks])  # [K, G]
  assert np.all(np.diff(ladder, axis=0) >= -1e-12)
  np.testing.assert_allclose(values["pass@1"], correct.mean(1), atol=1e-12)
  np.testing.assert_array_equal(values[f"pass@{n}"], correct.any(1).astype(float))
  np.testing.assert_allclose(values["maj@1"], correct.mean(1), atol=1e-12)
  assert values["maj@16"][5] == 0.0
  summary = scoring.summarize(values, {scoring.ALL: np.ones(6, bool)})[scoring.ALL]
  assert summary["distinct_answers"] == pytest.approx(values["distinct_answers"].mean())
  assert summary["answer_entropy"] == pytest.approx(values["answer_entropy"].mean())


def test_flat_summary_has_diversity_per_level():
  prompts = [synthetic.SyntheticTask(seed=0, train_per_level=2, test_per_level=2,
                                     levels=(1, 2)).prompts("test")[i] for i in range(4)]
  levels = [p.metadata["level"] for p in prompts]
  ids = np.asarray([[0, 0], [0, 1], [0, 0], [0, 0]])
  values = scoring.per_problem(ids == 0, ids, np.zeros((4, 2)), (1, 2))
  flat = scoring.flat_summary(values, prompts)
  want = {lv: np.mean([d for d, l in zip([1, 2, 1, 1], levels) if l == lv]) for lv in (1, 2)}
  assert flat["distinct_answers"] == pytest.approx(1.25)
  for level, value in want.items():
    assert flat[f"level{level}/distinct_answers"] == pytest.approx(value)
