"""Sample, decode, score; and the per-problem summary of n scored samples.

`sample_and_score` is the one path from a policy and prompts to scored completions: the sampler
(`ksjax.sampling.generate`), the tokenizer's decode and the task's scoring. The trainer's rollout
lays its output out for the update; `evaluate` runs it over a split in chunks for the held-out
evaluation inside a run and for the eval binary.

`per_problem` turns a problem's n outcomes into the numbers every report shows: the mean
reward, the unbiased pass@k and maj@k (`ksjax.objectives.estimates`) for each k, and how diverse
the problem's final answers are (`diversity`). `summarize` averages them over groups of problems
("all", "level=3", "subject=Algebra"). `k_ladder(n)` is the default set of ks, 1, 2, 4, ... and n,
which shows how pass@k grows with the sample budget (the large-k diagnostic: a policy that
sharpens onto one answer gains pass@1 but flattens the ladder).

Diversity is measured on the answer classes the task's scoring gives (`GroupScore.answer_ids`),
the same classes majority voting counts, so equal answers (mathematically equal, for math) are
one answer. Completions without an extractable answer all share one class ("none"): they count as
one distinct answer and one outcome of the entropy, as they are one candidate of the vote. (Math
answers whose equivalence check crashed or timed out are each a class of their own there, too.)

`hide_labels` is the reward of voting without labels (config.label_free): each completion is
rewarded for agreeing with the other completions of its prompt (`ksjax.objectives.label_free`).
The classes it votes on are formed again from the extracted answers' text alone, because the
tasks' own classes may consult the label (math puts every answer the checker finds equal to the
gold in one class, compares the others pairwise; code groups programs by their verdict on the
tests): equal text, one class; so math answers equal only up to form (1/2, 0.5) split the vote.
The label still decides `correct_gn`, which only the logged accuracy reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ksjax import distributed, sampling
from ksjax.objectives import estimates
from ksjax.objectives import label_free
from ksjax.tasks.base import GroupScore, Prompt, Task, answer_classes

ALL = "all"  # the group of every problem


@dataclasses.dataclass(frozen=True)
class Draw:
  """How completions are drawn (`ksjax.sampling.generate`'s arguments besides the prompts)."""
  num_samples: int      # n per prompt
  max_new_tokens: int
  temperature: float
  top_p: float
  top_k: int


@dataclasses.dataclass(frozen=True)
class Scored:
  """Completions of G prompts, n each (rows prompt-major: row g * n + s), and their scores."""
  output: sampling.SampleOutput   # on the host; tokens [G*n, N]
  texts: tuple[str, ...]          # [G*n] decoded completions
  correct_gn: np.ndarray          # bool [G, n]
  answer_ids_gn: np.ndarray       # int32 [G, n], answer classes (majority voting)
  rewards_gn: np.ndarray          # float32 [G, n]
  answers: tuple[tuple[str | None, ...], ...] = ()  # [G][n] extracted answers, None: none


def hide_labels(scored: Scored) -> Scored:
  """Voting without labels: rewards [G, n] are each completion's agreement with the others of
  its prompt (`ksjax.objectives.label_free.agreement`: 1, 1/t on a t-way tie, 0; no answer: no
  vote and 0), over answer classes formed from the answers' text; the label-based rewards and
  classes are dropped. Nothing it returns but `correct_gn` depends on the prompts' labels."""
  if len(scored.answers) != len(scored.rewards_gn):
    raise ValueError(f"{len(scored.answers)} groups of answers for {len(scored.rewards_gn)} "
                     "groups of scores; voting without labels needs the extracted answers")
  answer_ids_gn = np.stack([answer_classes(group) for group in scored.answers]).astype(np.int32)
  answered_gn = np.array([[a is not None for a in group] for group in scored.answers], bool)
  return dataclasses.replace(scored, answer_ids_gn=answer_ids_gn,
                             rewards_gn=label_free.agreement(answer_ids_gn, answered_gn))


def sample_and_score(llama, task: Task, prompts: Sequence[Prompt], draw: Draw, *, seed: int,
                     mesh=None, sampled: Callable[[], None] | None = None) -> Scored:
  """Samples `draw.num_samples` completions per prompt, decodes them and scores them.
  `sampled` is called between the sampling and the scoring (the trainer times the two)."""
  tokenizer = task.tokenizer
  out = sampling.generate(llama, [list(p.tokens) for p in prompts], num_samples=draw.num_samples,
                          max_new_tokens=draw.max_new_tokens, temperature=draw.temperature,
                          top_p=draw.top_p, top_k=draw.top_k, seed=seed,
                          eos_id=tuple(tokenizer.eos_ids), mesh=mesh, pad_id=tokenizer.pad_id)
  out = distributed.to_host(out)
  if sampled is not None:
    sampled()
  tokens_rn = np.asarray(out.tokens)
  g = len(prompts)
  if tokens_rn.shape[0] % max(g, 1):
    raise ValueError(f"{tokens_rn.shape[0]} sampled rows do not split into {g} prompts")
  n = tokens_rn.shape[0] // max(g, 1)
  texts = tuple(tokenizer.decode(row) for row in tokens_rn)
  return from_scores(out, texts, task.score(list(prompts),
                                            [texts[i * n:(i + 1) * n] for i in range(g)]))


def from_scores(output, texts: tuple[str, ...], scores: Sequence[GroupScore]) -> Scored:
  """The task's per-group scores as a Scored ([G, n] arrays)."""
  return Scored(output=output, texts=texts,
                correct_gn=np.stack([s.correct for s in scores]).astype(bool),
                answer_ids_gn=np.stack([s.answer_ids for s in scores]).astype(np.int32),
                rewards_gn=np.stack([s.rewards for s in scores]).astype(np.float32),
                answers=tuple(tuple(s.answers) for s in scores))


@dataclasses.dataclass(frozen=True)
class Outcomes:
  """Per-problem outcomes of one evaluation (G problems, n samples each)."""
  num_samples: int
  correct_gn: np.ndarray      # bool [G, n]
  answer_ids_gn: np.ndarray   # int32 [G, n]
  rewards_gn: np.ndarray      # float32 [G, n]
  extra_g: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)  # [G] each


def evaluate(llama, task: Task, prompts: Sequence[Prompt], draw: Draw, *, seed: int,
             batch_prompts: int, mesh=None,
             measure: Callable[[Scored], Mapping[str, np.ndarray]] | None = None) -> Outcomes:
  """`sample_and_score` over `prompts`, `batch_prompts` at a time (chunk c samples with seed
  `seed + c * batch_prompts`, so a chunk's draws do not depend on the others). `measure`, if
  given, maps each chunk's Scored to more per-problem values ([g] each, e.g. the eval binary's
  KL to a reference), gathered in `Outcomes.extra_g`."""
  correct, answer_ids, rewards, extra = [], [], [], []
  for start in range(0, len(prompts), batch_prompts):
    scored = sample_and_score(llama, task, prompts[start:start + batch_prompts], draw,
                              seed=seed + start, mesh=mesh)
    correct.append(scored.correct_gn)
    answer_ids.append(scored.answer_ids_gn)
    rewards.append(scored.rewards_gn)
    if measure is not None:
      extra.append(measure(scored))
  return Outcomes(draw.num_samples, np.concatenate(correct), np.concatenate(answer_ids),
                  np.concatenate(rewards),
                  {name: np.concatenate([e[name] for e in extra]) for name in extra[0]}
                  if extra else {})


def kl_per_completion(logp_rt: np.ndarray, ref_logp_rt: np.ndarray,
                      mask_rt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """KL(pi || pi_ref) estimates per completion from completions sampled from pi, summed over
  the tokens `mask_rt` marks ([R] each): k1 = sum_t (log pi - log pi_ref), unbiased but of
  either sign per sample, and k3 = sum_t (r_t - 1 - log r_t) with r_t = pi_ref / pi, unbiased and
  >= 0 per token (Schulman's estimators; the trainer's KL metrics and the eval binary's)."""
  log_ratio_rt = np.where(mask_rt, ref_logp_rt - logp_rt, 0.0)
  k1_r = (-log_ratio_rt).sum(1)
  k3_r = np.where(mask_rt, np.expm1(log_ratio_rt) - log_ratio_rt, 0.0).sum(1)
  return k1_r, k3_r


DISTINCT_ANSWERS = "distinct_answers"
ANSWER_ENTROPY = "answer_entropy"
DIVERSITY = (DISTINCT_ANSWERS, ANSWER_ENTROPY)


def k_ladder(n: int) -> tuple[int, ...]:
  """1, 2, 4, ... up to n, and n itself: the ks of pass@k against k on a log axis. n closes the
  ladder (pass@n, "solved by any sample", is the ceiling the smaller ks approach)."""
  if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
    raise ValueError(f"n={n!r} is not accepted; expected the samples per problem, an integer >= 1")
  ks = [1 << i for i in range(int(n).bit_length()) if 1 << i <= n]
  return tuple(ks if ks[-1] == n else ks + [int(n)])


def metric_names(ks: Sequence[int]) -> list[str]:
  return ["reward"] + [f"pass@{k}" for k in ks] + [f"maj@{k}" for k in ks]


def diversity(answer_ids_gn: np.ndarray) -> dict[str, np.ndarray]:
  """How spread out each problem's n final answers are, float64 [G] each:
  "distinct_answers", the number of answer classes among the n samples (1 = every sample gave
  the same answer), and "answer_entropy", the entropy in nats of the empirical distribution of
  the classes, -sum_j (c_j / n) log(c_j / n) (0 = one answer; log n = n different ones).

  Both are plug-in statistics of the n samples, not estimates of the policy's answer
  distribution: they grow with n, so compare them at equal n. Unanswered samples are one class
  (module docstring)."""
  ids_gn = np.asarray(answer_ids_gn)
  if ids_gn.ndim != 2 or ids_gn.shape[1] < 1:
    raise ValueError(f"answer_ids of shape {ids_gn.shape} is not accepted; expected [G, n], n >= 1")
  distinct, entropy = [], []
  for ids in ids_gn:
    _, counts = np.unique(ids, return_counts=True)
    p = counts / counts.sum()
    distinct.append(len(counts))
    entropy.append(float(-(p * np.log(p)).sum()) + 0.0)  # + 0.0: no -0.0 for one class
  return {DISTINCT_ANSWERS: np.asarray(distinct, np.float64),
          ANSWER_ENTROPY: np.asarray(entropy, np.float64)}


def per_problem(correct_gn: np.ndarray, answer_ids_gn: np.ndarray, rewards_gn: np.ndarray,
                ks: Sequence[int]) -> dict[str, np.ndarray]:
  """Each metric's estimate per problem, float64 [G], from n samples per problem ([G, n]):
  "reward" (the mean), "pass@k" and "maj@k" for each k, and the two `diversity` statistics."""
  n = correct_gn.shape[1]
  num_correct_g = correct_gn.sum(axis=1)
  out = {"reward": estimates.mean_reward(rewards_gn)}
  for k, values in estimates.pass_at_ks(num_correct_g, n, ks).items():
    out[f"pass@{k}"] = values
  for k in ks:
    out[f"maj@{k}"] = estimates.maj_at_k(answer_ids_gn, correct_gn, k)
  out.update(diversity(answer_ids_gn))
  return out


def group_masks(metadata: Sequence[Mapping[str, Any]],
                breakdown: Sequence[str]) -> dict[str, np.ndarray]:
  """"all" and "<field>=<value>" for each breakdown field the problems carry -> bool [G]."""
  masks = {ALL: np.ones(len(metadata), bool)}
  for field in breakdown:
    values = sorted({str(m[field]) for m in metadata if m.get(field) is not None},
                    key=_natural)
    for value in values:
      masks[f"{field}={value}"] = np.asarray([str(m.get(field)) == value for m in metadata])
  return masks


def _natural(text: str):
  """Sort "level=10" after "level=9"."""
  return (0, float(text), text) if _is_number(text) else (1, 0.0, text)


def _is_number(text: str) -> bool:
  try:
    float(text)
  except ValueError:
    return False
  return True


def summarize(values: Mapping[str, np.ndarray], masks: Mapping[str, np.ndarray]) -> dict:
  """{group: {"num_problems": g, metric: mean over the group's problems}}."""
  out = {}
  for group, mask in masks.items():
    out[group] = {"num_problems": int(mask.sum()),
                  **{name: float(v[mask].mean()) for name, v in values.items()}}
  return out


def flat_summary(values: Mapping[str, np.ndarray], prompts: Sequence[Prompt]) -> dict[str, float]:
  """The overall means as {metric: value} and each difficulty level's as
  {"level<L>/<metric>": value}: the flat form training logs and tables use."""
  groups = summarize(values, group_masks([p.metadata for p in prompts], ("level",)))
  out = {}
  for group, means in groups.items():
    prefix = "" if group == ALL else group.replace("=", "") + "/"
    out.update({prefix + name: v for name, v in means.items() if name != "num_problems"})
  return out
