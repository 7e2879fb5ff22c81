"""Supervised warm-up on the task's reference solutions, before RL (as the paper does on MATH).

Each training prompt contributes one example per reference solution (tasks with several routes
to an answer give several, so the warmed-up policy samples diverse chains of thought). An example
is the left-padded prompt followed by the solution and the end-of-sequence token; the loss is the
mean negative log-likelihood of the solution tokens (EOS included) over the batch, computed with
the same float32 `model.token_logprobs` the RL loss uses. Examples are visited in a seeded random
order, epoch after epoch. The optimizer is AdamW with its own warm-up (`update.make_optimizer`);
its state is discarded afterwards: RL starts with a fresh optimizer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

from ksjax import model
from ksjax.model import sharding
from ksjax.tasks.base import Task
from ksjax.tokenization import Tokenizer


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


def warm_up(llama: model.Llama, task: Task, *, steps: int, batch_size: int, learning_rate: float,
            lr_warmup_steps: int, weight_decay: float, seed: int, mesh: jax.sharding.Mesh,
            log_every: int = 50, log=print) -> tuple[nnx.State, dict[str, float]]:
  """Trains `llama` (in place) for `steps` steps on reference solutions; returns its state and
  a summary {"loss": final smoothed loss, "seconds": wall time}."""
  from ksjax.trainer import update  # pylint: disable=g-import-not-at-top

  tokenizer: Tokenizer = task.tokenizer
  pairs = examples(task)
  prompt_len = round_up(max(len(p) for p, _ in pairs), 8)
  total_len = prompt_len + round_up(max(len(c) for _, c in pairs), 8)
  optimizer = update.make_optimizer(learning_rate=learning_rate, warmup_steps=lr_warmup_steps,
                                    weight_decay=weight_decay, max_grad_norm=1.0)
  graphdef, params = nnx.split(llama)
  param_shardings = sharding.state_shardings(params, mesh)
  opt_state = jax.jit(optimizer.init)(params)
  data_sharding = NamedSharding(mesh, jax.sharding.PartitionSpec(sharding.BATCH, None))

  @jax.jit
  def step(params, opt_state, tokens_bt, mask_bt, target_bt):
    def loss_fn(params):
      with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # activation shardings
        logp_bt, _ = model.token_logprobs(nnx.merge(graphdef, params), tokens_bt, mask_bt)
      weight_bt = target_bt / jnp.maximum(target_bt.sum(), 1)
      return -(weight_bt * logp_bt).sum()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = jax.lax.with_sharding_constraint(optax.apply_updates(params, updates),
                                              param_shardings)
    return params, opt_state, loss

  rng = np.random.default_rng(seed)
  order, cursor = rng.permutation(len(pairs)), 0
  start, smoothed = time.time(), None
  for i in range(steps):
    if cursor + batch_size > len(order):
      order, cursor = rng.permutation(len(pairs)), 0
    batch = [pairs[j] for j in order[cursor:cursor + batch_size]]
    cursor += batch_size
    arrays = [jax.device_put(a, data_sharding)
              for a in layout(batch, prompt_len, total_len, tokenizer.pad_id)]
    params, opt_state, loss = step(params, opt_state, *arrays)
    if (i + 1) % log_every == 0 or i + 1 == steps:
      loss = float(loss)
      smoothed = loss if smoothed is None else 0.7 * smoothed + 0.3 * loss
      log(f"warm-up step {i + 1}/{steps}: loss {loss:.4f} ({time.time() - start:.0f}s)")
  nnx.update(llama, params)
  return params, {"loss": float("nan") if smoothed is None else smoothed,
                  "seconds": time.time() - start}
