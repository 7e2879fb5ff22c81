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
from collections.abc import Callable, Sequence

import numpy as np

from ksjax.run import scoring
from ksjax.run.spec import SamplingSpec
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


def collect(llama, task: Task, prompts: Sequence[Prompt], spec: SamplingSpec, *, seed: int,
            mesh=None, sampled: Callable[[], None] | None = None) -> Rollout:
  """Algorithm 1, step (ii): n completions of each prompt from `llama`, scored by the task
  (`ksjax.run.scoring.sample_and_score`, which calls `sampled` between the two) and laid out
  for the update. With `spec.label_free`, rewarded by agreement, not by the label
  (`scoring.hide_labels`)."""
  draw = scoring.Draw(num_samples=spec.n, max_new_tokens=spec.max_new_tokens,
                      temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k)
  scored = scoring.sample_and_score(llama, task, prompts, draw, seed=seed, mesh=mesh,
                                    sampled=sampled)
  return layout(prompts, scoring.hide_labels(scored) if spec.label_free else scored)


def layout(prompts: Sequence[Prompt], scored: scoring.Scored) -> Rollout:
  """Lays scored samples out for the update: [R, T] rows of prompt and completion."""
  out = scored.output
  tokens_rn = np.asarray(out.tokens)
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
                 finished_r=np.asarray(out.finished).astype(bool), texts=scored.texts,
                 rewards_bn=scored.rewards_gn, correct_bn=scored.correct_gn,
                 answer_ids_bn=scored.answer_ids_gn)


def batch_metrics(rollout: Rollout, k: int) -> dict[str, float]:
  """What the step's samples say: mean reward, the unbiased pass@k and maj@k of the batch, how
  diverse each prompt's answers are, completion lengths, and per level.

  Besides the objective's k ("batch/pass_at_k"), pass@k and maj@k are logged along the ladder
  k = 1, 2, 4, ..., n ("batch/pass_at_4", "batch/maj_at_4"): a policy that concentrates on one
  answer shows it as pass@1 rising while pass@n and "diversity/*" fall, which pass@k at the
  trained k alone can hide. The ladder and diversity are means over the step's B prompts, so
  they are noisy per step; the per-level breakdown ("level3/...") leaves the ladder out.
  """
  ladder = scoring.k_ladder(rollout.num_samples)
  ks = sorted({1, k, *ladder})
  values = scoring.per_problem(rollout.correct_bn, rollout.answer_ids_bn, rollout.rewards_bn, ks)
  names = {"reward": "reward/mean", "pass@1": "batch/pass_at_1", f"pass@{k}": "batch/pass_at_k",
           f"maj@{k}": "batch/maj_at_k",
           **{name: f"diversity/{name}" for name in scoring.DIVERSITY}}
  ladder_names = {**{f"pass@{j}": f"batch/pass_at_{j}" for j in ladder},
                  **{f"maj@{j}": f"batch/maj_at_{j}" for j in ladder}}
  masks = scoring.group_masks([p.metadata for p in rollout.prompts], ("level",))
  out = {}
  for group, means in scoring.summarize(values, masks).items():
    for key, name in names.items():  # per level: "level3/pass_at_k", "level3/answer_entropy"
      out[name if group == scoring.ALL else
          f"{group.replace('=', '')}/{name.split('/')[-1]}"] = means[key]
    if group == scoring.ALL:
      out.update({name: means[key] for key, name in ladder_names.items()})
  lengths_r = rollout.completion_mask_rt.sum(1)
  out["completion/length_mean"] = float(lengths_r.mean())
  out["completion/unfinished_fraction"] = float(1.0 - rollout.finished_r.mean())
  return out
