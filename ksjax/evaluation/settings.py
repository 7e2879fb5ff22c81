"""Start-up validation of an evaluation config (configs/eval.py), before anything is read or
written.

Every top-level field of the evaluation config is declared once, in `EvalSpec`, with its type,
default, one-line meaning and what it accepts (`ksjax.config_fields`); configs/eval.py derives
its ConfigDict from these declarations, and `python -m ksjax.evaluation.settings` lists them.
`validate(config)` checks every top-level field and the trainer config in `config.run` (with
`ksjax.run.spec.from_config`, so an evaluation accepts exactly the runs the trainer accepts), and
returns the settings as a frozen `EvalSpec`, with the run's spec. A bad value is a `ConfigError`
naming the field and what it accepts; a rule that ties fields together is a method of `EvalSpec`
named after it.

Settings are derived rather than copied where they depend on others: `ks` defaults to the ladder 1, 2, 4, ..., n
(`scoring.k_ladder`), and `batch_prompts` is lowered to fit `batch_rows` sampler rows per call
(n samples per problem, prompts padded to a power of two), so that asking for many samples needs
no other change; `max_new_tokens` defaults to the run's eval.max_new_tokens, and `kl_samples` to
n when the KL is measured. The derived batch_prompts is the one recorded with the results: it decides each
chunk's seed.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any

from ksjax import config_fields as cf
from ksjax import config_validation as cv
from ksjax.config_fields import field
from ksjax.config_validation import ConfigError
from ksjax.run import spec as spec_lib

if TYPE_CHECKING:
  from ksjax.run import scoring

STEP_CHOICES = "'latest', 'all', 'last:N' or step numbers 'S' / 'S1,S2,...'"


def _scoring():
  """`ksjax.run.scoring`, imported on first use: it loads jax, and configs/eval.py derives its
  defaults from the declarations below without it."""
  from ksjax.run import scoring  # pylint: disable=g-import-not-at-top,redefined-outer-name
  return scoring


def _checkpoint_dir(c: Any, name: str) -> str:
  value = cv.get(c, name)
  if not isinstance(value, str) or not value:
    raise ConfigError(f"config.{name}={value!r} is not accepted; expected the directory of a "
                      "training run (--config.checkpoint_dir=DIR)")
  return value


def _steps(c: Any, name: str) -> str:
  value = cv.string(c, name)
  parse_steps(value)
  return value


def _breakdown(c: Any, name: str) -> tuple[str, ...]:
  value = cv.get(c, name)
  if not isinstance(value, (tuple, list)) or not all(isinstance(b, str) and b for b in value):
    raise ConfigError(f"config.{name}={value!r} is not accepted; expected a tuple of problem "
                      "metadata field names, e.g. ('level', 'subject')")
  return tuple(value)


def _kl_reference(c: Any, name: str) -> str | None:
  value = cv.get(c, name)
  if value is not None and (not isinstance(value, str) or not value):
    raise ConfigError(f"config.{name}={value!r} is not accepted; expected 'start' (the run's "
                      "start policy), a ksjax.model checkpoint directory, or None")
  return value


@dataclasses.dataclass(frozen=True)
class EvalSpec(cf.Spec):
  """What an evaluation does: every top-level field of the evaluation config (configs/eval.py),
  and `run`, the trainer spec of config.run (its task, model and mesh). Made, the defaults that
  depend on other fields are filled in (`_resolve_dependent_defaults`): `ks`, `max_new_tokens`,
  `batch_prompts` and `kl_samples` hold what the evaluation uses. `sampling()` is what its
  results depend on."""
  checkpoint_dir: str | None = field(None, "a run's workdir, or its checkpoints/ dir (required)",
                                     check=_checkpoint_dir)
  # "last:N": each of the N newest, and their average, as the paper reports.
  steps: str = field("latest", f"which checkpoints: {STEP_CHOICES}", check=_steps)
  # Also the policy the run started from (<run>/start: the loaded or warmed-up model), as step 0,
  # before the checkpoints.
  include_start: bool = field(False, "also evaluate the run's start policy, as step 0")
  # Follow the directory and evaluate every checkpoint not evaluated yet (config.steps is not
  # used), now and as each lands; stop after idle_timeout_s seconds without a new one.
  watch: bool = field(False, "evaluate every new checkpoint as it lands (steps is not used)")
  poll_interval_s: float = field(30.0, "seconds between looks at the directory when watching",
                                 lo=0.0, lo_open=True)
  idle_timeout_s: float | None = field(None, "stop watching after this many seconds without a "
                                       "new checkpoint; None: never", lo=0.0)

  split: str = field("test", "the task split the problems come from")
  num_prompts: int | None = field(None, "the first N problems of the split; None: all", lo=1)
  # 200 or more for pass@100; 256 or more for the large-k diagnostics, on a subset of problems
  # via num_prompts.
  num_samples: int = field(20, "n completions per problem", lo=1)
  # (`ksjax.run.scoring.k_ladder`; e.g. 1, 2, 4, 8, 16, 20 for 20 samples).
  ks: tuple[int, ...] | None = field(None, "pass@k and maj@k for each k <= num_samples; None: "
                                     "the ladder 1, 2, 4, ..., num_samples", lo=1)
  temperature: float = spec_lib.evaluation_temperature_field()
  top_p: float = spec_lib.top_p_field()
  top_k: int = spec_lib.top_k_field()
  max_new_tokens: int | None = field(None, "the most tokens a completion has; None: the run's "
                                     "eval.max_new_tokens", lo=1)
  # 8 is the fastest on a CPU for the tiny model (benchmarks/eval.py: 4 and 8 alike, 16 about
  # 0.6x, 32 and 64 about 0.5x); on an accelerator with a large model, raise it until the device
  # is full.
  batch_prompts: int = field(8, "problems per sampler call (batch_prompts * num_samples rows), "
                             "lowered to fit batch_rows", lo=1)
  # batch_prompts drops to the largest power of two <= batch_rows // num_samples (the sampler
  # pads to powers of two) so that large n fits, e.g. to 4 at num_samples=512, or to 1 with
  # --config.batch_rows=256 at 256. All n samples of a problem are drawn in one call, so
  # num_samples > batch_rows is refused. The default leaves batch_prompts=8 alone up to n=256.
  # (A mesh whose batch axes do not divide num_samples pads a call further:
  # `ksjax.sampling.batching.bucket_prompt_batch`.)
  batch_rows: int | None = field(2048, "at most this many sampler rows (problems x samples) per "
                                 "call; None: no cap", lo=1)
  seed: int = field(0, "the sampling seed", lo=0, hi=2**31 - 1)
  breakdown: tuple[str, ...] = field(("level", "subject"), "problem metadata fields to report "
                                     "separately", check=_breakdown)
  output_dir: str | None = field(None, "where the results go; None: "
                                 "<run dir>/eval/<split>_n<n>_t<T>_p<p>")
  plots: bool = field(True, "draw the plots with the results")
  # KL(checkpoint || reference) on the held-out samples (temperature 1, no top-p/top-k): per
  # completion, summed over its tokens, the k1 and k3 estimators (`kl_k1`, `kl_k3` in the
  # metrics), from the sampler's log-probs and one reference forward.
  kl_reference: str | None = field(None, "the KL's reference: 'start' (the run's start policy), "
                                   "a ksjax.model checkpoint directory; None: not measured",
                                   check=_kl_reference)
  kl_samples: int | None = field(None, "the first this many samples of each problem are scored "
                                 "for the KL; None: all of them", check=cf.unchecked)

  # Not a config field: config.run, read by the trainer's spec (`ksjax.run.spec.from_config`).
  # Without it (a spec made in Python), a max_new_tokens of None stays None.
  run: spec_lib.TrainSpec | None = dataclasses.field(default=None, compare=False, repr=False)

  def __post_init__(self):
    super().__post_init__()
    self._ks_within_num_samples()
    self._samples_fit_batch_rows()
    self._kl_samples_within_num_samples()
    self._resolve_dependent_defaults()
    self._kl_needs_the_policys_own_samples()

  def _ks_within_num_samples(self):
    if self.ks is None:
      return
    ks, n = self.ks, self.num_samples
    if max(ks) > n:
      raise ConfigError(f"config.ks={ks!r} is not accepted with config.num_samples={n}; "
                        f"expected every k <= num_samples (pass@{max(ks)} needs at least "
                        f"{max(ks)} samples per problem)")

  def _samples_fit_batch_rows(self):
    n, rows = self.num_samples, self.batch_rows
    if rows is not None and n > rows:
      raise ConfigError(
          f"config.num_samples={n} is not accepted with config.batch_rows={rows}; expected "
          "num_samples <= batch_rows (a problem's samples are drawn in one sampler call): raise "
          "batch_rows, or set it to None")

  def _kl_samples_within_num_samples(self):
    # kl_samples' own check too: its bounds depend on num_samples.
    cv.integer({"kl_samples": self.kl_samples}, "kl_samples", lo=1, hi=self.num_samples,
               allow_none=True)

  def _resolve_dependent_defaults(self):
    """ks: the ladder up to n; max_new_tokens: the run's; batch_prompts: lowered to fit
    batch_rows; kl_samples: n when the KL is measured, None when it is not."""
    n = self.num_samples
    ks = _scoring().k_ladder(n) if self.ks is None else self.ks
    resolved = {"ks": tuple(sorted(set(ks))),
                "batch_prompts": prompts_within_rows(self.batch_prompts, n, self.batch_rows),
                "kl_samples": None if self.kl_reference is None else (self.kl_samples or n)}
    if self.max_new_tokens is None and self.run is not None:
      resolved["max_new_tokens"] = self.run.eval.max_new_tokens
    for name, value in resolved.items():
      object.__setattr__(self, name, value)

  def _kl_needs_the_policys_own_samples(self):
    """The KL is estimated from samples of the policy itself: no temperature, top-p or top-k."""
    if self.kl_reference is not None and (self.temperature, self.top_p, self.top_k) != (1.0, 1.0,
                                                                                           0):
      raise ConfigError(
          f"config.kl_reference={self.kl_reference!r} is not accepted with temperature "
          f"{self.temperature:g}, top_p {self.top_p:g}, top_k {self.top_k}; expected "
          "temperature 1, top_p 1 and top_k 0 (the KL is estimated from samples of the policy "
          "itself)")

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
    return _scoring().Draw(num_samples=self.num_samples, max_new_tokens=self.max_new_tokens,
                        temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)

  def output_name(self) -> str:
    return f"{self.split}_n{self.num_samples}_t{self.temperature:g}_p{self.top_p:g}"


# What `validate` returns: the spec, its dependent defaults filled in.
Settings = EvalSpec


def prompts_within_rows(batch_prompts: int, num_samples: int, batch_rows: int | None) -> int:
  """batch_prompts, lowered so that a call's rows, its prompts padded to a power of two times
  num_samples, stay within batch_rows."""
  if batch_rows is None:
    return batch_prompts
  fit = batch_rows // num_samples
  # The sampler pads a call's prompts to a power of two (`ksjax.sampling.batching`), and the
  # padding takes rows like real prompts, so the cap holds for the padded count.
  if 1 << (batch_prompts - 1).bit_length() > fit:
    return min(batch_prompts, 1 << (fit.bit_length() - 1))
  return batch_prompts


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
  known = (*(name for name, _, _ in cf.leaves(EvalSpec)), "run")
  for key in config.keys():
    if key not in known:
      raise ConfigError(f"config.{key} is not a field of the evaluation config; the fields are "
                        f"{', '.join(known)}")
  spec = cf.read(EvalSpec, config)  # the evaluation's own fields first: no jax needed
  try:
    run = spec_lib.from_config(config.run)
  except ConfigError as e:
    raise ConfigError(str(e).replace("config.", "config.run.")) from None
  return dataclasses.replace(spec, run=run)  # fills max_new_tokens from the run


if __name__ == "__main__":
  print(cf.describe(EvalSpec))
