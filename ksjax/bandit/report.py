"""The bandit study's outputs: a CSV of curves, a three-panel figure, the config, a variance table.

Every file is written to a temporary name in the destination folder and renamed into place, so a
run that dies leaves either the previous file or the new one, never half of one.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np

from ksjax.files import atomic_write

CURVE_COLUMNS = ("step", "variant", "mean_reward", "mean_reward_std", "pass_at_k", "pass_at_k_std",
                 "kl", "kl_std")


def curves_csv(curves: Mapping[str, Mapping[str, np.ndarray]]) -> str:
  """CSV text: one row per (variant, step) with mean and std across seeds of every metric.

  Args:
    curves: variant key -> {"mean_reward"|"pass_at_k"|"kl": [S, T] array}.
  """
  out = io.StringIO()
  writer = csv.writer(out, lineterminator="\n")
  writer.writerow(CURVE_COLUMNS)
  for key, metrics in curves.items():
    stats = {name: (values.mean(0), values.std(0)) for name, values in metrics.items()}
    for step in range(metrics["kl"].shape[1]):
      row = [step, key]
      for name in ("mean_reward", "pass_at_k", "kl"):
        row += [f"{stats[name][0][step]:.6g}", f"{stats[name][1][step]:.6g}"]
      writer.writerow(row)
  return out.getvalue()


def plot_curves(path: str, curves: Mapping[str, Mapping[str, np.ndarray]],
                labels: Mapping[str, str], *, k: int, best_reward: float, title: str) -> None:
  """Three panels (mean reward vs step, mean reward vs KL, pass@k vs step) of seed means.

  Bands are +-1 standard error of the seed mean (vertical only in the middle panel). The std across
  seeds (in the CSV) is mostly the spread of the bandits' best rewards, which would hide every
  difference between estimators; the standard error shows which differences are real.
  """
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.4), constrained_layout=True)
  for key, metrics in curves.items():
    mean_r, passk, kl = (metrics[name] for name in ("mean_reward", "pass_at_k", "kl"))
    steps = np.arange(kl.shape[1])
    panels = ((axes[0], steps, mean_r), (axes[1], kl.mean(0), mean_r), (axes[2], steps, passk))
    for ax, x, y in panels:
      line, = ax.plot(x, y.mean(0), label=labels[key], lw=1.6)
      stderr = y.std(0, ddof=1) / np.sqrt(y.shape[0]) if y.shape[0] > 1 else np.zeros_like(y[0])
      ax.fill_between(x, y.mean(0) - stderr, y.mean(0) + stderr, color=line.get_color(), alpha=0.2,
                      lw=0)
  for ax in axes:
    ax.axhline(best_reward, color="gray", ls=":", lw=1, label="best action (seed mean)")
    ax.grid(alpha=0.3)
  last_step = next(iter(curves.values()))["kl"].shape[1] - 1
  for ax in (axes[0], axes[2]):
    ax.set_xscale("symlog", linthresh=10)  # linear to step 10, logarithmic after
    ax.set_xlim(0, last_step)
  axes[0].set(xlabel="step", ylabel="mean reward  E_pi[r]", title="mean reward vs step")
  axes[1].set(xlabel="KL(pi || pi_ref)", ylabel="mean reward  E_pi[r]", title="mean reward vs KL")
  axes[2].set(xlabel="step", ylabel=f"pass@{k}  E[max of {k}]", title=f"pass@{k} vs step")
  axes[2].legend(loc="lower right", fontsize=8)
  fig.suptitle(title, fontsize=10)
  atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
  plt.close(fig)


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
  """A fixed-width text table, columns left-aligned."""
  widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
  lines = [header, ["-" * w for w in widths], *rows]
  return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip()
                   for line in lines) + "\n"
