"""Voting without labels (TTRL, arXiv 2504.16084), leave-one-out: a sample is rewarded for
agreeing with the majority of the OTHER samples of its group.

TTRL rewards r_i = 1[a_i = majority answer of the group]; the majority includes a_i's own vote,
so a sample partly votes for itself (with n = 2, any answer "wins" half of the time). Here

  r_i = g(a_i; a_-i) = 1[a_i in T_i] / |T_i|,  T_i = the answers with the most votes among the
                                              other n - 1 samples,

so a tied vote counts as a uniformly random tie-break, in expectation (a sample whose answer is
one of t tied pluralities gets 1/t). Samples without an extractable answer neither vote nor
agree (r = 0): otherwise "no answer" is itself an answer a whole group can agree on, the
cheapest consensus there is. With no answered other sample, r_i = 0.

Within an answer class the other samples' votes are the same (each member removes one vote of
its own class), so r is constant within a class, as majority voting's aggregator requires.

What it estimates. The reward of sample i depends on the whole group, so the usual argument
(a baseline that does not involve y_i leaves the gradient alone) does not apply as it stands.
Write A(theta_s, theta_v) = P(a ~ pi_s agrees with the vote of n - 1 draws of pi_v), ties split:
the chance that a sample agrees with the leave-one-out majority. For weights w_i(a) of a group,
E[sum_i w_i grad log pi(a_i)] = sum_i E[w_i score_i], and
  E[r_i score_i] = d_s A        (a_i is the sample),
  E[r_j score_i] = d_v A/(n-1)  (j != i: a_i is one of j's n - 1 voters, all alike),
with d_s, d_v the gradients in theta_s and theta_v at theta. Hence, on these rewards,
  baseline "none" with k = n (every w_i = rbar):   E = d_s A + d_v A = grad A(theta, theta);
  the mean's leave-one-out (r_i - rbar)/(n - 1):   E = d_s A - d_v A/(n - 1).
d_s A = sum_a grad pi(a) m(a), m(a) = P(a wins a vote of n - 1 samples): raising each answer in
proportion to its chance of winning the vote, with the electorate held fixed; d_v A is what moving
the electorate does. So with the RLOO / Dr. GRPO-style weights the trainer uses it is mostly
"agree with a fixed electorate", with 1/(n-1) of the electorate's own gradient taken away; it is
never a gradient of accuracy. The modal answer gains most, so a policy whose modal answer is
right gets more right, and one whose modal answer is wrong is driven to the wrong answer
(`tests/objectives/test_label_free.py` proves both statements and shows the two cases by exact
enumeration on a softmax bandit).

Nothing here sees a label: the inputs are answer classes and whether each sample answered. The
classes must themselves be formed without the label (`ksjax.run.scoring.hide_labels` forms them
from the answers' text).
"""

from __future__ import annotations

import numpy as np


def agreement(answer_ids_gn: np.ndarray, answered_gn: np.ndarray) -> np.ndarray:
  """r_i = 1[a_i among the plurality answers of the other answered samples] / their number,
  float32 [G, n] (0 for samples without an answer, or without an answered other sample).

  Args:
    answer_ids_gn: int [G, n], answer classes within each group (equal id: equal answer).
    answered_gn: bool [G, n], whether the sample has an answer (and so votes).
  """
  ids_gn = np.asarray(answer_ids_gn)
  answered_gn = np.asarray(answered_gn, bool)
  if ids_gn.ndim != 2 or ids_gn.shape != answered_gn.shape:
    raise ValueError(f"answer_ids {ids_gn.shape} and answered {answered_gn.shape} must both be "
                     "[G, n]")
  n = ids_gn.shape[1]
  same_gij = ids_gn[:, :, None] == ids_gn[:, None, :]
  # votes_g[j]: answered samples sharing j's answer; without i, one fewer where i shares it too.
  votes_gj = np.sum(same_gij & answered_gn[:, None, :], axis=2)
  others_gij = answered_gn[:, None, :] & ~np.eye(n, dtype=bool)
  votes_gij = np.where(others_gij, votes_gj[:, None, :] - (same_gij & answered_gn[:, :, None]), 0)
  top_gi = votes_gij.max(axis=2, initial=0)
  # Each of the t tied classes holds top members among the others.
  tied_gi = np.sum(others_gij & (votes_gij == top_gi[:, :, None]), axis=2) / np.maximum(top_gi, 1)
  own_gi = votes_gj - 1  # i's own class among the others (i answered)
  agrees_gi = answered_gn & (top_gi >= 1) & (own_gi == top_gi)
  return np.where(agrees_gi, 1.0 / np.maximum(tied_gi, 1), 0.0).astype(np.float32)
