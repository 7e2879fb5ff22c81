"""The gradient estimators the bandit study compares, as hashable values.

A `Variant` is one call of `ksjax.objectives.k_sample_advantages`: an aggregator (the f of the
k-sample objective), a baseline (the control variate), a scale and the shared k, p, beta. It is a
frozen dataclass so it can be a static argument of jitted functions.
"""

from __future__ import annotations

import dataclasses

from ksjax.objectives import AGGREGATORS
from ksjax.objectives import BASELINES
from ksjax.objectives import SCALES

# The three estimators of the paper's Figure 1, always compared, never rescaled.
PAPER_PAIRS = (("mean", "loo"), ("pass_at_k", "loo"), ("pass_at_k", "loo_demeaned"))
_PAPER_LABELS = {
    ("mean", "loo", "none"): "mean PG",
    ("pass_at_k", "loo", "none"): "pass@k PG",
    ("pass_at_k", "loo_demeaned", "none"): "biased pass@k PG",
}


@dataclasses.dataclass(frozen=True)
class Variant:
  """One k-sample policy-gradient estimator.

  Attributes:
    aggregator: one of AGGREGATORS.
    baseline: one of BASELINES.
    scale: one of SCALES.
    k: samples per k-sample objective.
    p: samples left out by baseline "leave_p_out".
    beta: inverse temperature of aggregator "softmax".
  """
  aggregator: str
  baseline: str
  scale: str = "none"
  k: int = 4
  p: int = 1
  beta: float = 1.0

  @property
  def key(self) -> str:
    """Machine name used in the CSV: "aggregator:baseline[:scale]"."""
    suffix = "" if self.scale == "none" else f":{self.scale}"
    return f"{self.aggregator}:{self.baseline}{suffix}"

  @property
  def label(self) -> str:
    """Human name used in legends and tables."""
    if (self.aggregator, self.baseline, self.scale) in _PAPER_LABELS:
      return _PAPER_LABELS[(self.aggregator, self.baseline, self.scale)]
    detail = []
    if self.baseline == "leave_p_out":
      detail.append(f"p={self.p}")
    if self.aggregator == "softmax":
      detail.append(f"beta={self.beta:g}")
    return self.key + (f" ({', '.join(detail)})" if detail else "")


def parse_spec(spec: str, default_scale: str) -> tuple[str, str, str]:
  """Parses "aggregator:baseline[:scale]"; raises ValueError saying what is wrong."""
  parts = [part.strip() for part in spec.split(":")]
  if len(parts) not in (2, 3):
    raise ValueError(f"{spec!r} is not of the form aggregator:baseline[:scale]")
  aggregator, baseline = parts[:2]
  scale = parts[2] if len(parts) == 3 else default_scale
  for name, value, accepted in (("aggregator", aggregator, AGGREGATORS),
                                ("baseline", baseline, BASELINES), ("scale", scale, SCALES)):
    if value not in accepted:
      raise ValueError(f"{spec!r} has {name} {value!r}; expected one of "
                       f"{', '.join(map(repr, accepted))}")
  return aggregator, baseline, scale
