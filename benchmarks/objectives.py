"""Time of jitted `k_sample_advantages` for G groups of n samples per aggregator, and growth in n.

  python benchmarks/objectives.py [--groups=256] [--sizes=4,16,64,256] [--reps=7]

Each row is one (aggregator, baseline, k) configuration timed at every n, on the default device
(CPU here): the median over --reps of the mean time per call, after compilation. Beside it, in the
same run, the time of a jitted `jnp.sort` of the same [G, n] rewards, the floor of any sort-based
closed form, so the ratio stays meaningful on a shared, noisy machine where absolute times do not.
The growth exponent is the least-squares slope of log(time) against log(n) over n >= 16 (at n = 4
dispatch overhead dominates); n log n would read 1.25 over 16..256, n^2 2.0.

majority_vote and softmax enumerate subsets, so with k = 4 they are timed only while C(n, 4) is
within `MAX_SUBSETS` (n <= 16 at the default sizes); with k = n they need the group and its n
leave-one-outs, O(n^2) work per group.
"""

from __future__ import annotations

import functools
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from ksjax import objectives

_GROUPS = flags.DEFINE_integer("groups", 256, "Groups (prompts) per call.")
_SIZES = flags.DEFINE_list("sizes", ["4", "16", "64", "256"], "Samples per group, n.")
_REPS = flags.DEFINE_integer("reps", 7, "Timed repetitions (median reported).")

# (aggregator, baseline, k or None for k = n, p or None for k // 2)
CONFIGS = [
    ("mean", "loo", None, 1),
    ("mean", "none", 4, 1),
    ("pass_at_k", "loo", None, 1),
    ("pass_at_k", "loo", 4, 1),
    ("pass_at_k", "leave_p_out", None, None),
    ("majority_vote", "loo", None, 1),
    ("majority_vote", "loo", 4, 1),
    ("softmax", "loo", None, 1),
    ("softmax", "loo", 4, 1),
]


def _seconds_per_call(fn, *args, **kwargs) -> float:
  call = lambda: jax.block_until_ready(fn(*args, **kwargs))
  call()  # Compile.
  number, elapsed = 1, 0.0
  while elapsed < 0.02:  # Calls per repetition: enough for ~20 ms.
    number *= 2
    start = time.perf_counter()
    for _ in range(number):
      call()
    elapsed = time.perf_counter() - start
  times = []
  for _ in range(_REPS.value):
    start = time.perf_counter()
    for _ in range(number):
      call()
    times.append((time.perf_counter() - start) / number)
  return statistics.median(times)


def _allowed(aggregator: str, n: int, k: int) -> bool:
  return aggregator in ("mean", "pass_at_k") or math.comb(n, k) <= objectives.MAX_SUBSETS


def _slope(sizes: list[int], seconds: list[float]) -> float:
  points = [(math.log(n), math.log(s)) for n, s in zip(sizes, seconds) if n >= 16 and s == s]
  if len(points) < 2:
    return math.nan
  x, y = np.array(points).T
  return float(np.polyfit(x, y, 1)[0])


def main(argv):
  del argv
  sizes = [int(s) for s in _SIZES.value]
  groups = _GROUPS.value
  rng = np.random.default_rng(0)
  data = {}
  for n in sizes:
    answers = rng.integers(0, 4, size=(groups, n)).astype(np.int32)
    rewards = np.array([1.0, -1.0, 0.5, -1.0], np.float32)[answers] + np.float32(0.01) * rng.normal(
        size=(groups, n)).astype(np.float32)
    data[n] = (jax.device_put(rewards), jax.device_put(answers))

  print(f"device: {jax.devices()[0].device_kind}, G = {groups}, float32; "
        "time per call in microseconds")
  sort = jax.jit(functools.partial(jnp.sort, axis=-1))
  sort_times = [_seconds_per_call(sort, data[n][0]) for n in sizes]
  print(f"{'configuration':<34}" + "".join(f"{'n=' + str(n):>18}" for n in sizes)
        + f"{'exponent':>10}")
  print(f"{'jnp.sort (reference)':<34}" + "".join(f"{t * 1e6:>18.1f}" for t in sort_times)
        + f"{_slope(sizes, sort_times):>10.2f}")
  for aggregator, baseline, k, p in CONFIGS:
    label = f"{aggregator} {baseline} k={'n' if k is None else k}"
    if baseline == "leave_p_out":
      label += " p=k/2" if p is None else f" p={p}"
    cells, seconds = [], []
    for n, sort_time in zip(sizes, sort_times):
      k_n = n if k is None else k
      p_n = max(1, k_n // 2) if p is None else p
      if k_n > n or not _allowed(aggregator, n, k_n):
        cells.append(f"{'-':>18}")
        seconds.append(math.nan)
        continue
      fn = jax.jit(functools.partial(objectives.k_sample_advantages, aggregator=aggregator,
                                     baseline=baseline, k=k_n, p=p_n))
      rewards, answers = data[n]
      t = _seconds_per_call(fn, rewards, answer_ids=answers)
      seconds.append(t)
      cells.append(f"{t * 1e6:>9.1f} ({t / sort_time:>4.1f}x)")
    print(f"{label:<34}" + "".join(f"{c:>18}" for c in cells) + f"{_slope(sizes, seconds):>10.2f}")
  print("(Nx) = time relative to jnp.sort of the same rewards; exponent = slope of log time vs "
        "log n over n >= 16; '-' = beyond MAX_SUBSETS for an enumerated aggregator.")


if __name__ == "__main__":
  app.run(main)
