"""Sparse updates: leave zero-advantage completions out of the backward pass.

With the pass@k leave-one-out estimator at most one completion per group has a non-zero weight
(the unique best one, and only when it beats the second best), so with n = k = 8 at least 7/8 of
the rows contribute exactly nothing to the policy-gradient loss. When no other loss term reads
them (no value loss, no KL penalty; `LossSpec.needs_every_row`, which also decides
`LossSpec.use_sparse`), those rows are dropped and the rest are
gathered into a smaller batch. Because every loss is a sum over tokens with weights fixed from
the whole batch (`losses.token_weights`), the update is the same as the dense one.

Shapes stay bounded (`layout`): the kept rows fill micro-batches of the configured size, and the
update runs only those holding a real row (a trip count read at run time), so the number of kept
rows changes no shape; below one micro-batch the micro-batch shrinks to a bucket, a power of two
times the number of batch shards (at least `min_rows`, `config.sparse_min_rows`). A run compiles
at most log2(micro_batch / min_rows) + 1 update programs. Padding rows have no tokens (weight 0)
and contribute 0.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

# The default smallest bucket (config.sparse_min_rows): for a small model a padding row costs less
# than a compilation. On SmolLM2-135M on a CPU a row's forward and backward cost more than a
# compilation, so its config buckets from 1 row (benchmarks/real_model.py --parts=config prints
# its steps' split and compilations).
MIN_ROWS = 8


def bucket_rows(kept: int, total: int, multiple: int = 1, min_rows: int = MIN_ROWS) -> int:
  """The padded row count for `kept` rows: the smallest multiple * 2^j >= max(kept, min_rows),
  capped at `total` (the dense size, which is itself compiled anyway)."""
  if total % multiple:
    raise ValueError(f"total={total} rows do not split over {multiple} batch shards")
  size = multiple
  while size < max(kept, min_rows):
    size *= 2
  return min(size, total)


@dataclasses.dataclass(frozen=True)
class Selection:
  """Which rows of a mini-batch an update runs, laid out in micro-batches.

  Attributes:
    rows: int64 [S] indices into the mini-batch; the real ones first, then copies of row 0 marked
      as padding. S is the mini-batch's rows rounded up to whole micro-batches, so that every
      selection of a mini-batch with the same `micro` has one shape.
    kept: the number of rows kept (those with a weight).
    padding: bool [S], True on rows that carry no weight (their token weights must be zeroed):
      the padding, and under `share` > 1 a kept group's rows that were not kept.
    micro: rows per micro-batch.
    count: the micro-batches holding a real row: the update runs these and no others
      (`Updater.step`'s `count`).
    share: rows per prompt in the update: 1, each row runs its own prompt; s > 1 (`shared`),
      the rows come in blocks of s that continue one prompt, which the update runs once per
      block (`Updater.step`'s `group`).
  """
  rows: np.ndarray
  kept: int
  padding: np.ndarray
  micro: int
  count: int
  share: int = 1


def select_rows(advantage_r: np.ndarray, multiple: int = 1, min_rows: int = MIN_ROWS,
                micro_batch: int | None = None) -> Selection:
  """The rows with a non-zero advantage, in order, in micro-batches (`layout`).

  Zero means exactly 0.0: pass@k leave-one-out gives exact zeros (differences of equal rewards),
  and a tiny non-zero weight is kept, as the dense update would use it.
  """
  advantage_r = np.asarray(advantage_r)
  return layout(np.flatnonzero(advantage_r != 0), len(advantage_r), multiple, min_rows,
                micro_batch)


def micro_sizes(total: int, multiple: int = 1, min_rows: int = MIN_ROWS,
                micro_batch: int | None = None) -> tuple[int, ...]:
  """The micro-batch sizes `select_rows` lays a mini-batch of `total` rows out in, one for each
  update program a run of sparse updates may compile, smallest first (the memory plan counts
  what each holds). Every number of kept rows from 1 to `total` is tried: a bucket's rounding to
  the batch shards and its cap at the micro-batch make a closed form less clear than the count."""
  return tuple(sorted({layout(np.arange(kept), total, multiple, min_rows, micro_batch).micro
                       for kept in range(1, total + 1)}))


def every_row(total: int, multiple: int = 1, micro_batch: int | None = None) -> Selection:
  """Every row of a mini-batch of `total`, in order: the dense update's layout."""
  return layout(np.arange(total), total, multiple, total, micro_batch)


def layout(kept_rows: np.ndarray, total: int, multiple: int = 1, min_rows: int = MIN_ROWS,
           micro_batch: int | None = None) -> Selection:
  """`kept_rows` of a mini-batch of `total` rows in micro-batches of
  min(`micro_batch`, `bucket_rows(len(kept_rows))`) rows (`micro_batch` None: the whole
  mini-batch), padded to the mini-batch's size in whole micro-batches.

  Why the bucket only sizes the micro-batch: the update loops over the first `count`
  micro-batches with a trip count it reads at run time, so the number of kept rows changes no
  shape once it fills a micro-batch, and a run compiles one update per micro-batch size (at most
  log2(micro_batch / min_rows) + 1 of them) instead of one per bucket of rows, and runs
  ceil(kept / micro) micro-batches instead of a power of two's worth. Below a micro-batch the
  bucket still shrinks it: a small model's configs take the whole mini-batch as one micro-batch.
  """
  kept = len(kept_rows)
  micro = min(bucket_rows(kept, total, multiple, min_rows), micro_batch or total)
  micro = -(-micro // multiple) * multiple
  slots = -(-total // micro) * micro
  rows = np.concatenate([np.asarray(kept_rows, np.int64), np.zeros(slots - kept, np.int64)])
  padding = np.arange(slots) >= kept
  return Selection(rows, kept, padding, micro, -(-kept // micro))


def shared(kept_rows: np.ndarray, total: int, n: int, multiple: int, min_rows: int,
           micro_batch: int | None, prompt_len: int, completion_len: int) -> Selection | None:
  """`kept_rows` of a mini-batch of `total` rows, whole groups of `n` rows sharing a prompt
  (a rollout's prompt-major layout, unshuffled), laid out so that the update runs each prompt
  once per block of rows: the Selection, or None where that would not compute fewer positions
  than `layout`'s a prompt per row.

  Every row of a group that has a kept row is laid out (the others marked as padding: they carry
  no weight), as `layout` lays out kept rows, in micro-batches of the same size rules; the rows
  of a micro-batch on one device (`micro / multiple`, contiguous) come in blocks of
  s = gcd(micro / multiple, n) rows of one group, so no block straddles a device, and the memory
  of a micro-batch is never more positions than `layout`'s: (micro / s) prompts and micro
  completions against micro whole rows.

  Why: the update's forward and backward otherwise run a group's prompt once per row, and on
  the arithmetic prompts (longer than their completions) that is most of the positions a dense
  objective (mean, GRPO) computes. A sparse pass@k with n = k keeps at most one row per group,
  where sharing has nothing to save: the cost rule then keeps `layout`'s.
  """
  kept_rows = np.asarray(kept_rows, np.int64)
  if n < 2 or total % n or prompt_len < 1 or not len(kept_rows):
    return None
  groups = np.unique(kept_rows // n)
  rows = (groups[:, None] * n + np.arange(n)).ravel()
  grouped = layout(rows, total, multiple, min_rows, micro_batch)
  share = math.gcd(grouped.micro // multiple, n)
  if share < 2:
    return None
  alone = layout(kept_rows, total, multiple, min_rows, micro_batch)
  cost = lambda sel, s: sel.count * sel.micro * (prompt_len / s + completion_len)
  if cost(grouped, share) >= cost(alone, 1):
    return None
  padding = grouped.padding | ~np.isin(grouped.rows, kept_rows)
  return dataclasses.replace(grouped, kept=len(kept_rows), padding=padding, share=share)
