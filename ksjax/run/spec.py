"""What a run is, as typed, frozen specifications built from a trainer config in one function.

A trainer config (`ksjax.run.config.base_config`, the `configs/*.py` files, `--config.x=`
overrides) is an ml_collections ConfigDict: the experiment as a file. Everything below the entry
points reads a `TrainSpec` instead: frozen dataclasses, one per concern,

  TaskSpec       the task, its rewards and data, the model's tokenizer;
  ModelSpec      where the starting weights come from, or the preset, and the number format;
  SamplingSpec   Algorithm 1's step (ii): B prompts, n completions each, how they are drawn;
  EstimatorSpec  the k-sample objective and its estimator (`ksjax.objectives`);
  LossSpec       the policy-gradient stack and how completions become optimizer steps;
  OptimizerSpec  AdamW, its schedule and clipping (`build()` gives the optax transformation);
  WarmupSpec     the optional supervised warm-up;
  HeldOutSpec    the held-out evaluation at the start and the end of a run;
  RunSpec        seed, work directory, mesh, length, logging and checkpoints,

each checking its own fields when it is made (`__post_init__`, so a spec made in Python, in a
test or a benchmark, is checked exactly as one read from a file), and `TrainSpec` checking how
they combine. `from_config(config)` is the one function that reads a ConfigDict: it refuses
fields the base config does not define, fills the defaults that depend on other fields (n = k,
the token_sum constant, the micro-batch, the evaluation's generation budget) and builds the
specs. Every failure is a `ConfigError` naming the config field and what it accepts; the entry
points print it as one line and exit with status 2.

The estimator's arguments are checked by calling `ksjax.objectives.k_sample_advantages` itself
on a dummy group, so a run accepts exactly what the objective library accepts.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import jax
import numpy as np
import optax

from ksjax import objectives
from ksjax import config_validation as cv
from ksjax.config_validation import ConfigError
from ksjax.model import config as model_config
from ksjax.run import config as run_config
from ksjax.tasks import reasoning_gym as gym_task
from ksjax.tasks import registry

ALGORITHMS = ("pg", "ppo", "grpo", "dr_grpo")
CLIPPED = ("ppo", "grpo", "dr_grpo")  # stacks with PPO's clipped ratio
LOSS_AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "token_sum")
KL_ESTIMATORS = ("k1", "k3")
IS_LEVELS = ("token", "group")  # what one truncated importance weight covers (LossSpec.is_level)
# Where starting weights may come from: a Hugging Face directory, a ksjax.model checkpoint, a GGUF.
STARTS = ("init_hf", "init_checkpoint", "init_gguf")
ARITHMETIC_LEVELS = 4  # ksjax.tasks.arithmetic.LEVELS (not imported: it loads math-verify)
SYNTHETIC_MAX_MODULUS = 100  # ksjax.tasks.synthetic.MAX_MODULUS (tests check they agree)
# Completions per prompt: the estimator is checked at start-up on a group of n (O(n) memory and
# time), so an n in the billions would hang or exhaust memory before the run begins.
MAX_COMPLETIONS = 1 << 14
# Fields of config.model that change a preset when set (None keeps the preset's value).
PRESET_OVERRIDES = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                    "intermediate_size", "tie_embeddings")


def _check(values: dict[str, Any]) -> dict:
  """A nested view {"synthetic": {"levels": ...}} of {"synthetic.levels": ...}, for the
  `ksjax.config_validation` checks, whose messages name the dotted config field."""
  out: dict = {}
  for name, value in values.items():
    node = out
    *parents, leaf = name.split(".")
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = value
  return out


def check_mesh_shape(c: Any, field: str) -> tuple[int, int, int]:
  """A (data, fsdp, tensor) mesh shape field, as a tuple; ConfigError naming `field` if not."""
  mesh = cv.int_tuple(c, field, length=3)
  if any(s == 0 or s < -1 for s in mesh) or mesh.count(-1) > 1:
    raise ConfigError(f"config.{field}={mesh!r} is not accepted; expected three sizes >= 1 for "
                      "(data, fsdp, tensor), at most one of them -1 (the remaining devices)")
  return tuple(mesh)


class _Spec:
  """A spec's fields and the config fields they are read from (`CONFIG`: attribute -> dotted
  config name; an attribute not listed is read from the config field of the same name)."""
  CONFIG: dict[str, str] = {}

  @classmethod
  def config_names(cls) -> dict[str, str]:
    return {f.name: cls.CONFIG.get(f.name, f.name) for f in dataclasses.fields(cls)}

  def _view(self) -> dict:
    return _check({name: getattr(self, attr) for attr, name in self.config_names().items()})


@dataclasses.dataclass(frozen=True)
class TaskSpec(_Spec):
  """The task (`ksjax.tasks.registry`), its rewards, its data and the model's tokenizer."""
  name: str
  correct_reward: float = 1.0
  wrong_reward: float = -1.0
  reward_workers: int = 2            # processes checking answers or running programs
  synthetic_seed: int = 0            # the embedded task's problems (not the run's seed)
  synthetic_levels: tuple[int, ...] = (1, 2, 3, 4, 5)
  synthetic_train_per_level: int = 800
  synthetic_test_per_level: int = 60
  synthetic_num_solutions: int = 4
  synthetic_modulus: int = 10        # the embedded task's answers are 0..modulus-1
  data_dir: str | None = None        # dataset tasks: built by `python -m ksjax.tasks.data`
  train_split: str = "train"
  tokenizer_path: str | None = None  # tokenizer.json or its directory; None: the model's
  tokenizer_bos: str | None = "<|begin_of_text|>"
  tokenizer_eos: tuple[str, ...] = ("<|eot_id|>", "<|end_of_text|>")
  tokenizer_pad: str | None = None   # None: the first eos token
  arithmetic_seed: int = 0           # the word-problem task's problems
  arithmetic_levels: tuple[int, ...] = (1, 2, 3, 4)
  arithmetic_train_per_level: int = 500
  arithmetic_test_per_level: int = 40
  reasoning_gym_datasets: str = "chain_sum"  # one dataset, or a weighted mix "a:2,b:1"
  reasoning_gym_options: Any = ()    # frozen: ((dataset, ((option, value), ...)), ...)
  reasoning_gym_seed: int = 0        # reasoning-gym's problems
  reasoning_gym_train_per_level: int = 500
  reasoning_gym_test_per_level: int = 32
  system_prompt: str | None = None   # chat tasks: the system message, if any

  CONFIG = {"name": "task", "data_dir": "data.data_dir", "train_split": "data.train_split",
            "system_prompt": "chat.system_prompt",
            **{f"synthetic_{f}": f"synthetic.{f}" for f in (
                "seed", "levels", "train_per_level", "test_per_level", "num_solutions",
                "modulus")},
            **{f"arithmetic_{f}": f"arithmetic.{f}" for f in (
                "seed", "levels", "train_per_level", "test_per_level")},
            **{f"reasoning_gym_{f}": f"reasoning_gym.{f}" for f in (
                "datasets", "options", "seed", "train_per_level", "test_per_level")},
            **{f"tokenizer_{f}": f"tokenizer.{f}" for f in ("path", "bos", "eos", "pad")}}

  def __post_init__(self):
    c = self._view()
    cv.choice(c, "task", registry.TASKS)
    correct = cv.real(c, "correct_reward")
    wrong = cv.real(c, "wrong_reward")
    if not correct > wrong:
      raise ConfigError(f"config.correct_reward={correct} is not accepted; expected more than "
                        f"config.wrong_reward={wrong}")
    cv.integer(c, "reward_workers", lo=1)
    cv.integer(c, "synthetic.seed", lo=0, hi=2**32 - 1)
    levels = cv.int_tuple(c, "synthetic.levels", lo=1)
    if any(level > 5 for level in levels) or len(set(levels)) != len(levels):
      raise ConfigError(f"config.synthetic.levels={levels!r} is not accepted; expected distinct "
                        "levels among 1, 2, 3, 4, 5")
    cv.integer(c, "synthetic.train_per_level", lo=1)
    cv.integer(c, "synthetic.test_per_level", lo=1, hi=155)
    cv.integer(c, "synthetic.num_solutions", lo=1)
    cv.integer(c, "synthetic.modulus", lo=2, hi=SYNTHETIC_MAX_MODULUS)
    cv.string(c, "data.data_dir", allow_none=True)
    cv.string(c, "data.train_split")
    cv.string(c, "tokenizer.path", allow_none=True)
    cv.string(c, "tokenizer.bos", allow_none=True)
    eos = self.tokenizer_eos
    if not (isinstance(eos, (tuple, list)) and eos and all(isinstance(e, str) and e for e in eos)):
      raise ConfigError(f"config.tokenizer.eos={eos!r} is not accepted; expected a non-empty tuple "
                        "of token strings")
    cv.string(c, "tokenizer.pad", allow_none=True)
    cv.integer(c, "arithmetic.seed", lo=0, hi=2**32 - 1)
    arithmetic_levels = cv.int_tuple(c, "arithmetic.levels", lo=1)
    if (any(level > ARITHMETIC_LEVELS for level in arithmetic_levels)
        or len(set(arithmetic_levels)) != len(arithmetic_levels)):
      raise ConfigError(f"config.arithmetic.levels={arithmetic_levels!r} is not accepted; "
                        f"expected distinct levels among 1..{ARITHMETIC_LEVELS}")
    cv.integer(c, "arithmetic.train_per_level", lo=1)
    cv.integer(c, "arithmetic.test_per_level", lo=1)
    mix = gym_task.parse_mix(self.reasoning_gym_datasets)
    options = gym_task.freeze_options(self.reasoning_gym_options)
    cv.integer(c, "reasoning_gym.seed", lo=0, hi=2**32 - 1)
    cv.integer(c, "reasoning_gym.train_per_level", lo=1)
    cv.integer(c, "reasoning_gym.test_per_level", lo=1)
    if self.name == "reasoning_gym":  # needs the package: only when it is the task
      gym_task.check_datasets(mix, gym_task.thaw_options(options))
    if self.system_prompt is not None and not isinstance(self.system_prompt, str):
      raise ConfigError(f"config.chat.system_prompt={self.system_prompt!r} is not accepted; "
                        "expected a string or None")
    object.__setattr__(self, "synthetic_levels", tuple(levels))
    object.__setattr__(self, "arithmetic_levels", tuple(arithmetic_levels))
    object.__setattr__(self, "tokenizer_eos", tuple(eos))
    object.__setattr__(self, "reasoning_gym_options", options)

  @property
  def is_synthetic(self) -> bool:
    return self.name == "synthetic"

  @property
  def is_generated(self) -> bool:
    """Generated in memory (no dataset to build)."""
    return self.name == "synthetic" or self.name in registry.CHAT_TASKS


@dataclasses.dataclass(frozen=True)
class ModelSpec(_Spec):
  """The starting policy: a Hugging Face directory, a ksjax.model checkpoint, or a fresh preset
  with some of its shapes changed; and the number format."""
  init_hf: str | None = None
  init_checkpoint: str | None = None
  init_gguf: str | None = None
  preset: str = "tiny"
  hidden_size: int | None = None
  num_layers: int | None = None
  num_heads: int | None = None
  num_kv_heads: int | None = None
  head_dim: int | None = None
  intermediate_size: int | None = None
  tie_embeddings: bool | None = None  # None: the preset's
  dtype: str = "float32"              # parameters and compute
  matmul_dtype: str | None = None     # the weight matmuls' operands (LlamaConfig.matmul_dtype)
  remat: bool = False                 # scan rematerialised decoder blocks in the backward pass

  CONFIG = {f: f"model.{f}" for f in ("preset", *PRESET_OVERRIDES, "dtype", "matmul_dtype",
                                      "remat")}

  def __post_init__(self):
    c = self._view()
    starts = [field for field in STARTS if cv.string(c, field, allow_none=True)]
    if len(starts) > 1:
      raise ConfigError(f"config.{starts[0]} and config.{starts[1]} are both set; expected at "
                        f"most one starting point of {', '.join(STARTS)}")
    cv.choice(c, "model.preset", model_config.PRESETS)
    for field in PRESET_OVERRIDES[:-1]:
      cv.integer(c, f"model.{field}", lo=1, allow_none=True)
    if self.tie_embeddings is not None:
      cv.boolean(c, "model.tie_embeddings")
    cv.choice(c, "model.dtype", model_config.DTYPES)
    if self.matmul_dtype is not None:
      cv.choice(c, "model.matmul_dtype", model_config.DTYPES)
    cv.boolean(c, "model.remat")

  @property
  def pretrained(self) -> bool:
    """Whether the weights come from a file (else: a fresh preset)."""
    return self.start is not None

  @property
  def start(self) -> str | None:
    """The config field naming the starting weights ("init_hf", ...), None for a preset."""
    return next((field for field in STARTS if getattr(self, field)), None)

  @property
  def preset_overrides(self) -> dict[str, Any]:
    return {f: getattr(self, f) for f in PRESET_OVERRIDES if getattr(self, f) is not None}


@dataclasses.dataclass(frozen=True)
class SamplingSpec(_Spec):
  """Algorithm 1, step (ii): B prompts per step, n completions each."""
  batch_prompts: int = 16
  n: int = 4                 # completions per prompt (the config's None means n = k)
  max_new_tokens: int = 64
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  # Voting without labels: each completion's reward is its agreement with the other completions
  # of its prompt (`ksjax.run.scoring.hide_labels`), not its correctness.
  label_free: bool = False
  # Dynamic sampling (`ksjax.trainer.dynamic`): resample rounds of batch_prompts prompts until
  # batch_prompts groups with a non-zero k-sample weight are kept, at most this many rounds.
  dynamic_sampling: bool = False
  dynamic_max_rounds: int = 4
  # Asynchronous rollouts (`ksjax.trainer.async_rollouts`): step s samples with the parameters of
  # step max(0, s - max_lag); sampler_devices > 0 gives the sampler its own sub-mesh.
  max_lag: int = 0
  sampler_devices: int = 0
  sampler_mesh: tuple[int, int, int] = (-1, 1, 1)

  def __post_init__(self):
    c = self._view()
    lag = cv.integer(c, "max_lag", lo=0)
    devices = cv.integer(c, "sampler_devices", lo=0)
    if devices and not lag:
      raise ConfigError(f"config.sampler_devices={devices} is not accepted with config.max_lag=0: "
                        "a lockstep sampler cannot run beside the learner; expected "
                        "sampler_devices=0, or max_lag >= 1")
    object.__setattr__(self, "sampler_mesh", check_mesh_shape(c, "sampler_mesh"))
    cv.integer(c, "batch_prompts", lo=1)
    cv.integer(c, "n", lo=1, hi=MAX_COMPLETIONS)
    cv.integer(c, "max_new_tokens", lo=1)
    cv.real(c, "temperature", lo=0.0, lo_open=True)
    cv.real(c, "top_p", lo=0.0, hi=1.0, lo_open=True)
    cv.integer(c, "top_k", lo=0)
    cv.boolean(c, "dynamic_sampling")
    cv.integer(c, "dynamic_max_rounds", lo=1)
    if cv.boolean(c, "label_free") and self.n < 2:
      raise ConfigError(f"config.label_free=True is not accepted with n={self.n}: a completion is "
                        "rewarded for agreeing with the others of its prompt; expected n >= 2")

  @property
  def rows(self) -> int:
    """Completions per step, B * n."""
    return self.batch_prompts * self.n


@dataclasses.dataclass(frozen=True)
class EstimatorSpec(_Spec):
  """The k-sample objective and its estimator (same names as `ksjax.objectives`), and the
  schedule of k over training (`ksjax.objectives.k_at_step`; "none": k throughout).

  With a k_mixture the objective is sum_{j<=k} w_j E[f(y_1..y_j)] (`ksjax.objectives.mixture`),
  and a schedule truncates it at the step's k."""
  aggregator: str = "pass_at_k"
  baseline: str = "loo"
  k: int = 4
  p: int = 1          # leave_p_out only
  beta: float = 1.0   # softmax only
  scale: str = "none"
  k_schedule: str = "none"
  k_start: int | None = None   # k at step 0 of a linear/step schedule
  k_schedule_steps: int = 0    # linear: k reached at this step; step: k from this step on
  k_mixture: str = "none"      # none | maxrl | weights: the objective over every k up to k
  k_weights: tuple[float, ...] | None = None  # k_mixture="weights": w_1..w_k

  def __post_init__(self):
    c = self._view()
    cv.integer(c, "k", lo=1)
    cv.choice(c, "aggregator", objectives.AGGREGATORS)
    cv.choice(c, "baseline", objectives.ALL_BASELINES)
    cv.choice(c, "scale", objectives.SCALES)
    cv.integer(c, "p", lo=1)
    cv.real(c, "beta")
    cv.choice(c, "k_schedule", objectives.K_SCHEDULES)
    cv.integer(c, "k_start", lo=1, allow_none=True)
    cv.integer(c, "k_schedule_steps", lo=0)
    try:
      objectives.k_at_step(0, k=self.k, schedule=self.k_schedule, k_start=self.k_start,
                           steps=self.k_schedule_steps)
    except ValueError as e:
      raise ConfigError(f"config.{e}") from None
    cv.choice(c, "k_mixture", objectives.K_MIXTURES)
    weights = self.k_weights
    listed = isinstance(weights, (tuple, list))
    if self.k_mixture == "weights" and listed and len(weights) != self.k:
      raise ConfigError(f"config.k_weights has {len(weights)} entries; expected k={self.k} "
                        "(w_1, ..., w_k of the mixture up to k)")
    try:
      self.weights_at(self.k)
    except ValueError as e:
      raise ConfigError(f"config.{e}") from None
    if weights is not None:
      object.__setattr__(self, "k_weights", tuple(float(w) for w in weights))

  def weights_at(self, k: int):
    """w_1..w_k of the mixture truncated at k (a schedule's k at a step), None without one."""
    return objectives.mixture_weights(self.k_mixture, k, self.k_weights)

  def k_at(self, step: int) -> int:
    """The k of the objective at `step` (0-based count of updates done)."""
    return objectives.k_at_step(step, k=self.k, schedule=self.k_schedule, k_start=self.k_start,
                                steps=self.k_schedule_steps)

  def scheduled_ks(self) -> tuple[int, ...]:
    """Every k the schedule takes, ascending (k alone without a schedule)."""
    if self.k_schedule == "none":
      return (self.k,)
    low, high = sorted((self.k, self.k_start))
    if self.k_schedule == "linear" and self.k_schedule_steps >= high - low:
      return tuple(range(low, high + 1))  # steps of at most 1, rounded: every integer between
    if self.k_schedule == "step":
      return (low, high) if low != high else (low,)  # k_start before k_schedule_steps, k after
    return tuple(sorted({self.k_at(step) for step in range(self.k_schedule_steps + 1)}))

  def check_with(self, n: int) -> None:
    """What the objective library accepts for groups of n completions (ConfigError if not), for
    every k the schedule takes: the enumerated aggregators' subset limits are not monotone in k."""
    for field, k in (("k", self.k), ("k_start", self.k_start)):
      if k is not None and k > n:
        raise ConfigError(f"config.{field}={k} is not accepted with config.n={n}; expected k <= n "
                          "(the objective's k samples come from the n completions of a prompt)")
    for k in self.scheduled_ks():
      try:
        self.advantages(np.linspace(-1.0, 1.0, n, dtype=np.float32)[None],
                        np.arange(n, dtype=np.int32)[None], k=k)
      except ValueError as e:
        origin = "" if k == self.k else (
            f" taken by config.k_schedule={self.k_schedule!r} from k_start={self.k_start}")
        raise ConfigError(f"config.{e} (with aggregator={self.aggregator!r}, "
                          f"baseline={self.baseline!r}, k={k}{origin}, n={n})") from None

  def advantages(self, rewards_bn: np.ndarray, answer_ids_bn: np.ndarray,
                 k: int | None = None) -> np.ndarray:
    """The k-sample weights of `ksjax.objectives`, float32 [B, n]; k: `self.k` unless given
    (a schedule's `k_at(step)`); with a k_mixture, those of the mixture up to k."""
    k = self.k if k is None else k
    if self.k_mixture != "none":
      return np.asarray(objectives.mixture_advantages(
          rewards_bn, k_weights=self.weights_at(k), aggregator=self.aggregator,
          baseline=self.baseline, beta=self.beta, scale=self.scale, answer_ids=answer_ids_bn),
          np.float32)
    return np.asarray(objectives.k_sample_advantages(
        rewards_bn, aggregator=self.aggregator, baseline=self.baseline,
        k=k, p=self.p, beta=self.beta, scale=self.scale, answer_ids=answer_ids_bn), np.float32)


@dataclasses.dataclass(frozen=True)
class LossSpec(_Spec):
  """The policy-gradient stack, and how one step's completions become optimizer steps."""
  algorithm: str = "pg"
  aggregation: str = "token_sum"
  loss_constant: float = 64.0        # C of token_sum (the config's None: max_new_tokens)
  ppo_epochs: int = 1
  num_minibatches: int = 1
  micro_batch_size: int = 64         # rows per gradient micro-batch (None: a mini-batch)
  clip_eps: float = 0.2
  value_clip: float = 0.2
  value_coef: float = 0.5
  is_cap: float | None = None        # truncated importance weight cap; None: no correction
  is_level: str = "token"            # "token": a weight per token; "group": one per prompt group
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  sparse_updates: bool = True        # drop zero-advantage completions when no term reads them
  sparse_min_rows: int = 8           # the smallest bucket of kept rows (`trainer.sparse`)
  kl_every: int = 1                  # steps between the KL-to-reference metrics (no KL penalty)

  CONFIG = {"aggregation": "loss_aggregation"}

  def __post_init__(self):
    c = self._view()
    cv.choice(c, "algorithm", ALGORITHMS)
    cv.choice(c, "loss_aggregation", LOSS_AGGREGATIONS)
    cv.real(c, "loss_constant", lo=0.0, lo_open=True)
    epochs = cv.integer(c, "ppo_epochs", lo=1)
    minibatches = cv.integer(c, "num_minibatches", lo=1)
    cv.integer(c, "micro_batch_size", lo=1)
    cv.real(c, "clip_eps", lo=0.0, hi=1.0, lo_open=True, hi_open=True)
    cv.real(c, "value_clip", lo=0.0, lo_open=True)
    cv.real(c, "value_coef", lo=0.0)
    if self.is_cap is not None and self.is_cap != math.inf:  # inf: untruncated weights
      try:
        cv.real(c, "is_cap", lo=1.0)
      except ConfigError:
        raise ConfigError(f"config.is_cap={self.is_cap!r} is not accepted; expected None (no "
                          "correction), a number >= 1, or inf (no truncation)") from None
    cv.choice(c, "is_level", IS_LEVELS)
    cv.real(c, "kl_coef", lo=0.0)
    cv.choice(c, "kl_estimator", KL_ESTIMATORS)
    cv.boolean(c, "sparse_updates")
    cv.integer(c, "sparse_min_rows", lo=1)
    kl_every = cv.integer(c, "kl_every", lo=1)
    if self.kl_coef > 0 and kl_every != 1:
      raise ConfigError(f"config.kl_every={kl_every} is not accepted with config.kl_coef="
                        f"{self.kl_coef}: the KL penalty needs the reference policy's log-probs "
                        "every step; expected kl_every=1, or kl_coef=0")
    if self.algorithm == "pg" and (epochs > 1 or minibatches > 1) and self.is_cap is None:
      raise ConfigError("config.ppo_epochs or config.num_minibatches > 1 with algorithm='pg' "
                        "makes later optimizer steps off-policy; expected an importance-weight "
                        "cap config.is_cap (e.g. 2.0), or ppo_epochs = num_minibatches = 1")
    if self.is_level == "group" and self.is_cap is None:
      raise ConfigError("config.is_level='group' is not accepted with config.is_cap=None; "
                        "expected a cap (inf: untruncated), or is_level='token'")
    if self.is_level == "group" and self.algorithm == "pg" and (epochs > 1 or minibatches > 1):
      raise ConfigError("config.is_level='group' with algorithm='pg' weighs by the learner at "
                        "the step's start, which later optimizer steps leave; expected "
                        "ppo_epochs = num_minibatches = 1, or a clipped algorithm (ppo, grpo, "
                        "dr_grpo)")

  def reference_at(self, step: int, last_step: int) -> bool:
    """Whether step `step` (1-based) runs the reference forward: every step with a KL penalty,
    else every `kl_every` steps, the first and the last (for the logged KL)."""
    return self.kl_coef > 0 or step == 1 or step % self.kl_every == 0 or step == last_step

  @property
  def clipped(self) -> bool:
    return self.algorithm in CLIPPED

  @property
  def group_is(self) -> bool:
    """Group-level importance weights (computed before the update from the learner's log-probs
    at the step's start, `ksjax.trainer.learner`)."""
    return self.is_cap is not None and self.is_level == "group"

  @property
  def value_head(self) -> bool:
    """PPO trains a value head on the policy's trunk."""
    return self.algorithm == "ppo"

  @property
  def needs_every_row(self) -> bool:
    """Whether some loss term reads rows whose advantage is 0: the value loss of PPO (its
    target R_i - V(x) is trained on every completion) or a KL penalty."""
    return self.algorithm == "ppo" or self.kl_coef > 0

  @property
  def use_sparse(self) -> bool:
    """Sparse updates, when asked for and allowed: the one place this is decided."""
    return self.sparse_updates and not self.needs_every_row


@dataclasses.dataclass(frozen=True)
class OptimizerSpec(_Spec):
  """AdamW with a linear warm-up to a constant learning rate and global-norm clipping."""
  learning_rate: float = 1e-3
  lr_warmup_steps: int = 5
  weight_decay: float = 0.0
  max_grad_norm: float | None = 1.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8

  CONFIG = {"b1": "adam_b1", "b2": "adam_b2", "eps": "adam_eps"}

  def __post_init__(self):
    c = self._view()
    cv.real(c, "learning_rate", lo=0.0, lo_open=True)
    cv.integer(c, "lr_warmup_steps", lo=0)
    cv.real(c, "weight_decay", lo=0.0)
    cv.optional_real(c, "max_grad_norm", lo=0.0, lo_open=True)
    cv.real(c, "adam_b1", lo=0.0, hi=1.0, hi_open=True)
    cv.real(c, "adam_b2", lo=0.0, hi=1.0, hi_open=True)
    cv.real(c, "adam_eps", lo=0.0, lo_open=True)

  def schedule(self) -> optax.Schedule:
    """Linear warm-up from 0 to `learning_rate` over `lr_warmup_steps`, then constant."""
    if not self.lr_warmup_steps:
      return optax.constant_schedule(self.learning_rate)  # a 0-step warm-up would stay at 0
    return optax.warmup_constant_schedule(0.0, self.learning_rate, self.lr_warmup_steps)

  def build(self) -> optax.GradientTransformation:
    """The optax transformation. Weight decay applies to matrices only (not to norm scales or
    the value bias), as is usual."""
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    adamw = optax.adamw(self.schedule(), b1=self.b1, b2=self.b2, eps=self.eps,
                        weight_decay=self.weight_decay, mask=decay_mask)
    if self.max_grad_norm is None:
      return adamw
    return optax.chain(optax.clip_by_global_norm(self.max_grad_norm), adamw)


@dataclasses.dataclass(frozen=True)
class WarmupSpec(_Spec):
  """Supervised warm-up on the task's reference solutions, before RL (0 steps: none).

  With a `target_pass_at_1` (not None or 0), `steps` is the most it runs: every `check_every`
  steps it samples `calibration_samples` completions at temperature 1 for each of
  `calibration_prompts` training prompts and stops at the first check whose pass@1 reaches the
  target (`ksjax.trainer.warmup`).
  """
  steps: int = 0
  batch_size: int = 64
  learning_rate: float = 3e-3
  lr_warmup_steps: int = 20
  weight_decay: float = 0.0
  target_pass_at_1: float | None = None  # None or 0: exactly `steps` steps
  check_every: int = 25
  calibration_prompts: int = 32
  calibration_samples: int = 4

  CONFIG = {f: f"sft_warmup.{f}" for f in (
      "steps", "batch_size", "learning_rate", "lr_warmup_steps", "weight_decay",
      "target_pass_at_1", "check_every", "calibration_prompts", "calibration_samples")}

  def __post_init__(self):
    c = self._view()
    cv.integer(c, "sft_warmup.steps", lo=0)
    cv.integer(c, "sft_warmup.batch_size", lo=1)
    cv.real(c, "sft_warmup.learning_rate", lo=0.0, lo_open=True)
    cv.integer(c, "sft_warmup.lr_warmup_steps", lo=0)
    cv.real(c, "sft_warmup.weight_decay", lo=0.0)
    try:  # 0 as well as None: a command-line override cannot set a float field to None
      cv.optional_real(c, "sft_warmup.target_pass_at_1", lo=0.0, hi=1.0, hi_open=True)
    except ConfigError:
      raise ConfigError(f"config.sft_warmup.target_pass_at_1={self.target_pass_at_1!r} is not "
                        "accepted; expected None or 0 (a fixed number of steps) or a number in "
                        "(0, 1) (the calibration pass@1 that stops the warm-up)") from None
    cv.integer(c, "sft_warmup.check_every", lo=1)
    cv.integer(c, "sft_warmup.calibration_prompts", lo=1)
    cv.integer(c, "sft_warmup.calibration_samples", lo=1)

  @property
  def targeted(self) -> bool:
    """Whether calibration checks may stop the warm-up before `steps`."""
    return bool(self.target_pass_at_1)

  def optimizer(self) -> OptimizerSpec:
    """The warm-up's own AdamW (its state is discarded afterwards: RL starts afresh)."""
    return OptimizerSpec(learning_rate=self.learning_rate, lr_warmup_steps=self.lr_warmup_steps,
                         weight_decay=self.weight_decay, max_grad_norm=1.0)


@dataclasses.dataclass(frozen=True)
class HeldOutSpec(_Spec):
  """The held-out evaluation at the (warmed-up) start and at the end of a run, and the labelled
  probe every `probe_every` steps during it (`ksjax.trainer.probe`)."""
  at_start: bool = True
  at_end: bool = True
  split: str = "test"
  num_prompts: int | None = None   # None: the whole split
  num_samples: int = 16            # n per prompt for the unbiased pass@k / maj@k
  ks: tuple[int, ...] = (1, 4, 8, 16)
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  max_new_tokens: int = 64         # the config's None: the run's max_new_tokens
  batch_prompts: int = 64          # prompts per sampler call
  probe_every: int = 0             # RL steps between probes; 0: none
  probe_prompts: int = 48          # held-out prompts of a probe, spread evenly over the split
  probe_samples: int = 4           # n per probe prompt

  @classmethod
  def config_names(cls) -> dict[str, str]:
    return {f.name: f"eval.{f.name}" for f in dataclasses.fields(cls)}

  def probe_at(self, step: int) -> bool:
    """Whether the probe runs after RL step `step` (1-based)."""
    return bool(self.probe_every) and step % self.probe_every == 0

  def __post_init__(self):
    c = self._view()
    cv.boolean(c, "eval.at_start")
    cv.boolean(c, "eval.at_end")
    cv.string(c, "eval.split")
    cv.integer(c, "eval.num_prompts", lo=1, allow_none=True)
    eval_n = cv.integer(c, "eval.num_samples", lo=1)
    ks = cv.int_tuple(c, "eval.ks", lo=1)
    for ek in ks:
      if ek > eval_n:
        raise ConfigError(f"config.eval.ks={ks!r} is not accepted; expected every k <= "
                          f"eval.num_samples={eval_n}")
    cv.real(c, "eval.temperature", lo=0.0)
    cv.real(c, "eval.top_p", lo=0.0, hi=1.0, lo_open=True)
    cv.integer(c, "eval.top_k", lo=0)
    cv.integer(c, "eval.max_new_tokens", lo=1)
    cv.integer(c, "eval.batch_prompts", lo=1)
    cv.integer(c, "eval.probe_every", lo=0)
    cv.integer(c, "eval.probe_prompts", lo=1)
    cv.integer(c, "eval.probe_samples", lo=1)
    object.__setattr__(self, "ks", tuple(ks))


@dataclasses.dataclass(frozen=True)
class RunSpec(_Spec):
  """The run around the steps: seed, directory, mesh, length, logs and checkpoints."""
  workdir: str = "runs/pass_at_k"
  seed: int = 0
  resume: bool = False
  mesh: tuple[int, int, int] = (-1, 1, 1)  # (data, fsdp, tensor); -1: the remaining devices
  num_steps: int = 100
  max_cpu_minutes: float | None = None  # the RL steps' CPU budget; None (or 0): none
  log_every: int = 1
  checkpoint_every: int = 25
  keep_checkpoints: int = 3
  async_checkpoints: bool = True
  progress_bar: bool = True

  def __post_init__(self):
    c = self._view()
    cv.string(c, "workdir")
    cv.integer(c, "seed", lo=0, hi=2**31 - 1)
    cv.boolean(c, "resume")
    mesh = check_mesh_shape(c, "mesh")
    cv.integer(c, "num_steps", lo=0)
    cv.optional_real(c, "max_cpu_minutes", lo=0.0)
    cv.integer(c, "log_every", lo=1)
    cv.integer(c, "checkpoint_every", lo=1)
    cv.integer(c, "keep_checkpoints", lo=1)
    cv.boolean(c, "async_checkpoints")
    cv.boolean(c, "progress_bar")
    object.__setattr__(self, "mesh", mesh)

  @property
  def cpu_budget_seconds(self) -> float | None:
    """config.max_cpu_minutes in CPU-seconds; None when there is no budget."""
    return self.max_cpu_minutes * 60.0 if self.max_cpu_minutes else None


@dataclasses.dataclass(frozen=True)
class TrainSpec:
  """A whole training run. `config_json` is the ConfigDict it came from, as JSON-ready data:
  what the run directory and every checkpoint record."""
  task: TaskSpec
  model: ModelSpec
  sampling: SamplingSpec
  estimator: EstimatorSpec
  loss: LossSpec
  optimizer: OptimizerSpec
  warmup: WarmupSpec
  held_out: HeldOutSpec
  run: RunSpec
  config_json: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

  def __post_init__(self):
    if not self.task.is_synthetic and not self.model.pretrained:
      raise ConfigError(f"config.init_hf is missing; task {self.task.name!r} trains a "
                        "pre-trained model: expected a Hugging Face Llama directory (or "
                        "config.init_checkpoint, a ksjax.model checkpoint, or config.init_gguf, "
                        "a GGUF file)")
    self.estimator.check_with(self.sampling.n)
    scale, algorithm = self.estimator.scale, self.loss.algorithm
    if algorithm == "grpo" and scale != "group_std":
      raise ConfigError(f"config.scale={scale!r} is not accepted with algorithm='grpo', which "
                        "divides by the group's standard deviation; expected 'group_std' (or "
                        "algorithm='dr_grpo' for no division)")
    if algorithm == "dr_grpo" and scale != "none":
      raise ConfigError(f"config.scale={scale!r} is not accepted with algorithm='dr_grpo', "
                        "which does not divide by the group's standard deviation; expected "
                        "'none' (or algorithm='grpo')")
    rows, minibatches = self.sampling.rows, self.loss.num_minibatches
    if rows % minibatches:
      raise ConfigError(f"config.num_minibatches={minibatches} is not accepted; expected a "
                        f"divisor of the completions per step, batch_prompts * n = {rows}")
    if self.minibatch_rows % self.loss.micro_batch_size:
      raise ConfigError(f"config.micro_batch_size={self.loss.micro_batch_size} is not accepted; "
                        f"expected a divisor of the rows per optimizer step, "
                        f"{self.minibatch_rows}")

  @property
  def minibatch_rows(self) -> int:
    """Rows per optimizer step."""
    return self.sampling.rows // self.loss.num_minibatches

  def check_mesh(self, batch_shards: int) -> None:
    """Rows must split evenly over the mesh's batch axes (data x fsdp)."""
    if self.loss.micro_batch_size % batch_shards:
      raise ConfigError(f"config.micro_batch_size (or the rows per optimizer step) = "
                        f"{self.loss.micro_batch_size} is not accepted on this mesh; expected a "
                        f"multiple of the batch shards data x fsdp = {batch_shards}")


def _read(cls, config: Any, **resolved) -> Any:
  """`cls` from its config fields; `resolved` replaces fields whose config value depends on
  others."""
  values = {attr: cv.get(config, name) for attr, name in cls.config_names().items()}
  values.update(resolved)
  return cls(**values)


def from_config(config: Any) -> TrainSpec:
  """The one reader of a trainer ConfigDict. Raises ConfigError naming the field."""
  cv.known_fields(config, run_config.base_config(), "the trainer config")
  task = _read(TaskSpec, config)
  model = _read(ModelSpec, config)
  k = cv.integer(config, "k", lo=1)
  n = cv.integer(config, "n", lo=1, allow_none=True)
  max_new = cv.integer(config, "max_new_tokens", lo=1)
  sampling = _read(SamplingSpec, config, n=k if n is None else n)
  estimator = _read(EstimatorSpec, config)
  constant = cv.optional_real(config, "loss_constant", lo=0.0, lo_open=True)
  minibatches = cv.integer(config, "num_minibatches", lo=1)
  micro = cv.integer(config, "micro_batch_size", lo=1, allow_none=True)
  loss = _read(LossSpec, config, loss_constant=float(max_new) if constant is None else constant,
               micro_batch_size=sampling.rows // minibatches if micro is None else micro)
  optimizer = _read(OptimizerSpec, config)
  run = _read(RunSpec, config)
  warmup = _read(WarmupSpec, config)
  eval_max_new = cv.integer(config, "eval.max_new_tokens", lo=1, allow_none=True)
  held_out = _read(HeldOutSpec, config,
                   max_new_tokens=max_new if eval_max_new is None else eval_max_new)
  return TrainSpec(task=task, model=model, sampling=sampling, estimator=estimator, loss=loss,
                   optimizer=optimizer, warmup=warmup, held_out=held_out, run=run,
                   config_json=config_json(config))


def config_json(config: Any) -> dict[str, Any]:
  """The ConfigDict as plain JSON-ready data (tuples become lists)."""
  return json.loads(config.to_json_best_effort(sort_keys=True))
