"""What a run is, as typed, frozen specifications: every field of the trainer config, declared once.

A trainer config (`ksjax.run.config.base_config`, the `configs/*.py` files, `--config.x=`
overrides) is an ml_collections ConfigDict: the experiment as a file. Its fields are the fields
of the frozen dataclasses below, each declared with its type, default, one-line meaning and what
it accepts (`ksjax.config_fields`); `base_config()` is derived from these declarations.
Everything below the entry points reads a `TrainSpec`, one spec per concern,

  TaskSpec       the task, its rewards, its options, its data and the model's tokenizer;
  ModelSpec      where the starting weights come from, and config.model: the preset, its
                 changes and the number format;
  SamplingSpec   Algorithm 1's step (ii): B prompts, n completions each, how they are drawn;
  EstimatorSpec  the k-sample objective and its estimator (`ksjax.objectives`);
  LossSpec       the policy-gradient stack and how completions become optimizer steps;
  OptimizerSpec  AdamW or SGD, its schedule and clipping (`build()` gives the optax
                 transformation);
  RunSpec        seed, work directory, mesh, length, logging and checkpoints;
  WarmupSpec     config.sft_warmup, the optional supervised warm-up;
  HeldOutSpec    config.eval, the held-out evaluation at the start and the end of a run.

The specs nest like the config: a concern gathers fields of the config's top level
(`TrainSpec.loss.kl_coef` is config.kl_coef), and a section of the config is a spec of its own
under the same name (`TrainSpec.task.synthetic.levels` is config.synthetic.levels; a task's
options are declared by the task, `ksjax.tasks.registry.OPTIONS`). A spec checks its fields when
it is made, each against its declaration and then the rules that tie fields together, each a
method named after its rule, so a spec made in Python (in a test or a benchmark) is checked
exactly as one read from a file. `TrainSpec` fills the defaults that depend on other fields
(`TrainSpec._resolve_dependent_defaults`) and checks how the concerns combine.
`from_config(config)` is the one function that reads a ConfigDict: it refuses fields the specs
do not declare and builds the specs. Every failure is a `ConfigError` naming the config field and
what it accepts; the entry points print it as one line and exit with status 2.

The estimator's arguments are checked by calling `ksjax.objectives.k_sample_advantages` itself
on a dummy group, so a run accepts exactly what the objective library accepts. The objectives,
the model package, jax and optax are imported where a check or a method first needs them: config
files derive their defaults from these declarations without loading jax.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np

from ksjax import config_fields as cf
from ksjax import config_validation as cv
from ksjax.config_fields import field, group, section
from ksjax.config_validation import ConfigError
from ksjax.lora_options import LoraSpec
from ksjax.tasks import registry
from ksjax.tasks.arithmetic import ArithmeticOptions
from ksjax.tasks.planted import PlantedOptions
from ksjax.tasks.reasoning_gym import ReasoningGymOptions
from ksjax.tasks.synthetic import SyntheticOptions

ALGORITHMS = ("pg", "ppo", "grpo", "dr_grpo")
CLIPPED = ("ppo", "grpo", "dr_grpo")  # stacks with PPO's clipped ratio
LOSS_AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "token_sum")
KL_ESTIMATORS = ("k1", "k3")
IS_LEVELS = ("token", "group")  # what one truncated importance weight covers (LossSpec.is_level)
# Where starting weights may come from: a Hugging Face directory, a ksjax.model checkpoint, a GGUF.
STARTS = ("init_hf", "init_checkpoint", "init_gguf")
# Completions per prompt: the estimator is checked at start-up on a group of n (O(n) memory and
# time), so an n in the billions would hang or exhaust memory before the run begins.
MAX_COMPLETIONS = 1 << 14
# Fields of config.model that change a preset when set (None keeps the preset's value).
PRESET_OVERRIDES = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                    "intermediate_size", "tie_embeddings")


def _objectives():
  """`ksjax.objectives`, imported on first use: it loads jax."""
  from ksjax import objectives  # pylint: disable=g-import-not-at-top
  return objectives


def _model_config():
  """`ksjax.model.config`, imported on first use: the `ksjax.model` package loads jax."""
  from ksjax.model import config  # pylint: disable=g-import-not-at-top
  return config


def check_mesh_shape(c: Any, field_name: str) -> tuple[int, int, int]:
  """A (data, fsdp, tensor) mesh shape field, as a tuple; ConfigError naming the field if not."""
  mesh = cv.int_tuple(c, field_name, length=3)
  if any(s == 0 or s < -1 for s in mesh) or mesh.count(-1) > 1:
    raise ConfigError(f"config.{field_name}={mesh!r} is not accepted; expected three sizes >= 1 "
                      "for (data, fsdp, tensor), at most one of them -1 (the remaining devices)")
  return tuple(mesh)


def _token_strings(c: Any, name: str) -> tuple[str, ...]:
  tokens = cv.get(c, name)
  if not (isinstance(tokens, (tuple, list)) and tokens
          and all(isinstance(t, str) and t for t in tokens)):
    raise ConfigError(f"config.{name}={tokens!r} is not accepted; expected a non-empty tuple of "
                      "token strings")
  return tuple(tokens)


def _text_or_none(c: Any, name: str) -> str | None:
  text = cv.get(c, name)
  if text is not None and not isinstance(text, str):
    raise ConfigError(f"config.{name}={text!r} is not accepted; expected a string or None")
  return text


def _importance_cap(c: Any, name: str) -> float | None:
  cap = cv.get(c, name)
  if cap is not None and cap != math.inf:  # inf: untruncated weights
    try:
      cv.real(c, name, lo=1.0)
    except ConfigError:
      raise ConfigError(f"config.{name}={cap!r} is not accepted; expected None (no correction), a "
                        "number >= 1, or inf (no truncation)") from None
  return cap


def _target_pass_at_1(c: Any, name: str) -> float | None:
  target = cv.get(c, name)
  try:  # 0 as well as None: a command-line override cannot set a float field to None
    cv.optional_real(c, name, lo=0.0, hi=1.0, hi_open=True)
  except ConfigError:
    raise ConfigError(f"config.{name}={target!r} is not accepted; expected None or 0 (a fixed "
                      "number of steps) or a number in (0, 1) (the calibration pass@1 that stops "
                      "the warm-up)") from None
  return target


@dataclasses.dataclass(frozen=True)
class DataSpec(cf.Spec, path="data"):
  """A dataset task's data: built by `python -m ksjax.tasks.data`."""
  data_dir: str | None = field(None, "where the dataset was built")
  train_split: str = field("train", "the split RL trains on")


@dataclasses.dataclass(frozen=True)
class TokenizerSpec(cf.Spec, path="tokenizer"):
  """The model's tokenizer, for the tasks that tokenize with it."""
  path: str | None = field(None, "tokenizer.json or its directory; None: init_gguf's, or init_hf's")
  bos: str | None = field("<|begin_of_text|>", "the BOS token; None: none")
  eos: tuple[str, ...] = field(("<|eot_id|>", "<|end_of_text|>"), "the tokens that end a row",
                               check=_token_strings)
  pad: str | None = field(None, "the padding token; None: the first eos token")


@dataclasses.dataclass(frozen=True)
class ChatSpec(cf.Spec, path="chat"):
  """Instruct models: prompts are rendered with the checkpoint's own chat template (init_gguf's
  metadata, or tokenizer_config.json beside the tokenizer), with this system prompt if set."""
  system_prompt: str | None = field(None, "the system message before each question; None: the "
                                    "template's own", check=_text_or_none)


@dataclasses.dataclass(frozen=True)
class TaskSpec(cf.Spec):
  """The task (`ksjax.tasks.registry`), its rewards, its options, its data and the model's
  tokenizer. A task's options are its own section, declared beside the task."""
  task: str = field("synthetic", "which task trains", choices=registry.TASKS)
  correct_reward: float = field(1.0, "the reward of a correct completion")
  wrong_reward: float = field(-1.0, "the reward of any other completion")
  reward_workers: int = field(2, "processes checking answers or running programs (math, code "
                              "and chat tasks)", lo=1)
  synthetic: SyntheticOptions = section(SyntheticOptions, "the embedded task "
                                        "(ksjax.tasks.synthetic)")
  arithmetic: ArithmeticOptions = section(ArithmeticOptions, "word problems for instruct models "
                                          "(ksjax.tasks.arithmetic)")
  reasoning_gym: ReasoningGymOptions = section(
      ReasoningGymOptions, "reasoning-gym's generators for instruct models "
      "(ksjax.tasks.reasoning_gym; pip install -e \".[gym]\")")
  planted: PlantedOptions = section(PlantedOptions, "a task whose objectives' optima are known "
                                    "(ksjax.tasks.planted)")
  data: DataSpec = section(DataSpec, "a dataset task's data")
  tokenizer: TokenizerSpec = section(TokenizerSpec, "the model's tokenizer")
  chat: ChatSpec = section(ChatSpec, "the chat template's system prompt")

  def __post_init__(self):
    super().__post_init__()
    self._correct_reward_exceeds_wrong_reward()
    self._reasoning_gym_serves_its_datasets()

  def _correct_reward_exceeds_wrong_reward(self):
    correct, wrong = float(self.correct_reward), float(self.wrong_reward)
    if not correct > wrong:
      raise ConfigError(f"config.correct_reward={correct} is not accepted; expected more than "
                        f"config.wrong_reward={wrong}")

  def _reasoning_gym_serves_its_datasets(self):
    if self.task == "reasoning_gym":  # needs the package: only when it is the task
      self.reasoning_gym.check_served()

  @property
  def name(self) -> str:
    """The task's name (config.task)."""
    return self.task

  @property
  def options(self) -> cf.Spec | None:
    """The task's own options (its config section), None for a task without any."""
    return getattr(self, self.task) if self.task in registry.OPTIONS else None

  @property
  def is_synthetic(self) -> bool:
    return self.task == "synthetic"

  @property
  def is_embedded(self) -> bool:
    """Brings its own tokenizer and trains a fresh model (`registry.EMBEDDED_TASKS`)."""
    return self.task in registry.EMBEDDED_TASKS

  @property
  def is_generated(self) -> bool:
    """Generated in memory (no dataset to build)."""
    return self.is_embedded or self.task in registry.CHAT_TASKS


@dataclasses.dataclass(frozen=True)
class LlamaSpec(cf.Spec, path="model"):
  """A fresh model's preset and the shapes it changes (None keeps the preset's), and the number
  format of any model."""
  preset: str = field("tiny", "a fresh model's size; with weights from a file, only names it",
                      choices=lambda: _model_config().PRESETS)
  hidden_size: int | None = field(None, "the residual width; None: the preset's", lo=1)
  num_layers: int | None = field(None, "decoder blocks; None: the preset's", lo=1)
  num_heads: int | None = field(None, "attention heads; None: the preset's", lo=1)
  num_kv_heads: int | None = field(None, "key/value heads; None: the preset's", lo=1)
  head_dim: int | None = field(None, "the width of a head; None: the preset's", lo=1)
  intermediate_size: int | None = field(None, "the MLP's width; None: the preset's", lo=1)
  tie_embeddings: bool | None = field(None, "the output layer reuses the input embeddings; None: "
                                      "the preset's")
  dtype: str = field("float32", "parameters and compute", choices=lambda: _model_config().DTYPES)
  # bfloat16 with dtype float32 keeps float32 weights and activations and runs the projections on
  # bfloat16 matrix units (ksjax/model/config.py, LlamaConfig.matmul_dtype).
  matmul_dtype: str | None = field(None, "the weight matmuls' operand dtype (float32 "
                                   "accumulation); None: dtype",
                                   choices=lambda: _model_config().DTYPES)
  remat: bool = field(False, "rematerialise decoder blocks in the backward pass")

  @property
  def preset_overrides(self) -> dict[str, Any]:
    return {f: getattr(self, f) for f in PRESET_OVERRIDES if getattr(self, f) is not None}


@dataclasses.dataclass(frozen=True)
class ModelSpec(cf.Spec):
  """The starting policy: a Hugging Face directory, a ksjax.model checkpoint, a GGUF file, or a
  fresh `model.preset` with some of its shapes changed; and the number format."""
  init_hf: str | None = field(None, "a Hugging Face Llama directory to start from")
  init_checkpoint: str | None = field(None, "or a ksjax.model Orbax checkpoint")
  init_gguf: str | None = field(None, "or a llama.cpp GGUF file (weights and tokenizer)")
  model: LlamaSpec = section(LlamaSpec, "a fresh model (none of the above): preset and changes; "
                             "the number format of any")

  def __post_init__(self):
    super().__post_init__()
    self._at_most_one_start()

  def _at_most_one_start(self):
    starts = [name for name in STARTS if getattr(self, name)]
    if len(starts) > 1:
      raise ConfigError(f"config.{starts[0]} and config.{starts[1]} are both set; expected at "
                        f"most one starting point of {', '.join(STARTS)}")

  @property
  def pretrained(self) -> bool:
    """Whether the weights come from a file (else: a fresh preset)."""
    return self.start is not None

  @property
  def start(self) -> str | None:
    """The config field naming the starting weights ("init_hf", ...), None for a preset."""
    return next((name for name in STARTS if getattr(self, name)), None)


def evaluation_temperature_field() -> Any:
  """The temperature of a held-out evaluation's samples (0: greedy), declared alike by the
  trainer's `eval` section and the eval binary's config."""
  return field(1.0, "the sampling temperature", lo=0.0)


def top_p_field() -> Any:
  """Nucleus sampling's mass, declared alike wherever a config samples (a dataclass field
  belongs to one class, hence a function)."""
  return field(1.0, "nucleus sampling's probability mass; 1: off", lo=0.0, hi=1.0, lo_open=True)


def top_k_field() -> Any:
  """Top-k sampling's k, declared alike wherever a config samples."""
  return field(0, "sample among the top_k likeliest tokens; 0: off", lo=0)


@dataclasses.dataclass(frozen=True)
class SamplingSpec(cf.Spec):
  """Algorithm 1, step (ii): B prompts per step, n completions each."""
  batch_prompts: int = field(16, "B prompts per step", lo=1)
  n: int | None = field(None, "completions per prompt; None: n = k", lo=1, hi=MAX_COMPLETIONS)
  max_new_tokens: int = field(64, "the most tokens a completion has", lo=1)
  temperature: float = field(1.0, "the sampling temperature", lo=0.0, lo_open=True)
  top_p: float = top_p_field()
  top_k: int = top_k_field()
  # Voting without labels (TTRL; ksjax.objectives.label_free): a completion's reward is whether
  # its answer agrees with the majority of the other n - 1 completions of its prompt (1/t for t
  # tied answers; no answer: no vote, reward 0), from answer classes formed from the answers' text
  # alone (`ksjax.run.scoring.hide_labels`); correct_reward and wrong_reward do not apply. The
  # labels reach only the logged accuracy: batch/* and the held-out probe (eval.probe_every).
  label_free: bool = field(False, "reward agreement with the prompt's other completions, not "
                           "correctness")
  # Dynamic sampling (ksjax.trainer.dynamic): a step samples rounds of batch_prompts prompts until
  # it holds batch_prompts groups whose k-sample weights are not all zero (the others are dropped
  # before the reference forward and the update), or dynamic_max_rounds rounds are done; then it
  # updates on the groups it has (none: no update that step). Off: one round, every group.
  dynamic_sampling: bool = field(False, "resample until batch_prompts groups carry a signal")
  dynamic_max_rounds: int = field(4, "the most rounds of a dynamic step; 1 only drops the "
                                  "zero-weight groups of the one round", lo=1)
  # Asynchronous rollouts (ksjax.trainer.async_rollouts): step s's completions are sampled with
  # the parameters of step s - max_lag (of step 0 before that), on a worker that runs ahead of
  # the learner. Correct the lag with is_cap (and is_level).
  max_lag: int = field(0, "steps the sampler's parameters lag the learner's; 0: lockstep", lo=0)
  # The learner's config.mesh takes the other devices.
  sampler_devices: int = field(0, "devices of the sampler's own sub-mesh (the last ones); 0: the "
                               "sampler shares the learner's devices", lo=0)
  sampler_mesh: tuple[int, int, int] = field((-1, 1, 1), "(data, fsdp, tensor) of the sampler's "
                                             "sub-mesh", check=check_mesh_shape)

  def __post_init__(self):
    super().__post_init__()
    self._sampler_devices_need_a_lag()
    self._label_free_needs_two_completions()

  def _sampler_devices_need_a_lag(self):
    if self.sampler_devices and not self.max_lag:
      raise ConfigError(f"config.sampler_devices={self.sampler_devices} is not accepted with "
                        "config.max_lag=0: a lockstep sampler cannot run beside the learner; "
                        "expected sampler_devices=0, or max_lag >= 1")

  def _label_free_needs_two_completions(self):
    # n is None until TrainSpec resolves it (n = k), which makes this spec again.
    if self.label_free and self.n is not None and self.n < 2:
      raise ConfigError(f"config.label_free=True is not accepted with n={self.n}: a completion is "
                        "rewarded for agreeing with the others of its prompt; expected n >= 2")

  @property
  def rows(self) -> int:
    """Completions per step, B * n."""
    return self.batch_prompts * self.n


@dataclasses.dataclass(frozen=True)
class EstimatorSpec(cf.Spec):
  """The k-sample objective and its estimator (same names as `ksjax.objectives` and
  configs/bandit.py), and the schedule of k over training (`ksjax.objectives.k_at_step`; "none":
  k throughout).

  With a k_mixture the objective is sum_{j<=k} w_j E[f(y_1..y_j)] (`ksjax.objectives.mixture`),
  and a schedule truncates it at the step's k."""
  aggregator: str = field("pass_at_k", "f of the k samples: mean | pass_at_k | majority_vote | "
                          "softmax", choices=lambda: _objectives().AGGREGATORS)
  baseline: str = field("loo", "the estimator's baseline (ksjax.objectives.ALL_BASELINES)",
                        choices=lambda: _objectives().ALL_BASELINES)
  k: int = field(4, "the objective's k samples per prompt", lo=1)
  p: int = field(1, "leave_p_out only: the samples left out", lo=1)
  beta: float = field(1.0, "softmax only: its inverse temperature")
  scale: str = field("none", "none | group_std: divide by the group's standard deviation",
                     choices=lambda: _objectives().SCALES)
  # PKPO (ksjax.objectives.k_at_step): the trainer computes step s's advantages (s = RL steps
  # done) with that step's k and logs it (objective/k); the batch metrics stay at config.k.
  k_schedule: str = field("none", "annealing k over training: none | linear | step",
                          choices=lambda: _objectives().K_SCHEDULES)
  k_start: int | None = field(None, "k at step 0 of a linear/step schedule; None: none", lo=1)
  k_schedule_steps: int = field(0, "linear: k is reached at this step; step: k from this step on",
                                lo=0)
  # An objective over every k up to k (ksjax.objectives.mixture): sum_{j<=k} w_j E[f(y_1..y_j)],
  # maxrl: w_j = 1/j (MaxRL's truncated log-likelihood); weights: w_j = k_weights[j-1]; baseline
  # none | loo | leave_two_out. With a k schedule, step s's mixture stops at its k.
  k_mixture: str = field("none", "an objective over every k up to k: none | maxrl | weights",
                         choices=lambda: _objectives().K_MIXTURES)
  k_weights: tuple[float, ...] | None = field(None, "k_mixture='weights': (w_1, ..., w_k), >= 0",
                                              check=cf.unchecked)

  def __post_init__(self):
    super().__post_init__()
    self._k_schedule_reaches_k()
    self._k_weights_fit_the_mixture()

  def _k_schedule_reaches_k(self):
    try:
      _objectives().k_at_step(0, k=self.k, schedule=self.k_schedule, k_start=self.k_start,
                              steps=self.k_schedule_steps)
    except ValueError as e:
      raise ConfigError(f"config.{e}") from None

  def _k_weights_fit_the_mixture(self):
    weights = self.k_weights
    if (self.k_mixture == "weights" and isinstance(weights, (tuple, list))
        and len(weights) != self.k):
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
    return _objectives().mixture_weights(self.k_mixture, k, self.k_weights)

  def k_at(self, step: int) -> int:
    """The k of the objective at `step` (0-based count of updates done)."""
    return _objectives().k_at_step(step, k=self.k, schedule=self.k_schedule,
                                   k_start=self.k_start, steps=self.k_schedule_steps)

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
    for name, k in (("k", self.k), ("k_start", self.k_start)):
      if k is not None and k > n:
        raise ConfigError(f"config.{name}={k} is not accepted with config.n={n}; expected k <= n "
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
    objectives = _objectives()
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
class LossSpec(cf.Spec):
  """The policy-gradient stack, and how one step's completions become optimizer steps."""
  algorithm: str = field("pg", "pg | ppo | grpo | dr_grpo", choices=ALGORITHMS)
  loss_aggregation: str = field("token_sum", "how token terms make the loss: token_sum | "
                                "seq_mean_token_mean | token_mean", choices=LOSS_AGGREGATIONS)
  loss_constant: float | None = field(None, "C of token_sum; None: max_new_tokens", lo=0.0,
                                      lo_open=True)
  ppo_epochs: int = field(1, "passes over each batch of completions", lo=1)
  num_minibatches: int = field(1, "optimizer steps per pass", lo=1)
  micro_batch_size: int | None = field(None, "rows per gradient micro-batch; None: every row of a "
                                       "mini-batch", lo=1)
  clip_eps: float = field(0.2, "PPO's ratio clipping (ppo, grpo, dr_grpo)", lo=0.0, hi=1.0,
                          lo_open=True, hi_open=True)
  value_clip: float = field(0.2, "alpha of the clipped value loss (ppo)", lo=0.0, lo_open=True)
  value_coef: float = field(0.5, "weight of the value loss (ppo)", lo=0.0)
  is_cap: float | None = field(None, "truncated importance weight cap; None: no correction; inf: "
                               "untruncated weights", check=_importance_cap)
  # "token": min(pi/mu, cap) per token (TIS); "group": min(prod pi/mu, cap) over every token of a
  # prompt's n completions, unbiased for k-sample estimators at inf.
  is_level: str = field("token", "what one importance weight covers: token | group",
                        choices=IS_LEVELS)
  kl_coef: float = field(0.0, "KL penalty to the reference (start) policy; 0: logged only",
                         lo=0.0)
  kl_estimator: str = field("k3", "k1 | k3, the estimator the penalty uses (both are logged)",
                            choices=KL_ESTIMATORS)
  sparse_updates: bool = field(True, "drop zero-advantage completions from the backward pass "
                               "when allowed")
  # One update program per bucket: a small model compiles in longer than a few padding rows cost,
  # a 135M one the other way round.
  sparse_min_rows: int = field(8, "the smallest micro-batch of kept rows: fewer kept rows than "
                               "a micro-batch are padded to a power of two of at least this many",
                               lo=1)
  # The same gradient within float32 rounding in fewer positions: the arithmetic prompts are longer
  # than their completions (`ksjax.trainer.sparse.shared` says when it applies).
  share_prompts: bool = field(True, "the update runs a group's prompt once for its rows where "
                              "that computes fewer positions than a prompt per row")
  # A forward pass of the start policy over every completion; the first and last steps always log
  # it, and a KL penalty needs it every step.
  kl_every: int = field(1, "steps between the logged KL to the reference; 1: every step", lo=1)

  def __post_init__(self):
    super().__post_init__()
    self._kl_penalty_needs_the_reference_every_step()
    self._off_policy_pg_steps_need_an_is_cap()
    self._group_weights_need_a_cap()
    self._group_weights_need_one_pg_step()

  @property
  def _several_steps(self) -> bool:
    return self.ppo_epochs > 1 or self.num_minibatches > 1

  def _kl_penalty_needs_the_reference_every_step(self):
    if self.kl_coef > 0 and self.kl_every != 1:
      raise ConfigError(f"config.kl_every={self.kl_every} is not accepted with config.kl_coef="
                        f"{self.kl_coef}: the KL penalty needs the reference policy's log-probs "
                        "every step; expected kl_every=1, or kl_coef=0")

  def _off_policy_pg_steps_need_an_is_cap(self):
    if self.algorithm == "pg" and self._several_steps and self.is_cap is None:
      raise ConfigError("config.ppo_epochs or config.num_minibatches > 1 with algorithm='pg' "
                        "makes later optimizer steps off-policy; expected an importance-weight "
                        "cap config.is_cap (e.g. 2.0), or ppo_epochs = num_minibatches = 1")

  def _group_weights_need_a_cap(self):
    if self.is_level == "group" and self.is_cap is None:
      raise ConfigError("config.is_level='group' is not accepted with config.is_cap=None; "
                        "expected a cap (inf: untruncated), or is_level='token'")

  def _group_weights_need_one_pg_step(self):
    if self.is_level == "group" and self.algorithm == "pg" and self._several_steps:
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
  def shares_prompts(self) -> bool:
    """Whether the update may run a group's prompt once for its rows (`share_prompts`): not
    over shuffled mini-batches, which break the rollout's groups, nor for ppo, whose value loss
    reads each row's prompt."""
    return self.share_prompts and not self._several_steps and self.algorithm != "ppo"

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
class OptimizerSpec(cf.Spec):
  """AdamW (or plain SGD) with a linear warm-up to a constant learning rate and global-norm
  clipping."""
  optimizer: str = field("adamw", "the update rule: 'adamw' (Adam's per-coordinate "
                         "normalisation, decoupled weight decay) or 'sgd' (plain gradient "
                         "descent: no momentum, no normalisation)", choices=("adamw", "sgd"))
  learning_rate: float = field(1e-3, "the learning rate after the warm-up", lo=0.0,
                               lo_open=True)
  lr_warmup_steps: int = field(5, "steps of the linear warm-up from 0", lo=0)
  weight_decay: float = field(0.0, "AdamW's decoupled weight decay (matrices only)", lo=0.0)
  max_grad_norm: float | None = field(1.0, "global-norm clipping; None: none", lo=0.0,
                                      lo_open=True)
  adam_b1: float = field(0.9, "Adam's first-moment decay", lo=0.0, hi=1.0, hi_open=True)
  adam_b2: float = field(0.999, "Adam's second-moment decay", lo=0.0, hi=1.0, hi_open=True)
  adam_eps: float = field(1e-8, "Adam's epsilon", lo=0.0, lo_open=True)

  def schedule(self):
    """Linear warm-up from 0 to `learning_rate` over `lr_warmup_steps`, then constant (an
    optax schedule)."""
    import optax  # pylint: disable=g-import-not-at-top
    if not self.lr_warmup_steps:
      return optax.constant_schedule(self.learning_rate)  # a 0-step warm-up would stay at 0
    return optax.warmup_constant_schedule(0.0, self.learning_rate, self.lr_warmup_steps)

  def build(self):
    """The optax transformation. Weight decay applies to matrices only (not to norm scales or
    the value bias), as is usual; with SGD it is added to the gradient (L2), as optax does."""
    import jax  # pylint: disable=g-import-not-at-top
    import optax  # pylint: disable=g-import-not-at-top
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    if self.optimizer == "sgd":
      rule = optax.chain(optax.add_decayed_weights(self.weight_decay, mask=decay_mask),
                         optax.sgd(self.schedule()))
    else:
      rule = optax.adamw(self.schedule(), b1=self.adam_b1, b2=self.adam_b2, eps=self.adam_eps,
                         weight_decay=self.weight_decay, mask=decay_mask)
    if self.max_grad_norm is None:
      return rule
    return optax.chain(optax.clip_by_global_norm(self.max_grad_norm), rule)


@dataclasses.dataclass(frozen=True)
class RunSpec(cf.Spec):
  """The run around the steps: seed, directory, mesh, length, logs and checkpoints."""
  workdir: str = field("runs/pass_at_k", "the run directory")
  seed: int = field(0, "the run's seed (sampling, a fresh model's weights)", lo=0, hi=2**31 - 1)
  # From the newest readable checkpoint whose files match its checksum manifest (a damaged one is
  # moved aside with a warning, the previous one used). With no checkpoint in workdir, a fresh
  # run starts there and says so in one line.
  resume: bool = field(False, "continue the run in workdir from its newest checkpoint")
  mesh: tuple[int, int, int] = field((-1, 1, 1), "(data, fsdp, tensor) device counts; -1: the "
                                     "remaining devices", check=check_mesh_shape)
  num_steps: int = field(100, "RL steps", lo=0)
  # In CPU-minutes (user + system, every thread of the process; ksjax.trainer.loop says what is
  # counted): the run stops after the first step that brings the training loop's CPU time to
  # it, checkpoints and evaluates as at num_steps. Warm-up and held-out evaluations are not
  # counted; a resumed run continues its budget.
  max_cpu_minutes: float | None = field(None, "a CPU budget for the RL steps; None or 0: none",
                                        lo=0.0)
  log_every: int = field(1, "steps between logged metrics", lo=1)
  checkpoint_every: int = field(25, "steps between checkpoints", lo=1)
  keep_checkpoints: int = field(3, "the newest checkpoints kept", lo=1)
  async_checkpoints: bool = field(True, "write checkpoints while training goes on")
  progress_bar: bool = field(True, "show a progress bar")

  @property
  def cpu_budget_seconds(self) -> float | None:
    """config.max_cpu_minutes in CPU-seconds; None when there is no budget."""
    return self.max_cpu_minutes * 60.0 if self.max_cpu_minutes else None


@dataclasses.dataclass(frozen=True)
class WarmupSpec(cf.Spec, path="sft_warmup"):
  """Supervised warm-up on the task's reference solutions, before RL (0 steps: none).

  With a `target_pass_at_1` (not None or 0), `steps` is the most it runs: every `check_every`
  steps it samples `calibration_samples` completions at temperature 1 for each of
  `calibration_prompts` training prompts (fixed by the seed; never the held-out split) and stops
  at the first check whose pass@1 reaches the target (`ksjax.trainer.warmup`): where a fixed
  number of steps leaves the policy depends on the CPU's floating-point details.
  """
  steps: int = field(0, "warm-up steps (the most, with a target); 0: no warm-up", lo=0)
  batch_size: int = field(64, "reference solutions per step", lo=1)
  learning_rate: float = field(3e-3, "the warm-up's AdamW learning rate", lo=0.0, lo_open=True)
  lr_warmup_steps: int = field(20, "steps of its linear learning-rate warm-up", lo=0)
  weight_decay: float = field(0.0, "its AdamW weight decay", lo=0.0)
  target_pass_at_1: float | None = field(None, "the calibration pass@1 that stops it; None or 0: "
                                         "`steps` steps", check=_target_pass_at_1)
  check_every: int = field(25, "steps between calibration checks", lo=1)
  calibration_prompts: int = field(32, "training prompts of a check", lo=1)
  calibration_samples: int = field(4, "completions per prompt of a check", lo=1)

  @property
  def targeted(self) -> bool:
    """Whether calibration checks may stop the warm-up before `steps`."""
    return bool(self.target_pass_at_1)

  def optimizer(self) -> OptimizerSpec:
    """The warm-up's own AdamW (its state is discarded afterwards: RL starts afresh)."""
    return OptimizerSpec(learning_rate=self.learning_rate, lr_warmup_steps=self.lr_warmup_steps,
                         weight_decay=self.weight_decay, max_grad_norm=1.0)


@dataclasses.dataclass(frozen=True)
class HeldOutSpec(cf.Spec, path="eval"):
  """The held-out evaluation at the (warmed-up) start and at the end of a run, and the labelled
  probe every `probe_every` steps during it (`ksjax.trainer.probe`)."""
  at_start: bool = field(True, "evaluate the (warmed-up) start policy")
  at_end: bool = field(True, "evaluate the final policy")
  split: str = field("test", "the task split the problems come from")
  num_prompts: int | None = field(None, "the first problems of the split; None: the whole split",
                                  lo=1)
  num_samples: int = field(16, "n per prompt for the unbiased pass@k / maj@k estimates", lo=1)
  ks: tuple[int, ...] = field((1, 4, 8, 16), "the k of pass@k and maj@k", lo=1)
  temperature: float = evaluation_temperature_field()
  top_p: float = top_p_field()
  top_k: int = top_k_field()
  max_new_tokens: int | None = field(None, "the most tokens a completion has; None: the run's "
                                     "max_new_tokens", lo=1)
  batch_prompts: int = field(64, "prompts per sampler call", lo=1)
  # A labelled probe during training (a label-free run's true accuracy; any run's): logged as
  # probe/pass_at_1, probe/maj_at_<n>, ...; its CPU time is not counted in max_cpu_minutes.
  probe_every: int = field(0, "RL steps between probes; 0: none", lo=0)
  probe_prompts: int = field(48, "held-out prompts of a probe, spread evenly over eval.split",
                             lo=1)
  probe_samples: int = field(4, "completions per probe prompt", lo=1)

  def __post_init__(self):
    super().__post_init__()
    self._ks_within_num_samples()

  def _ks_within_num_samples(self):
    for k in self.ks:
      if k > self.num_samples:
        raise ConfigError(f"config.eval.ks={self.ks!r} is not accepted; expected every k <= "
                          f"eval.num_samples={self.num_samples}")

  def probe_at(self, step: int) -> bool:
    """Whether the probe runs after RL step `step` (1-based)."""
    return bool(self.probe_every) and step % self.probe_every == 0


@dataclasses.dataclass(frozen=True)
class TrainSpec(cf.Spec):
  """A whole training run: every field of the trainer config. `config_json` is the ConfigDict it
  came from, as JSON-ready data: what the run directory and every checkpoint record."""
  task: TaskSpec = group(TaskSpec, "the task, its rewards, options and data")
  model: ModelSpec = group(ModelSpec, "the starting policy")
  lora: LoraSpec = section(LoraSpec, "low-rank adapters: what trains when not every weight does")
  sampling: SamplingSpec = group(SamplingSpec, "sampling (Algorithm 1, step ii)")
  estimator: EstimatorSpec = group(EstimatorSpec, "the k-sample objective and its estimator")
  loss: LossSpec = group(LossSpec, "the policy-gradient stack")
  optimizer: OptimizerSpec = group(OptimizerSpec, "the optimizer")
  run: RunSpec = group(RunSpec, "the run around the steps")
  sft_warmup: WarmupSpec = section(WarmupSpec, "supervised warm-up on reference solutions, "
                                   "before RL")
  eval: HeldOutSpec = section(HeldOutSpec, "held-out evaluation at the (warmed-up) start and at "
                              "the end")
  config_json: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

  def __post_init__(self):
    super().__post_init__()
    self._resolve_dependent_defaults()
    self._a_pretrained_task_needs_weights()
    self.estimator.check_with(self.sampling.n)
    self._the_scale_fits_the_algorithm()
    self._minibatches_divide_the_rows()
    self._micro_batches_divide_a_minibatch()

  def _resolve_dependent_defaults(self):
    """The one place that fills the fields whose None means another field's value: n = k, the
    token_sum constant C = max_new_tokens, a micro-batch = every row of a mini-batch, the held-out
    evaluation's max_new_tokens = the run's."""
    def fill(concern: str, **values):
      spec = getattr(self, concern)
      missing = {name: value for name, value in values.items() if getattr(spec, name) is None}
      if missing:  # made again, so the spec's rules see the filled values too
        object.__setattr__(self, concern, dataclasses.replace(spec, **missing))
    fill("sampling", n=self.estimator.k)
    fill("loss", loss_constant=float(self.sampling.max_new_tokens),
         micro_batch_size=self.sampling.rows // self.loss.num_minibatches)
    fill("eval", max_new_tokens=self.sampling.max_new_tokens)

  def _a_pretrained_task_needs_weights(self):
    if not self.task.is_embedded and not self.model.pretrained:
      raise ConfigError(f"config.init_hf is missing; task {self.task.name!r} trains a "
                        "pre-trained model: expected a Hugging Face Llama directory (or "
                        "config.init_checkpoint, a ksjax.model checkpoint, or config.init_gguf, "
                        "a GGUF file)")

  def _the_scale_fits_the_algorithm(self):
    scale, algorithm = self.estimator.scale, self.loss.algorithm
    if algorithm == "grpo" and scale != "group_std":
      raise ConfigError(f"config.scale={scale!r} is not accepted with algorithm='grpo', which "
                        "divides by the group's standard deviation; expected 'group_std' (or "
                        "algorithm='dr_grpo' for no division)")
    if algorithm == "dr_grpo" and scale != "none":
      raise ConfigError(f"config.scale={scale!r} is not accepted with algorithm='dr_grpo', "
                        "which does not divide by the group's standard deviation; expected "
                        "'none' (or algorithm='grpo')")

  def _minibatches_divide_the_rows(self):
    rows, minibatches = self.sampling.rows, self.loss.num_minibatches
    if rows % minibatches:
      raise ConfigError(f"config.num_minibatches={minibatches} is not accepted; expected a "
                        f"divisor of the completions per step, batch_prompts * n = {rows}")

  def _micro_batches_divide_a_minibatch(self):
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


def from_config(config: Any) -> TrainSpec:
  """The one reader of a trainer ConfigDict. Raises ConfigError naming the field."""
  cv.known_fields(config, cf.config_dict(TrainSpec), "the trainer config")
  return cf.read(TrainSpec, config, config_json=config_json(config))


def config_json(config: Any) -> dict[str, Any]:
  """The ConfigDict as plain JSON-ready data (tuples become lists)."""
  return json.loads(config.to_json_best_effort(sort_keys=True))
