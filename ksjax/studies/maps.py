"""A map's report (`cells.Map`): the paired gap in every cell, along training, with intervals.

Exploratory by construction: every number is a paired difference over seeds (a minus b, the
seeds whose two runs were published from one machine) with its 95% t interval and p, and no
statement is called supported. A cell with fewer paired seeds than the map declares is listed as
unfinished and its numbers are not shown. Pure functions of the published records and marks, so
the same records give the same report.

  summary.json     per cell: the factor and its value, the paired seeds, the start's values, and
                   per checkpoint and metric the gap (difference, interval, p, seeds above), the
                   arms' means; the gap in the training log's metrics at `log_steps`
  gaps_heatmap.png one heat map per gap metric: cells by checkpoints, the gap in colour, the
                   difference and its interval written in each square
  factors.png      small multiples: one panel per factor (the centre's value included), the gap
                   at the last checkpoint against the factor's value, with 95% intervals
  along_training.png  the gap against the step for every cell, with intervals
  README.md        the tables, and what is not finished
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ksjax import files
from ksjax.evaluation import statistics
from ksjax.studies import analysis
from ksjax.studies import store

REPORT_FILES = ("summary.json", "gaps_heatmap.png", "factors.png", "along_training.png",
                "README.md")
KL = "kl"  # the gap in the KL to the start, beside the cell's metrics


def paired_seeds(out: str, names: Mapping[int, tuple[str, str]]) -> tuple[list[int], dict]:
  """The seeds whose two runs ({seed: (a's run, b's run)}) touched one and the same machine (every
  machine each run's mark lists), and {seed: why} for the others."""
  used, left = [], {}
  for seed, (a, b) in names.items():
    marks = [store.read_mark(out, n) for n in (a, b)]
    where = [analysis.mark_machines(m) for m in marks]
    if not all(marks):
      left[seed] = "not published"
    elif not analysis.one_machine(*where):
      left[seed] = f"{a} on {analysis.named(where[0])}, {b} on {analysis.named(where[1])}"
    else:
      used.append(seed)
  return used, left


def _values(records: Sequence[Mapping[str, Any]], metric: str, kl_metric: str) -> dict[int, float]:
  return {r["step"]: float(r["metrics"][kl_metric if metric == KL else metric]) for r in records
          if (kl_metric if metric == KL else metric) in r["metrics"]}


def gap(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
  """The paired comparison of a and b over seeds, JSON-ready."""
  c = statistics.paired(a, b)
  return {"difference": float(c.difference), "ci_low": float(c.ci_low),
          "ci_high": float(c.ci_high), "p_value": float(c.p_value), "n": c.n,
          "seeds_above": int(c.seeds_positive), "a_mean": float(np.mean(a)),
          "b_mean": float(np.mean(b))}


def cell_summary(m, cell, out: str) -> dict[str, Any]:
  """One cell's paired gaps at every checkpoint both arms of every paired seed evaluated."""
  names = {s: (m.arm(cell, m.a) + f"_s{s}", m.arm(cell, m.b) + f"_s{s}") for s in m.seeds}
  seeds, left = paired_seeds(out, names)
  summary = {"factor": cell.factor, "value": cell.value, "seeds": seeds,
             "left_out": {str(s): why for s, why in left.items()},
             "finished": len(seeds) == len(m.seeds), "metrics": dict(cell.metrics),
             "steps": [], "gaps": {}, "log_gaps": {}}
  if len(seeds) < 2:
    return summary
  kl_metric = m.work.kl_metric
  records = {s: [m.work.records(out, n) for n in names[s]] for s in seeds}
  gaps: dict[str, dict[str, Any]] = {}
  steps = None
  for label, metric in [*cell.metrics.items(), (KL, KL)]:
    per_seed = [[_values(r, metric, kl_metric) for r in records[s]] for s in seeds]
    common = sorted(set.intersection(*(set(v) for pair in per_seed for v in pair)))
    steps = common if steps is None else sorted(set(steps) & set(common))
    gaps[label] = {str(step): gap([p[0][step] for p in per_seed], [p[1][step] for p in per_seed])
                   for step in common}
  summary["steps"] = steps
  summary["gaps"] = {label: {k: v for k, v in by_step.items() if int(k) in steps}
                     for label, by_step in gaps.items()}
  if m.log is not None:
    logs = {s: [m.log(store.run_dir(out, n)) for n in names[s]] for s in seeds}
    for metric in m.log_metrics:
      by_step = {}
      for step in m.log_steps:
        pairs = [(logs[s][0].get(step, {}).get(metric), logs[s][1].get(step, {}).get(metric))
                 for s in seeds]
        if all(a is not None and b is not None for a, b in pairs):
          by_step[str(step)] = gap([a for a, _ in pairs], [b for _, b in pairs])
      summary["log_gaps"][metric] = by_step
  return summary


def trainer_log(run_dir: str, window: int = 1) -> dict[int, dict[str, float]]:
  """The trainer's metrics.jsonl (or metrics.jsonl.gz) of a run directory: {step: {metric: value}} (empty without
  one), each value the mean over the `window` logged steps up to the step (fewer at the start;
  a resumed run's repeated steps count once, the last)."""
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.exists(path) and os.path.exists(path + ".gz"):
    path += ".gz"  # as a map's mirror keeps it
  elif not os.path.exists(path):
    return {}
  rows = {}
  with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
    for line in f:
      if line.strip():
        row = json.loads(line)
        rows[int(row["step"])] = {k: float(v) for k, v in row.items()
                                  if isinstance(v, (int, float)) and k != "step"}
  steps = sorted(rows)
  out = {}
  for i, step in enumerate(steps):
    recent = [rows[s] for s in steps[max(0, i - window + 1):i + 1]]
    out[step] = {k: float(np.mean([r[k] for r in recent if k in r])) for k in rows[step]}
  return out


def summarize(m, out: str) -> dict[str, Any]:
  start = m.work.start_record(out) if store.is_published(out, store.START) else None
  return {"map": m.name, "a": m.a, "b": m.b, "seeds": list(m.seeds), "exploratory": True,
          "registration": m.registration, "command": m.command,
          "provenance": store.read_json(os.path.join(out, "provenance.json"), {}),
          "start": start, "cells": {c.name: cell_summary(m, c, out) for c in m.cells}}


def _fmt(g: Mapping[str, Any]) -> str:
  return f"{g['difference']:+.3f} [{g['ci_low']:+.3f}, {g['ci_high']:+.3f}]"


def tables(m, summary: Mapping[str, Any]) -> list[str]:
  """Markdown: the gap at the last checkpoint per cell, then per checkpoint."""
  labels = list(dict.fromkeys(l for c in m.cells for l in c.metrics)) + [KL]
  lines = ["| cell | factor = value | seeds | " + " | ".join(
      f"gap at {l}" for l in labels) + " |", "|" + "---|" * (3 + len(labels))]
  unfinished = []
  for c in m.cells:
    s = summary["cells"][c.name]
    if not s["finished"]:
      unfinished.append(f"{c.name} ({len(s['seeds'])} of {len(m.seeds)} seeds paired)")
      continue
    last = str(s["steps"][-1])
    lines.append(f"| {c.name} | {c.factor} = {c.value} | {len(s['seeds'])} | " + " | ".join(
        _fmt(s["gaps"][l][last]) + f" (p {s['gaps'][l][last]['p_value']:.2f})"
        if l in s["gaps"] else "" for l in labels) + " |")
  steps = sorted({st for c in m.cells for st in summary["cells"][c.name]["steps"]
                  if summary["cells"][c.name]["finished"]})
  along = []
  for c in m.cells:
    s = summary["cells"][c.name]
    if not s["finished"]:
      continue
    for l in [*c.metrics, KL]:
      along.append(f"| {c.name} | {l} | " + " | ".join(
          _fmt(s["gaps"][l][str(st)]) if str(st) in s["gaps"][l] else "" for st in steps) + " |")
  log_steps = [str(st) for st in m.log_steps]
  logs = []
  for c in m.cells:
    s = summary["cells"][c.name]
    for metric, by_step in s["log_gaps"].items() if s["finished"] else ():
      logs.append(f"| {c.name} | {metric} | " + " | ".join(
          _fmt(by_step[st]) if st in by_step else "" for st in log_steps) + " |")
  out = ["## The gap at the last checkpoint", "", *lines, ""]
  if unfinished:
    out += ["Unfinished, not read: " + "; ".join(unfinished) + ".", ""]
  if along:
    out += ["## The gap at every checkpoint", "",
            "| cell | gap at | " + " | ".join(f"step {st}" for st in steps) + " |",
            "|" + "---|" * (2 + len(steps)), *along, ""]
  if logs:
    out += ["## The gap in the training log along training", "",
            "| cell | metric | " + " | ".join(f"step {st}" for st in log_steps) + " |",
            "|" + "---|" * (2 + len(log_steps)), *logs, ""]
  return out


def figures(m, summary: Mapping[str, Any], out: str) -> None:
  """gaps_heatmap.png, factors.png, along_training.png (module docstring)."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  from ksjax.evaluation import plots  # pylint: disable=g-import-not-at-top
  done = [c for c in m.cells if summary["cells"][c.name]["finished"]]
  labels = list(dict.fromkeys(l for c in m.cells for l in c.metrics)) + [KL]
  steps = sorted({st for c in done for st in summary["cells"][c.name]["steps"]})
  # heat maps: cells x checkpoints, one per gap
  fig = Figure(figsize=(1.2 * max(len(steps), 1) * len(labels) + 2, 0.45 * len(m.cells) + 1.5))
  axes = fig.subplots(1, len(labels), squeeze=False)[0]
  for ax, label in zip(axes, labels):
    grid = np.full((len(m.cells), max(len(steps), 1)), np.nan)
    for i, c in enumerate(m.cells):
      s = summary["cells"][c.name]
      for j, st in enumerate(steps):
        g = s["gaps"].get(label, {}).get(str(st)) if s["finished"] else None
        if g:
          grid[i, j] = g["difference"]
          ax.text(j, i, f"{g['difference']:+.3f}\n[{g['ci_low']:+.2f},{g['ci_high']:+.2f}]",
                  ha="center", va="center", fontsize=5)
    bound = np.nanmax(np.abs(grid)) if np.isfinite(grid).any() else 1.0
    ax.imshow(grid, cmap="RdBu", vmin=-bound, vmax=bound, aspect="auto")
    ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=6)
    ax.set_yticks(range(len(m.cells)), [f"{c.name} ({c.factor}={c.value})" for c in m.cells],
                  fontsize=6)
    ax.set_xlabel("step")
    ax.set_title(f"{m.a} - {m.b}: {label}", fontsize="small")
  fig.tight_layout()
  plots.save(fig, os.path.join(out, "gaps_heatmap.png"))
  # small multiples: one panel per factor, gap at the last checkpoint against the value
  factors = list(dict.fromkeys(c.factor for c in m.cells if c.name != m.centre))
  centre = next((c for c in m.cells if c.name == m.centre), None)
  fig = Figure(figsize=(3.2 * max(len(factors), 1), 3.0))
  axes = fig.subplots(1, max(len(factors), 1), squeeze=False)[0]
  for ax, factor in zip(axes, factors):
    label_at = {m.centre: m.centre_at.get(factor, ("centre", 0.0))}  # the centre's own
    members = sorted(([centre] if centre else []) + [c for c in m.cells if c.factor == factor],
                     key=lambda c: label_at[c.name][1] if c.name in label_at else c.rank)
    for offset, label in enumerate(labels[:-1]):
      xs, ys, lo, hi = [], [], [], []
      for x, c in enumerate(members):
        s = summary["cells"][c.name]
        if not s["finished"] or label not in s["gaps"]:
          continue
        g = s["gaps"][label][str(s["steps"][-1])]
        xs.append(x + 0.1 * offset)
        ys.append(g["difference"])
        lo.append(g["difference"] - g["ci_low"])
        hi.append(g["ci_high"] - g["difference"])
      ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=3, label=label, color=f"C{offset}")
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.set_xticks(range(len(members)), [label_at[c.name][0] if c.name in label_at else c.value
                                         for c in members], fontsize=7, rotation=30)
    ax.set_title(factor, fontsize="small")
    ax.set_ylabel(f"{m.a} - {m.b}, last checkpoint")
  axes[0].legend(fontsize="x-small")
  fig.tight_layout()
  plots.save(fig, os.path.join(out, "factors.png"))
  # the gap along training, every finished cell
  fig = Figure(figsize=(3.2 * len(labels), 3.0))
  axes = fig.subplots(1, len(labels), squeeze=False)[0]
  for ax, label in zip(axes, labels):
    for i, c in enumerate(done):
      s = summary["cells"][c.name]
      by_step = s["gaps"].get(label, {})
      xs = [int(st) for st in by_step]
      ax.plot(xs, [g["difference"] for g in by_step.values()], marker=".", color=f"C{i % 10}",
              label=c.name)
      ax.fill_between(xs, [g["ci_low"] for g in by_step.values()],
                      [g["ci_high"] for g in by_step.values()], color=f"C{i % 10}", alpha=0.1)
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.set_xlabel("step")
    ax.set_title(f"{m.a} - {m.b}: {label}", fontsize="small")
  axes[0].legend(fontsize="xx-small")
  fig.tight_layout()
  plots.save(fig, os.path.join(out, "along_training.png"))


def publish(m, out: str) -> str:
  """Writes the report files (REPORT_FILES) from what is published in `out`; returns the
  last-checkpoint table. Nothing is written where nothing is published."""
  if not os.path.isdir(os.path.join(out, "runs")):
    return "(nothing published yet)"
  summary = summarize(m, out)
  store.write_json(os.path.join(out, "summary.json"), summary)
  figures(m, summary, out)
  finished = sum(s["finished"] for s in summary["cells"].values())
  provenance = summary["provenance"]
  lines = [f"# {m.title}", "",
           f"**Exploratory** (registered as such in `{m.registration}`): every number is a paired "
           f"difference over seeds, {m.a} minus {m.b}, with its 95% t interval and p; no "
           "statement is judged and none is called supported. "
           f"{finished} of {len(m.cells)} cells are finished"
           + (" (the others are not read)." if finished < len(m.cells) else "."), "",
           f"Produced by `{m.command}` from the published records"
           + (f"; the runs trained at ksjax commit `{str(provenance.get('commit'))[:7]}` on "
              f"{provenance.get('machine')}" if provenance.get("commit") else "") + ".", "",
           m.setup, ""]
  start = summary["start"] or {}
  if start.get("groups"):
    lines += ["The start (step 0, held-out): " + "; ".join(
        f"{group}: " + ", ".join(f"{k} {v:.3f}" for k, v in values.items() if k in (
            "pass@1", "pass@4", "pass@64")) for group, values in sorted(start["groups"].items()))
              + ".", ""]
  lines += tables(m, summary)
  if m.notes:
    lines += [m.notes, ""]
  lines += ["Figures: `gaps_heatmap.png` (cells by checkpoints), `factors.png` (one panel per "
            "factor, the last checkpoint), `along_training.png`; every number: `summary.json`."]
  files.write_text(os.path.join(out, "README.md"), "\n".join(lines).rstrip("\n") + "\n")
  text = tables(m, summary)
  return "\n".join(text[2:text.index("", 2)])  # the last checkpoint's table
