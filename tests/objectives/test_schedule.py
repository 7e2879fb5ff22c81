"""k_at_step: PKPO-style annealing of k, a pure function of the step."""

from __future__ import annotations

import pytest

from ksjax import objectives


def test_none_is_k_throughout():
  assert [objectives.k_at_step(s, k=4) for s in (0, 1, 10**6)] == [4, 4, 4]
  assert objectives.k_at_step(3, k=4, schedule="none", k_start=4) == 4


def test_linear_down_and_up_rounds_half_up():
  down = [objectives.k_at_step(s, k=1, schedule="linear", k_start=8, steps=10) for s in range(12)]
  # 8 - 0.7 s: 8, 7.3, 6.6, 5.9, 5.2, 4.5, 3.8, 3.1, 2.4, 1.7, 1, then k.
  assert down == [8, 7, 7, 6, 5, 5, 4, 3, 2, 2, 1, 1]
  up = [objectives.k_at_step(s, k=8, schedule="linear", k_start=2, steps=4) for s in range(6)]
  assert up == [2, 4, 5, 7, 8, 8]  # 2 + 1.5 s: 2, 3.5, 5, 6.5, 8


def test_linear_stays_between_k_start_and_k_and_is_monotone():
  for k_start, k, steps in [(16, 2, 7), (1, 9, 100), (5, 5, 3), (3, 4, 1)]:
    ks = [objectives.k_at_step(s, k=k, schedule="linear", k_start=k_start, steps=steps)
          for s in range(steps + 3)]
    assert ks[0] == k_start and ks[steps:] == [k] * 3
    assert all(min(k, k_start) <= v <= max(k, k_start) for v in ks)
    assert ks == sorted(ks, reverse=k < k_start)


def test_step_switches_at_steps():
  ks = [objectives.k_at_step(s, k=1, schedule="step", k_start=8, steps=3) for s in range(5)]
  assert ks == [8, 8, 8, 1, 1]


@pytest.mark.parametrize("step,kwargs,message", [
    (0, dict(k=4, schedule="cosine"), r"k_schedule='cosine' .*'linear'"),
    (0, dict(k=0), r"k=0 .*>= 1"),
    (0, dict(k=4, k_start=8), r"k_start=8 is not accepted with k_schedule='none'"),
    (0, dict(k=4, schedule="linear", steps=5), r"k_start=None .*k_schedule='linear'"),
    (0, dict(k=4, schedule="step", k_start=8), r"k_schedule_steps=0 .*k_schedule='step'"),
    (0, dict(k=4, schedule="linear", k_start=8, steps=2.5), r"k_schedule_steps=2.5 "),
    (-1, dict(k=4), r"step=-1 .*>= 0"),
    (True, dict(k=4), r"step=True "),
])
def test_rejects(step, kwargs, message):
  with pytest.raises(ValueError, match=message) as error:
    objectives.k_at_step(step, **kwargs)
  assert "\n" not in str(error.value)
