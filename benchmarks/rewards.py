"""Reward throughput: how fast rewards are computed, per kind of task.

  python benchmarks/rewards.py                    # every section
  python benchmarks/rewards.py --sections=math    # some of them

Each section is an independent function `bench_<name>(...) -> dict` that prints its own table and
returns its figures; `SECTIONS` lists them for `main`. Sections compare configurations side by side
in one run (timings on a shared machine are noisy; ratios within a run are what to read).

math: answers checked per second through the hardened math-verify pool (`AnswerChecker.check` on
distinct (gold, answer) pairs), and completions scored per second by `MathTask.score` (extraction,
shortcuts for identical texts, answer classes), for 1 and 2 worker processes, on a realistic mix of
MATH-style answers: a third correct in another form, half wrong, the rest without an answer.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Callable

FILLER = ("We first simplify the expression and collect like terms. Substituting the known values "
          "and checking the boundary cases gives the result. ")


def _math_item(rng: random.Random) -> tuple[str, list[str], list[str]]:
  """(gold, answers equal to it in other forms, wrong answers) of one random MATH-style problem."""
  a, b = rng.randint(2, 60), rng.randint(2, 60)
  kind = rng.randrange(8)
  if kind == 0:
    return str(a * b), [f"{a * b}.0", f"{a * b}"], [str(a * b + 1), str(-a * b)]
  if kind == 1:
    g = math.gcd(a, b)
    p, q = a // g, b // g + (1 if b // g == 1 else 0)
    g = math.gcd(p, q)
    p, q = p // g, q // g
    return f"\\frac{{{p}}}{{{q}}}", [f"{p}/{q}", f"\\dfrac{{{2 * p}}}{{{2 * q}}}"], [
        f"\\frac{{{q}}}{{{p}}}", f"\\frac{{{p + 1}}}{{{q}}}"]
  if kind == 2:
    m = rng.choice([2, 3, 5, 6, 7])
    return f"{a}\\sqrt{{{m}}}", [f"\\sqrt{{{a * a * m}}}"], [f"{a}\\sqrt{{{m + 1}}}", str(a * m)]
  if kind == 3:
    lo, hi = sorted((a, b + 61))
    return f"[{lo}, {hi})", [f"[{lo},{hi})"], [f"({lo}, {hi})", f"[{lo}, {hi}]"]
  if kind == 4:
    return f"({a}, -{b})", [f"\\left({a},-{b}\\right)"], [f"(-{b}, {a})", f"({a}, {b})"]
  if kind == 5:
    return f"(x+{a})^2", [f"x^2+{2 * a}x+{a * a}"], [f"(x-{a})^2", f"x^2+{a * a}"]
  if kind == 6:
    return f"{a}\\%", [f"{a}", f"{a / 100}"], [f"{a + 1}\\%", f"{a / 10}"]
  return f"{a}\\pi", [f"\\pi \\cdot {a}"], [f"{a}", f"{a + 1}\\pi"]


def _completion(rng: random.Random, answer: str | None) -> str:
  body = FILLER * rng.randint(2, 6)
  if answer is None:
    return body + "This is as far as I can get."
  if rng.random() < 0.5:
    return f"{body}The final answer is ${answer}$. I hope it is correct."
  return f"{body}So the result is $\\boxed{{{answer}}}$."


def _math_workload(groups: int, group_size: int, seed: int):
  """Golds [G] and completions [G][n] with the mix described in the module docstring."""
  rng = random.Random(seed)
  golds, completions = [], []
  for _ in range(groups):
    gold, equal, wrong = _math_item(rng)
    group = []
    for _ in range(group_size):
      u = rng.random()
      answer = rng.choice(equal) if u < 0.35 else rng.choice(wrong) if u < 0.85 else (
          gold if u < 0.9 else None)
      group.append(_completion(rng, answer))
    golds.append(gold)
    completions.append(group)
  return golds, completions


def bench_math(workers: tuple[int, ...] = (1, 2), groups: int = 96, group_size: int = 8,
               timeout_s: float = 5.0, seed: int = 0) -> dict:
  """Answers checked per second and completions scored per second, per worker count."""
  # pylint: disable=import-outside-toplevel
  from ksjax.tasks.math_answer import canonical, extract_answer
  from ksjax.tasks.math_checker import AnswerChecker, CheckerConfig
  from ksjax.tasks.math_task import MathTask
  from ksjax.tasks.synthetic import make_tokenizer

  tokenizer = make_tokenizer()
  results = {}
  print(f"math: {groups} groups x {group_size} completions, timeout {timeout_s} s")
  print(f"{'workers':>8} {'start s':>8} {'pairs':>6} {'checks/s':>9} {'completions/s':>14}")
  for count in workers:
    # Fresh workloads per configuration, so that no worker-side cache helps the later runs.
    golds, completions = _math_workload(groups, group_size, seed + 1000 * count)
    pairs = sorted({(canonical(g), canonical(a)) for g, group in zip(golds, completions)
                    for a in map(extract_answer, group) if a is not None and a != g})
    start = time.perf_counter()
    checker = AnswerChecker(CheckerConfig(workers=count, timeout_s=timeout_s))
    checker.start()
    started = time.perf_counter() - start
    try:
      start = time.perf_counter()
      checker.check(pairs)
      checks_per_s = len(pairs) / (time.perf_counter() - start)

      golds, completions = _math_workload(groups, group_size, seed + 1000 * count + 1)
      records = [{"id": str(i), "problem": "p", "answer": g} for i, g in enumerate(golds)]
      task = MathTask({"bench": records}, tokenizer, checker=checker)
      prompts = task.prompts("bench")
      start = time.perf_counter()
      task.score(prompts, completions)
      completions_per_s = groups * group_size / (time.perf_counter() - start)
    finally:
      checker.close()
    results[count] = {"startup_s": started, "checks_per_s": checks_per_s,
                      "completions_per_s": completions_per_s, "verdicts": dict(checker.stats)}
    print(f"{count:>8} {started:>8.2f} {len(pairs):>6} {checks_per_s:>9.1f} {completions_per_s:>14.1f}")
  if 1 in results and 2 in results:
    print(f"2 workers / 1 worker: checks {results[2]['checks_per_s'] / results[1]['checks_per_s']:.2f}x, "
          f"completions {results[2]['completions_per_s'] / results[1]['completions_per_s']:.2f}x")
  return results


# Section name -> function; each runs with its defaults.
SECTIONS: dict[str, Callable[[], dict]] = {
    "math": bench_math,
}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sections", default=",".join(SECTIONS),
                      help=f"comma-separated subset of: {', '.join(SECTIONS)}")
  args = parser.parse_args()
  names = [s for s in args.sections.split(",") if s]
  unknown = [s for s in names if s not in SECTIONS]
  if unknown:
    parser.error(f"unknown sections {unknown}; expected some of {', '.join(SECTIONS)}")
  for name in names:
    SECTIONS[name]()
    print()


if __name__ == "__main__":
  main()
