"""Algorithm 1, steps (i)-(ii) and the scoring: B prompts, n completions each, rewards, advantages.

A `Rollout` holds one step's completions as the update consumes them: R = B * n rows, prompt-major
(row b * n + s is sample s of prompt b), each row the left-padded prompt (P columns) followed by
the completion (max_new_tokens columns, the EOS included, padding after it). The sampler's
log-probabilities of the completion tokens are kept in the same [R, T] layout: column P + j holds
log mu(completion token j), which is where `model.token_logprobs` puts the learner's log-prob of
that token, so the two can be compared element by element.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from ksjax import objectives
from ksjax import sampling
from ksjax.evaluation import estimators
from ksjax.tasks.base import Prompt, Task


@dataclasses.dataclass(frozen=True)
class Rollout:
  """One step's completions and scores (R = B * n rows, T = P + max_new_tokens columns)."""
  prompts: tuple[Prompt, ...]      # [B]
  tokens_rt: np.ndarray            # int32 [R, T]
  attention_mask_rt: np.ndarray    # bool [R, T], prompt and completion tokens
  completion_mask_rt: np.ndarray   # bool [R, T], completion tokens only (what the loss trains)
  behaviour_logp_rt: np.ndarray    # float32 [R, T], sampler log-probs on completion tokens, else 0
  prompt_len: int                  # P
  finished_r: np.ndarray           # bool [R], ended with EOS
  texts: tuple[str, ...]           # [R] decoded completions
  rewards_bn: np.ndarray           # float32 [B, n]
  correct_bn: np.ndarray           # bool [B, n]
  answer_ids_bn: np.ndarray        # int32 [B, n]

  @property
  def num_samples(self) -> int:
    return self.rewards_bn.shape[1]


def sample(llama, prompts: Sequence[Prompt], *, num_samples: int, max_new_tokens: int,
           temperature: float, top_p: float, top_k: int, seed: int, eos_ids: Sequence[int],
           pad_id: int, mesh=None) -> sampling.SampleOutput:
  return sampling.generate(llama, [list(p.tokens) for p in prompts], num_samples=num_samples,
                           max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                           top_k=top_k, seed=seed, eos_id=tuple(eos_ids), mesh=mesh, pad_id=pad_id)


def score(task: Task, prompts: Sequence[Prompt], out: sampling.SampleOutput) -> Rollout:
  """Decodes and scores the sampler's output; lays it out for the update."""
  tokenizer = task.tokenizer
  b = len(prompts)
  tokens_rn = np.asarray(out.tokens)
  r = tokens_rn.shape[0]
  if r % b:
    raise ValueError(f"{r} sampled rows do not split into {b} prompts")
  n = r // b
  texts = tuple(tokenizer.decode(row) for row in tokens_rn)
  scores = task.score(prompts, [texts[g * n:(g + 1) * n] for g in range(b)])
  seq_rt, mask_rt = (np.asarray(x) for x in out.sequences())
  prompt_len = seq_rt.shape[1] - tokens_rn.shape[1]
  completion_mask_rt = mask_rt.copy()
  completion_mask_rt[:, :prompt_len] = False
  behaviour_rt = np.zeros(seq_rt.shape, np.float32)
  behaviour_rt[:, prompt_len:] = np.where(completion_mask_rt[:, prompt_len:],
                                          np.asarray(out.logprobs), 0.0)
  return Rollout(prompts=tuple(prompts), tokens_rt=seq_rt.astype(np.int32),
                 attention_mask_rt=mask_rt.astype(bool), completion_mask_rt=completion_mask_rt,
                 behaviour_logp_rt=behaviour_rt, prompt_len=prompt_len,
                 finished_r=np.asarray(out.finished).astype(bool), texts=texts,
                 rewards_bn=np.stack([s.rewards for s in scores]).astype(np.float32),
                 correct_bn=np.stack([s.correct for s in scores]).astype(bool),
                 answer_ids_bn=np.stack([s.answer_ids for s in scores]).astype(np.int32))


def advantages(rollout: Rollout, *, aggregator: str, baseline: str, k: int, p: int, beta: float,
               scale: str) -> np.ndarray:
  """The k-sample weights of `ksjax.objectives`, float32 [B, n]."""
  return np.asarray(objectives.k_sample_advantages(
      rollout.rewards_bn, aggregator=aggregator, baseline=baseline, k=k, p=p, beta=beta,
      scale=scale, answer_ids=rollout.answer_ids_bn), np.float32)


def batch_metrics(rollout: Rollout, k: int) -> dict[str, float]:
  """What the step's samples say: mean reward, the unbiased pass@k and maj@k of the batch,
  completion lengths, and per level."""
  n = rollout.num_samples
  correct_bn, answers_bn = rollout.correct_bn, rollout.answer_ids_bn
  per_prompt = {"reward/mean": rollout.rewards_bn.mean(1), "batch/pass_at_1": correct_bn.mean(1),
                "batch/pass_at_k": estimators.pass_at_k(correct_bn.sum(1), n, k),
                "batch/maj_at_k": estimators.maj_at_k(answers_bn, correct_bn, k)}
  out = {name: float(v.mean()) for name, v in per_prompt.items()}
  levels = np.asarray([prompt.metadata.get("level", -1) for prompt in rollout.prompts])
  for level in sorted(set(levels.tolist()) - {-1}):
    select = levels == level
    for name, v in per_prompt.items():
      out[f"level{level}/{name.split('/')[-1]}"] = float(v[select].mean())
  lengths_r = rollout.completion_mask_rt.sum(1)
  out["completion/length_mean"] = float(lengths_r.mean())
  out["completion/unfinished_fraction"] = float(1.0 - rollout.finished_r.mean())
  return out
