"""The labelled probe: the policy's true accuracy on held-out prompts every few RL steps.

A label-free run's reward measures how much its completions agree, not whether they are right,
so a run can raise its reward while its accuracy falls; the probe (config.eval.probe_every) is
what tells the two apart, and works for any run. It is the held-out evaluation's pipeline
(`ksjax.run.scoring.evaluate`, the unbiased `per_problem` estimators, `flat_summary`), with
labels, on the held-out split only, so no training prompt is ever scored against its label by it.

Small and steady by design: `probe_prompts` prompts spread evenly over the split (a split listed
level by level would otherwise give its first level alone), `probe_samples` completions each,
and the same sampling seed at every probe, so that successive probes differ by the policy rather
than by the draw. Logged as probe/pass_at_1, probe/pass_at_<n>, probe/maj_at_<n>, probe/reward,
per level (probe/level2/pass_at_1), and the answers' diversity.
"""

from __future__ import annotations

import numpy as np

from ksjax.run import scoring
from ksjax.run.spec import HeldOutSpec
from ksjax.tasks.base import Prompt, Task


def prompts(task: Task, spec: HeldOutSpec) -> list[Prompt]:
  """`spec.probe_prompts` prompts of `spec.split`, evenly spaced (all of them if fewer)."""
  split = list(task.prompts(spec.split))
  count = min(spec.probe_prompts, len(split))
  return [split[i] for i in np.linspace(0, len(split) - 1, count).round().astype(int)]


def evaluate(llama, task: Task, spec: HeldOutSpec, *, seed: int, mesh=None) -> dict[str, float]:
  """The probe's scalars, {"probe/pass_at_1": ..., ...}."""
  chosen = prompts(task, spec)
  n = spec.probe_samples
  draw = scoring.Draw(num_samples=n, max_new_tokens=spec.max_new_tokens,
                      temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k)
  out = scoring.evaluate(llama, task, chosen, draw, seed=seed, batch_prompts=spec.batch_prompts,
                         mesh=mesh)
  values = scoring.per_problem(out.correct_gn, out.answer_ids_gn, out.rewards_gn, sorted({1, n}))
  return {f"probe/{name.replace('@', '_at_')}": value
          for name, value in scoring.flat_summary(values, chosen).items()}
