"""A policy on the planted task, measured exactly, and each objective's held-out value there.

`answer_probabilities` reads the policy's probability of each answer for every prompt type from
teacher-forced log-probs (`model.token_logprobs`): no sampling, so no sampling noise. An answer is
one token (a letter of the character tokenizer) and a planted run samples one token per
completion (configs/planted.py: max_new_tokens = 1), so the completions the task grades as
answer j are exactly the one token j, and q_j is exactly the probability that a sample is graded
j. The rest of the mass, 1 - sum_j q_j, is no answer (wrong). (With longer completions the
letter followed by padding or another special token would decode, and be graded, as the letter
too; a run that learnt to end with one of those instead of the end token, which is equally
rewarded, would be undercounted. That is why the config samples one token.)

`values` turns q into each target's held-out value with the closed forms of
`ksjax.objectives.planted`, at the test split's label frequencies.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import jax.numpy as jnp
import numpy as np

from ksjax import model
from ksjax.model import checkpoint as model_checkpoint
from ksjax.objectives import planted as closed
from ksjax.run import checkpoints
from ksjax.run.directory import RunDirectory
from ksjax.run.spec import EstimatorSpec
from ksjax.tasks.planted import PlantedTask


def answer_probabilities(llama: model.Llama, task: PlantedTask, *, split: str = "test",
                         temperature: float = 1.0) -> np.ndarray:
  """q [P, m], float64: the probability that `llama`'s first sampled token (at `temperature`) is
  answer j, for prompt type t."""
  tok = task.tokenizer
  prompts = task.type_prompts(split)
  completions = [tuple(tok.encode(a, add_bos=False)) for a in task.answers]  # one token each
  prompt_len = max(len(p.tokens) for p in prompts)
  total = prompt_len + max(len(c) for c in completions)
  rows = len(prompts) * len(completions)
  tokens_rt = np.full((rows, total), tok.pad_id, np.int32)
  mask_rt = np.zeros((rows, total), bool)
  for r, (p, c) in enumerate((p, c) for p in prompts for c in completions):
    tokens_rt[r, prompt_len - len(p.tokens):prompt_len] = p.tokens
    tokens_rt[r, prompt_len:prompt_len + len(c)] = c
    mask_rt[r, prompt_len - len(p.tokens):prompt_len + len(c)] = True
  logp_rt, _ = model.token_logprobs(llama, jnp.asarray(tokens_rt), jnp.asarray(mask_rt),
                                    temperature=temperature, start=prompt_len)
  logp_r = np.asarray(logp_rt, np.float64).sum(1)  # 0 outside the completions
  return np.exp(logp_r).reshape(len(prompts), len(completions))


def target(estimator: EstimatorSpec) -> closed.Target:
  """The objective a run's estimator optimises (`closed.target`), at its k."""
  e = estimator
  return closed.target(e.aggregator, e.baseline, e.k, e.p, e.weights_at(e.k))


def values(q_pm: np.ndarray, task: PlantedTask,
           targets: Mapping[str, closed.Target]) -> dict[str, float]:
  """{name: the target's held-out value at q} (averaged over prompt types)."""
  f_pm = task.frequencies()
  return {name: closed.value(t, q_pm, f_pm) for name, t in targets.items()}


def optimal_values(task: PlantedTask, targets: Mapping[str, closed.Target]) -> dict[str, float]:
  """{name: the target's value at its own optimum}."""
  f_pm = task.frequencies()
  return {name: closed.optimal_value(t, f_pm) for name, t in targets.items()}


def run_policies(workdir: str) -> Iterator[tuple[int, model.Llama]]:
  """(step, policy) of a run: its start as step 0, then every step checkpoint it kept."""
  run = RunDirectory(workdir)
  start, _ = model.load_checkpoint(run.start_dir)
  yield 0, start
  mesh = model.make_mesh((1, 1, 1))
  graphdef, target = checkpoints.abstract_policy(model_checkpoint.load_config(run.start_dir), mesh)
  for step in checkpoints.steps(run):
    yield step, checkpoints.restore_policy(run, step, graphdef, target)


def trajectory(workdir: str, task: PlantedTask, *,
               temperature: float = 1.0) -> tuple[list[int], np.ndarray]:
  """The steps of `run_policies` and q at each, float64 [S, P, m]."""
  steps, qs = [], []
  for step, llama in run_policies(workdir):
    steps.append(step)
    qs.append(answer_probabilities(llama, task, temperature=temperature))
  return steps, np.stack(qs)
