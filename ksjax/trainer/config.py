"""Start-up validation of a trainer config: every field, before anything is read or written.

`validate(config)` checks each field of `defaults.base_config()` (and refuses fields it does not
know), then the combinations: the estimator's arguments are checked by calling
`ksjax.objectives.k_sample_advantages` itself on a dummy group, so the trainer accepts exactly what
the objective library accepts. Any failure is a `ConfigError` naming the field and what it
accepts; `ksjax.main` prints it as one line and exits with status 2.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ksjax import objectives
from ksjax.config_validation import ConfigError, choice, get, integer, real
from ksjax.model import config as model_config
from ksjax.tasks import registry
from ksjax.trainer import defaults, losses, update



@dataclasses.dataclass(frozen=True)
class Derived:
  """Values that follow from the config: defaults that depend on other fields, and sizes."""
  n: int                  # completions per prompt
  rows: int               # completions per step, B * n
  minibatch_rows: int     # rows per optimizer step
  micro_batch_size: int   # rows per gradient micro-batch
  loss_constant: float    # C of the token_sum aggregation
  eval_max_new_tokens: int


def _boolean(config, field: str) -> bool:
  value = get(config, field)
  if not isinstance(value, bool):
    raise ConfigError(f"config.{field}={value!r} is not accepted; expected True or False")
  return value


def _string(config, field: str, *, allow_none: bool = False) -> str | None:
  value = get(config, field)
  if value is None and allow_none:
    return None
  if not isinstance(value, str) or not value:
    raise ConfigError(f"config.{field}={value!r} is not accepted; expected a non-empty string"
                      + (" or None" if allow_none else ""))
  return value


def _optional_real(config, field: str, **bounds) -> float | None:
  return None if get(config, field) is None else real(config, field, **bounds)


def _int_tuple(config, field: str, *, length: int | None = None, lo: int | None = None) -> tuple:
  value = get(config, field)
  ok = isinstance(value, (tuple, list)) and all(
      isinstance(v, int) and not isinstance(v, bool) for v in value) and len(value) > 0
  if ok and length is not None:
    ok = len(value) == length
  if ok and lo is not None:
    ok = all(v >= lo for v in value)
  if not ok:
    what = f"{length} integers" if length else "a non-empty tuple of integers"
    raise ConfigError(f"config.{field}={value!r} is not accepted; expected {what}"
                      + (f" >= {lo}" if lo is not None else ""))
  return tuple(value)


def _known_fields(config, reference, prefix: str = "") -> None:
  """Refuses fields that the base config does not define (a typo in a config file)."""
  for key in config.keys():
    if key not in reference:
      raise ConfigError(f"config.{prefix}{key} is not a field of the trainer config; the fields "
                        f"are {', '.join(sorted(prefix + k for k in reference.keys()))}")
    value, ref = config[key], reference[key]
    if hasattr(ref, "keys") and hasattr(value, "keys"):
      _known_fields(value, ref, f"{prefix}{key}.")


def validate(config: Any) -> Derived:
  """Checks every field of `config`; returns the derived values. Raises ConfigError."""
  _known_fields(config, defaults.base_config())
  choice(config, "task", registry.TASKS)
  _string(config, "workdir")
  integer(config, "seed", lo=0, hi=2**31 - 1)
  _boolean(config, "resume")

  # Task.
  correct = real(config, "correct_reward")
  wrong = real(config, "wrong_reward")
  if not correct > wrong:
    raise ConfigError(f"config.correct_reward={correct} is not accepted; expected more than "
                      f"config.wrong_reward={wrong}")
  integer(config, "reward_workers", lo=1)
  integer(config, "synthetic.seed", lo=0, hi=2**32 - 1)
  levels = _int_tuple(config, "synthetic.levels", lo=1)
  if any(level > 5 for level in levels) or len(set(levels)) != len(levels):
    raise ConfigError(f"config.synthetic.levels={levels!r} is not accepted; expected distinct "
                      "levels among 1, 2, 3, 4, 5")
  integer(config, "synthetic.train_per_level", lo=1)
  integer(config, "synthetic.test_per_level", lo=1, hi=155)
  integer(config, "synthetic.num_solutions", lo=1)
  _string(config, "data.data_dir", allow_none=True)
  _string(config, "data.train_split")
  _string(config, "tokenizer.path", allow_none=True)
  _string(config, "tokenizer.bos", allow_none=True)
  eos = get(config, "tokenizer.eos")
  if not (isinstance(eos, (tuple, list)) and eos and all(isinstance(e, str) and e for e in eos)):
    raise ConfigError(f"config.tokenizer.eos={eos!r} is not accepted; expected a non-empty tuple "
                      "of token strings")
  _string(config, "tokenizer.pad", allow_none=True)

  # Model.
  init_hf = _string(config, "init_hf", allow_none=True)
  init_ckpt = _string(config, "init_checkpoint", allow_none=True)
  if init_hf and init_ckpt:
    raise ConfigError("config.init_hf and config.init_checkpoint are both set; expected at most "
                      "one starting point")
  if get(config, "task") != "synthetic" and not (init_hf or init_ckpt):
    raise ConfigError(f"config.init_hf is missing; task {get(config, 'task')!r} trains a "
                      "pre-trained model: expected a Hugging Face Llama directory (or "
                      "config.init_checkpoint, a ksjax.model checkpoint)")
  choice(config, "model.preset", model_config.PRESETS)
  for field in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "intermediate_size"):
    integer(config, f"model.{field}", lo=1, allow_none=True)
  if get(config, "model.tie_embeddings") is not None:
    _boolean(config, "model.tie_embeddings")
  choice(config, "model.dtype", model_config.DTYPES)
  _boolean(config, "model.remat")
  mesh = _int_tuple(config, "mesh", length=3)
  if any(s == 0 or s < -1 for s in mesh) or mesh.count(-1) > 1:
    raise ConfigError(f"config.mesh={mesh!r} is not accepted; expected three sizes >= 1 for "
                      "(data, fsdp, tensor), at most one of them -1 (the remaining devices)")

  # Sampling.
  b = integer(config, "batch_prompts", lo=1)
  k = integer(config, "k", lo=1)
  n = integer(config, "n", lo=1, allow_none=True)
  n = k if n is None else n
  if k > n:
    raise ConfigError(f"config.k={k} is not accepted with config.n={n}; expected k <= n (the "
                      "objective's k samples come from the n completions of a prompt)")
  max_new = integer(config, "max_new_tokens", lo=1)
  real(config, "temperature", lo=0.0, lo_open=True)
  real(config, "top_p", lo=0.0, hi=1.0, lo_open=True)
  integer(config, "top_k", lo=0)

  # Estimator: exactly what the objective library accepts.
  aggregator = choice(config, "aggregator", objectives.AGGREGATORS)
  baseline = choice(config, "baseline", objectives.BASELINES)
  scale = choice(config, "scale", objectives.SCALES)
  p = integer(config, "p", lo=1)
  beta = real(config, "beta")
  try:
    objectives.k_sample_advantages(
        np.linspace(-1.0, 1.0, n, dtype=np.float32)[None], aggregator=aggregator,
        baseline=baseline, k=k, p=p, beta=beta, scale=scale,
        answer_ids=np.arange(n, dtype=np.int32)[None])
  except ValueError as e:
    raise ConfigError(f"config.{e} (with aggregator={aggregator!r}, baseline={baseline!r}, "
                      f"k={k}, n={n})") from None

  # Policy-gradient stack.
  algorithm = choice(config, "algorithm", update.ALGORITHMS)
  choice(config, "loss_aggregation", losses.AGGREGATIONS)
  loss_constant = _optional_real(config, "loss_constant", lo=0.0, lo_open=True)
  epochs = integer(config, "ppo_epochs", lo=1)
  minibatches = integer(config, "num_minibatches", lo=1)
  real(config, "clip_eps", lo=0.0, hi=1.0, lo_open=True, hi_open=True)
  real(config, "value_clip", lo=0.0, lo_open=True)
  real(config, "value_coef", lo=0.0)
  _optional_real(config, "is_cap", lo=1.0)
  kl_coef = real(config, "kl_coef", lo=0.0)
  choice(config, "kl_estimator", losses.KL_ESTIMATORS)
  _boolean(config, "sparse_updates")
  if algorithm == "grpo" and scale != "group_std":
    raise ConfigError(f"config.scale={scale!r} is not accepted with algorithm='grpo', which "
                      "divides by the group's standard deviation; expected 'group_std' (or "
                      "algorithm='dr_grpo' for no division)")
  if algorithm == "dr_grpo" and scale != "none":
    raise ConfigError(f"config.scale={scale!r} is not accepted with algorithm='dr_grpo', which "
                      "does not divide by the group's standard deviation; expected 'none' (or "
                      "algorithm='grpo')")
  if algorithm == "pg" and (epochs > 1 or minibatches > 1) and get(config, "is_cap") is None:
    raise ConfigError("config.ppo_epochs or config.num_minibatches > 1 with algorithm='pg' makes "
                      "later optimizer steps off-policy; expected an importance-weight cap "
                      "config.is_cap (e.g. 2.0), or ppo_epochs = num_minibatches = 1")
  del kl_coef

  rows = b * n
  if rows % minibatches:
    raise ConfigError(f"config.num_minibatches={minibatches} is not accepted; expected a divisor "
                      f"of the completions per step, batch_prompts * n = {rows}")
  minibatch_rows = rows // minibatches
  micro = integer(config, "micro_batch_size", lo=1, allow_none=True)
  micro = minibatch_rows if micro is None else micro
  if minibatch_rows % micro:
    raise ConfigError(f"config.micro_batch_size={micro} is not accepted; expected a divisor of "
                      f"the rows per optimizer step, {minibatch_rows}")

  # Optimizer and run.
  real(config, "learning_rate", lo=0.0, lo_open=True)
  integer(config, "lr_warmup_steps", lo=0)
  real(config, "weight_decay", lo=0.0)
  _optional_real(config, "max_grad_norm", lo=0.0, lo_open=True)
  real(config, "adam_b1", lo=0.0, hi=1.0, hi_open=True)
  real(config, "adam_b2", lo=0.0, hi=1.0, hi_open=True)
  real(config, "adam_eps", lo=0.0, lo_open=True)
  integer(config, "num_steps", lo=0)
  integer(config, "log_every", lo=1)
  integer(config, "checkpoint_every", lo=1)
  integer(config, "keep_checkpoints", lo=1)
  _boolean(config, "async_checkpoints")
  _boolean(config, "progress_bar")

  # Warm-up.
  integer(config, "sft_warmup.steps", lo=0)
  integer(config, "sft_warmup.batch_size", lo=1)
  real(config, "sft_warmup.learning_rate", lo=0.0, lo_open=True)
  integer(config, "sft_warmup.lr_warmup_steps", lo=0)
  real(config, "sft_warmup.weight_decay", lo=0.0)

  # Evaluation.
  _boolean(config, "eval.at_start")
  _boolean(config, "eval.at_end")
  _string(config, "eval.split")
  integer(config, "eval.num_prompts", lo=1, allow_none=True)
  eval_n = integer(config, "eval.num_samples", lo=1)
  ks = _int_tuple(config, "eval.ks", lo=1)
  for ek in ks:
    if ek > eval_n:
      raise ConfigError(f"config.eval.ks={ks!r} is not accepted; expected every k <= "
                        f"eval.num_samples={eval_n}")
  real(config, "eval.temperature", lo=0.0)
  real(config, "eval.top_p", lo=0.0, hi=1.0, lo_open=True)
  integer(config, "eval.top_k", lo=0)
  eval_max_new = integer(config, "eval.max_new_tokens", lo=1, allow_none=True)
  integer(config, "eval.batch_prompts", lo=1)

  return Derived(n=n, rows=rows, minibatch_rows=minibatch_rows, micro_batch_size=micro,
                 loss_constant=float(max_new) if loss_constant is None else loss_constant,
                 eval_max_new_tokens=max_new if eval_max_new is None else eval_max_new)


def check_mesh(derived: Derived, batch_shards: int) -> None:
  """Rows must split evenly over the mesh's batch axes (data x fsdp)."""
  if derived.micro_batch_size % batch_shards:
    raise ConfigError(f"config.micro_batch_size (or the rows per optimizer step) = "
                      f"{derived.micro_batch_size} is not accepted on this mesh; expected a "
                      f"multiple of the batch shards data x fsdp = {batch_shards}")
