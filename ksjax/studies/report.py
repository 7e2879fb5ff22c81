"""A study's published report: summary.json, table.md, the figures and README.md.

Everything here is a function of the published records, the marks and provenance.json, so the
same command regenerates the same bytes. summary.json is written first and README.md last: a
study stopped in between publishes again on its next run.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ksjax import files
from ksjax.studies import analysis
from ksjax.studies import jobs
from ksjax.studies import store


def _label(study, arm: str) -> list[str]:
  return list(study.report.labels.get(arm, (arm,)))


def table(study, data: Mapping[str, Any], arms: Sequence[str]) -> str:
  """Markdown: the declared metrics per arm at the last checkpoint, mean ± std over seeds."""
  r = study.report
  cols = list(r.columns)
  head = "| " + " | ".join(r.label_columns) + " | " + " | ".join(cols) + " |"
  lines = [head, "|" + "---|" * (len(cols) + len(r.label_columns))]
  start = data["curves"][next(iter(data["curves"]))][0]
  lines.append("| " + " | ".join(r.start_label) + " | " + " | ".join(
      f"{start['metrics'][c][0]:.3f}" if c != "kl" else "0" for c in cols) + " |")
  for arm in arms:
    values = data["final"][f"{study.prefix}{arm}"]
    cells = ["{:.3f} ± {:.3f}".format(*analysis.mean_std(values[c])) for c in cols]
    lines.append("| " + " | ".join(_label(study, arm)) + " | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def figures(study, data: Mapping[str, Any], arms: Sequence[str], out: str, ks: Sequence[int]
            ) -> list[str]:
  """metric vs step (seed means, the band min-max over seeds), metric vs KL (seed means of both),
  pass@k vs k at the last checkpoint (seed means)."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  from ksjax.evaluation import plots  # pylint: disable=g-import-not-at-top

  shown = list(study.report.figure_metrics)
  colors = dict(zip(arms, [f"C{i}" for i in range(len(arms))]))
  prefix = f"{study.report.figure_prefix}: " if study.report.figure_prefix else ""
  paths = []
  for name, draw in (("metrics_vs_step.png", plots.metric_vs_step),
                     ("metrics_vs_kl.png", plots.metric_vs_kl)):
    fig = Figure(figsize=(3.4 * len(shown), 3.0))
    axes = fig.subplots(1, len(shown), squeeze=False)
    for col, metric in enumerate(shown):
      ax = axes[0][col]
      for arm in arms:
        runs = data["curves"][f"{study.prefix}{arm}"]
        x = np.mean([r["steps" if draw is plots.metric_vs_step else "kl"] for r in runs], 0)
        y = np.asarray([r["metrics"][metric] for r in runs])
        draw(ax, x, y.mean(0), _label(study, arm)[-1], metric=metric, color=colors[arm])
        if draw is plots.metric_vs_step:  # against KL, x differs per seed: no band
          ax.fill_between(x, y.min(0), y.max(0), color=colors[arm], alpha=0.12)
      ax.set_title(f"{prefix}{metric}", fontsize="medium")
    axes[0][0].legend(fontsize="x-small")
    fig.tight_layout()
    paths.append(os.path.join(out, name))
    plots.save(fig, paths[-1])
  fig = Figure(figsize=(5.0, 3.6))
  ax = fig.subplots(1, 1, squeeze=False)[0][0]
  for arm in arms:
    values = data["final"][f"{study.prefix}{arm}"]
    plots.pass_at_k_curve(ax, ks, [np.mean(values[f"pass@{x}"]) for x in ks],
                          _label(study, arm)[-1], color=colors[arm])
  plots.pass_at_k_curve(ax, ks, [data["start"]["metrics"][f"pass@{x}"] for x in ks], "start",
                        color="black", linestyle="--")
  ax.set_ylabel("pass@k (last checkpoint, mean over seeds)")
  ax.set_title(study.report.ks_title, fontsize="medium")
  ax.legend(fontsize="x-small")
  fig.tight_layout()
  paths.append(os.path.join(out, "pass_at_k_vs_k.png"))
  plots.save(fig, paths[-1])
  return paths


def _produced(study, provenance: Mapping[str, Any]) -> str:
  return (f"Produced by `{study.command}` (every file in this directory; regenerate with the same "
          "command, which trains nothing when the runs' records are here)"
          + (f" at ksjax commit `{provenance['commit'][:7]}`"
             + (" with uncommitted changes" if provenance.get("uncommitted_changes") else "")
             + (f" on {provenance['machine']}" if provenance.get("machine") else "")
             + "".join(f", resumed on {m}" for m in provenance.get("resumed_on", []))
             + ("" if not provenance.get("resumed_at") else ", resumed at "
                + ", ".join(f"`{c[:7]}`" for c in provenance["resumed_at"]))
             if provenance.get("commit") else "")
          + ". Floating-point results depend on the code and the CPU, so an exact regeneration "
          "of the runs needs that commit and machine.")


def publish(study, out: str, runs, arms: Sequence[str], seeds: Sequence[int], data, verdicts,
            ks: Sequence[int], workers: int) -> str:
  """Writes summary.json, table.md, the figures and README.md; returns the table."""
  table_text = table(study, data, arms)
  timing = store.read_json(os.path.join(out, "timing.json"), {})
  provenance = store.read_json(os.path.join(out, "provenance.json"), {})
  settings = dict(study.settings)
  if list(seeds) != list(study.seeds):
    settings["seeds"] = list(seeds)
  summary = {"study": settings, "command": study.command, "provenance": provenance,
             "timing": timing, "runs": {r.name: store.read_mark(out, r.name) for r in runs},
             "statements": verdicts["rows"], "registration": verdicts["registration"],
             "departures": verdicts["departures"], "power": verdicts["power"],
             "final": data["final"], "curves": data["curves"],
             "start": data["start"]["metrics"]}
  if verdicts["left_out"]:
    summary["left_out"] = {i: {str(s): why for s, why in seeds_.items()}
                           for i, seeds_ in verdicts["left_out"].items()}
  store.write_json(os.path.join(out, "summary.json"), summary)
  jobs.maybe_stop("report")
  files.write_text(os.path.join(out, "table.md"), table_text + "\n")
  figures(study, data, arms, out, ks)
  power = verdicts["power"]
  lines = [f"# {study.report.title}", "", _produced(study, provenance), "", study.report.setup,
           "", "## Last checkpoint (mean ± std over seeds)", "", table_text, ""]
  if study.report.table_note:
    lines += [study.report.table_note, ""]
  lines += ["## Statements", "", verdicts["line"], "",
            ("Every statement was judged as pre-registered in "
             f"`{study.registration}`: paired t-test over seeds, two-sided, Holm across the "
             "primary statements." if verdicts["registered"] else
             f"**Exploratory:** this study does not run as registered in `{study.registration}`"
             + (f" ({'; '.join(verdicts['departures'])})" if verdicts["departures"] else "")
             + ", so no statement is called supported."), "", verdicts["table"], ""]
  for statement, left in verdicts["left_out"].items():
    lines += [f"{statement} leaves out " + "; ".join(
        f"seed {s} ({why})" for s, why in left.items()) + ": a seed is paired only where both "
        "of its runs were published from one machine.", ""]
  if power:
    lines += [f"Power: with {power['seeds']} seeds and the observed between-seed sd of the "
              f"{power['statement']} difference ({power['sd_of_differences']:.4f}), the paired "
              f"test detects a difference of {power['minimum_detectable_effect']:.4f} with 80% "
              "power at alpha 0.05; smaller true differences may go unseen.", ""]
  total = sum(timing.values())
  lines += ["## Time", "",
            f"Wall time {total / 60:.1f} min ("
            + ", ".join(f"{k} {v / 60:.1f} min" for k, v in sorted(timing.items())) + ") with "
            f"{workers} worker process(es).", ""]
  if study.report.files_note:
    lines += [study.report.files_note]
  files.write_text(os.path.join(out, "README.md"), "\n".join(lines).rstrip("\n") + "\n")
  return table_text
