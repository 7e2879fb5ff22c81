"""The paper's evaluation figures, drawn with matplotlib on Axes the caller owns.

The drawing functions take an Axes and plain sequences so that the eval binary (which saves
PNGs next to its results) and experiments/analysis.ipynb (which lays out its own figures) draw
the same curves the same way:
  * pass_at_k_curve: pass@k (or maj@k) against k, k on a log axis, one line per checkpoint
    (the eval binary's ks default to the ladder 1, 2, 4, ..., n, evenly spaced on that axis);
  * metric_vs_step: a metric against the training step;
  * metric_vs_kl: a metric against the KL to the reference policy (the paper's trade-off plot).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

# Figure objects, not pyplot: the files need no backend and no global state, and importing this
# module in a notebook leaves its inline backend alone.
from matplotlib import ticker
from matplotlib.figure import Figure

from ksjax import files

PASS_AT_K_PNG = "pass_at_k.png"
METRICS_PNG = "metrics_vs_step.png"


def pass_at_k_curve(ax, ks: Sequence[int], values: Sequence[float], label: str | None = None,
                    **style: Any) -> None:
  """One curve; the k ticks are every k drawn on `ax` so far (curves may have different ks)."""
  ax.plot(list(ks), list(values), marker="o", label=label, **style)
  ax.set_xscale("log")
  drawn = sorted({int(round(x)) for line in ax.get_lines() for x in line.get_xdata()})
  ax.set_xticks(drawn, [str(k) for k in drawn])
  ax.minorticks_off()
  ax.set_xlabel("k")
  ax.set_ylim(-0.02, 1.02)
  ax.grid(True, alpha=0.3)


def metric_vs_step(ax, steps: Sequence[float], values: Sequence[float], label: str | None = None,
                   *, metric: str = "", **style: Any) -> None:
  ax.plot(list(steps), list(values), marker="o" if len(steps) < 30 else None, label=label,
          **style)
  ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
  ax.set_xlabel("training step")
  ax.set_ylabel(metric)
  ax.grid(True, alpha=0.3)


def metric_vs_kl(ax, kl: Sequence[float], values: Sequence[float], label: str | None = None,
                 *, metric: str = "", **style: Any) -> None:
  ax.plot(list(kl), list(values), marker=".", label=label, **style)
  ax.set_xlabel("KL(policy || reference)")
  ax.set_ylabel(metric)
  ax.grid(True, alpha=0.3)


def save(fig: Figure, path: str) -> None:
  """Saves `fig` as PNG atomically (temporary file, then rename)."""
  files.atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, bbox_inches="tight",
                                                   format="png"))


def pass_at_k_figure(records: Sequence[Mapping[str, Any]], path: str) -> None:
  """pass@k and maj@k against k, one line per evaluated checkpoint (each with its own ks): the
  large-k diagnostic, where training that sharpens the policy shows as curves that cross."""
  fig = Figure(figsize=(10, 4))
  left, right = fig.subplots(1, 2, sharey=True)
  for record in records:
    ks = record["ks"]
    label = f"step {record['step']}"
    pass_at_k_curve(left, ks, [record["metrics"][f"pass@{k}"] for k in ks], label)
    pass_at_k_curve(right, ks, [record["metrics"][f"maj@{k}"] for k in ks], label)
  left.set_ylabel("pass@k")
  right.set_ylabel("maj@k")
  n = records[0]["num_samples"]
  fig.suptitle(f"{records[0]['sampling']['split']}: unbiased estimates from {n} samples per "
               "problem")
  left.legend(fontsize="small")
  save(fig, path)


def metrics_figure(records: Sequence[Mapping[str, Any]], path: str) -> None:
  """Each metric every record has against the training step, one panel per metric (the
  diversity's included)."""
  names = [m for m in records[0]["metrics"] if all(m in r["metrics"] for r in records)]
  cols = min(4, len(names))
  rows = -(-len(names) // cols)
  fig = Figure(figsize=(3.2 * cols, 2.6 * rows))
  axes = fig.subplots(rows, cols, squeeze=False)
  steps = [r["step"] for r in records]
  for ax, name in zip(axes.flat, names):
    metric_vs_step(ax, steps, [r["metrics"][name] for r in records], metric=name)
  for ax in list(axes.flat)[len(names):]:
    ax.set_visible(False)
  fig.tight_layout()
  save(fig, path)


def save_figures(output_dir: str, records: Sequence[Mapping[str, Any]]) -> list[str]:
  paths = [os.path.join(output_dir, PASS_AT_K_PNG), os.path.join(output_dir, METRICS_PNG)]
  pass_at_k_figure(records, paths[0])
  metrics_figure(records, paths[1])
  return paths
