"""Sparse updates: leave zero-advantage completions out of the backward pass.

With the pass@k leave-one-out estimator at most one completion per group has a non-zero weight
(the unique best one, and only when it beats the second best), so with n = k = 8 at least 7/8 of
the rows contribute exactly nothing to the policy-gradient loss. When no other loss term reads
them (no value loss, no KL penalty; `LossSpec.needs_every_row`, which also decides
`LossSpec.use_sparse`), those rows are dropped and the rest are
gathered into a smaller batch. Because every loss is a sum over tokens with weights fixed from
the whole batch (`losses.token_weights`), the update is the same as the dense one.

Shapes stay bounded: the kept rows are padded to a bucket, a power of two times the number of
batch shards (at least `min_rows`, `config.sparse_min_rows`), capped at the dense size, so a run
compiles at most log2(rows / min_rows) + 1 update programs. Padding rows have no tokens (weight 0)
and contribute 0.
"""

from __future__ import annotations

import dataclasses

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
  """Which rows of a dense batch an update keeps and how they are padded.

  Attributes:
    rows: int64 [S] indices into the dense batch; the first `kept` are real, the rest repeat row 0
      and are marked as padding.
    kept: the number of real rows.
    padding: bool [S], True on padding rows (their token weights must be zeroed).
  """
  rows: np.ndarray
  kept: int
  padding: np.ndarray


def select_rows(advantage_r: np.ndarray, multiple: int = 1, min_rows: int = MIN_ROWS) -> Selection:
  """The rows with a non-zero advantage, padded to `bucket_rows`; order preserved.

  Zero means exactly 0.0: pass@k leave-one-out gives exact zeros (differences of equal rewards),
  and a tiny non-zero weight is kept, as the dense update would use it.
  """
  advantage_r = np.asarray(advantage_r)
  nonzero = np.flatnonzero(advantage_r != 0)
  size = bucket_rows(len(nonzero), len(advantage_r), multiple, min_rows)
  if size == len(advantage_r):  # the dense shape: keep every row in order, nothing to pad
    return Selection(np.arange(size), size, np.zeros(size, bool))
  rows = np.concatenate([nonzero, np.zeros(size - len(nonzero), np.int64)])
  padding = np.arange(size) >= len(nonzero)
  return Selection(rows, len(nonzero), padding)
