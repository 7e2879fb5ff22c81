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

code: programs executed per second by the sandbox (`Sandbox.run_many`, every program in its own
namespaced runner, all of its tests passing), for 1 and 2 workers, with the full isolation and with
namespaces off (resource limits only), to show what isolation costs; simple correct stdin/stdout
programs, distinct texts, a few tests each.
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
    # The same workloads for every configuration; each gets a fresh pool (verdict cache and the
    # workers' parse caches start empty), so no configuration profits from an earlier one.
    golds, completions = _math_workload(groups, group_size, seed)
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

      golds, completions = _math_workload(groups, group_size, seed + 1)
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


def _code_workload(programs: int, tests: int) -> list:
  """Distinct correct programs (sum of n integers, written several ways) with `tests` tests."""
  # pylint: disable=import-outside-toplevel
  from ksjax.tasks.sandbox import Job
  bodies = ("print(sum(map(int, input().split())))",
            "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))",
            "total = 0\nfor x in input().split():\n  total += int(x)\nprint(total)")
  rng = random.Random(0)
  jobs = []
  for p in range(programs):
    cases = [[rng.randint(-1000, 1000) for _ in range(rng.randint(1, 20))] for _ in range(tests)]
    jobs.append(Job(program=f"# program {p}\n{bodies[p % len(bodies)]}\n",
                    tests=[{"input": " ".join(map(str, c)) + "\n", "output": f"{sum(c)}\n"}
                           for c in cases]))
  return jobs


def bench_code(configs: tuple[tuple[int, bool], ...] = ((1, True), (2, True), (2, False)),
               programs: int = 96, tests: int = 5) -> dict:
  """Programs executed per second, per (workers, namespaces) configuration."""
  # pylint: disable=import-outside-toplevel
  import resource
  from ksjax.tasks.sandbox import Sandbox, SandboxConfig

  results = {}
  print(f"code: {programs} correct programs x {tests} tests (stdin/stdout)")
  print(f"{'workers':>8} {'namespaces':>11} {'isolation':>13} {'programs/s':>11} {'tests/s':>8} "
        f"{'cpu ms/program':>15}")
  for workers, namespaces in configs:
    with Sandbox(SandboxConfig(workers=workers, namespaces=namespaces)) as sandbox:
      level = sandbox.isolation_report()["level"]
      sandbox.run_many(_code_workload(2 * workers, tests))  # warm the pool
      jobs = _code_workload(programs, tests)
      before = resource.getrusage(resource.RUSAGE_CHILDREN)
      start = time.perf_counter()
      outcomes = sandbox.run_many(jobs)
      elapsed = time.perf_counter() - start
      after = resource.getrusage(resource.RUSAGE_CHILDREN)
    failed = [r.verdict for r in outcomes if not r.passed]
    if failed:
      raise RuntimeError(f"{len(failed)} correct programs failed: {failed[:5]}")
    cpu_ms = 1000 * (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / programs
    results[(workers, namespaces)] = {"isolation": level, "programs_per_s": programs / elapsed,
                                      "tests_per_s": programs * tests / elapsed,
                                      "cpu_ms_per_program": cpu_ms}
    print(f"{workers:>8} {str(namespaces):>11} {level:>13} {programs / elapsed:>11.1f} "
          f"{programs * tests / elapsed:>8.1f} {cpu_ms:>15.1f}")
  rate = {config: r["programs_per_s"] for config, r in results.items()}
  if (1, True) in rate and (2, True) in rate:
    print(f"2 workers / 1 worker: {rate[(2, True)] / rate[(1, True)]:.2f}x")
  if (2, True) in rate and (2, False) in rate:
    print(f"namespaces on / off: {rate[(2, True)] / rate[(2, False)]:.2f}x")
  return results


# Section name -> function; each runs with its defaults.
SECTIONS: dict[str, Callable[[], dict]] = {
    "math": bench_math,
    "code": bench_code,
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
