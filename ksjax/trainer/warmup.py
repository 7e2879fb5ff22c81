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
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from ksjax import model
from ksjax.run.spec import LossSpec, WarmupSpec
from ksjax.tasks.base import Task
from ksjax.tokenization import Tokenizer
from ksjax.trainer import update
from ksjax.trainer.batch import MicroBatch


def examples(task: Task, split: str = "train") -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
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


def warm_up(llama: model.Llama, task: Task, spec: WarmupSpec, *, seed: int,
            mesh: jax.sharding.Mesh, log_every: int = 50,
            log=print) -> tuple[nnx.State, dict[str, float]]:
  """Trains `llama` (in place) for `spec.steps` steps on reference solutions; returns its state
  and a summary {"loss": final smoothed loss, "seconds": wall time}."""
  tokenizer: Tokenizer = task.tokenizer
  pairs = examples(task)
  prompt_len = round_up(max(len(p) for p, _ in pairs), 8)
  total_len = prompt_len + round_up(max(len(c) for _, c in pairs), 8)
  graphdef, params = nnx.split(llama)
  # Weight-1 policy gradient = negative log-likelihood (see the module docstring).
  nll = LossSpec(algorithm="pg", aggregation="token_sum", loss_constant=1.0, micro_batch_size=1,
                 sparse_updates=False)
  updater = update.Updater(graphdef, spec.optimizer().build(), nll, mesh, temperature=1.0)
  state = updater.init_state(params, jax.random.key(seed))

  rng = np.random.default_rng(seed)
  order, cursor = rng.permutation(len(pairs)), 0
  start, smoothed = time.time(), None
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
    if (i + 1) % log_every == 0 or i + 1 == spec.steps:
      loss = float(metrics["loss"])
      smoothed = loss if smoothed is None else 0.7 * smoothed + 0.3 * loss
      log(f"warm-up step {i + 1}/{spec.steps}: loss {loss:.4f} ({time.time() - start:.0f}s)")
  nnx.update(llama, state.params)
  return state.params, {"loss": float("nan") if smoothed is None else smoothed,
                        "seconds": time.time() - start}
