"""The planted task's policy measure (`ksjax.evaluation.planted`): the answer probabilities read by
teacher forcing are the model's next-token probabilities after the prompt, and what the sampler
draws and the task grades as each answer, one-token completions being exactly one token."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ksjax import model, sampling
from ksjax.evaluation import planted as measure
from ksjax.objectives import planted as closed
from ksjax.tasks import planted

SAMPLES = 4096


def _sharp_model(task, prompt):
  """A fresh tiny Llama whose head gives the letters logits 3, 2.5 and 2 after `prompt`, so the
  counts below are large."""
  cfg = model.preset("tiny", vocab_size=task.tokenizer.vocab_size, hidden_size=32, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64,
                     tie_embeddings=False)
  llama = model.Llama(cfg, rngs=nnx.Rngs(3))
  hidden = llama.hidden(jnp.asarray([prompt.tokens]))[0, -1]  # [D], what the head reads
  letters = np.asarray([task.tokenizer.encode(a, add_bos=False)[0] for a in task.answers])
  columns = jnp.outer(hidden / jnp.dot(hidden, hidden), jnp.asarray([3.0, 2.5, 2.0]))  # [D, 3]
  llama.lm_head[...] = llama.lm_head[...].at[:, letters].set(columns)
  return llama


def test_answer_probabilities_are_the_next_token_distribution_the_sampler_draws():
  task = planted.PlantedTask(labels=(3, 2, 1), start=(1, 1, 1))
  prompt = task.type_prompts()[0]
  llama = _sharp_model(task, prompt)
  q = measure.answer_probabilities(llama, task)  # [1, 3]
  logits = np.asarray(llama(jnp.asarray([prompt.tokens]))[0, -1], np.float64)
  softmax = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
  letters = [task.tokenizer.encode(a, add_bos=False)[0] for a in task.answers]
  np.testing.assert_allclose(q[0], softmax[letters], rtol=1e-4)
  assert q.sum() > 0.2  # the letters carry mass: the counts below test something

  out = sampling.generate(llama, [list(prompt.tokens)], num_samples=SAMPLES, max_new_tokens=1,
                          temperature=1.0, top_p=1.0, top_k=0, seed=0,
                          eos_id=tuple(task.tokenizer.eos_ids), pad_id=task.tokenizer.pad_id)
  texts = [task.tokenizer.decode(row) for row in np.asarray(out.tokens)]
  [score] = task.score([prompt], [texts])
  graded = np.asarray([[a == letter for a in score.answers] for letter in task.answers]).sum(1)
  sigma = np.sqrt(SAMPLES * q[0] * (1 - q[0]))
  assert (np.abs(graded - SAMPLES * q[0]) < 5 * sigma + 1).all(), (graded, SAMPLES * q[0])


def test_values_read_the_task_s_frequencies():
  task = planted.PlantedTask(labels=(3, 2))
  q = np.array([[0.5, 0.25]])
  got = measure.values(q, task, {"mean": closed.MEAN, "pass@2": closed.single(2)})
  assert got["mean"] == 0.6 * 0.5 + 0.4 * 0.25
  assert got["pass@2"] == 0.6 * (1 - 0.5**2) + 0.4 * (1 - 0.75**2)
  assert measure.optimal_values(task, {"mean": closed.MEAN}) == {"mean": 0.6}
