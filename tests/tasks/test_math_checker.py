"""The hardened answer checker: equivalence verdicts (table-driven) and the reliability suite.

Verdicts are what a mathematician would give; where plain math-verify disagrees, the row says so
and why our layer differs (exact numbers), or why we keep math-verify's convention.
"""

import os
import resource
import signal
import threading
import time

import pytest

from ksjax.tasks.math_answer import extract_answer
from ksjax.tasks.math_checker import AnswerChecker, CheckerConfig, Verdict

T, F = True, False

# (gold, prediction, equal?, note). Predictions are final answers as extracted from completions.
EQUIVALENCE_CASES = [
    # Fractions and decimals.
    ("\\frac{1}{2}", "0.5", T, ""),
    ("\\frac{1}{2}", "1/2", T, ""),
    ("\\frac{1}{2}", "\\dfrac12", T, ""),
    ("\\frac{1}{2}", ".5", T, ""),
    ("0.25", "\\frac{1}{4}", T, ""),
    ("2.50", "2.5", T, ""),
    ("\\frac{6}{4}", "\\frac{3}{2}", T, ""),
    ("-\\frac{1}{2}", "\\frac{-1}{2}", T, ""),
    ("\\frac{1}{2}", "-\\frac{1}{2}", F, ""),
    ("\\frac{1}{3}", "0.33", F, ""),
    ("\\frac{1}{3}", "0.333333", F, "math-verify: equal (6-decimal rounding); a decimal is the exact "
     "rational it writes, and 333333/10^6 is not 1/3"),
    ("\\sqrt{2}", "1.41421356", F, "math-verify: equal (rounding); an approximation is not sqrt(2)"),
    ("\\pi", "3.14159", F, ""),
    ("3", "3.0", T, ""),
    ("3", "3.000001", F, ""),
    ("0.0000001", "0.0000002", F, "math-verify: equal (both round to 0.000000)"),
    # Exact numbers, compared exactly.
    ("\\frac{1}{2004!}", "\\frac{1}{2006!}", F, "math-verify: equal (evalf(chop=True) of the "
     "difference is 0)"),
    ("\\frac{1}{2004!}", "\\frac{2005 \\cdot 2006}{2006!}", T, ""),
    ("(\\frac{1}{2004!}, 1)", "(\\frac{1}{2006!}, 1)", F, "math-verify: equal; the guard also "
     "covers numbers inside tuples"),
    ("2^{100}", "1267650600228229401496703205376", T, ""),
    ("2^{100}", "1267650600228229401496703205377", F, ""),
    ("10^{20}+1", "100000000000000000001", T, ""),
    ("e^{-200}", "0", F, ""),
    ("1,000", "1000", T, "thousands separator"),
    ("1000", "1{,}000", T, ""),
    # Irrational constants.
    ("\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}\\sqrt{3}", T, ""),
    ("\\sqrt{8}", "2\\sqrt{2}", T, ""),
    ("\\sqrt{2+\\sqrt{3}}", "\\frac{\\sqrt{6}+\\sqrt{2}}{2}", T, "denesting, proved exactly"),
    ("2\\pi", "\\pi \\cdot 2", T, ""),
    # Intervals.
    ("[1,2)", "[1,2)", T, ""),
    ("[1,2)", "(1,2)", F, ""),
    ("(-\\infty, 3]", "(-\\infty,3]", T, ""),
    ("[0, \\frac{1}{2}]", "[0, 0.5]", T, ""),
    ("[0, 0.0000001]", "[0, 0.0000002]", F, "math-verify: equal (rounded endpoints)"),
    ("(-\\infty,-1)\\cup(1,\\infty)", "(-\\infty,-1) \\cup (1,\\infty)", T, ""),
    ("(-\\infty,-1)\\cup(1,\\infty)", "(1,\\infty)\\cup(-\\infty,-1)", T, ""),
    # verify(gold, prediction) is not symmetric; the gold is always first.
    ("1<x<2", "(1,2)", T, "a relation in the gold may be answered by its solution set"),
    ("(1,2)", "1<x<2", F, "but the reverse is not accepted: the order is not swapped"),
    # Tuples and sets.
    ("(3,-4)", "(3, -4)", T, ""),
    ("(3,-4)", "(-4,3)", F, "tuples are ordered"),
    ("(1,2,3)", "(1,2,3)", T, ""),
    ("(1,2,3)", "(3,2,1)", F, ""),
    ("\\{1,2\\}", "\\{2,1\\}", T, "sets are not"),
    ("1, 2", "2, 1", T, "a list of solutions is a set"),
    ("\\left( 3, -4 \\right)", "(3,-4)", T, ""),
    # Units.
    ("10\\text{ cm}", "10", T, "units are dropped on both sides"),
    ("10", "10\\text{ cm}", T, ""),
    ("5\\text{ inches}", "5", T, ""),
    ("\\$18.90", "18.90", T, ""),
    ("18.90", "\\$18.9", T, ""),
    # Percent.
    ("5\\%", "5", T, "math-verify's convention: the number asked for in percent; kept"),
    ("5\\%", "0.05", T, ""),
    ("5\\%", "5\\%", T, ""),
    ("12.5\\%", "0.125", T, ""),
    ("5\\%", "0.5", F, ""),
    # Degrees.
    ("90^\\circ", "90", T, ""),
    ("90", "90^{\\circ}", T, ""),
    ("30^\\circ", "\\frac{\\pi}{6}", F, "math-verify does not convert degrees to radians; a "
     "mathematician may accept this (a false negative, kept: MATH asks for degrees as numbers)"),
    # LaTeX variants and expressions.
    ("\\frac{3}{4}", "\\tfrac{3}{4}", T, ""),
    ("\\frac34", "\\dfrac{3}{4}", T, ""),
    ("x^2+2x+1", "(x+1)^2", T, ""),
    ("2x+2", "2(x+1)", T, ""),
    ("x^2", "y^2", F, ""),
    ("y = 2x+1", "2x+1", T, "an assignment in the gold is answered by its right-hand side"),
    ("\\text{Monday}", "Monday", T, ""),
    ("\\text{(C)}", "C", T, ""),
    ("\\infty", "\\infty", T, ""),
    ("-\\infty", "\\infty", F, ""),
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", T, ""),
    ("1+2i", "2i+1", T, ""),
    ("0", "-0", T, ""),
]

# (gold, completion, correct?): extraction and checking together.
COMPLETION_CASES = [
    ("5", "First \\boxed{3}; on reflection, the final answer is 5.", T),
    ("5", "The final answer is 5. Hmm, actually \\boxed{3}", F),
    ("6", "\\boxed{5} and later \\boxed{6}", T),
    ("5", "\\boxed{5} and later \\boxed{6}", F),
    ("\\frac{1}{2}", "The final answer is $\\boxed{\\frac{1}{2}}$. I hope it is correct.", T),
    ("\\frac{1}{2}", "The final answer is 0.5.", T),
    ("\\{1,2\\}", "so the set is \\boxed{\\{1, 2\\}}", T),
    ("12", "... which gives \\boxed{12", F),
    ("7", "\\fbox{7}", T),
    ("3.5", "The Final Answer Is 3.5.", T),
    ("x^2", "The final answer is\n$$x^2$$", T),
    ("5", "I think it is 5", F),
]

assert len(EQUIVALENCE_CASES) + len(COMPLETION_CASES) >= 60


@pytest.fixture(scope="module")
def checker():
  # A generous timeout: the table must not depend on the machine's load.
  with AnswerChecker(CheckerConfig(workers=2, timeout_s=3.0)) as c:
    yield c


@pytest.fixture(scope="module")
def verdicts(checker):
  """All table rows checked in one parallel batch."""
  pairs = [(g, p) for g, p, _, _ in EQUIVALENCE_CASES]
  pairs += [(g, extract_answer(c) or "") for g, c, _ in COMPLETION_CASES]
  return dict(zip(pairs, checker.check(pairs)))


@pytest.mark.parametrize("gold,prediction,equal,note", EQUIVALENCE_CASES)
def test_equivalence(verdicts, gold, prediction, equal, note):
  verdict = verdicts[(gold, prediction)]
  assert verdict in (Verdict.EQUAL, Verdict.DIFFERENT), verdict
  assert (verdict == Verdict.EQUAL) == equal, note


@pytest.mark.parametrize("gold,completion,correct", COMPLETION_CASES)
def test_completion(verdicts, gold, completion, correct):
  answer = extract_answer(completion)
  assert (answer is not None and verdicts[(gold, answer)] == Verdict.EQUAL) == correct


# ------------------------------------------------------------------------------------------------
# Reliability: adversarial answers return within timeout + 1 s as a failure, memory bounded.

TIMEOUT_S = 1.0
MEMORY_LIMIT = 1 << 30

ADVERSARIAL = {
    "power_tower": "9^{9^{9^9}}",
    "million_chars": "1" * 1_000_000,
    "million_char_sum": "x+" * 333_333 + "1",
    "nested_parentheses": "(" * 5000 + "1" + ")" * 5000,
    "nested_braces": "{" * 5000 + "1" + "}" * 5000,
    "log_chain": "\\log_{2^5}" * 300 + " 2",
    "nested_logs": "\\log_{2^{5}}(" * 300 + "2" + ")" * 300,
}


@pytest.fixture(scope="module")
def hardened():
  # No verdict cache: every check here must reach a worker.
  config = CheckerConfig(workers=2, timeout_s=TIMEOUT_S, kill_grace_s=0.25,
                         memory_limit_bytes=MEMORY_LIMIT, max_answer_chars=None, cache_size=0)
  with AnswerChecker(config) as c:
    yield c


def _address_space_limit(pid: int) -> int:
  with open(f"/proc/{pid}/limits") as f:
    line = next(l for l in f if l.startswith("Max address space"))
  return int(line.split()[3])


def _vm_peak_bytes(pid: int) -> int:
  with open(f"/proc/{pid}/status") as f:
    line = next(l for l in f if l.startswith("VmPeak"))
  return int(line.split()[1]) * 1024


# Every answer as the prediction; two also as the gold (pairwise class checks put a model's answer
# in the gold's place).
ADVERSARIAL_RUNS = [(name, "prediction") for name in sorted(ADVERSARIAL)] + [
    ("power_tower", "gold"), ("nested_parentheses", "gold")]


@pytest.mark.parametrize("name,side", ADVERSARIAL_RUNS)
def test_adversarial_answer_fails_in_time(hardened, name, side):
  answer = ADVERSARIAL[name]
  pair = ("5", answer) if side == "prediction" else (answer, "5")
  parent_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  start = time.monotonic()
  [verdict] = hardened.check([pair])
  elapsed = time.monotonic() - start
  assert verdict != Verdict.EQUAL
  assert elapsed < TIMEOUT_S + 1.0, (verdict, elapsed)
  # Memory bounded: the trainer's process never parses the answer; workers stay under their limit.
  assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - parent_peak < 64 * 1024  # KiB
  for pid in hardened.worker_pids():
    assert _address_space_limit(pid) == MEMORY_LIMIT
    assert _vm_peak_bytes(pid) <= MEMORY_LIMIT
  # ... and the pool still works.
  assert hardened.check([("\\frac{1}{2}", "0.5")]) == [Verdict.EQUAL]


def test_exact_number_guard_lives_in_the_workers_only(verdicts):
  from math_verify import grader  # pylint: disable=import-outside-toplevel
  from ksjax.tasks.math_checker import exact_numeric_eq  # pylint: disable=import-outside-toplevel
  assert verdicts[("\\frac{1}{2004!}", "\\frac{1}{2006!}")] == Verdict.DIFFERENT
  assert grader.sympy_numeric_eq is not exact_numeric_eq  # this process's math-verify is intact


def test_verdicts_are_cached_across_calls_but_not_timeouts(checker):
  hits = checker.stats["cache_hits"]
  pairs = [("7", "\\frac{14}{2}"), ("7", "8")]
  assert checker.check(pairs) == [Verdict.EQUAL, Verdict.DIFFERENT]
  assert checker.stats["cache_hits"] == hits
  assert checker.check([list(p) for p in reversed(pairs)]) == [Verdict.DIFFERENT, Verdict.EQUAL]
  assert checker.stats["cache_hits"] == hits + 2


def test_too_long_answers_are_rejected_unparsed(checker):
  start = time.monotonic()
  assert checker.check([("5", "1" * 1_000_000)]) == [Verdict.TOO_LONG]
  assert time.monotonic() - start < 0.5


def test_frozen_worker_is_killed_and_replaced(hardened):
  """A worker stuck where no signal handler runs (here: SIGSTOP, as inside long C code) is
  SIGKILLed by the parent at timeout + grace and replaced."""
  hardened.start()  # both workers ready (replacements from earlier tests may still be starting)
  old = hardened.worker_pids()
  kills = hardened.stats["hard_kills"]
  for pid in old:
    os.kill(pid, signal.SIGSTOP)
  start = time.monotonic()
  verdicts = hardened.check([("1", "1.0"), ("2", "2.0")])
  elapsed = time.monotonic() - start
  assert verdicts == [Verdict.TIMEOUT, Verdict.TIMEOUT]
  assert elapsed < TIMEOUT_S + 1.0
  assert hardened.stats["hard_kills"] == kills + 2
  assert not set(hardened.worker_pids()) & set(old)
  assert hardened.check([("1", "1.0")]) == [Verdict.EQUAL]


def test_crashed_worker_counts_as_wrong_and_is_replaced(hardened):
  hardened.start()
  old = hardened.worker_pids()
  timers = [threading.Timer(0.2, os.kill, (pid, signal.SIGSEGV)) for pid in old]
  for t in timers:
    t.start()
  verdicts = hardened.check([("5", ADVERSARIAL["power_tower"])] * 2)
  for t in timers:
    t.join()
  assert verdicts == [Verdict.CRASHED, Verdict.CRASHED]
  assert not set(hardened.worker_pids()) & set(old)
  assert hardened.check([("\\frac{1}{2}", "0.5")]) == [Verdict.EQUAL]


def test_check_from_a_non_main_thread(hardened):
  """math-verify's timeouts need the main thread; ours run in the workers' main threads, so the
  trainer may score from any thread, timeouts included."""
  results = []
  thread = threading.Thread(
      target=lambda: results.append(hardened.check([("2", "2.0"), ("5", "9^{9^{9^9}}")])))
  thread.start()
  thread.join()
  assert results == [[Verdict.EQUAL, Verdict.TIMEOUT]]


@pytest.mark.parametrize("field,value", [
    ("workers", 0), ("timeout_s", 0.0), ("timeout_s", float("nan")), ("kill_grace_s", -1.0),
    ("memory_limit_bytes", 1 << 20), ("max_answer_chars", 0), ("cache_size", -1)])
def test_config_rejects_bad_values(field, value):
  with pytest.raises(ValueError, match=field):
    CheckerConfig(**{field: value})
