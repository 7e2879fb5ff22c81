"""Supervised warm-up on the task's reference solutions, before RL (as the paper does on MATH).

Each training prompt contributes one example per reference solution (tasks with several routes
to an answer give several, so the warmed-up policy samples diverse chains of thought). An example
is the left-padded prompt followed by the solution and the end-of-sequence token; the loss is the
mean negative log-likelihood of the solution tokens (EOS included) over the batch, computed with
the same float32 `model.token_logprobs` the RL loss uses. Examples are visited in a seeded random
order, epoch after epoch. The optimizer is AdamW with its own warm-up (`WarmupSpec.optimizer`);
its state is discarded afterwards: RL starts with a fresh optimizer.

It runs through the RL update's own `Updater`: that loss with every advantage 1, no importance
weight and token weights 1 / (solution tokens in the batch) is exactly the mean negative
log-likelihood, so the warm-up gets the update's activation shardings, donation and non-finite
skip without a second compiled step to maintain.

Where a fixed number of steps leaves the policy depends on floating-point details (the CPU's
instruction set, the order of a sum), so a warm-up may instead stop at a target: with
`WarmupSpec.target_pass_at_1` set, every `check_every` steps the current parameters sample
completions for a fixed, seeded set of training prompts (`calibration_prompts`; the held-out split
is never read) through the run's own sample-decode-score path (`ksjax.run.scoring`), and the
warm-up stops at the first check whose pass@1 reaches the target, or at `steps`. A check reads the
parameters only: the example order and the optimizer are those of the fixed-step warm-up, so a
warm-up stopped at step s has exactly the parameters of a fixed warm-up of s steps, and the checks
sample from their own seed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from ksjax import model
from ksjax.model import lora
from ksjax.run import scoring
from ksjax.run.spec import LossSpec, WarmupSpec
from ksjax.tasks.base import Prompt, Task
from ksjax.tokenization import Tokenizer
from ksjax.trainer import update
from ksjax.trainer.batch import MicroBatch


TRAIN_SPLIT = "train"  # the split the warm-up trains on, and the only one its checks read
# Mixed into the run's seed for the calibration's prompts and samples, so that they are a stream of
# their own: the warm-up's example order does not depend on whether checks run.
CALIBRATION_STREAM = 0x6361_6C69


def examples(task: Task, split: str = TRAIN_SPLIT) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
  """(prompt tokens, solution tokens + EOS) for every reference solution of every prompt."""
  tokenizer = task.tokenizer
  out = []
  for prompt in task.prompts(split):
    for text in task.reference_solutions(prompt):
      out.append((tuple(prompt.tokens),
                  tuple(tokenizer.encode(text, add_bos=False)) + (tokenizer.eos_id,)))
  if not out:
    raise ValueError(f"task {task.name!r} has no reference solutions in split {split!r}; set "
                     "config.sft_warmup.steps=0 or use a task with solutions")
  return out


def layout(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], prompt_len: int, total_len: int,
           pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """tokens int32 [B, T], attention mask bool [B, T] and loss mask bool [B, T] for (prompt,
  completion) pairs: prompts left-padded to `prompt_len`, completions after them."""
  b = len(pairs)
  tokens = np.full((b, total_len), pad_id, np.int32)
  mask = np.zeros((b, total_len), bool)
  target = np.zeros((b, total_len), bool)
  for r, (prompt, completion) in enumerate(pairs):
    completion = list(completion)[:total_len - prompt_len]
    tokens[r, prompt_len - len(prompt):prompt_len] = prompt
    tokens[r, prompt_len:prompt_len + len(completion)] = completion
    mask[r, prompt_len - len(prompt):prompt_len + len(completion)] = True
    target[r, prompt_len:prompt_len + len(completion)] = True
  return tokens, mask, target


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def calibration_prompts(task: Task, count: int, seed: int) -> list[Prompt]:
  """`count` training prompts (all of them if the split has fewer), fixed by `seed`.

  An equal share comes from each difficulty level (`metadata["level"]`; one group if the task has
  none), so the calibration's pass@1 does not depend on how many training problems each level
  happens to have. The draws use their own stream (`CALIBRATION_STREAM`).
  """
  prompts = list(task.prompts(TRAIN_SPLIT))
  if count >= len(prompts):
    return prompts
  groups: dict = {}
  for i, prompt in enumerate(prompts):
    groups.setdefault(prompt.metadata.get("level"), []).append(i)
  rng = np.random.default_rng([CALIBRATION_STREAM, seed])
  queues = [list(rng.permutation(indices)) for indices in groups.values()]
  chosen: list[int] = []
  while len(chosen) < count:  # round robin over the levels; count < len(prompts) ends it
    for queue in queues:
      if queue and len(chosen) < count:
        chosen.append(int(queue.pop()))
  return [prompts[i] for i in sorted(chosen)]


def calibration_seed(seed: int) -> int:
  """The sampler seed of every check: the same draws each time, so that the checks differ by the
  parameters only."""
  return int(np.random.default_rng([CALIBRATION_STREAM, seed, 1]).integers(2**32))


def calibration_pass_at_1(llama: model.Llama, task: Task, prompts: Sequence[Prompt],
                          spec: WarmupSpec, *, max_new_tokens: int, seed: int,
                          mesh: jax.sharding.Mesh | None = None) -> float:
  """The mean over `prompts` of the fraction of `spec.calibration_samples` completions at
  temperature 1 that the task scores correct (the unbiased pass@1)."""
  draw = scoring.Draw(num_samples=spec.calibration_samples, max_new_tokens=max_new_tokens,
                      temperature=1.0, top_p=1.0, top_k=0)
  scored = scoring.sample_and_score(llama, task, prompts, draw, seed=seed, mesh=mesh)
  return float(np.mean(scored.correct_gn))


def warm_up(llama: model.Llama, task: Task, spec: WarmupSpec, *, seed: int,
            mesh: jax.sharding.Mesh, log_every: int = 50, max_new_tokens: int | None = None,
            log=print) -> tuple[nnx.State, dict[str, float]]:
  """Trains `llama` (in place) on reference solutions for `spec.steps` steps, or until a check's
  calibration pass@1 reaches `spec.target_pass_at_1` when that is set; returns its state and a
  summary {"loss": final smoothed loss, "seconds": wall time, "steps": steps taken,
  "calibration_pass_at_1": the last check's (nan without checks)}.

  `max_new_tokens` is the checks' generation budget (None: the longest reference solution with
  its EOS)."""
  tokenizer: Tokenizer = task.tokenizer
  pairs = examples(task)
  prompt_len = round_up(max(len(p) for p, _ in pairs), 8)
  total_len = prompt_len + round_up(max(len(c) for _, c in pairs), 8)
  frozen = None
  if lora.is_adapted(llama):  # the adapters warm up; the base stays as it is
    graphdef, params, frozen = lora.split(llama)
  else:
    graphdef, params = nnx.split(llama)
  # Weight-1 policy gradient = negative log-likelihood (see the module docstring).
  nll = LossSpec(algorithm="pg", loss_aggregation="token_sum", loss_constant=1.0,
                 micro_batch_size=1, sparse_updates=False)
  updater = update.Updater(graphdef, spec.optimizer().build(), nll, mesh, temperature=1.0,
                           frozen=frozen)
  state = updater.init_state(params, jax.random.key(seed))
  calibration = calibration_prompts(task, spec.calibration_prompts, seed) if spec.targeted else []
  budget = max_new_tokens or max(len(c) for _, c in pairs)

  rng = np.random.default_rng(seed)
  order, cursor = rng.permutation(len(pairs)), 0
  start, smoothed, steps, reached, pass_at_1 = time.time(), None, 0, False, float("nan")
  for i in range(spec.steps):
    if cursor + spec.batch_size > len(order):
      order, cursor = rng.permutation(len(pairs)), 0
    batch = [pairs[j] for j in order[cursor:cursor + spec.batch_size]]
    cursor += spec.batch_size
    tokens_bt, mask_bt, target_bt = layout(batch, prompt_len, total_len, tokenizer.pad_id)
    weight_bt = target_bt / np.float32(max(target_bt.sum(), 1))
    rows = MicroBatch(tokens=tokens_bt, attention_mask=mask_bt,
                      token_weight=weight_bt.astype(np.float32),
                      behaviour_logp=np.zeros(tokens_bt.shape, np.float32),
                      advantage=np.ones(len(batch), np.float32))
    state, metrics = updater.step(state, updater.place(rows.split(len(batch))), prompt_len)
    steps = i + 1
    if spec.targeted and steps % spec.check_every == 0:
      # A module of its own around the current parameters: `llama` is only updated at the end.
      pass_at_1 = calibration_pass_at_1(updater.policy(state.params), task, calibration,
                                        spec, max_new_tokens=budget, seed=calibration_seed(seed),
                                        mesh=mesh)
      reached = pass_at_1 >= spec.target_pass_at_1
      log(f"warm-up step {steps}: calibration pass@1 {pass_at_1:.3f} (target "
          f"{spec.target_pass_at_1:g}; {len(calibration)} training prompts x "
          f"{spec.calibration_samples} samples)")
    if steps % log_every == 0 or steps == spec.steps or reached:
      loss = float(metrics["loss"])
      smoothed = loss if smoothed is None else 0.7 * smoothed + 0.3 * loss
      log(f"warm-up step {steps}/{spec.steps}: loss {loss:.4f} ({time.time() - start:.0f}s)")
    if reached:
      break
  if spec.targeted and steps and not reached:
    last = (f"no check ran (check_every={spec.check_every})" if math.isnan(pass_at_1) else
            f"the last check gave {pass_at_1:.3f}")
    log(f"warm-up stopped at its maximum of {steps} steps without reaching calibration pass@1 "
        f"{spec.target_pass_at_1:g}; {last}")
  nnx.update(llama, state.params)
  return state.params, {"loss": float("nan") if smoothed is None else smoothed,
                        "seconds": time.time() - start, "steps": steps,
                        "calibration_pass_at_1": pass_at_1}
