"""Host-side preparation of a prompt batch: validation, shape buckets, left padding.

Every distinct (prompt batch, prompt length) compiles a new prefill and decode program, so both are
rounded up to buckets and a run compiles a bounded number of shapes:
  * prompt length: a power of two (at least `MIN_PROMPT_BUCKET`) up to `LINEAR_FROM`, then a
    multiple of `LINEAR_FROM`; so at most 5 + context / 256 lengths, and a bucket wastes at most
    half of a short prompt's slots and 256 slots of a long one;
  * prompt batch: a power of two, then a multiple of what the mesh needs so that the rows
    (prompts x samples) split evenly over the batch axes ("data", "fsdp").
Padding prompts are one `pad_id` token each; their rows are marked finished before the first step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

MIN_PROMPT_BUCKET = 16
LINEAR_FROM = 256


def bucket_length(n: int) -> int:
  """The padded prompt length for a longest prompt of `n` tokens."""
  if n <= LINEAR_FROM:
    return max(MIN_PROMPT_BUCKET, 1 << (n - 1).bit_length())
  return -(-n // LINEAR_FROM) * LINEAR_FROM


def bucket_prompt_batch(num_prompts: int, num_samples: int, batch_shards: int) -> int:
  """The padded number of prompts: a power of two >= `num_prompts`, rounded up to a multiple of
  the smallest count whose rows (count x num_samples) `batch_shards` divides."""
  multiple = batch_shards // math.gcd(num_samples, batch_shards)
  p = 1 << (num_prompts - 1).bit_length()
  return -(-p // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class PromptBatch:
  """Left-padded prompts, padded to a bucketed batch (rows past `num_prompts` are padding)."""
  tokens_pt: np.ndarray   # int32 [P', T], pad_id left of each prompt
  mask_pt: np.ndarray     # bool [P', T], True on real tokens
  num_prompts: int        # P, the real prompts


def validate_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[np.ndarray]:
  """The prompts as int32 arrays, or ValueError naming the first bad one."""
  if isinstance(prompts, (str, bytes, np.ndarray)) or not isinstance(prompts, Sequence):
    raise ValueError(f"prompts of type {type(prompts).__name__} is not accepted; expected a "
                     "list of prompts, each a list of token ids")
  if not prompts:
    raise ValueError("prompts is empty; expected a non-empty list of prompts, each a non-empty "
                     "list of token ids")
  out = []
  for i, prompt in enumerate(prompts):
    if isinstance(prompt, (str, bytes)):
      raise ValueError(f"prompts[{i}] is a string; expected a list of token ids (tokenize first)")
    ids = np.asarray(prompt)
    if ids.ndim != 1 or ids.size == 0:
      raise ValueError(f"prompts[{i}] has shape {ids.shape}; expected a non-empty 1-D list of "
                       "token ids")
    if ids.dtype.kind not in "iu":
      raise ValueError(f"prompts[{i}] has dtype {ids.dtype}; expected integer token ids")
    if ids.min() < 0 or ids.max() >= vocab_size:
      raise ValueError(f"prompts[{i}] has token id {int(ids.min() if ids.min() < 0 else ids.max())}"
                       f"; expected ids in [0, vocab_size={vocab_size})")
    out.append(ids.astype(np.int32))
  return out


def validate_lengths(prompts: Sequence[np.ndarray], max_new_tokens: int, context: int) -> None:
  """ValueError if a prompt, or a prompt plus `max_new_tokens`, does not fit in `context`."""
  longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
  n = len(prompts[longest])
  if n >= context:
    raise ValueError(f"prompts[{longest}] has {n} tokens; the model's context "
                     f"(max_position_embeddings) is {context}, so prompts must have at most "
                     f"{context - 1} tokens")
  if n + max_new_tokens > context:
    raise ValueError(f"max_new_tokens={max_new_tokens} is past the context: the longest prompt "
                     f"(prompts[{longest}], {n} tokens) plus max_new_tokens exceeds "
                     f"max_position_embeddings={context}; accepted: max_new_tokens <= "
                     f"{context - n}")


def pad_prompts(prompts: Sequence[np.ndarray], num_samples: int, batch_shards: int,
                pad_id: int) -> PromptBatch:
  """Left-pads validated prompts into a bucketed [P', T] batch."""
  t = bucket_length(max(len(p) for p in prompts))
  rows = bucket_prompt_batch(len(prompts), num_samples, batch_shards)
  tokens_pt = np.full((rows, t), pad_id, np.int32)
  mask_pt = np.zeros((rows, t), bool)
  for i, prompt in enumerate(prompts):
    tokens_pt[i, t - len(prompt):] = prompt
    mask_pt[i, t - len(prompt):] = True
  mask_pt[len(prompts):, -1] = True  # padding prompts: one pad token
  return PromptBatch(tokens_pt, mask_pt, len(prompts))
