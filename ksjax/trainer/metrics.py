"""What a run shows: per-step scalars to TensorBoard and JSONL, and a console progress bar.

`MetricsWriter` writes every step's scalars to `<workdir>/metrics.jsonl` (one JSON object per
line, `{"step": s, "name": value, ...}`) and to TensorBoard event files in `<workdir>/tensorboard`
(tensorboardX, no TensorFlow). On resume the JSONL is cut back to the restored step, so a run
killed and resumed has each step once. Only JAX process 0 writes.

`ProgressBar` is tqdm with the run's headline numbers in its postfix; its ETA comes from tqdm's
smoothed rate.

`CompileCounter` counts XLA compilations and their seconds (JAX's own monitoring events), so that
each step logs `compile/count` and `compile/seconds`: a run whose shapes are bucketed well compiles
in its first steps only, and a step that compiles again shows it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping

import threading

import jax
import jax.monitoring
import tqdm
from tensorboardX import SummaryWriter

from ksjax import files
from ksjax.run.directory import RunDirectory


# JAX records this event once per XLA compilation, with its seconds (jax/_src/dispatch.py).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
  """Counts XLA compilations in this process from the moment it is made (JAX's listeners cannot be
  removed one by one, so the listener is registered once per process and feeds every counter)."""

  _lock = threading.Lock()
  _count = 0
  _seconds = 0.0
  _registered = False

  def __init__(self):
    with CompileCounter._lock:
      if not CompileCounter._registered:
        jax.monitoring.register_event_duration_secs_listener(CompileCounter._record)
        CompileCounter._registered = True
      self._base = (CompileCounter._count, CompileCounter._seconds)

  @staticmethod
  def _record(event: str, seconds: float, **_) -> None:
    if event == BACKEND_COMPILE_EVENT:
      with CompileCounter._lock:
        CompileCounter._count += 1
        CompileCounter._seconds += seconds

  def take(self) -> dict[str, float]:
    """Compilations and their seconds since the last `take` (or since construction)."""
    with CompileCounter._lock:
      now = (CompileCounter._count, CompileCounter._seconds)
    count, seconds = now[0] - self._base[0], now[1] - self._base[1]
    self._base = now
    return {"compile/count": float(count), "compile/seconds": seconds}


def _is_writer() -> bool:
  return jax.process_index() == 0


class MetricsWriter:
  """Scalars per step to JSONL and TensorBoard."""

  def __init__(self, run: RunDirectory, *, resume_step: int | None = None):
    self.path = run.metrics_jsonl
    self._tb = None
    if not _is_writer():
      return
    os.makedirs(run.workdir, exist_ok=True)
    if resume_step is not None:
      truncate_jsonl(self.path, resume_step)
    elif os.path.exists(self.path):
      os.remove(self.path)
    self._tb = SummaryWriter(run.tensorboard_dir, flush_secs=30)

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    if self._tb is None:
      return
    clean = {k: float(v) for k, v in scalars.items()}
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(json.dumps({"step": step, **{k: _json_number(v) for k, v in clean.items()}}) + "\n")
    for name, value in clean.items():
      self._tb.add_scalar(name, value, step)

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


def _json_number(x: float):
  """JSON has no NaN/inf; they are written as strings so that the line stays valid JSON."""
  return x if math.isfinite(x) else str(x)


def truncate_jsonl(path: str, last_step: int) -> None:
  """Keeps the lines of `path` with step <= last_step (atomic rewrite)."""
  if not os.path.exists(path):
    return
  kept = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        if json.loads(line)["step"] <= last_step:
          kept.append(line if line.endswith("\n") else line + "\n")
      except (ValueError, KeyError, TypeError):
        continue  # a line cut off by a kill
  files.write_text(path, "".join(kept))


def read_jsonl(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


class ProgressBar:
  """tqdm over the RL steps, showing the headline numbers of the last step."""

  HEADLINE = (("reward", "reward/mean"), ("pass@k", "batch/pass_at_k"), ("kl", "kl/k3"),
              ("nz_adv", "advantage/nonzero_fraction"), ("tok/s", "throughput/tokens_per_s"))

  def __init__(self, total: int, initial: int, *, enabled: bool = True):
    self._bar = tqdm.tqdm(total=total, initial=initial, desc="train", unit="step",
                          disable=not (enabled and _is_writer()), dynamic_ncols=True,
                          mininterval=1.0)

  def update(self, scalars: Mapping[str, float]) -> None:
    post = {}
    for label, key in self.HEADLINE:
      if key in scalars:
        post[label] = f"{scalars[key]:.3g}"
    self._bar.set_postfix(post, refresh=False)
    self._bar.update(1)

  def close(self) -> None:
    self._bar.close()


def logged_value(path: str, step: int, name: str) -> float | None:
  """The value of `name` on step `step`'s line of the step log, or None when there is none."""
  if not os.path.exists(path):
    return None
  value = None
  for row in read_jsonl(path):
    if row.get("step") == step and name in row:
      value = row[name]
  return None if value is None else float(value)
