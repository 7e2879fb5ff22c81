"""The bandit study of the paper's Figure 1: `run(config)` trains, measures and writes the results.

Each of `num_seeds` bandits has 100 (`num_actions`) deterministic rewards drawn from N(0, 1); every
estimator (`Variant`) trains a softmax policy on every bandit from the uniform policy with the same
sampling keys. Outputs in `workdir`: curves.csv (exact mean reward, pass@k and KL per step, mean
and std across seeds), curves.png (the three panels of Figure 1), summary.txt (the tables printed:
final values, values at matched KL, gradient error at initialisation) and config.json.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from ksjax import config_validation as cv
from ksjax import files
from ksjax import objectives
from ksjax.bandit import comparisons
from ksjax.bandit import exact
from ksjax.bandit import report
from ksjax.bandit import train
from ksjax.bandit import variance
from ksjax.bandit import variants as variants_lib
from ksjax.bandit.variants import Variant

FIELDS = ("task", "workdir", "seed", "num_seeds", "num_actions", "learning_rate", "num_steps",
          "groups_per_step", "aggregator", "baseline", "k", "n", "p", "beta", "scale",
          "extra_variants", "variance_draws")
_NUM_KL_BUDGETS = 4  # matched-KL read-outs in summary.txt
# Enumerated targets (softmax, majority vote) cost far more per bandit than closed forms at 100
# actions and k = 4 (4.4M multisets, differentiated), so their gradient error is measured on this
# many bandits only.
_ENUMERATED_TARGET_BANDITS = 4


@dataclasses.dataclass(frozen=True)
class Settings:
  """A validated bandit config."""
  workdir: str
  seed: int
  num_seeds: int
  num_actions: int
  learning_rate: float
  num_steps: int
  groups_per_step: int
  k: int
  n: int
  variance_draws: int
  variants: tuple[Variant, ...]


def parse_config(config: ml_collections.ConfigDict) -> Settings:
  """Validates every field; raises ConfigError naming the first bad one. Writes nothing."""
  unknown = sorted(set(config.keys()) - set(FIELDS))
  if unknown:
    raise cv.ConfigError(f"config.{unknown[0]} is not a bandit field; accepted fields: "
                         f"{', '.join(FIELDS)}")
  cv.choice(config, "task", ("bandit",))
  workdir = cv.get(config, "workdir")
  if not isinstance(workdir, str) or not workdir:
    raise cv.ConfigError(f"config.workdir={workdir!r} is not accepted; expected a non-empty path")
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise cv.ConfigError(f"config.workdir={workdir!r} exists and is not a folder")
  k = cv.integer(config, "k", lo=2, hi=64)
  n = cv.integer(config, "n", lo=k, hi=4096, allow_none=True)
  n = k if n is None else n
  p = cv.integer(config, "p", lo=1, hi=k - 1)
  beta = cv.real(config, "beta", lo=0.0)
  scale = cv.choice(config, "scale", variants_lib.SCALES)
  aggregator = cv.choice(config, "aggregator", variants_lib.AGGREGATORS)
  baseline = cv.choice(config, "baseline", variants_lib.BASELINES)

  settings = Settings(
      workdir=workdir,
      seed=cv.integer(config, "seed", lo=0, hi=2**31 - 1),
      num_seeds=cv.integer(config, "num_seeds", lo=1, hi=10_000),
      num_actions=cv.integer(config, "num_actions", lo=2, hi=100_000),
      learning_rate=cv.real(config, "learning_rate", lo=0.0, lo_open=True),
      num_steps=cv.integer(config, "num_steps", lo=1, hi=1_000_000),
      groups_per_step=cv.integer(config, "groups_per_step", lo=1, hi=4096),
      k=k, n=n,
      variance_draws=cv.integer(config, "variance_draws", lo=2, hi=10_000_000),
      variants=())

  specs = [("the paper's estimator", (agg, bl, "none")) for agg, bl in variants_lib.PAPER_PAIRS]
  specs.append((f"config.aggregator={aggregator!r}, config.baseline={baseline!r}, "
                f"config.scale={scale!r}", (aggregator, baseline, scale)))
  extra = cv.get(config, "extra_variants")
  if not isinstance(extra, str):
    raise cv.ConfigError(f"config.extra_variants={extra!r} is not accepted; expected a string of "
                         "comma-separated aggregator:baseline[:scale]")
  for spec in filter(None, (s.strip() for s in extra.split(","))):
    try:
      specs.append((f"config.extra_variants entry {spec!r}", variants_lib.parse_spec(spec, scale)))
    except ValueError as e:
      raise cv.ConfigError(f"config.extra_variants: {e}") from None
  chosen: dict[tuple[str, str, str], Variant] = {}
  for origin, (agg, bl, sc) in specs:  # the library judges each combination last, after the fields
    variant = Variant(agg, bl, sc, k=k, p=p, beta=beta)
    _check_with_library(variant, n, origin)
    chosen.setdefault((agg, bl, sc), variant)
  return dataclasses.replace(settings, variants=tuple(chosen.values()))


def _check_with_library(variant: Variant, n: int, origin: str) -> None:
  """Lets `k_sample_advantages` judge the combination (k vs n, p vs k, C(n, k) limits, ...);
  `origin` names the config fields the variant came from."""
  actions = jnp.zeros((1, n), jnp.int32)
  try:
    objectives.k_sample_advantages(
        jnp.zeros((1, n)), aggregator=variant.aggregator, baseline=variant.baseline, k=variant.k,
        p=variant.p, beta=variant.beta, scale=variant.scale,
        answer_ids=actions if variant.aggregator == "majority_vote" else None)
  except ValueError as e:
    raise cv.ConfigError(f"{origin} (estimator {variant.key} with config.k={variant.k}, n={n}, "
                         f"config.p={variant.p}) is not accepted: {e}") from None


def bandits(settings: Settings) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Each seed's rewards [S, A] and its training and variance-measurement keys, each [S]."""
  key_rewards, key_train, key_variance = jax.random.split(jax.random.key(settings.seed), 3)
  rewards_sa = jax.random.normal(key_rewards, (settings.num_seeds, settings.num_actions))
  return (rewards_sa, jax.random.split(key_train, settings.num_seeds),
          jax.random.split(key_variance, settings.num_seeds))


def train_variant(settings: Settings, variant: Variant, rewards_sa: jax.Array,
                  keys_s: jax.Array) -> dict[str, np.ndarray]:
  """{"mean_reward"|"pass_at_k"|"kl": [S, num_steps + 1]} of one estimator on every bandit."""
  curves = train.train(keys_s, rewards_sa, settings.learning_rate, variant=variant, n=settings.n,
                       groups_per_step=settings.groups_per_step, num_steps=settings.num_steps)
  return {name: np.asarray(values) for name, values in curves._asdict().items()}


def run(config: ml_collections.ConfigDict) -> dict[str, dict[str, np.ndarray]]:
  """Runs the study; returns variant key -> {"mean_reward"|"pass_at_k"|"kl": [S, T + 1]}."""
  settings = parse_config(config)
  rewards_sa, train_keys_s, variance_keys_s = bandits(settings)
  print(f"bandit: {settings.num_seeds} seeds x {settings.num_actions} actions, k={settings.k}, "
        f"n={settings.n}, lr={settings.learning_rate:g}, {settings.num_steps} steps", flush=True)

  curves, errors = {}, {}
  for variant in settings.variants:
    start = time.perf_counter()
    curves[variant.key] = train_variant(settings, variant, rewards_sa, train_keys_s)
    trained = time.perf_counter()
    if exact.has_exact_target(variant, settings.num_actions):
      measured = (settings.num_seeds if exact.is_closed_form(variant)
                  else min(settings.num_seeds, _ENUMERATED_TARGET_BANDITS))
      errors[variant.key] = jax.tree.map(np.asarray, variance.gradient_errors(
          variance_keys_s[:measured], rewards_sa[:measured], variant, n=settings.n,
          num_draws=settings.variance_draws))
    print(f"  {variant.label:<28} trained in {trained - start:5.1f}s, gradient error in "
          f"{time.perf_counter() - trained:5.1f}s", flush=True)

  summary = _summary(settings, curves, errors)
  print(summary, end="", flush=True)
  os.makedirs(settings.workdir, exist_ok=True)
  files.write_text(os.path.join(settings.workdir, "config.json"), config.to_json(indent=2) + "\n")
  files.write_text(os.path.join(settings.workdir, "curves.csv"), report.curves_csv(curves))
  files.write_text(os.path.join(settings.workdir, "summary.txt"), summary)
  report.plot_curves(
      os.path.join(settings.workdir, "curves.png"), curves,
      {v.key: v.label for v in settings.variants}, k=settings.k,
      best_reward=float(rewards_sa.max(-1).mean()),
      title=f"softmax bandit: {settings.num_actions} actions, rewards ~ N(0,1), k={settings.k}, "
      f"n={settings.n}, lr={settings.learning_rate:g}; mean over {settings.num_seeds} seeds, "
      "band +-1 standard error")
  print(f"wrote {settings.workdir}/{{curves.csv,curves.png,summary.txt,config.json}}")
  return curves


def _summary(settings: Settings, curves, errors) -> str:
  """The three tables of summary.txt (also printed)."""
  labels = {v.key: v.label for v in settings.variants}
  k, last = settings.k, settings.num_steps
  text = [f"\nFinal policy (step {last}), mean +- std over {settings.num_seeds} seeds:\n"]
  text.append(report.table(
      ["estimator", "E[r]", f"pass@{k}", "KL(pi||pi_ref)"],
      [[labels[key]] + [f"{m[name][:, -1].mean():.3f} +- {m[name][:, -1].std():.3f}"
                        for name in ("mean_reward", "pass_at_k", "kl")]
       for key, m in curves.items()]))

  budgets = comparisons.common_budgets([m["kl"] for m in curves.values()], _NUM_KL_BUDGETS)
  text.append("\nAt matched KL budgets (each seed read where its KL first reaches the budget), "
              "seed mean:\n")
  rows = []
  for key, m in curves.items():
    mean_at = comparisons.value_at_kl(m["kl"], m["mean_reward"], budgets).mean(0)
    passk_at = comparisons.value_at_kl(m["kl"], m["pass_at_k"], budgets).mean(0)
    rows.append([labels[key]] + [f"{a:.3f} / {b:.3f}" for a, b in zip(mean_at, passk_at)])
  text.append(report.table(
      ["estimator"] + [f"KL={b:.2f}: E[r] / pass@{k}" for b in budgets], rows))

  text.append(f"\nSingle-group gradient error at initialisation (uniform policy), "
              f"{settings.variance_draws} draws per bandit, mean over the bandits measured "
              "(+- Monte Carlo standard error):\n")
  rows = []
  for variant in settings.variants:
    e = errors.get(variant.key)
    if e is None:
      rows.append([variant.label, exact.target_description(variant), "0",
                   "n/a (too many multisets)", "", "", ""])
      continue
    rows.append([variant.label, exact.target_description(variant), str(len(e.mse)),
                 f"{e.mse.mean():.4g} +- {np.sqrt(np.sum(e.mse_stderr**2)) / len(e.mse):.2g}",
                 f"{e.exact_sq_norm.mean():.4g}", f"{(e.mse / e.exact_sq_norm).mean():.3g}",
                 f"{(e.bias_sq / e.exact_sq_norm).mean():+.4f}"])
  text.append(report.table(
      ["estimator", "target J", "bandits", "E||g - grad J||^2", "||grad J||^2", "ratio",
       "||E g - grad J||^2 / ||grad J||^2"], rows))
  return "".join(text)
