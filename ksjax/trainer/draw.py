"""Every step's draw (`draw_step`): its rounds of sampling, and the groups its update keeps.

Without dynamic sampling (the default) a step makes one round and keeps every group in place: the
same rollout object, the same shapes and the same update as a plain sample call.

Dynamic sampling spends a step's update on groups with signal. With the pass@k leave-one-out
estimator a group (the n completions of one prompt) has a non-zero weight only when its best
completion is unique, so on easy or hard prompts most groups weigh nothing: they cost a reference
forward and (dense) update rows and teach nothing. With
`config.dynamic_sampling` a step samples rounds of `batch_prompts` prompts (each round one
`rollout.collect` call, the sampler's usual batch) until it holds B = batch_prompts groups whose
k-sample weights are not all zero, or `config.dynamic_max_rounds` rounds are done.

The filter is "every weight of the group is exactly 0", stricter than DAPO's "every reward
equal": a pass@k leave-one-out group with two correct samples has none (it is kept under DAPO's
rule and contributes nothing). Exact zeros are what the estimators give for no signal
(differences of equal rewards), and it is the rule `sparse.select_rows` drops rows by.

What a step keeps and uses:
  * the first B signal groups in sampling order (round by round, prompt order within a round);
    signal groups beyond B in the last round are dropped, not carried over: a buffer would be
    state outside the checkpoint (resume would no longer be exact) and its samples would be one
    update off-policy by the time they were used;
  * at the cap, fewer than B: the update uses those it has, normalised over its own rows (the
    token weights count the kept completions, as DAPO's do); none: the step makes no update
    (no optimizer step, so Adam's moments and the learning-rate schedule do not move), but it
    logs its metrics, saves its checkpoint and counts as a step;
  * the kept groups are laid out in a batch of `bucket_groups` groups, padded with groups whose
    rows have no completion tokens and zero advantage (copies of a kept row's tokens, so that
    every forward stays finite): such rows get token weight 0 and are not counted as sequences
    (`losses.token_weights`, `losses.sequence_weights`), so the update is that of the kept groups
    alone, while the reference forward and the update see at most log2(B) + 1 shapes; with B
    groups kept the batch is exactly today's shape.

Other loss terms follow the update: with PPO's value loss or a KL penalty (dense updates), those
terms too see the kept groups only. update/rows_fraction is relative to the padded batch.

Metrics: the batch metrics (reward/mean, batch/pass_at_k, completion lengths, advantage/*,
entropy) describe every sampled group of the step, what the policy does; the KL metrics and the
update describe the kept groups. `metrics` adds dynamic/rounds, dynamic/kept_fraction (kept
groups / sampled groups), dynamic/sampled_tokens_per_kept_row (completion tokens generated per
kept row, the price of a row of signal; left out when none is kept) and dynamic/prompts_consumed.

Resume stays exact: every round draws its prompts with `next` on the checkpointed data iterator
(a step consumes rounds * batch_prompts prompts, and the checkpoint after it records where the
stream stands), and round r's sampling seed is `round_seed(sample_key, r)`, derived from the step's
key alone (round 0's is the seed a step without dynamic sampling uses).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import numpy as np

from ksjax.trainer import sparse
from ksjax.trainer.rollout import Rollout


# ---------------------------------------------------------------------------------------------
# Pure selection
# ---------------------------------------------------------------------------------------------

def round_seed(sample_key: jax.Array, round_index: int) -> int:
  """The sampling seed of round `round_index` of a step, from the step's sampling key alone.

  Round 0 uses the key itself, so its seed is the one a step without dynamic sampling draws;
  later rounds fold their index into it.
  """
  key = sample_key if round_index == 0 else jax.random.fold_in(sample_key, round_index)
  return int(jax.random.randint(key, (), 0, 2**31 - 1))


def signal_groups(advantage_bn: np.ndarray) -> np.ndarray:
  """bool [B]: whether a group has any non-zero k-sample weight (exactly 0.0 is no signal)."""
  return np.any(np.asarray(advantage_bn) != 0, axis=1)


def choose(signal_per_round: Sequence[np.ndarray], target: int) -> np.ndarray:
  """The groups a step keeps, int64 indices into the groups of all rounds laid end to end: the
  first `target` groups with signal, in sampling order."""
  signal = np.concatenate([np.asarray(s, bool) for s in signal_per_round]) if len(
      signal_per_round) else np.zeros(0, bool)
  return np.flatnonzero(signal)[:target]


def should_continue(kept: int, rounds: int, *, target: int, max_rounds: int) -> bool:
  """Whether a step samples another round: fewer than `target` signal groups so far and fewer
  than `max_rounds` rounds made."""
  return kept < target and rounds < max_rounds


def group_multiple(n: int, row_multiple: int) -> int:
  """The fewest groups of n rows whose row count is a multiple of `row_multiple` (the update's
  mini-batches times the batch shards), so that a batch of such groups splits as a full one."""
  return row_multiple // math.gcd(n, row_multiple)


def bucket_groups(kept: int, total: int, multiple: int = 1) -> int:
  """The padded group count for `kept` groups: multiple * 2^j >= kept, capped at `total` (B, the
  dense size), as `sparse.bucket_rows` does for rows. At least `multiple` (never 0)."""
  return sparse.bucket_rows(kept, total, multiple, min_rows=1)


# ---------------------------------------------------------------------------------------------
# Rollouts: concatenating rounds, taking groups
# ---------------------------------------------------------------------------------------------

def _left_pad(x_rt: np.ndarray, columns: int) -> np.ndarray:
  if not columns:
    return x_rt
  return np.concatenate([np.zeros((x_rt.shape[0], columns), x_rt.dtype), x_rt], axis=1)


def concatenate(rollouts: Sequence[Rollout]) -> Rollout:
  """The groups of several rollouts as one, in order. Prompts are left-padded to the longest
  prompt width P (padding columns are masked out, and RoPE positions count unmasked tokens only,
  so a row means the same at any P)."""
  if len(rollouts) == 1:
    return rollouts[0]
  width = max(r.prompt_len for r in rollouts)
  cat = lambda name: np.concatenate([
      _left_pad(getattr(r, name), width - r.prompt_len) for r in rollouts])
  stack = lambda name: np.concatenate([getattr(r, name) for r in rollouts])
  return Rollout(
      prompts=sum((r.prompts for r in rollouts), ()), tokens_rt=cat("tokens_rt"),
      attention_mask_rt=cat("attention_mask_rt"), completion_mask_rt=cat("completion_mask_rt"),
      behaviour_logp_rt=cat("behaviour_logp_rt"), prompt_len=width,
      finished_r=stack("finished_r"), texts=sum((r.texts for r in rollouts), ()),
      rewards_bn=stack("rewards_bn"), correct_bn=stack("correct_bn"),
      answer_ids_bn=stack("answer_ids_bn"))


def take_groups(rollout: Rollout, groups: np.ndarray, size: int | None = None) -> Rollout:
  """Groups `groups` of `rollout`, in that order, then `size - len(groups)` padding groups: rows
  that repeat the first kept row's tokens and attention (finite in every forward) with no
  completion tokens, so no loss term and no token-weight normaliser counts them."""
  groups = np.asarray(groups, np.int64)
  size = len(groups) if size is None else size
  if size < len(groups) or (size and not len(groups)):
    raise ValueError(f"size={size} is not accepted for {len(groups)} groups; expected at least "
                     "as many, and a group to copy when padding")
  n = rollout.num_samples
  rows = (groups[:, None] * n + np.arange(n)).reshape(-1)
  pad_groups, pad_rows = size - len(groups), (size - len(groups)) * n
  fill = np.concatenate([rows, np.full(pad_rows, rows[0] if len(rows) else 0, np.int64)])

  def per_row(x_r, blank=None):
    out = x_r[fill]
    if blank is not None and pad_rows:
      out[len(rows):] = blank
    return out

  def per_group(x_bn, blank):
    return np.concatenate([x_bn[groups], np.full((pad_groups, n), blank, x_bn.dtype)])

  prompts = tuple(rollout.prompts[g] for g in groups)
  return Rollout(
      prompts=prompts + prompts[:1] * pad_groups,
      tokens_rt=per_row(rollout.tokens_rt), attention_mask_rt=per_row(rollout.attention_mask_rt),
      completion_mask_rt=per_row(rollout.completion_mask_rt, False),
      behaviour_logp_rt=per_row(rollout.behaviour_logp_rt, 0.0), prompt_len=rollout.prompt_len,
      finished_r=per_row(rollout.finished_r, True),
      texts=tuple(rollout.texts[r] for r in rows) + ("",) * pad_rows,
      rewards_bn=per_group(rollout.rewards_bn, 0.0),
      correct_bn=per_group(rollout.correct_bn, False),
      answer_ids_bn=per_group(rollout.answer_ids_bn, -1))


# ---------------------------------------------------------------------------------------------
# One step's sampling
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Drawn:
  """One step's samples and what its update uses.

  Attributes:
    sampled: every group of every round, in sampling order (what the batch metrics describe).
    advantage_bn: float32 [G, n], the k-sample weights of `sampled`.
    kept: int64 indices of the groups the update uses, into `sampled`'s groups.
    update: the kept groups then padding groups (`take_groups`), the batch the reference forward
      and the update read; `sampled` itself when every group is kept unpadded (dynamic sampling
      off). Meaningless when nothing is kept.
    update_advantage_r: float32 [rows of `update`], 0 on padding rows.
    rounds: sampler rounds made.
    prompts_consumed: prompts drawn from the data stream.
    k: the k of `advantage_bn` (config.k_schedule's at the step), carried with the samples so
      that what the step logs is what its weights used, however far ahead it was drawn.
  """
  sampled: Rollout
  advantage_bn: np.ndarray
  kept: np.ndarray
  update: Rollout
  update_advantage_r: np.ndarray
  rounds: int
  prompts_consumed: int
  k: int

  @property
  def kept_rows(self) -> int:
    """Real (not padding) rows of `update`."""
    return len(self.kept) * self.sampled.num_samples

  def metrics(self) -> dict[str, float]:
    """The dynamic/* scalars of the step."""
    groups = len(self.advantage_bn)
    generated = float(self.sampled.completion_mask_rt.sum())
    out = {
        "dynamic/rounds": float(self.rounds),
        "dynamic/kept_fraction": len(self.kept) / max(groups, 1),
        "dynamic/prompts_consumed": float(self.prompts_consumed),
    }
    if self.kept_rows:  # with none kept it is undefined: left out, a gap in the curve
      out["dynamic/sampled_tokens_per_kept_row"] = generated / self.kept_rows
    return out


def draw_step(draw: Callable[[int], tuple[Rollout, np.ndarray]], *, k: int, target: int,
              enabled: bool, max_rounds: int, multiple: int = 1) -> Drawn:
  """A step's rounds of sampling and the groups its update keeps.

  Args:
    draw: round index -> (rollout of one sampler batch, its k-sample weights [B, n] for `k`); it
      draws the round's prompts from the data stream and samples with `round_seed(key, round)`.
    k: the k the step's weights are computed with, recorded on the `Drawn`.
    target: B, the groups an update wants (batch_prompts).
    enabled: dynamic sampling; off, one round and every group, unpadded.
    max_rounds: the cap on rounds (config.dynamic_max_rounds).
    multiple: the group multiple of the padded batch (`group_multiple`).
  """
  rollouts, advantages, signals = [], [], []
  kept = 0
  while not rollouts or (enabled and should_continue(kept, len(rollouts), target=target,
                                                     max_rounds=max_rounds)):
    batch, advantage_bn = draw(len(rollouts))
    rollouts.append(batch)
    advantages.append(np.asarray(advantage_bn, np.float32))
    signals.append(signal_groups(advantage_bn))
    kept += int(signals[-1].sum())
  sampled = concatenate(rollouts)
  advantage_bn = np.concatenate(advantages)
  prompts = sum(len(r.prompts) for r in rollouts)
  if not enabled:
    return Drawn(sampled, advantage_bn, np.arange(len(advantage_bn)), sampled,
                 advantage_bn.reshape(-1), len(rollouts), prompts, k)
  chosen = choose(signals, target)
  size = bucket_groups(len(chosen), target, multiple) if len(chosen) else 0
  update = take_groups(sampled, chosen, size) if len(chosen) else sampled
  n = sampled.num_samples
  update_advantage_r = np.zeros(size * n, np.float32)
  update_advantage_r[:len(chosen) * n] = advantage_bn[chosen].reshape(-1)
  return Drawn(sampled, advantage_bn, chosen, update, update_advantage_r, len(rollouts), prompts,
               k)
