"""The sampler's settings: one frozen, hashable dataclass.

Every field changes the compiled program (the loop's length, which truncation branches exist, the
stop tests), so the dataclass is a static argument of the jitted prefill and decode and part of
the key of the program cache (as the sampler config of google-deepmind gemma). Prompts, the number
of prompts and the seed are data and are not here.

Validation raises `ValueError` naming the `generate` argument that was wrong and what is accepted;
checks that need the model (token ids inside the vocabulary, lengths inside the context) are in
`batching.py`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def _is_int(value: Any) -> bool:
  """A Python or numpy integer, not a bool."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def token_ids(value: Any, name: str, *, allow_empty: bool) -> tuple[int, ...]:
  """`value` (an int or a sequence of ints >= 0) as a tuple, or ValueError naming `name`."""
  items = (value,) if _is_int(value) else value
  if isinstance(items, (str, bytes)) or not isinstance(items, (Sequence, np.ndarray)):
    raise ValueError(f"{name}={value!r} is not accepted; expected a token id (int >= 0) or a "
                     "sequence of them")
  items = list(items)
  if not all(_is_int(t) and int(t) >= 0 for t in items):
    raise ValueError(f"{name}={value!r} is not accepted; expected token ids: integers >= 0")
  if not items and not allow_empty:
    raise ValueError(f"{name}={value!r} is empty; expected at least one token id")
  return tuple(int(t) for t in items)


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  """How to sample; see `sampling.generate` for the meaning of each field.

  `eos_id` and `stop_sequences` are normalised to tuples so that the config stays hashable.
  `prefill_once` chooses how the `num_samples` rows of a prompt get their KV cache: True prefills
  each prompt once and its rows share that cache, False prefills every row (the prompt repeated)
  and gives each row its own. Both give the same samples; True is the default because it is
  faster and smaller (benchmarks/sampling.py measures both prefills).
  `compact_rows`: whenever at most half of the decode batch is still running, the sampler moves
  the running rows into a batch half as large (or smaller), so finished rows stop costing a
  decode step; it never shrinks below `compact_rows` rows (0: never shrinks). A row's samples do
  not depend on it (each row keeps its own keys); sampler.py says how.
  `cache_phases`: the decode loop runs in up to this many phases, each attending only the row
  slots it can have written by its end (about 1/4, 1/2 and all of them for 3), so that early
  tokens do not read the whole generated cache; each phase compiles its own loop body, and none
  is shorter than 64 slots. 1: one loop over all slots. Generations of at most 97 new tokens
  always take one loop.
  `weights_first_rows`: on a CPU, a decode program of at most this many rows multiplies by
  transposed copies of the weight matrices, made once per call, with the weights as the left
  operand (`sampler.weights_first`): at a few rows XLA:CPU's dot library runs that way several
  times faster. The copies cost the matrices' bytes once more while the sampler runs. 0: never.
  """
  max_new_tokens: int = 256
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  eos_id: tuple[int, ...] = ()
  stop_sequences: tuple[tuple[int, ...], ...] = ()
  pad_id: int = 0
  prefill_once: bool = True
  compact_rows: int = 8
  cache_phases: int = 3
  weights_first_rows: int = 32

  def __post_init__(self):
    if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens={self.max_new_tokens!r} is not accepted; expected an "
                       "integer >= 1")
    if (isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float))
        or not math.isfinite(self.temperature) or self.temperature < 0):
      raise ValueError(f"temperature={self.temperature!r} is not accepted; expected a finite "
                       "number >= 0 (0 means greedy)")
    if (isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float))
        or not 0 < self.top_p <= 1):
      raise ValueError(f"top_p={self.top_p!r} is not accepted; expected 0 < top_p <= 1 "
                       "(1 means no nucleus truncation)")
    if not _is_int(self.top_k) or self.top_k < 0:
      raise ValueError(f"top_k={self.top_k!r} is not accepted; expected an integer >= 0 "
                       "(0 means no top-k truncation)")
    if not _is_int(self.pad_id) or self.pad_id < 0:
      raise ValueError(f"pad_id={self.pad_id!r} is not accepted; expected a token id (int >= 0)")
    if not _is_int(self.compact_rows) or self.compact_rows < 0:
      raise ValueError(f"compact_rows={self.compact_rows!r} is not accepted; expected an integer "
                       ">= 0 (0 means the decode batch never shrinks)")
    if not _is_int(self.cache_phases) or self.cache_phases < 1:
      raise ValueError(f"cache_phases={self.cache_phases!r} is not accepted; expected an integer "
                       ">= 1 (1 means one decode loop over all slots)")
    if not _is_int(self.weights_first_rows) or self.weights_first_rows < 0:
      raise ValueError(f"weights_first_rows={self.weights_first_rows!r} is not accepted; expected "
                       "an integer >= 0 (0 means the weights are never transposed)")
    eos = () if self.eos_id is None else token_ids(self.eos_id, "eos_id", allow_empty=True)
    stops = self.stop_sequences or ()
    if isinstance(stops, (str, bytes)) or not isinstance(stops, Sequence):
      raise ValueError(f"stop_sequences={stops!r} is not accepted; expected a sequence of "
                       "token-id sequences")
    stops = tuple(token_ids(s, f"stop_sequences[{i}]", allow_empty=False)
                  for i, s in enumerate(stops))
    object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
    object.__setattr__(self, "temperature", float(self.temperature))
    object.__setattr__(self, "top_p", float(self.top_p))
    object.__setattr__(self, "top_k", int(self.top_k))
    object.__setattr__(self, "pad_id", int(self.pad_id))
    object.__setattr__(self, "compact_rows", int(self.compact_rows))
    object.__setattr__(self, "cache_phases", int(self.cache_phases))
    object.__setattr__(self, "weights_first_rows", int(self.weights_first_rows))
    object.__setattr__(self, "eos_id", eos)
    object.__setattr__(self, "stop_sequences", stops)

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  def token_ids_used(self) -> tuple[tuple[str, int], ...]:
    """(argument name, token id) of every id in the config, to check against a vocabulary."""
    named = [("eos_id", t) for t in self.eos_id] + [("pad_id", self.pad_id)]
    named += [(f"stop_sequences[{i}]", t) for i, s in enumerate(self.stop_sequences) for t in s]
    return tuple(named)
