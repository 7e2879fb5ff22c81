"""The registered statements' verdicts, as the registration says, or why there is none.

A study that departs from its registration (other seeds or arms, a changed registered setting)
or whose registration does not precede its runs is judged as exploratory: numbers, and no
statement called supported (`ksjax.evaluation.preregistration.judge`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ksjax.evaluation import preregistration
from ksjax.evaluation import statistics
from ksjax.studies import analysis
from ksjax.studies import store


def departures(study, prereg, arms: Sequence[str], seeds: Sequence[int]) -> list[str]:
  """The settings where this study departs from its registration (empty: none)."""
  design = dict(prereg.design)
  design.update(seeds=list(prereg.seeds))
  changed = []
  for field in study.registered_fields:
    value = study.settings
    for part in field.split("."):
      value = value[part]
    want = design.get(field)
    if want is None or list(np.atleast_1d(value)) != list(np.atleast_1d(want)):
      changed.append(f"{field}={value!r} (registered: {want!r})")
  if list(seeds) != list(prereg.seeds):
    changed.append(f"seeds={tuple(seeds)!r} (registered: {list(prereg.seeds)!r})")
  if sorted(arms) != sorted(prereg.arms):
    changed.append(f"arms={tuple(arms)!r} (registered: {sorted(prereg.arms)!r})")
  return changed


def power(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """The smallest difference the first primary statement's seeds detect with 80% power."""
  primary = [r for r in rows if r.get("kind") == "primary" and "differences" in r]
  if not primary or len(primary[0]["differences"]) < 2:
    return {}
  sd = float(np.std(primary[0]["differences"], ddof=1))
  return {"statement": primary[0]["id"], "sd_of_differences": sd,
          "seeds": len(primary[0]["differences"]),
          "minimum_detectable_effect": statistics.minimum_detectable_effect(
              sd, len(primary[0]["differences"])) if sd > 0 else 0.0}


def judged(study, prereg, data: Mapping[str, Any], out: str, arms, seeds) -> dict[str, Any]:
  """Paired over seeds within a machine, Holm across the primary statements."""
  provenance = store.read_json(os.path.join(out, "provenance.json"), {})
  order = preregistration.registration(study.root, study.registration, provenance.get("commit"))
  departed = departures(study, prereg, arms, seeds)
  registered = not departed and order["precedes"] is True
  values, left_out = analysis.statement_values(prereg, data, study.prefix, study.kl_match)
  rows = [{**row, **study.statement_fields}
          for row in preregistration.judge(prereg, values, registered=registered)]
  return {"rows": rows, "registration": order, "departures": departed, "registered": registered,
          "left_out": left_out, "line": preregistration.registration_line(order),
          "table": preregistration.table(rows), "power": power(rows)}
