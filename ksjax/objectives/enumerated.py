"""majority_vote and softmax aggregators: exact U-statistics by enumerating subsets.

These f have no order-statistic structure, so f is evaluated on every m-subset of the n samples
(for the sizes m the estimator needs, see `ksjax.objectives.advantages`) and the subset values are
summed onto the samples each subset contains or leaves out. The subset lists are static
(itertools.combinations of range(n)); their size is capped at `MAX_SUBSETS` per family. With
n = k the families are tiny: the whole group and its n leave-one-outs, which have O(n) (softmax)
and O(n^2) (majority voting) forms that gather nothing. Small subsets are evaluated one member
column at a time, large ones as gathered [C, m] blocks or through the samples they leave out.

majority_vote, f(y) = r(maj(a)) with uniform random tie-break, taken in expectation: the average of
the rewards of the plurality classes. A class's reward is the mean reward of its members in the
subset (equal to "the reward of the answer" when, as the task interface guarantees, rewards are
constant within a class); every plurality class has the same number of members, so f is the plain
mean reward of the members of plurality classes, computed below from per-member vote counts.

softmax, f(y) = sum_i p_i r_i with p = softmax(beta r) over the subset; every path shifts a
subset's logits by that subset's own maximum, so subsets far below the group maximum do not
underflow whatever beta * r spans.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ksjax.objectives import exclusive_sums

MAX_SUBSETS = 20_000
# Elements of the per-member vote-count intermediate made at once; more groups run in chunks.
_VOTE_ELEMENTS_PER_CHUNK = 1 << 24
# Subsets of at most this many members are handled one member column [G, C] at a time: XLA's CPU
# backend reduces a short minor axis ([G, C, m] over m) about ten times slower than it combines m
# [G, C] arrays elementwise. Majority voting compares every pair of members, hence its lower bound.
_UNROLL_SOFTMAX, _UNROLL_VOTES = 16, 4


class Subsets(NamedTuple):
  """All m-subsets of range(n), C = C(n, m) of them, in itertools.combinations order."""
  members: np.ndarray  # int32 [C, m]
  others: np.ndarray  # int32 [C, n - m], the samples each subset leaves out
  membership: np.ndarray  # bool [C, n]


@functools.lru_cache(maxsize=64)
def subsets(n: int, m: int) -> Subsets:
  """The m-subsets of range(n), built once per (n, m) and read-only."""
  count = math.comb(n, m)
  members_cm = np.array(list(itertools.combinations(range(n), m)), dtype=np.int32).reshape(count, m)
  membership_cn = np.zeros((count, n), dtype=bool)
  np.put_along_axis(membership_cn, members_cm.astype(np.intp), True, axis=1)
  others_cl = np.nonzero(~membership_cn)[1].astype(np.int32).reshape(count, n - m)
  for array in (members_cm, others_cl, membership_cn):
    array.flags.writeable = False
  return Subsets(members_cm, others_cl, membership_cn)


def check_enumerable(aggregator: str, n: int, sizes: tuple[int, ...]) -> None:
  """Raises ValueError if an m-subset family needed for these n samples exceeds MAX_SUBSETS."""
  for m in sizes:
    count = math.comb(n, m)
    if count > MAX_SUBSETS:
      raise ValueError(
          f"aggregator={aggregator!r} is computed exactly by enumerating the {m}-subsets of the "
          f"n={n} samples per group, and C({n}, {m}) = {count} exceeds the limit of {MAX_SUBSETS}; "
          f"accepted: k and p with C(n, m) <= {MAX_SUBSETS} for each subset size m the baseline "
          "needs (k for 'none' and 'leave_two_out'; k and k-1 for 'loo'; k-p for "
          "'loo_demeaned' (p=1) and 'leave_p_out'), e.g. k = n")


@functools.partial(jax.jit, static_argnames="m")
def softmax_values(rewards_gn: jax.Array, beta: float | jax.Array, m: int) -> jax.Array:
  """f on every m-subset, [G, C(n, m)]."""
  n = rewards_gn.shape[-1]
  if m == n - 1 >= 1:
    # combinations(range(n), n - 1) lists the subsets leaving out n - 1, n - 2, ..., 0.
    return jnp.flip(_softmax_leave_one_out(rewards_gn, beta), axis=-1)
  members_cm = subsets(n, m).members
  if m <= _UNROLL_SOFTMAX:
    columns = [rewards_gn[:, members_cm[:, j]] for j in range(m)]  # m x [G, C]
    top_gc = functools.reduce(jnp.maximum, [beta * column for column in columns])
    weights = [jnp.exp(beta * column - top_gc) for column in columns]
    return sum(w * column for w, column in zip(weights, columns)) / sum(weights)
  rewards_gcm = rewards_gn[:, members_cm]
  probs_gcm = jax.nn.softmax(beta * rewards_gcm, axis=-1)
  return jnp.sum(probs_gcm * rewards_gcm, axis=-1)


def _softmax_leave_one_out(rewards_gn: jax.Array, beta: float | jax.Array) -> jax.Array:
  """f on the group without sample j, [G, n]: O(n), where the gathered form is O(n^2).

  Without j the largest logit is the group's, unless j holds it; so one set of exponentials,
  shifted by the group maximum, serves every j but that one (its sums are at least 1), and a
  second, shifted by the runner-up, serves it. Sums over i != j are exclusive prefix plus suffix
  sums, so nothing is subtracted.
  """
  logits_gn = beta * rewards_gn
  n = logits_gn.shape[-1]
  top_g1 = jnp.argmax(logits_gn, axis=-1, keepdims=True)
  is_top_gn = jnp.arange(n) == top_g1
  others_gn = jnp.where(is_top_gn, -jnp.inf, logits_gn)
  weights_gn = jnp.exp(logits_gn - jnp.max(logits_gn, axis=-1, keepdims=True))
  runner_up_gn = jnp.exp(others_gn - jnp.max(others_gn, axis=-1, keepdims=True))
  def without_each(values_gn):
    return exclusive_sums.before(values_gn) + exclusive_sums.after(values_gn)

  value_gn = without_each(weights_gn * rewards_gn) / without_each(weights_gn)
  top_value_g1 = (jnp.sum(runner_up_gn * rewards_gn, axis=-1, keepdims=True)
                  / jnp.sum(runner_up_gn, axis=-1, keepdims=True))
  return jnp.where(is_top_gn, top_value_g1, value_gn)


def _majority_leave_one_out(rewards_n, ids_n):
  """Per group: f without sample j, [n], from the full vote counts less j's own vote, [n, n]."""
  n = rewards_n.shape[0]
  same_ji = ids_n[:, None] == ids_n[None, :]
  others_ji = ~np.eye(n, dtype=bool)
  votes_ji = jnp.where(others_ji, jnp.sum(same_ji, axis=0) - same_ji, 0)
  in_plurality_ji = others_ji & (votes_ji == jnp.max(votes_ji, axis=-1, keepdims=True))
  return (jnp.sum(jnp.where(in_plurality_ji, rewards_n, 0), axis=-1)
          / jnp.sum(in_plurality_ji, axis=-1).astype(rewards_n.dtype))


def _majority_values_unrolled(rewards_n, ids_n, members_cm):
  """Per group, for few members: member columns [C], votes compared pairwise."""
  m = members_cm.shape[1]
  rewards = [rewards_n[members_cm[:, j]] for j in range(m)]
  ids = [ids_n[members_cm[:, j]] for j in range(m)]
  votes = [sum((ids[j] == ids[i]).astype(jnp.int32) for i in range(m)) for j in range(m)]
  top_c = functools.reduce(jnp.maximum, votes)
  in_plurality = [v == top_c for v in votes]
  return (sum(jnp.where(inside, r, 0) for inside, r in zip(in_plurality, rewards))
          / sum(inside.astype(rewards_n.dtype) for inside in in_plurality))


def _majority_values_direct(rewards_n, ids_n, members_cm):
  """Per group: votes of each member counted among the members, [C, m, m] intermediate."""
  rewards_cm, ids_cm = rewards_n[members_cm], ids_n[members_cm]
  votes_cm = jnp.sum(ids_cm[:, :, None] == ids_cm[:, None, :], axis=-1)
  in_plurality_cm = votes_cm == jnp.max(votes_cm, axis=-1, keepdims=True)
  return (jnp.sum(jnp.where(in_plurality_cm, rewards_cm, 0), axis=-1)
          / jnp.sum(in_plurality_cm, axis=-1).astype(rewards_n.dtype))


def _majority_values_complement(rewards_n, ids_n, others_cl, membership_cn):
  """Per group, for large m: votes in the full group minus votes among the l = n - m left out."""
  same_nn = ids_n[:, None] == ids_n[None, :]
  votes_n = jnp.sum(same_nn, axis=-1)
  votes_cn = votes_n - jnp.sum(same_nn[others_cl], axis=1)  # [C, l, n] -> [C, n]
  votes_cn = jnp.where(membership_cn, votes_cn, 0)
  in_plurality_cn = membership_cn & (votes_cn == jnp.max(votes_cn, axis=-1, keepdims=True))
  return (jnp.sum(jnp.where(in_plurality_cn, rewards_n, 0), axis=-1)
          / jnp.sum(in_plurality_cn, axis=-1).astype(rewards_n.dtype))


@functools.partial(jax.jit, static_argnames="m")
def majority_vote_values(rewards_gn: jax.Array, answer_ids_gn: jax.Array, m: int) -> jax.Array:
  """f on every m-subset, [G, C(n, m)], counting votes among the members or the left-outs."""
  group_count, n = rewards_gn.shape
  family = subsets(n, m)
  count = family.members.shape[0]
  if m == n - 1 >= 1:
    per_group = n * n
    values = _majority_leave_one_out
  elif m <= _UNROLL_VOTES:
    per_group = count * m * m
    values = functools.partial(_majority_values_unrolled, members_cm=family.members)
  elif m * m <= n * (n - m):
    per_group = count * m * m
    values = functools.partial(_majority_values_direct, members_cm=family.members)
  else:
    per_group = count * n * max(1, n - m)  # Plus the n x n answer comparison when m = n.
    values = functools.partial(_majority_values_complement, others_cl=family.others,
                               membership_cn=family.membership)
  if group_count == 0:
    return jnp.zeros((0, count), rewards_gn.dtype)
  batch = max(1, _VOTE_ELEMENTS_PER_CHUNK // per_group)
  if batch >= group_count:
    values_gc = jax.vmap(values)(rewards_gn, answer_ids_gn)
  else:
    values_gc = jax.lax.map(lambda xs: values(*xs), (rewards_gn, answer_ids_gn), batch_size=batch)
  # combinations(range(n), n - 1) lists the subsets leaving out n - 1, n - 2, ..., 0.
  return jnp.flip(values_gc, axis=-1) if values is _majority_leave_one_out else values_gc


def _onto_samples(values_gc: jax.Array, coefficients_cn: np.ndarray) -> jax.Array:
  """sum_c values[g, c] coefficients[c, i], [G, n].

  A dense matmul rather than a scatter-add of the C * m (subset, member) pairs: XLA's CPU scatter is
  an order of magnitude slower, and a 0/1 pattern keeps single-term sums exact.
  """
  return jnp.matmul(values_gc, jnp.asarray(coefficients_cn, values_gc.dtype),
                    precision=jax.lax.Precision.HIGHEST)


@functools.partial(jax.jit, static_argnames=("n", "k"))
def none(values_k, n: int, k: int) -> jax.Array:
  """(k/n) phi_k = sum_{S contains i} f(S) / C(n, k), from f on the k-subsets [G, C(n, k)]."""
  return _onto_samples(values_k, subsets(n, k).membership) / math.comb(n, k)


@functools.partial(jax.jit, static_argnames=("n", "k"))
def loo(values_k, values_k1, n: int, k: int) -> jax.Array:
  """sum_{S contains i} [f(S) - f(S minus i)] / C(n, k), from f on the k- and (k-1)-subsets."""
  # T ranges over the (k-1)-subsets without i <=> S = T + {i} over the k-subsets with i.
  coefficients = np.concatenate(
      [subsets(n, k).membership, np.where(subsets(n, k - 1).membership, 0.0, -1.0)])
  values = jnp.concatenate([values_k, values_k1], axis=1)
  return _onto_samples(values, coefficients) / math.comb(n, k)


@functools.partial(jax.jit, static_argnames=("n", "m"))
def leave_p_out(values_m, n: int, m: int) -> jax.Array:
  """(m/n)(phi_m - psi_m) = [sum_{T contains i} f(T) - m/(n-m) sum_{T without i} f(T)] / C(n, m)."""
  membership_cn = subsets(n, m).membership
  return _onto_samples(values_m, np.where(membership_cn, 1.0, -m / (n - m))) / math.comb(n, m)
