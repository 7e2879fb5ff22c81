"""A study's pre-registration: its statements, decision rule and seeds, fixed before any run.

A study that chooses what to test after seeing its results finds something in noise. So each
study in experiments/ reads a JSON file (data only) committed before its first run:

  {"study": name, "question": text, "seeds": [0, 1, ...], "arms": {arm: what it trains},
   "design": {...}, "power": {...},
   "decision_rule": {"test": "paired_t", "alpha": 0.05, "correction": "holm"},
   "primary": [statement, ...], "secondary": [statement, ...]}

where a statement is {"id", "text", "a", "b", "metric"} and, optionally, "at" (where along the
runs it is read: "last", the default, or "kl", pass@k at the held-out KL every compared run
reaches). Its test is the paired t-test over seeds of a minus b, two-sided (`statistics.paired`);
the primary statements are corrected together by Holm, the secondary ones are not.

An arm is described in words, or by an object; an object may give the arm its own "seeds" (two
or more of the study's), for a study that runs some arms on fewer seeds than others (its other
fields are the study's to read). A statement is tested on the seeds both of its arms run
(`statement_seeds`).

`judge` turns the per-seed values of each statement into its verdict. Only a pre-registered
primary statement can be "supported"; a pre-registered secondary statement is at most
"significant, uncorrected"; anything a report adds after the fact is "exploratory", whatever
its p-value. `registration` reads from git when the file was committed and whether it changed
afterwards, so that a report can print both commits and check that the registration precedes the
runs.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ksjax.config_validation import ConfigError
from ksjax.evaluation import statistics

PRIMARY, SECONDARY, EXPLORATORY = "primary", "secondary", "exploratory"
STATEMENT_FIELDS = ("id", "text", "a", "b", "metric")
WHERE = ("last", "kl")
TESTS = ("paired_t",)
CORRECTIONS = ("holm",)


@dataclasses.dataclass(frozen=True)
class Statement:
  id: str
  text: str
  a: str  # the arm whose values come first (the difference is a - b)
  b: str
  metric: str
  at: str = "last"
  kind: str = PRIMARY


@dataclasses.dataclass(frozen=True)
class Preregistration:
  path: str
  study: str
  seeds: tuple[int, ...]
  arms: Mapping[str, Any]
  design: Mapping[str, Any]
  alpha: float
  statements: tuple[Statement, ...]
  raw: Mapping[str, Any]

  @property
  def primary(self) -> tuple[Statement, ...]:
    return tuple(s for s in self.statements if s.kind == PRIMARY)

  def arm_seeds(self, arm: str) -> tuple[int, ...]:
    """The seeds `arm` runs: its own "seeds" where its description gives them, else the
    study's."""
    described = self.arms[arm]
    if isinstance(described, Mapping) and "seeds" in described:
      return tuple(described["seeds"])
    return self.seeds

  def statement_seeds(self, statement: Statement) -> tuple[int, ...]:
    """The seeds a statement is tested on: those both of its arms run, in the study's order."""
    both = set(self.arm_seeds(statement.a)) & set(self.arm_seeds(statement.b))
    return tuple(s for s in self.seeds if s in both)


def _fail(path: str, what: str) -> ConfigError:
  return ConfigError(f"pre-registration {path}: {what}")


def load(path: str) -> Preregistration:
  """Reads and checks a pre-registration file; a bad one is one ConfigError line."""
  try:
    with open(path, encoding="utf-8") as f:
      raw = json.load(f)
  except OSError as e:
    raise _fail(path, f"cannot be read ({e.strerror}); expected a JSON file") from None
  except json.JSONDecodeError as e:
    raise _fail(path, f"is not JSON ({e.msg}, line {e.lineno}); expected a JSON object") from None
  if not isinstance(raw, dict):
    raise _fail(path, "expected a JSON object")
  for key in ("study", "seeds", "arms", "decision_rule", "primary"):
    if key not in raw:
      raise _fail(path, f"has no {key!r}; expected study, seeds, arms, decision_rule, primary")
  seeds = raw["seeds"]
  if (not isinstance(seeds, list) or len(seeds) < 2
      or not all(isinstance(s, int) for s in seeds) or len(set(seeds)) != len(seeds)):
    raise _fail(path, f"seeds={seeds!r}; expected a list of two or more distinct integers")
  rule = raw["decision_rule"]
  if not isinstance(rule, dict) or rule.get("test") not in TESTS or rule.get(
      "correction") not in CORRECTIONS:
    raise _fail(path, f"decision_rule={rule!r}; expected test in {TESTS} and correction in "
                f"{CORRECTIONS}")
  alpha = rule.get("alpha")
  if not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
    raise _fail(path, f"decision_rule.alpha={alpha!r}; expected a number in (0, 1)")
  arms = raw["arms"]
  if not isinstance(arms, dict) or len(arms) < 2:
    raise _fail(path, f"arms={arms!r}; expected an object naming two or more arms")
  for arm, described in arms.items():
    own = described.get("seeds", seeds) if isinstance(described, dict) else seeds
    if (not isinstance(own, list) or len(own) < 2 or len(set(own)) != len(own)
        or not all(isinstance(s, int) and s in seeds for s in own)):
      raise _fail(path, f"arms.{arm}.seeds={own!r}; expected a list of two or more distinct "
                  "seeds of the study's")
  statements, seen = [], set()
  for kind in (PRIMARY, SECONDARY):
    items = raw.get(kind, [])
    if not isinstance(items, list) or (kind == PRIMARY and not items):
      raise _fail(path, f"{kind} must be a list" + (" of one or more statements"
                                                      if kind == PRIMARY else ""))
    for item in items:
      if not isinstance(item, dict) or any(not isinstance(item.get(k), str)
                                           for k in STATEMENT_FIELDS):
        raise _fail(path, f"{kind} statement {item!r}; expected strings {STATEMENT_FIELDS}")
      if item["id"] in seen:
        raise _fail(path, f"statement id {item['id']!r} appears twice; expected unique ids")
      seen.add(item["id"])
      for arm in (item["a"], item["b"]):
        if arm not in arms:
          raise _fail(path, f"statement {item['id']!r} names arm {arm!r}; expected one of "
                      f"{sorted(arms)}")
      at = item.get("at", "last")
      if at not in WHERE:
        raise _fail(path, f"statement {item['id']!r} at={at!r}; expected one of {WHERE}")
      statements.append(Statement(item["id"], item["text"], item["a"], item["b"],
                                  item["metric"], at, kind))
  return Preregistration(path=path, study=str(raw["study"]), seeds=tuple(seeds), arms=arms,
                         design=raw.get("design", {}), alpha=float(alpha),
                         statements=tuple(statements), raw=raw)


# ---------------------------------------------------------------------------------------------
# Verdicts
# ---------------------------------------------------------------------------------------------

def judge(prereg: Preregistration, values: Mapping[str, tuple[Sequence[float], Sequence[float]]],
          exploratory: Sequence[Statement] = (), *, registered: bool = True
          ) -> list[dict[str, Any]]:
  """The verdict of every statement from its per-seed values {id: (a_values, b_values)}, seed i
  at index i in both (the seeds it is tested on: `Preregistration.statement_seeds`, less any the
  study leaves out and says so).

  Primary statements: paired t over seeds, two-sided, Holm-adjusted together; "supported" when
  the adjusted p is below alpha (the sign of the difference says which way). Secondary: the
  same test uncorrected, "significant, uncorrected". `exploratory` statements (not in the file)
  get their numbers but never a verdict stronger than "exploratory". A statement whose values
  are missing is "not measured" and is left out of the correction (the report says so).
  With `registered` False (the file was not committed before the runs: `registration`), every
  statement is judged as exploratory.
  """
  rows = []
  listed = prereg.statements if registered else tuple(
      dataclasses.replace(s, kind=EXPLORATORY) for s in prereg.statements)
  for statement in (*listed, *(dataclasses.replace(s, kind=EXPLORATORY) for s in exploratory)):
    if statement.id not in values:
      rows.append({**dataclasses.asdict(statement), "verdict": "not measured"})
      continue
    a, b = (np.asarray(v, np.float64) for v in values[statement.id])
    finite = np.isfinite(a) & np.isfinite(b)
    result = statistics.paired(a[finite], b[finite]) if finite.sum() else None
    rows.append({**dataclasses.asdict(statement), "a_mean": float(np.mean(a[finite])),
                 "b_mean": float(np.mean(b[finite])), "seeds_used": int(finite.sum()),
                 **(result.as_dict() if result else {})})
  tested = [r for r in rows if r["kind"] == PRIMARY and np.isfinite(r.get("p_value", np.nan))]
  if tested:
    adjusted, reject = statistics.holm([r["p_value"] for r in tested], prereg.alpha)
    for row, p, r in zip(tested, np.atleast_1d(adjusted), np.atleast_1d(reject)):
      row["p_holm"] = float(p)
      row["reject"] = bool(r)
  for row in rows:
    if "verdict" in row:
      continue
    p = row.get("p_value", np.nan)
    if not np.isfinite(p):
      row["verdict"] = "no test (fewer than two seeds)"
    elif row["kind"] == PRIMARY:
      row["verdict"] = (f"supported: {_direction_text(row)} (Holm p = {row['p_holm']:.3g})"
                        if row.get("reject") else
                        f"not supported (Holm p = {row['p_holm']:.3g})")
    elif row["kind"] == SECONDARY:
      row["verdict"] = (f"significant, uncorrected: {_direction_text(row)}"
                        if p < prereg.alpha else "not significant")
    else:
      row["verdict"] = "exploratory (not pre-registered)"
  return rows


def _direction_text(row: Mapping[str, Any]) -> str:
  return f"{row['a']} {'above' if row['difference'] > 0 else 'below'} {row['b']}"


def table(rows: Sequence[Mapping[str, Any]]) -> str:
  """Markdown: one line per statement with the paired difference, its interval, p and verdict."""
  lines = ["| id | kind | statement | a − b (paired over seeds) | 95% interval | p | Holm p | "
           "seeds a > b | verdict |", "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if "difference" not in r:
      lines.append(f"| {r['id']} | {r['kind']} | {r['text']} | | | | | | {r['verdict']} |")
      continue
    holm = f"{r['p_holm']:.3g}" if "p_holm" in r else ""
    lines.append(
        f"| {r['id']} | {r['kind']} | {r['text']} ({r['a']} − {r['b']}, {r['metric']}) | "
        f"{r['difference']:+.4f} | [{r['ci_low']:+.4f}, {r['ci_high']:+.4f}] | "
        f"{r['p_value']:.3g} | {holm} | {r['seeds_positive']} of {r['n']} | {r['verdict']} |")
  return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# When it was registered
# ---------------------------------------------------------------------------------------------

def git(repo: str, *args: str) -> str | None:
  """The output of `git <args>` in `repo`; None where git or the repository is missing, or git
  says no (a non-zero exit, as `merge-base --is-ancestor` answers)."""
  try:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True,
                          timeout=30).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None


def registration(repo: str, path: str, first_run_commit: str | None) -> dict[str, Any]:
  """When `path` (relative to `repo`) was committed, and whether that precedes the study's first
  run, made at `first_run_commit`.

  Returns {"registered_at": the commit that added the file (None if never committed),
  "changed_at": later commits that changed it, "first_run_commit", "precedes": True when the
  registration and every change are ancestors of (or equal to) the first run's commit, i.e.
  the runs read the file as it was registered; False when not; None when it cannot be told
  (no git, no commit)}.
  """
  log = git(repo, "log", "--format=%H", "--", path)
  commits = log.split() if log else []
  out = {"registered_at": commits[-1] if commits else None, "changed_at": commits[-2::-1],
         "first_run_commit": first_run_commit, "precedes": None}
  if not commits or not first_run_commit:
    return out
  out["precedes"] = all(git(repo, "merge-base", "--is-ancestor", c, first_run_commit) is not None
                        for c in commits)
  return out


def registration_line(info: Mapping[str, Any]) -> str:
  """One sentence for a report: both commits and whether the order holds."""
  reg, run = info.get("registered_at"), info.get("first_run_commit")
  if not reg:
    return "The pre-registration file is not committed: no statement can be called supported."
  text = f"Pre-registered at commit `{reg[:7]}`; the study's first run trained at " + (
      f"`{run[:7]}`" if run else "an unrecorded commit")
  if info.get("precedes"):
    return text + ": the registration precedes every run."
  if info.get("precedes") is False:
    late = [c[:7] for c in info.get("changed_at", [])]
    return text + (": THE REGISTRATION DOES NOT PRECEDE THE RUNS"
                   + (f" (changed at {', '.join(late)})" if late else "") + ".")
  return text + ": the order could not be checked."
