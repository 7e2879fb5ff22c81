"""Literal, loop-by-loop definitions of the k-sample objectives: the objectives tests' reference.

Nothing here shares code with `ksjax.objectives`: every quantity is computed straight from its
definition in the paper (section 3 and appendix) by Python loops over samples and subsets, which is
slow and obviously right.
"""

from __future__ import annotations

import collections
import itertools
import math

import numpy as np


def f(aggregator: str, rewards, answers, beta: float) -> float:
  """The aggregator on one set of samples (sequences of rewards and answer classes)."""
  rewards = [float(r) for r in rewards]
  if aggregator == "mean":
    return sum(rewards) / len(rewards)
  if aggregator == "pass_at_k":
    return max(rewards)
  if aggregator == "softmax":
    top = max(rewards)
    exps = [math.exp(beta * (r - top)) for r in rewards]
    return sum(e * r for e, r in zip(exps, rewards)) / sum(exps)
  if aggregator == "majority_vote":
    members = collections.defaultdict(list)
    for r, a in zip(rewards, answers):
      members[int(a)].append(r)
    plurality = max(len(v) for v in members.values())
    tied = [v for v in members.values() if len(v) == plurality]
    # Uniform random tie-break in expectation; a class's reward is its members' (common) reward.
    return sum(sum(v) / len(v) for v in tied) / len(tied)
  raise AssertionError(aggregator)


def target(aggregator: str, baseline: str, p: int, rewards, answers, beta: float) -> float:
  """The estimator's stated target functional on k samples (its expectation is the objective)."""
  k = len(rewards)
  on = lambda keep: f(aggregator, [rewards[i] for i in keep], [answers[i] for i in keep], beta)
  if baseline in ("none", "loo"):
    return on(range(k))
  left_out = 1 if baseline == "loo_demeaned" else p  # E[(1/k) sum_i f(y_-i)] and the appendix's.
  outs = list(itertools.combinations(range(k), left_out))
  return sum(on([i for i in range(k) if i not in s]) for s in outs) / len(outs)


def weights_k(aggregator: str, baseline: str, p: int, rewards, answers, beta: float) -> list[float]:
  """The paper's n = k estimator on one group of k samples."""
  k = len(rewards)
  on = lambda keep: f(aggregator, [rewards[i] for i in keep], [answers[i] for i in keep], beta)
  full = on(range(k))
  if baseline == "none":
    return [full] * k
  loo = [full - on([j for j in range(k) if j != i]) for i in range(k)]
  if baseline == "loo":
    return loo
  if baseline == "loo_demeaned":
    return [a - sum(loo) / k for a in loo]
  # Appendix: w_i = (1/C(k-1, p-1)) sum_{|s|=p, i in s} (A_s - mean_s' A_s'), A_s = f(y) - f(y_-s).
  outs = list(itertools.combinations(range(k), p))
  advantage = {s: full - on([j for j in range(k) if j not in s]) for s in outs}
  mean_advantage = sum(advantage.values()) / len(outs)
  return [sum(advantage[s] - mean_advantage for s in outs if i in s) / math.comb(k - 1, p - 1)
          for i in range(k)]


def weights(aggregator: str, baseline: str, k: int, p: int, rewards_gn, answers_gn, beta: float,
            scale: str = "none", eps: float = 1e-6) -> np.ndarray:
  """U-statistic (1/C(n, k)) sum over k-subsets S of [w^S_i if i in S else 0], per group, [G, n]."""
  rewards_gn, answers_gn = np.asarray(rewards_gn, np.float64), np.asarray(answers_gn)
  out = np.zeros_like(rewards_gn)
  n = rewards_gn.shape[1]
  for g in range(rewards_gn.shape[0]):
    subsets = list(itertools.combinations(range(n), k))
    for subset in subsets:
      w = weights_k(aggregator, baseline, p, [rewards_gn[g, i] for i in subset],
                    [answers_gn[g, i] for i in subset], beta)
      for i, w_i in zip(subset, w):
        out[g, i] += w_i / len(subsets)
    if scale == "group_std":
      out[g] /= np.std(out[g], ddof=1) + eps
  return out


def objective(aggregator: str, k: int, rewards_gn, answers_gn, beta: float) -> np.ndarray:
  """U-statistic estimate of E[f(y_1..y_k)]: the mean of f over the k-subsets of each group, [G]."""
  n = np.shape(rewards_gn)[1]
  return np.array([
      np.mean([f(aggregator, [rewards[i] for i in s], [answers[i] for i in s], beta)
               for s in itertools.combinations(range(n), k)])
      for rewards, answers in zip(np.asarray(rewards_gn), np.asarray(answers_gn))])
