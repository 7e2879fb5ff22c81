"""Algorithm 1, step (iii): turn one rollout and its k-sample advantages into optimizer steps.

The completions of a step are used `ppo_epochs` times, split each time (in a fresh random order
when there is more than one mini-batch or epoch) into `num_minibatches` mini-batches, one
optimizer step each. Token weights (`losses.token_weights`) are fixed per mini-batch before any
row is dropped, so the sparse path (`ksjax.trainer.sparse`) updates exactly as the dense one.

Log-probabilities of three policies meet here:
  * mu, the sampler's (`Rollout.behaviour_logp_rt`), the policy the completions came from;
  * pi_old, the learner's at the start of the step (clipped stacks only): one forward pass over
    the rows an update will use, before the first optimizer step;
  * pi_theta, the learner's now, inside the loss.
Plain PG weights each token by min(pi_theta / mu, is_cap) when is_cap is set, which is 1
on-policy and corrects the lag of later mini-batches and epochs; the clipped stacks take the
ratio pi_theta / pi_old and weight by min(pi_old / mu, is_cap), the sampler-learner mismatch.
With is_level="group" every row of a prompt's group carries one weight, min(prod pi_old / mu,
is_cap) over the group's tokens (`losses.group_is_weight`), from a forward pass over every row
before the first optimizer step (the sparse path drops zero-advantage rows from the update, not
from their group's weight).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from ksjax import distributed
from ksjax.trainer import losses, sparse
from ksjax.trainer.batch import MicroBatch
from ksjax.trainer.rollout import Rollout
from ksjax.trainer.update import TrainState, Updater


def forward_rows(updater: Updater, params, rollout: Rollout, rows: np.ndarray, micro: int, *,
                 values: bool = False, share: bool = False) -> dict[str, np.ndarray]:
  """Learner log-probs (and V(x)) of the given rows (ascending), forward only, as host arrays
  [len(rows), T].

  The rows are laid out as the update lays them out (`row_layout`: micro-batches of `micro` rows
  in a batch of the rollout's size, with `share` each group's prompt run once where that is
  cheaper), so that one program serves every number of rows."""
  selection = row_layout(rollout, rows, updater.batch_shards, micro, micro,
                         share=share and not values)
  return _forward(updater, params, rollout, selection, group=selection.share, values=values)


def row_layout(rollout: Rollout, rows: np.ndarray, shards: int, min_rows: int,
               micro: int | None, share: bool) -> sparse.Selection:
  """The layout of `rows` (ascending indices into the rollout, prompt-major in groups of
  `rollout.num_samples`) that an update or a forward runs: with `share`, `sparse.shared`'s where
  it computes fewer positions, else `sparse.layout`'s, a prompt per row."""
  total = len(rollout.tokens_rt)
  selection = None
  if share:
    selection = sparse.shared(rows, total, rollout.num_samples, shards, min_rows, micro,
                              rollout.prompt_len,
                              rollout.tokens_rt.shape[1] - rollout.prompt_len)
  return selection or sparse.layout(rows, total, shards, min_rows, micro)


def reference_rows(updater: Updater, params, rollout: Rollout, micro: int) -> np.ndarray:
  """Log-probs [R, T] of every row of `rollout` (whole groups of `rollout.num_samples`, prompt-
  major) under `params`, forward only: the reference's, for the KL penalty and the logged KL.

  Each micro-batch holds whole groups (`micro` rounded up to a multiple of the group and of the
  batch shards; a micro-batch's padding rows are copies of row 0, whole groups of them), so each
  prompt runs once for its group (`Updater.forward`'s `group`). Where the layout cannot hold
  whole groups, the rows run one by one as `forward_rows` runs them."""
  total = len(rollout.tokens_rt)
  selection, group = reference_layout(total, rollout.num_samples, updater.batch_shards, micro)
  return _forward(updater, params, rollout, selection, group=group)["logp"]


def reference_layout(total: int, n: int, shards: int, micro: int) -> tuple[sparse.Selection, int]:
  """`reference_rows`'s layout of a rollout of `total` rows in groups of `n`, and the group its
  forward runs (1 where no micro-batch holds whole groups); the memory plan compiles the same."""
  grouped = math.lcm(-(-micro // n) * n, shards)
  selection = sparse.layout(np.arange(total), total, shards, grouped, grouped)
  if total % n or selection.micro % n:  # groups that no micro-batch size holds whole
    return sparse.layout(np.arange(total), total, shards, micro, micro), 1
  return selection, n


def _forward(updater: Updater, params, rollout: Rollout, selection: sparse.Selection,
             **options) -> dict[str, np.ndarray]:
  """The forward's outputs of the selection's rows that carry a weight, in their order."""
  split = lambda v: v.reshape(len(selection.rows) // selection.micro, selection.micro,
                              *v.shape[1:])
  tokens_mmt, mask_mmt = (updater.place_rows(split(v[selection.rows])) for v in (
      rollout.tokens_rt, rollout.attention_mask_rt))
  out = updater.forward(params, tokens_mmt, mask_mmt, prompt_len=rollout.prompt_len,
                        count=selection.count, **options)
  out = distributed.to_host(out)
  real = np.flatnonzero(~selection.padding)
  return {k: np.asarray(v).reshape(len(selection.rows), *v.shape[2:])[real]
          for k, v in out.items()}


def learn(updater: Updater, state: TrainState, rollout: Rollout, advantage_r: np.ndarray,
          key: jax.Array,
          ref_logp_rt: np.ndarray | None = None) -> tuple[TrainState, dict[str, float]]:
  """All optimizer steps of one rollout, as `updater.loss` says (epochs, mini-batches, micro-
  batches, sparse rows). Returns the new state and the step's update metrics.

  Args:
    advantage_r: float32 [R], the k-sample weights (for ppo the return R_i; the loss subtracts
      V_old(x)).
    key: raw uint32 key data, the randomness of the mini-batch order.
    ref_logp_rt: the reference policy's log-probs [R, T]; needed when the loss has a KL penalty.
  """
  cfg = updater.loss
  shards = updater.batch_shards
  num_rows = len(advantage_r)
  use_sparse = cfg.use_sparse
  clipped = cfg.clipped
  share = updater.shares_prompts
  # Rows an update can use: every row, or in the sparse path those with a non-zero advantage.
  usable = np.flatnonzero(advantage_r != 0) if use_sparse else np.arange(num_rows)
  # The rows pi_old's forward reads: those, or every row where a group's weight reads all of it.
  needed = np.arange(num_rows) if cfg.group_is else usable
  old = {}
  if (clipped or cfg.group_is) and len(needed):
    old = forward_rows(updater, state.params, rollout, needed, cfg.micro_batch_size,
                       values=cfg.algorithm == "ppo", share=share)
  old_logp_rt = np.zeros(rollout.tokens_rt.shape, np.float32)
  old_value_r = np.zeros(num_rows, np.float32)
  if "logp" in old:
    old_logp_rt[needed] = old["logp"]
  if "value" in old:
    old_value_r[needed] = old["value"]
  is_weight_r = None
  if cfg.group_is:
    log_ratio_r = np.where(rollout.completion_mask_rt,
                           old_logp_rt - rollout.behaviour_logp_rt, 0.0).sum(1)
    is_weight_r = np.asarray(losses.group_is_weight(log_ratio_r, rollout.num_samples,
                                                    cfg.is_cap), np.float32)

  rng = np.random.default_rng(np.asarray(key, np.uint32).ravel().tolist())
  shuffle = cfg.ppo_epochs > 1 or cfg.num_minibatches > 1
  totals: dict[str, float] = {}
  kept_rows = 0
  optimizer_steps = 0
  shared_steps = 0  # optimizer steps that ran each prompt once for a block of its rows
  for _ in range(cfg.ppo_epochs):
    order = rng.permutation(num_rows) if shuffle else np.arange(num_rows)
    for minibatch in np.split(order, cfg.num_minibatches):
      completion_rt = rollout.completion_mask_rt[minibatch]
      token_weight_rt = np.asarray(losses.token_weights(completion_rt, cfg.loss_aggregation,
                                                        constant=cfg.loss_constant))
      value_weight_r = np.asarray(losses.sequence_weights(completion_rt))
      if share:  # the mini-batch is the rollout in order (no shuffle): its groups are whole
        selection = row_layout(rollout, usable, shards,
                               cfg.sparse_min_rows if use_sparse else num_rows,
                               cfg.micro_batch_size, share=True)
      elif use_sparse:
        selection = sparse.select_rows(advantage_r[minibatch], shards, cfg.sparse_min_rows,
                                       cfg.micro_batch_size)
      else:
        selection = sparse.every_row(len(minibatch), shards, cfg.micro_batch_size)
      kept_rows += selection.kept
      if use_sparse and not selection.kept:  # no row has a weight: a zero gradient
        state, metrics = updater.zero_step(state)
        totals = _add_totals(totals, metrics)
        optimizer_steps += 1
        continue
      local, padding = selection.rows, selection.padding
      rows = minibatch[local]
      ppo = cfg.algorithm == "ppo"
      batch = MicroBatch(
          tokens=rollout.tokens_rt[rows],
          attention_mask=rollout.attention_mask_rt[rows],
          token_weight=np.where(padding[:, None], 0.0, token_weight_rt[local]).astype(np.float32),
          behaviour_logp=rollout.behaviour_logp_rt[rows],
          advantage=np.where(padding, 0.0, advantage_r[rows]).astype(np.float32),
          old_logp=old_logp_rt[rows] if clipped else None,
          old_value=old_value_r[rows] if ppo else None,
          value_weight=(np.where(padding, 0.0, value_weight_r[local]).astype(np.float32)
                        if ppo else None),
          ref_logp=ref_logp_rt[rows] if cfg.kl_coef > 0 else None,
          is_weight=is_weight_r[rows] if is_weight_r is not None else None)
      batch = updater.place(batch.split(selection.micro))
      state, metrics = updater.step(state, batch, rollout.prompt_len, selection.count,
                                    selection.share)
      shared_steps += selection.share > 1
      totals = _add_totals(totals, metrics)
      optimizer_steps += 1
  return state, {**summarize(totals, optimizer_steps, kept_rows, num_rows * cfg.ppo_epochs,
                             use_sparse),
                  "update/shared_prompts": shared_steps / max(optimizer_steps, 1)}


def _add_totals(totals: dict[str, float], metrics: Mapping[str, Any]) -> dict[str, float]:
  """An optimizer step's metric sums added to the step's totals ("_max" metrics maxed)."""
  out = dict(totals)
  for name, value in jax.device_get(metrics).items():
    before = out.get(name, 0.0)
    out[name] = max(before, float(value)) if name.endswith("_max") else before + float(value)
  return out


def summarize(totals: Mapping[str, float], steps: int, kept_rows: int, rows: int,
              use_sparse: bool) -> dict[str, float]:
  """Per-step update metrics from the sums over optimizer steps."""
  tokens = max(totals.get("tokens", 0.0), 1.0)
  out = {
      "loss/total": totals["loss"] / steps,
      "loss/policy": totals["pg_loss"] / steps,
      "optim/grad_norm": totals["grad_norm"] / steps,
      "optim/skipped_steps": steps - totals["finite"],
      "optim/steps": float(steps),
      "update/rows_fraction": kept_rows / max(rows, 1),
      "update/sparse": float(use_sparse),
      "is/weight_mean": totals["is_weight_sum"] / tokens,
      "is/weight_max": totals["is_weight_max"],
      "is/log_ratio_abs_mean": totals["log_ratio_abs_sum"] / tokens,
  }
  if "clipped_tokens" in totals:
    out["ppo/clip_fraction"] = totals["clipped_tokens"] / tokens
  if "is_truncated_tokens" in totals:
    out["is/truncated_fraction"] = totals["is_truncated_tokens"] / tokens
  if "value_loss" in totals:
    out["loss/value"] = totals["value_loss"] / steps
    out["ppo/value_clip_fraction"] = totals["value_clipped"] / max(totals["value_rows"], 1.0)
  if "kl_loss" in totals:
    out["loss/kl_penalty"] = totals["kl_loss"] / steps
  return out
