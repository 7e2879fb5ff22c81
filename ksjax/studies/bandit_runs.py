"""A study's runs on the softmax bandit (ksjax/bandit): the toy work, seconds a run.

A run is one bandit (its rewards drawn from N(0, 1) by the seed, so every arm of a seed trains on
the same bandit: paired) trained from the uniform policy by one k-sample policy-gradient
estimator (`ksjax.bandit.variants.Variant`: the arm's "aggregator" and "baseline"). Checkpoints
are the policy's logits every `checkpoint_every` steps (JSON, <run>/checkpoints/); the step keys
are folded from the seed and the step, so a run resumed from any checkpoint draws what an
uninterrupted one draws. Evaluation is exact (`ksjax.bandit.exact`): pass@m (the expected best
of m draws) for every m in `ks`, and the KL to the uniform start, one record per checkpoint in
<run>/records/, step 0 included.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

from ksjax import files
from ksjax.studies.declaration import StudyError

FIELDS = ("aggregator", "baseline", "k", "n", "learning_rate", "num_actions", "groups_per_step",
          "steps", "checkpoint_every", "ks")


def _step_file(directory: str, step: int) -> str:
  return os.path.join(directory, f"step_{step:08d}.json")


def _steps_in(directory: str) -> list[int]:
  if not os.path.isdir(directory):
    return []
  return sorted(int(n[5:13]) for n in os.listdir(directory)
                if n.startswith("step_") and n.endswith(".json"))


@functools.lru_cache(maxsize=None)
def _segment(variant, n: int, groups: int, learning_rate: float):
  """A jitted scan of updates at the given steps."""
  import jax  # pylint: disable=g-import-not-at-top
  from ksjax.bandit import policy_gradient  # pylint: disable=g-import-not-at-top

  @jax.jit
  def train(theta_a, rewards_a, key, steps_t):
    def step(theta_a, t):
      grads_ga = policy_gradient.gradient_estimates(jax.random.fold_in(key, t), theta_a,
                                                    rewards_a, variant, groups, n)
      return theta_a + learning_rate * grads_ga.mean(0), None
    theta_a, _ = jax.lax.scan(step, theta_a, steps_t)
    return theta_a
  return train


@dataclasses.dataclass(frozen=True)
class _Overrides:
  overrides: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class BanditRuns:
  """The toy work: `defaults` are every run's fields (FIELDS), an arm's overrides change them."""
  defaults: Mapping[str, Any]
  kl_metric: str = "kl"
  has_start: bool = False

  def settings(self, run) -> dict[str, Any]:
    s = {**self.defaults, **run.overrides}
    unknown = sorted(set(s) - set(FIELDS))
    if unknown:
      raise StudyError(f"bandit runs: fields {unknown} are not accepted; expected {FIELDS}")
    if s["steps"] % s["checkpoint_every"]:
      raise StudyError(f"bandit runs: steps={s['steps']} is not a multiple of checkpoint_every="
                       f"{s['checkpoint_every']}; expected one")
    return s

  def check(self, out: str, arm: str, overrides: Mapping[str, Any]) -> None:
    from ksjax import objectives  # pylint: disable=g-import-not-at-top
    del out
    s = self.settings(_Overrides(overrides))
    for field, accepted in (("aggregator", objectives.AGGREGATORS),
                            ("baseline", objectives.BASELINES)):
      if s[field] not in accepted:
        raise StudyError(f"bandit runs: arm {arm!r} {field}={s[field]!r}; expected one of "
                         f"{tuple(accepted)}")

  def _bandit(self, run, s):
    import jax  # pylint: disable=g-import-not-at-top
    from ksjax.bandit.variants import Variant  # pylint: disable=g-import-not-at-top
    rewards_a = jax.random.normal(jax.random.key(run.seed), (s["num_actions"],))
    return rewards_a, Variant(s["aggregator"], s["baseline"], k=s["k"])

  @staticmethod
  def _load(directory: str, step: int):
    import numpy as np  # pylint: disable=g-import-not-at-top
    with open(_step_file(directory, step), encoding="utf-8") as f:
      return np.asarray(json.load(f), np.float32)

  def prepare(self, out: str, shortened: int | None = None) -> None:
    del out, shortened  # every run starts from the uniform policy: nothing shared to make

  def schedule(self, overrides: Mapping[str, Any]) -> tuple[int, int]:
    s = {**self.defaults, **overrides}
    return s["steps"], s["steps"] // s["checkpoint_every"] + 1

  def shortened(self, overrides: Mapping[str, Any], steps: int) -> dict[str, Any]:
    return {**overrides, "steps": steps, "checkpoint_every": steps}

  def train(self, run) -> None:
    import jax  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    s = self.settings(run)
    directory = os.path.join(run.dir, "checkpoints")
    os.makedirs(directory, exist_ok=True)
    files.write_text(os.path.join(run.dir, "config.json"), json.dumps(s, indent=1, sort_keys=True))
    rewards_a, variant = self._bandit(run, s)
    done = _steps_in(directory)
    step = done[-1] if done else 0
    theta_a = (self._load(directory, step) if done else np.zeros(s["num_actions"], np.float32))
    if not done:
      files.write_text(_step_file(directory, 0), json.dumps(theta_a.tolist()))
    key = jax.random.key(1_000_003 + run.seed)
    while step < s["steps"]:
      theta_a = _segment(variant, s["n"], s["groups_per_step"], s["learning_rate"])(
          theta_a, rewards_a, key, np.arange(step, step + s["checkpoint_every"]))
      step += s["checkpoint_every"]
      files.write_text(_step_file(directory, step), json.dumps(np.asarray(theta_a).tolist()))

  def evaluate(self, run) -> None:
    import numpy as np  # pylint: disable=g-import-not-at-top
    from ksjax.bandit import exact  # pylint: disable=g-import-not-at-top
    s = self.settings(run)
    rewards_a, _ = self._bandit(run, s)
    records = os.path.join(run.dir, "records")
    os.makedirs(records, exist_ok=True)
    for step in _steps_in(os.path.join(run.dir, "checkpoints")):
      if os.path.exists(_step_file(records, step)):
        continue  # evaluated before a stop: kept
      theta_a = self._load(os.path.join(run.dir, "checkpoints"), step)
      metrics = {f"pass@{m}": float(exact.expected_max(theta_a, rewards_a, m)) for m in s["ks"]}
      metrics["kl"] = float(exact.kl_divergence(theta_a, np.zeros_like(theta_a)))
      files.write_text(_step_file(records, step),
                       json.dumps({"step": step, "metrics": metrics}, indent=1, sort_keys=True))

  def progress(self, run_dir: str) -> tuple[bool, bool]:
    return (len(_steps_in(os.path.join(run_dir, "checkpoints"))) > 1,
            bool(_steps_in(os.path.join(run_dir, "records"))))

  def carried(self, run_dir: str) -> list[str]:
    return [os.path.join("records", os.path.basename(_step_file("", s)))
            for s in _steps_in(os.path.join(run_dir, "records"))]

  def state_digest(self, run_dir: str, step: int) -> str:
    with open(_step_file(os.path.join(run_dir, "checkpoints"), step), "rb") as f:
      return hashlib.sha256(f.read()).hexdigest()

  def records(self, out: str, name: str) -> list[dict]:
    directory = os.path.join(out, "runs", name, "records")
    out_records = []
    for step in _steps_in(directory):
      with open(_step_file(directory, step), encoding="utf-8") as f:
        out_records.append(json.load(f))
    return out_records

  def start_record(self, out: str) -> None:
    del out
    return None
