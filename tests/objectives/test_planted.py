"""The planted task's closed forms (`ksjax.objectives.planted`) against an exact enumeration of
every k-tuple of answers and every instance label, with f on each tuple computed by the library's
own `objective_value` (float64, 1e-10); the optima against ESTIMATORS.md's worked case and against
every other policy; and which target each estimator has."""

import itertools

import jax
import numpy as np
import pytest

from ksjax.objectives import mixture_weights, objective_value
from ksjax.objectives import planted as closed

F2 = np.array([0.6, 0.4])
F3 = np.array([0.5, 0.3, 0.2])
MAXRL4 = closed.Target(tuple(float(w) for w in mixture_weights("maxrl", 4)))


@pytest.fixture(autouse=True)
def _float64():
  with jax.enable_x64(True):
    yield


def _policy(rng, m, none):
  """A random q over m answers leaving `none` of the mass to no answer."""
  return (1.0 - none) * rng.dirichlet(np.ones(m))


def _enumerated(aggregator, weights, q, f):
  """sum_j w_j E[f_j] by enumerating every K-tuple (K = the last j) of answers (class m: no
  answer) and every label, f_j on a tuple being `objective_value`'s U-statistic over its
  j-subsets, whose expectation is E[f_j]."""
  m = len(q)
  size = len(weights)
  probs = np.append(q, 1.0 - q.sum())
  tuples = np.array(list(itertools.product(range(m + 1), repeat=size)))  # [T, K]
  mass = np.prod(probs[tuples], axis=1)  # [T]
  total = 0.0
  for label, freq in enumerate(f):
    rewards = (tuples == label).astype(np.float64)
    for j, w in enumerate(weights, 1):
      if w:
        got = objective_value(rewards, aggregator=aggregator, k=j, answer_ids=tuples)
        total += freq * w * float(np.dot(mass, np.asarray(got)))
  return total


TARGETS = [("mean", closed.MEAN)]
TARGETS += [(f"pass@{j}", closed.single(j)) for j in (2, 3, 4)]
TARGETS += [(f"maj@{j}", closed.single(j, vote=True)) for j in (1, 2, 3, 4)]
TARGETS += [("maxrl@4", MAXRL4), ("maj mixture", closed.Target((0.5, 0.0, 1.0, 2.0), vote=True))]


@pytest.mark.parametrize("name,target", TARGETS, ids=[name for name, _ in TARGETS])
@pytest.mark.parametrize("f", [F2, F3], ids=["two answers", "three answers"])
def test_each_value_is_the_enumerated_expectation(name, target, f):
  rng = np.random.default_rng(len(name) + 7 * len(f))
  aggregator = "majority_vote" if target.vote else "pass_at_k"
  for none in (0.0, 0.15):
    q = _policy(rng, len(f), none)
    want = _enumerated(aggregator, target.weights, q, f)
    assert closed.value(target, q, f) == pytest.approx(want, abs=1e-10), (name, q)


def test_the_mean_aggregator_is_pass_at_1():
  q = np.array([0.3, 0.5])
  want = _enumerated("mean", (0.0, 0.0, 1.0), q, F2)  # the mean of 3 samples' rewards
  assert closed.value(closed.target("mean", "loo", 3), q, F2) == pytest.approx(want, abs=1e-10)


@pytest.mark.parametrize("k", [2, 3, 4])
def test_the_de_meaned_estimator_targets_the_paper_s_order_statistics(k):
  """E[((k-1)/k) r_(k) + (1/k) r_(k-1)] (ESTIMATORS.md), enumerated literally, is the value of
  the target `target` gives the de-meaned leave-one-out: pass@(k-1)."""
  q, f = np.array([0.35, 0.45, 0.1]), F3
  probs = np.append(q, 1.0 - q.sum())
  want = 0.0
  for answers in itertools.product(range(len(probs)), repeat=k):
    mass = np.prod(probs[list(answers)])
    for label, freq in enumerate(f):
      r = np.sort(np.array(answers) == label).astype(float)
      want += mass * freq * ((k - 1) / k * r[-1] + r[-2] / k)
  got = closed.value(closed.target("pass_at_k", "loo_demeaned", k), q, f)
  assert got == pytest.approx(want, abs=1e-10)


def test_the_worked_case_of_estimators_md():
  """f = (0.6, 0.4), k = 4: q_A ~ 0.534, pass@4 ~ 0.939 against 0.600 for the mean's optimum;
  pass@1 ~ 0.507 against 0.600."""
  pass4 = closed.single(4)
  q_pass = closed.optimum(pass4, F2)
  q_mean = closed.optimum(closed.MEAN, F2)
  assert round(float(q_pass[0, 0]), 3) == 0.534
  assert round(closed.value(pass4, q_pass, F2), 3) == 0.939
  assert round(closed.value(pass4, q_mean, F2), 3) == 0.600
  assert round(closed.value(closed.MEAN, q_pass, F2), 3) == 0.507
  assert closed.value(closed.MEAN, q_mean, F2) == pytest.approx(0.6, abs=1e-12)
  # Two answers: (1 - q_A)^3 f_A = q_A^3 f_B, so q_A = f_A^(1/3) / (f_A^(1/3) + f_B^(1/3)).
  cube = np.cbrt(F2)
  assert q_pass[0, 0] == pytest.approx(cube[0] / cube.sum(), abs=1e-12)


@pytest.mark.parametrize("name,target", TARGETS, ids=[name for name, _ in TARGETS])
@pytest.mark.parametrize("f", [F2, F3, np.array([0.45, 0.45, 0.1])],
                         ids=["two answers", "three answers", "tied"])
def test_the_optimum_beats_every_other_policy(name, target, f):
  q_star = closed.optimum(target, f)
  assert q_star.shape == (1, len(f)) and q_star.sum() == pytest.approx(1.0, abs=1e-12)
  best = closed.value(target, q_star, f)
  rng = np.random.default_rng(3)
  others = [_policy(rng, len(f), none) for none in (0.0, 0.0, 0.05) for _ in range(60)]
  eye = np.eye(len(f))
  others += [q_star[0] + 1e-4 * (eye[i] - eye[j])  # mass moved between two answers
             for i in range(len(f)) for j in range(len(f)) if i != j]
  for q in others:
    if (q >= 0).all() and q.sum() <= 1:
      assert closed.value(target, q, f) <= best + 1e-12, (name, q)
  if not target.vote and not target.linear:  # equal marginals wherever q_i > 0
    inner = q_star[0] > 1e-9
    marginals = closed._marginal(target.weights, f, q_star[0])  # pylint: disable=protected-access
    assert np.ptp(marginals[inner]) < 1e-9
    assert (marginals[~inner] <= marginals[inner].min() + 1e-9).all()


def test_an_answer_that_is_never_right_gets_no_mass():
  f = np.array([0.7, 0.3, 0.0])
  q = closed.optimum(closed.single(4), f)
  assert q[0, 2] == 0.0 and q[0, :2].sum() == pytest.approx(1.0)


def test_each_estimator_has_its_target():
  assert closed.target("mean", "loo_demeaned", 4) == closed.MEAN
  for baseline in ("none", "loo", "leave_two_out"):
    assert closed.target("pass_at_k", baseline, 4) == closed.single(4)
  assert closed.target("pass_at_k", "loo_demeaned", 4) == closed.single(3)
  assert closed.target("pass_at_k", "leave_p_out", 4, p=2) == closed.single(2)
  assert closed.target("majority_vote", "loo", 4) == closed.single(4, vote=True)
  assert closed.target("pass_at_k", "loo", 4, k_weights=mixture_weights("maxrl", 4)) == MAXRL4
  with pytest.raises(ValueError, match="softmax"):
    closed.target("softmax", "loo", 4)
  with pytest.raises(ValueError, match="normalized"):
    closed.target("pass_at_k", "normalized", 4)


@pytest.mark.parametrize("q,f,match", [
    ([0.7, 0.5], F2, "at most 1"), ([0.2, 0.2], [0.6, 0.6], "summing to 1"),
    ([0.2, 0.2, 0.2], F2, "shape")])
def test_bad_policies_and_frequencies_say_what_is_accepted(q, f, match):
  with pytest.raises(ValueError, match=match):
    closed.value(closed.MEAN, q, f)


def test_bad_weights_say_what_is_accepted():
  with pytest.raises(ValueError, match="not all 0"):
    closed.Target((0.0, 0.0))
  with pytest.raises(ValueError, match="integer >= 1"):
    closed.single(0)
