"""Start-up validation of an evaluation config (configs/eval.py), before anything is read or
written.

`validate(config)` checks every top-level field and the trainer config in `config.run` (with
`ksjax.run.spec.from_config`, so an evaluation accepts exactly the runs the trainer accepts), and
returns the settings as a frozen dataclass, with the run's spec. A bad value is a `ConfigError`
naming the field and what it accepts.

Two settings are derived rather than copied: `ks` defaults to the ladder 1, 2, 4, ..., n
(`scoring.k_ladder`), and `batch_prompts` is lowered to fit `batch_rows` sampler rows per call
(n samples per problem, prompts padded to a power of two), so that asking for many samples needs
no other change. The derived batch_prompts is the one recorded with the results: it decides each
chunk's seed.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from ksjax.config_validation import ConfigError, boolean, get, int_tuple, integer, real, string
from ksjax.run import scoring
from ksjax.run import spec as spec_lib

STEP_CHOICES = "'latest', 'all', 'last:N' or step numbers 'S' / 'S1,S2,...'"


@dataclasses.dataclass(frozen=True)
class Settings:
  """What an evaluation does; `sampling()` is what its results depend on."""
  checkpoint_dir: str
  steps: str
  watch: bool
  poll_interval_s: float
  idle_timeout_s: float | None
  split: str
  num_prompts: int | None
  num_samples: int
  ks: tuple[int, ...]
  temperature: float
  top_p: float
  top_k: int
  max_new_tokens: int
  batch_prompts: int    # problems per sampler call, after batch_rows
  batch_rows: int | None
  seed: int
  breakdown: tuple[str, ...]
  output_dir: str | None
  plots: bool
  run: spec_lib.TrainSpec  # the run's (config.run): its task, model and mesh
  include_start: bool = False      # also the run's start policy, as step 0
  kl_reference: str | None = None  # "start", a ksjax.model checkpoint directory, or None
  kl_samples: int | None = None    # samples per problem whose KL is estimated (None: all)

  def sampling(self) -> dict[str, Any]:
    """The fields that decide an evaluation's numbers: results are reused only when equal."""
    return {"split": self.split, "num_prompts": self.num_prompts,
            "num_samples": self.num_samples, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k, "max_new_tokens": self.max_new_tokens,
            "batch_prompts": self.batch_prompts, "seed": self.seed,
            # Only when asked for, so records made without KL still match settings without it.
            **({"kl_reference": self.kl_reference, "kl_samples": self.kl_samples}
               if self.kl_reference is not None else {})}

  def draw(self) -> scoring.Draw:
    return scoring.Draw(num_samples=self.num_samples, max_new_tokens=self.max_new_tokens,
                        temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)

  def output_name(self) -> str:
    return f"{self.split}_n{self.num_samples}_t{self.temperature:g}_p{self.top_p:g}"


def parse_steps(spec: str) -> tuple[str, int | tuple[int, ...] | None]:
  """"latest" | "all" | "last:N" | "S1,S2" -> (kind, argument)."""
  spec = spec.strip()
  if spec in ("latest", "all"):
    return spec, None
  match = re.fullmatch(r"last:(\d+)", spec)
  if match and int(match.group(1)) >= 1:
    return "last", int(match.group(1))
  if re.fullmatch(r"\d+(,\d+)*", spec):
    return "steps", tuple(sorted({int(s) for s in spec.split(",")}))
  raise ConfigError(f"config.steps={spec!r} is not accepted; expected {STEP_CHOICES}")


def select_steps(spec: str, available: list[int], where: str) -> list[int]:
  """The steps `spec` names among `available` (ascending); ConfigError for a missing one."""
  kind, arg = parse_steps(spec)
  if kind == "latest":
    return available[-1:]
  if kind == "all":
    return list(available)
  if kind == "last":
    return available[-arg:]
  missing = [s for s in arg if s not in available]
  if missing:
    raise ConfigError(f"config.steps={spec!r}: no checkpoint of step {missing[0]} in {where}; "
                      f"the steps there are {', '.join(map(str, available))}")
  return list(arg)


def validate(config: Any) -> Settings:
  """Checks every field; raises ConfigError. `config.run` is checked by the trainer."""
  known = ("checkpoint_dir", "steps", "watch", "poll_interval_s", "idle_timeout_s", "split",
           "num_prompts", "num_samples", "ks", "temperature", "top_p", "top_k",
           "max_new_tokens", "batch_prompts", "batch_rows", "seed", "breakdown", "output_dir",
           "plots", "include_start", "kl_reference", "kl_samples", "run")
  for key in config.keys():
    if key not in known:
      raise ConfigError(f"config.{key} is not a field of the evaluation config; the fields are "
                        f"{', '.join(known)}")
  checkpoint_dir = get(config, "checkpoint_dir")
  if not isinstance(checkpoint_dir, str) or not checkpoint_dir:
    raise ConfigError(f"config.checkpoint_dir={checkpoint_dir!r} is not accepted; expected the "
                      "directory of a training run (--config.checkpoint_dir=DIR)")
  steps = string(config, "steps")
  parse_steps(steps)
  watch = boolean(config, "watch")
  poll = real(config, "poll_interval_s", lo=0.0, lo_open=True)
  idle = None if get(config, "idle_timeout_s") is None else real(config, "idle_timeout_s", lo=0.0)
  n = integer(config, "num_samples", lo=1)
  ks = scoring.k_ladder(n) if get(config, "ks") is None else int_tuple(config, "ks", lo=1)
  if max(ks) > n:
    raise ConfigError(f"config.ks={ks!r} is not accepted with config.num_samples={n}; expected "
                      f"every k <= num_samples (pass@{max(ks)} needs at least {max(ks)} samples "
                      "per problem)")
  breakdown = get(config, "breakdown")
  if not isinstance(breakdown, (tuple, list)) or not all(
      isinstance(b, str) and b for b in breakdown):
    raise ConfigError(f"config.breakdown={breakdown!r} is not accepted; expected a tuple of "
                      "problem metadata field names, e.g. ('level', 'subject')")
  try:
    run = spec_lib.from_config(config.run)
  except ConfigError as e:
    raise ConfigError(str(e).replace("config.", "config.run.")) from None
  max_new = integer(config, "max_new_tokens", lo=1, allow_none=True)
  batch_prompts = integer(config, "batch_prompts", lo=1)
  batch_rows = integer(config, "batch_rows", lo=1, allow_none=True)
  if batch_rows is not None:
    if n > batch_rows:
      raise ConfigError(
          f"config.num_samples={n} is not accepted with config.batch_rows={batch_rows}; expected "
          "num_samples <= batch_rows (a problem's samples are drawn in one sampler call): raise "
          "batch_rows, or set it to None")
    fit = batch_rows // n
    # The sampler pads a call's prompts to a power of two (`ksjax.sampling.batching`), and the
    # padding takes rows like real prompts, so the cap holds for the padded count.
    if 1 << (batch_prompts - 1).bit_length() > fit:
      batch_prompts = min(batch_prompts, 1 << (fit.bit_length() - 1))
  settings = Settings(
      checkpoint_dir=checkpoint_dir, steps=steps, watch=watch, poll_interval_s=poll,
      idle_timeout_s=idle, split=string(config, "split"),
      num_prompts=integer(config, "num_prompts", lo=1, allow_none=True), num_samples=n,
      ks=tuple(sorted(set(ks))), temperature=real(config, "temperature", lo=0.0),
      top_p=real(config, "top_p", lo=0.0, hi=1.0, lo_open=True),
      top_k=integer(config, "top_k", lo=0),
      max_new_tokens=run.eval.max_new_tokens if max_new is None else max_new,
      batch_prompts=batch_prompts, batch_rows=batch_rows,
      seed=integer(config, "seed", lo=0, hi=2**31 - 1), breakdown=tuple(breakdown),
      output_dir=string(config, "output_dir", allow_none=True), plots=boolean(config, "plots"),
      run=run, include_start=boolean(config, "include_start"), **_kl_settings(config, n))
  if settings.kl_reference is not None and (settings.temperature, settings.top_p,
                                            settings.top_k) != (1.0, 1.0, 0):
    raise ConfigError(
        f"config.kl_reference={settings.kl_reference!r} is not accepted with temperature "
        f"{settings.temperature:g}, top_p {settings.top_p:g}, top_k {settings.top_k}; expected "
        "temperature 1, top_p 1 and top_k 0 (the KL is estimated from samples of the policy "
        "itself)")
  return settings


def _kl_settings(config: Any, n: int) -> dict[str, Any]:
  reference = get(config, "kl_reference")
  if reference is not None and (not isinstance(reference, str) or not reference):
    raise ConfigError(f"config.kl_reference={reference!r} is not accepted; expected 'start' (the "
                      "run's start policy), a ksjax.model checkpoint directory, or None")
  samples = integer(config, "kl_samples", lo=1, hi=n, allow_none=True)
  return {"kl_reference": reference,
          "kl_samples": None if reference is None else (samples or n)}
