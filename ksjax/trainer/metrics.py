"""What a run shows: per-step scalars to TensorBoard and JSONL, and a console progress bar.

`MetricsWriter` writes every step's scalars to `<workdir>/metrics.jsonl` (one JSON object per
line, `{"step": s, "name": value, ...}`) and to TensorBoard event files in `<workdir>/tensorboard`
(tensorboardX, no TensorFlow, and no PyTorch: `_summary_writer`). On resume the JSONL is cut back
to the restored step, so a run killed and resumed has each step once. Only JAX process 0 writes.
A line that a full disk stops half-way is cut off again, and the failure raised as
`ksjax.files.DiskFull`, one line with the line's size.

`ProgressBar` is tqdm with the run's headline numbers in its postfix; its ETA comes from tqdm's
smoothed rate.

`weight_noise` says how much signal and noise a step's k-sample weights carry (`advantage/*`), so
that estimators and objectives can be compared by what a sample buys rather than by reward.

`CompileCounter` counts XLA compilations and their seconds (JAX's own monitoring events), in all and
per program, so that each step logs `compile/count`, `compile/seconds` and `compile/cache_hits`
(those read from the persistent compilation cache), and a run ends with one line naming the
programs that took the time: a run whose shapes are bucketed well compiles in its first steps
only, a step that compiles again shows it, and a program compiled many times is named.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import threading
from collections.abc import Mapping

import jax
import jax.monitoring
import numpy as np
import tqdm

from ksjax import files
from ksjax.run.directory import RunDirectory


# JAX records this event once per XLA compilation, with its seconds and the program's name
# (`fun_name`, e.g. "jit(update)"; jax/_src/dispatch.py, interpreters/pxla.py). A program read
# from the persistent compilation cache records it too, with the seconds of the read, after
# CACHE_HIT_EVENT on the same thread (jax/_src/compiler.py `compile_or_get_cached`).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass
class Compiled:
  """Compilations of one program (or of all): how many, their seconds, and how many of them were
  read from the persistent compilation cache."""
  count: int = 0
  seconds: float = 0.0
  cache_hits: int = 0

  def add(self, seconds: float, hit: bool) -> None:
    self.count += 1
    self.seconds += seconds
    self.cache_hits += int(hit)

  def minus(self, other: "Compiled") -> "Compiled":
    return Compiled(self.count - other.count, self.seconds - other.seconds,
                    self.cache_hits - other.cache_hits)


def program_name(fun_name: str) -> str:
  """The function's own name: "jit(update)" -> "update"."""
  match = re.fullmatch(r"\w+\((.*)\)", fun_name)
  return match.group(1) if match else fun_name


class CompileCounter:
  """Counts XLA compilations in this process from the moment it is made, in all and per program
  (JAX's listeners cannot be removed one by one, so the listeners are registered once per process
  and feed every counter).

  A compilation served by the persistent compilation cache (`ksjax.compilation_cache`) counts as
  one, with the seconds of its read, and as a cache hit: so a run whose programs all come from the
  cache still shows how many it built, and how few seconds that took.
  """

  _lock = threading.Lock()
  _total = Compiled()
  _programs: dict[str, Compiled] = {}
  _hit = threading.local()  # a cache hit seen on this thread, for its compile event to come
  _registered = False

  def __init__(self):
    with CompileCounter._lock:
      if not CompileCounter._registered:
        jax.monitoring.register_event_listener(CompileCounter._record_hit)
        jax.monitoring.register_event_duration_secs_listener(CompileCounter._record)
        CompileCounter._registered = True
      self._base = dataclasses.replace(CompileCounter._total)  # for `take`
      self._start = dataclasses.replace(CompileCounter._total)  # for `programs` and `summary`
      self._start_programs = {name: dataclasses.replace(c)
                              for name, c in CompileCounter._programs.items()}

  @staticmethod
  def _record_hit(event: str, **_) -> None:
    if event == CACHE_HIT_EVENT:
      CompileCounter._hit.seen = True

  @staticmethod
  def _record(event: str, seconds: float, **kwargs) -> None:
    if event != BACKEND_COMPILE_EVENT:
      return
    hit = getattr(CompileCounter._hit, "seen", False)
    CompileCounter._hit.seen = False
    name = program_name(str(kwargs.get("fun_name", "?")))
    with CompileCounter._lock:
      CompileCounter._total.add(seconds, hit)
      CompileCounter._programs.setdefault(name, Compiled()).add(seconds, hit)

  def take(self) -> dict[str, float]:
    """Compilations, their seconds and the cache hits among them since the last `take` (or since
    construction): a step's `compile/*` scalars."""
    with CompileCounter._lock:
      now = dataclasses.replace(CompileCounter._total)
    step = now.minus(self._base)
    self._base = now
    return {"compile/count": float(step.count), "compile/seconds": step.seconds,
            "compile/cache_hits": float(step.cache_hits)}

  def total(self) -> Compiled:
    """All compilations since construction."""
    with CompileCounter._lock:
      return CompileCounter._total.minus(self._start)

  def programs(self) -> dict[str, Compiled]:
    """Compilations per program since construction (programs that compiled at all)."""
    with CompileCounter._lock:
      now = {name: c.minus(self._start_programs.get(name, Compiled()))
             for name, c in CompileCounter._programs.items()}
    return {name: c for name, c in now.items() if c.count}

  def summary(self, most: int = 4) -> str:
    """One line for the end of a run: programs, compilations (those read from the persistent
    cache), seconds, and the `most` programs that took the most seconds, with their counts; a
    program compiled more than once is one whose shapes changed (e.g. a new row bucket)."""
    total, programs = self.total(), self.programs()
    line = f"compiled: {len(programs)} programs, {total.count} compilations"
    if total.cache_hits:
      line += f" ({total.cache_hits} read from the persistent cache)"
    line += f", {total.seconds:.1f} s"
    ranked = sorted(programs.items(), key=lambda item: (-item[1].seconds, item[0]))
    shown = [f"{name} {c.count}x {c.seconds:.1f} s" for name, c in ranked[:most]]
    if len(ranked) > most:
      shown.append(f"{len(ranked) - most} more")
    return line + (f" ({', '.join(shown)})" if shown else "")


def weight_noise(advantage_bn: np.ndarray) -> dict[str, float]:
  """The step's k-sample weights [B, n], per group (prompt).

  A group's gradient estimate is sum_i w_i grad log pi(y_i); with score vectors that are nearly
  uncorrelated and of similar size, its noise grows with sum_i w_i^2, and a group whose weights
  are all 0 adds nothing but the cost of its samples. So:
    advantage/signal_groups: the share of groups with a non-zero weight (exactly 0 is none, the
      rule dynamic sampling and sparse updates use);
    advantage/group_variance: the variance of the weights within a group (over its n samples),
      averaged over all groups; advantage/signal_group_variance: over the groups with signal
      only, so that a sparse estimator is not flattered by its empty groups (0 with none);
    advantage/square_mean: the mean squared weight, the per-sample noise scale of the gradient.
  Compare them at equal n and with the rewards on one scale; they change with the policy.
  """
  weights_bn = np.asarray(advantage_bn, np.float64)  # a step samples B >= 1 groups
  signal_b = np.any(weights_bn != 0, axis=1)
  variance_b = weights_bn.var(axis=1)
  with_signal = float(variance_b[signal_b].mean()) if signal_b.any() else 0.0
  return {"advantage/signal_groups": float(signal_b.mean()),
          "advantage/group_variance": float(variance_b.mean()),
          "advantage/signal_group_variance": with_signal,
          "advantage/square_mean": float(np.mean(np.square(weights_bn)))}


def _is_writer() -> bool:
  return jax.process_index() == 0


def _summary_writer(logdir: str):
  """tensorboardX's SummaryWriter, imported without PyTorch.

  tensorboardX imports torch whenever it is installed (only to accept torch tensors, which ksjax
  never passes), and researchers' environments usually have it: the trainer then held PyTorch in
  its resident memory for the whole run and waited for its import at start-up (the figures:
  docs/benchmarks.md, "A run's peak memory"). So torch is hidden from tensorboardX's first
  import, unless this process has already imported torch itself (a test comparing against it),
  which is then left as it is.
  """
  hide = "torch" not in sys.modules
  if hide:
    sys.modules["torch"] = None  # `import torch` raises ImportError while this is set
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
  finally:
    if hide:
      del sys.modules["torch"]
  return SummaryWriter(logdir, flush_secs=30)


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
    self._tb = _summary_writer(run.tensorboard_dir)

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    if self._tb is None:
      return
    clean = {k: float(v) for k, v in scalars.items()}
    line = (json.dumps({"step": step, **{k: _json_number(v) for k, v in clean.items()}})
            + "\n").encode("utf-8")
    # Unbuffered, so that a failed write leaves nothing to be flushed at close.
    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
      before = os.lseek(fd, 0, os.SEEK_END)
      try:
        view = memoryview(line)
        while view:
          view = view[os.write(fd, view):]
      except OSError as e:
        os.ftruncate(fd, before)  # no half line: the log ends with the last whole step
        full = files.disk_full(f"writing step {step}'s line of the step log {self.path}", e,
                                needs=len(line), where=self.path,
                                left="the log ends with the step before it")
        if full is None:
          raise
        raise full from None
    finally:
      os.close(fd)
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
