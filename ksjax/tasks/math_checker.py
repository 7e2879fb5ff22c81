"""Hardened mathematical answer checking: math-verify in a pool of killable worker processes.

Model answers are adversarial input to SymPy. `9^{9^{9^9}}` asks for an integer with hundreds of
millions of digits, a million-character answer keeps the LaTeX parser busy for seconds and
hundreds of megabytes, thousands of nested brackets drive it deep into recursion. None of that may
hang or kill the trainer, so no answer is ever parsed in the trainer's process:

* Every check (`gold`, `prediction`) runs in a worker process. The parent waits for the reply until
  `timeout_s + kill_grace_s`; past that it SIGKILLs the worker, starts a replacement and records
  TIMEOUT. SIGKILL is the only interruption that works while the worker sits inside C code.
* Inside the worker, an interval timer gives each check a soft deadline of `timeout_s`: a Python-level
  hang (SymPy's `simplify`) is interrupted cheaply and the worker survives. math-verify's own
  timeouts use `signal.alarm` (whole seconds, main thread only, reset per call), so they are switched
  off (`parsing_timeout=None`, `timeout_seconds=None`) and replaced by this one timer per check; the
  worker loop runs in the worker's main thread, so the signal is delivered there whatever thread of
  the trainer calls `check`.
* Each worker has an address-space limit (RLIMIT_AS): allocations past it fail with MemoryError
  instead of pushing the host into swap (math-verify reads that as a failed parse; one that escapes
  ends the worker and a replacement starts). Core dumps are off, and a per-check CPU-time limit
  (RLIMIT_CPU) makes the kernel kill a worker orphaned by a dead trainer in mid-check.
* Workers are started by the "forkserver" method, never by forking the trainer (which runs JAX's
  threads); the fork server preloads math-verify, so a replacement is ready in a fraction of a
  second. As with any non-fork start method, scripts need the `if __name__ == "__main__":` guard.
* A timed-out, crashed or oversized check counts as "not equal": the answer earns the failure
  reward, and nothing raises into the trainer.

math-verify's argument order matters: `verify(gold, prediction)` is not symmetric (an equation or
relation in the gold is unwrapped differently from one in the prediction), so the gold is always
the first argument; for answer classes (majority voting) the class representative takes the gold's
place.

Exact numbers are compared exactly. math-verify's `sympy_numeric_eq` rounds decimals to 6 places and
compares other numbers with `evalf(chop=True)`, so `1/2004!` equals `1/2006!` and `0.0000001` equals
`0.0000002` (both differences chop or round to zero), and `0.333333` equals `1/3`. A worker replaces
that function (in the worker process only) with `exact_numeric_eq`: a decimal denotes the rational it
writes (`0.5` is exactly 1/2), rationals compare exactly, irrational constants compare with SymPy's
exact `equals` (minimal polynomials for algebraic numbers). math-verify's other strategies (string,
structural, sets, intervals, relations, `simplify(a - b) == 0`) are unchanged and recurse into the
replacement for their numeric leaves. The one deliberate difference from plain math-verify: a
rounded decimal no longer equals the exact value it approximates (`0.333333` is not `1/3`).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import resource
import signal
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)


class Verdict(enum.IntEnum):
  """The outcome of one check. Only EQUAL earns the success reward."""
  EQUAL = 0
  DIFFERENT = 1
  UNPARSABLE = 2  # math-verify found no expression in the gold or the prediction.
  TIMEOUT = 3  # soft deadline in the worker, or hard kill by the parent.
  CRASHED = 4  # the worker died (memory limit, segfault) or raised unexpectedly.
  TOO_LONG = 5  # longer than `max_answer_chars`: rejected without being parsed.


# Verdicts after which an answer is not compared again (its class is its own text).
POISONED = frozenset({Verdict.TIMEOUT, Verdict.CRASHED, Verdict.TOO_LONG, Verdict.UNPARSABLE})


@dataclasses.dataclass(frozen=True)
class CheckerConfig:
  """Limits of the checker pool.

  Attributes:
    workers: worker processes (each checks one pair at a time).
    timeout_s: soft per-check deadline inside the worker.
    kill_grace_s: extra time before the parent SIGKILLs a worker that missed its soft deadline.
    memory_limit_bytes: RLIMIT_AS of each worker (its whole address space; an idle worker with
      math-verify loaded maps about 100 MB).
    max_answer_chars: answers (gold or prediction) longer than this are TOO_LONG without being
      parsed; MATH and HARP gold answers are under 200 characters. None disables the guard.
    startup_timeout_s: how long a new worker may take to load math-verify and report ready.
    cache_size: verdicts remembered by (gold, prediction) text across calls: RL revisits the same
      problems, and common wrong answers recur.
  """
  workers: int = 2
  timeout_s: float = 5.0
  kill_grace_s: float = 0.5
  memory_limit_bytes: int = 2 << 30
  max_answer_chars: int | None = 4096
  startup_timeout_s: float = 120.0
  cache_size: int = 1 << 16

  def __post_init__(self):
    if self.workers < 1:
      raise ValueError(f"CheckerConfig.workers={self.workers} is not accepted; expected >= 1")
    for name in ("timeout_s", "kill_grace_s", "startup_timeout_s"):
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"CheckerConfig.{name}={value!r} is not accepted; expected a number > 0")
    if self.memory_limit_bytes < 256 << 20:
      raise ValueError(f"CheckerConfig.memory_limit_bytes={self.memory_limit_bytes} is not accepted; "
                       "expected >= 256 MiB (math-verify alone maps about 100 MB)")
    if self.cache_size < 0:
      raise ValueError(f"CheckerConfig.cache_size={self.cache_size} is not accepted; expected >= 0")
    if self.max_answer_chars is not None and self.max_answer_chars < 1:
      raise ValueError(f"CheckerConfig.max_answer_chars={self.max_answer_chars} is not accepted; "
                       "expected >= 1 or None")


# ---------------------------------------------------------------------------------------------
# Worker side. Everything below up to `AnswerChecker` runs only inside worker processes.


class _SoftTimeout(BaseException):
  """Raised by the worker's interval timer. A BaseException, so that math-verify's and SymPy's
  `except Exception` clauses let it through."""


def _exact_value(expr):
  """`expr` with every Float replaced by the rational its decimal digits write (0.5 -> 1/2)."""
  import sympy  # pylint: disable=import-outside-toplevel
  floats = expr.atoms(sympy.Float)
  if not floats:
    return expr
  return expr.xreplace({f: sympy.Rational(str(f)) for f in floats})


def exact_numeric_eq(a, b, float_rounding: int, numeric_precision: int) -> bool:
  """Drop-in for math-verify's `sympy_numeric_eq` without its tolerances (see module docstring).

  Signature and contract as in math-verify: True only when `a` and `b` are numerically equal; False
  lets math-verify go on to its symbolic comparison.
  """
  import sympy  # pylint: disable=import-outside-toplevel
  from math_verify import grader  # pylint: disable=import-outside-toplevel
  if isinstance(a, sympy.MatrixBase) and isinstance(b, sympy.MatrixBase):
    a, b = grader.safe_sympy_doit(a), grader.safe_sympy_doit(b)
    return a.shape == b.shape and all(
        exact_numeric_eq(x, y, float_rounding, numeric_precision) for x, y in zip(a, b))
  if not (isinstance(a, sympy.Basic) and isinstance(b, sympy.Basic)):
    return False
  # math-verify writes "X%" as X * UnevaluatedExpr(1/100); "5%" matches both 0.05 and a bare 5
  # (the number the question asks for in percent), as in math-verify.
  a_pct, b_pct = grader.get_pct_val(a), grader.get_pct_val(b)
  if (a_pct is None) != (b_pct is None):
    pct, other = (a_pct, b) if a_pct is not None else (b_pct, a)
    return _exact_number_eq(pct, other) or _exact_number_eq(pct / 100, other)
  if a_pct is not None:
    a, b = a_pct, b_pct
  return _exact_number_eq(a, b)


def _exact_number_eq(a, b) -> bool:
  import sympy  # pylint: disable=import-outside-toplevel
  try:
    a = _exact_value(sympy.sympify(a).doit())
    b = _exact_value(sympy.sympify(b).doit())
  except (ValueError, TypeError, ArithmeticError, sympy.SympifyError):
    return False  # e.g. a Float infinity has no exact value; math-verify's symbolic path decides.
  if not (a.is_number and b.is_number):
    return False
  if a.is_Rational and b.is_Rational:
    return a == b
  # Exact irrational constants: `equals` proves zero differences of algebraic numbers through
  # minimal polynomials and returns None when it cannot decide (then: not equal here, and
  # math-verify still tries `simplify`).
  return (a - b).equals(0) is True


_WRAP = "\\boxed{{{}}}"  # parse() extracts the boxed expression: the answer as a whole.


@functools.lru_cache(maxsize=1024)
def _parse(answer: str) -> tuple:
  """math-verify's parse of one answer, cached: a gold is checked against every answer of its
  group, and class checks reuse answers. Parsing is most of a check's cost. SymPy expressions are
  immutable, so sharing them is safe; a parse interrupted by the timer raises and is not cached."""
  import math_verify  # pylint: disable=import-outside-toplevel
  return tuple(math_verify.parse(_WRAP.format(answer), parsing_timeout=None))


def _check_pair(gold: str, prediction: str) -> Verdict:
  import math_verify  # pylint: disable=import-outside-toplevel
  parsed_gold, parsed_pred = _parse(gold), _parse(prediction)
  if not parsed_gold or not parsed_pred:
    return Verdict.UNPARSABLE
  equal = math_verify.verify(list(parsed_gold), list(parsed_pred), timeout_seconds=None)
  return Verdict.EQUAL if equal else Verdict.DIFFERENT


def _install_exact_numbers() -> None:
  from math_verify import grader  # pylint: disable=import-outside-toplevel
  needed = ("sympy_numeric_eq", "get_pct_val", "safe_sympy_doit")
  missing = [name for name in needed if not callable(getattr(grader, name, None))]
  if missing:
    raise RuntimeError(f"math_verify.grader lacks {missing}: the exact-number guard of "
                       "ksjax.tasks.math_checker needs updating for this math-verify version")
  grader.sympy_numeric_eq = exact_numeric_eq


def _on_alarm(signum, frame):
  raise _SoftTimeout()


def _worker_main(conn, timeout_s: float, hard_timeout_s: float, memory_limit_bytes: int) -> None:
  """Worker loop: receive (task id, gold, prediction), reply (task id, verdict)."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's; it closes the pool.
  signal.signal(signal.SIGALRM, _on_alarm)
  logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # timeouts are reported by verdict.
  logging.getLogger("latex2sympy2_extended").setLevel(logging.CRITICAL)
  try:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _, as_hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, as_hard))
    _install_exact_numbers()
    if _check_pair("\\frac{1}{2}", "0.5") != Verdict.EQUAL:  # Warm-up: lazy imports, regexes.
      raise RuntimeError("math-verify failed its warm-up check 1/2 == 0.5")
  except BaseException as e:  # pylint: disable=broad-except
    conn.send(("failed", f"{type(e).__name__}: {e}"))
    return
  conn.send(("ready", os.getpid()))
  _, cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)
  while True:
    try:
      task_id, gold, prediction = conn.recv()
    except (EOFError, OSError):
      return  # The parent closed the pool or died.
    # Orphan guard: if the parent dies mid-check nobody SIGKILLs us; the kernel does, by CPU time.
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu_limit = math.ceil(used.ru_utime + used.ru_stime + hard_timeout_s) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_limit, cpu_hard))
    exit_after = False
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
      verdict = _check_pair(gold, prediction)
    except _SoftTimeout:
      verdict = Verdict.TIMEOUT
    except MemoryError:
      verdict, exit_after = Verdict.CRASHED, True  # Heap state after a failed allocation: restart.
    except BaseException:  # pylint: disable=broad-except
      verdict = Verdict.CRASHED
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)
    conn.send((task_id, int(verdict)))
    if exit_after:
      return


# ---------------------------------------------------------------------------------------------
# Parent side.


@dataclasses.dataclass(eq=False)
class _Worker:
  process: Any
  conn: Any
  started: float
  ready: bool = False
  task: int | None = None  # index into the current batch
  deadline: float = math.inf


def _shutdown(workers: list[_Worker]) -> None:
  for worker in workers:
    try:
      worker.conn.close()
    except OSError:
      pass
    if worker.process.is_alive():
      worker.process.kill()
    worker.process.join(timeout=5)
  workers.clear()


class AnswerChecker:
  """A pool of math-verify worker processes; `check` never raises for any answer.

  Start once and reuse (workers load math-verify at start): as a context manager, or `close()`
  when done. Thread-safe: concurrent `check` calls are serialised.

  Attributes:
    stats: counters of verdicts and worker restarts since start, for the run's log.
  """

  def __init__(self, config: CheckerConfig = CheckerConfig()):
    self.config = config
    self.stats: collections.Counter[str] = collections.Counter()
    self._workers: list[_Worker] = []
    self._lock = threading.Lock()
    # (gold, prediction) -> verdict, least recently used first.
    self._cache: collections.OrderedDict[tuple[str, str], Verdict] = collections.OrderedDict()
    self._ctx = multiprocessing.get_context("forkserver")
    # The fork server imports math-verify once; workers fork from it already loaded. Harmless if
    # the fork server is already running (its preload is then ignored and workers import it).
    self._ctx.set_forkserver_preload(["ksjax.tasks.math_checker", "math_verify"])
    self._finalizer = weakref.finalize(self, _shutdown, self._workers)

  def __enter__(self) -> "AnswerChecker":
    self.start()
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def start(self) -> None:
    """Starts the workers and waits until every one is ready (idempotent)."""
    with self._lock:
      while len(self._workers) < self.config.workers:
        self._workers.append(self._spawn())
      self._wait_ready()

  def close(self) -> None:
    """Kills the workers. A later `check` starts new ones."""
    with self._lock:
      _shutdown(self._workers)

  def worker_pids(self) -> list[int]:
    """The workers' pids, once each has set its limits.

    A worker replaced after a kill is started but not yet ready when `check` returns; waiting here
    means a caller inspecting a pid (its /proc limits, say) sees the worker as it will check.
    """
    with self._lock:
      self._wait_ready()
      return [w.process.pid for w in self._workers]

  def check(self, pairs: Sequence[tuple[str, str]]) -> list[Verdict]:
    """Verdicts of `verify(gold, prediction)` for each (gold, prediction), in order.

    Runs the pairs in parallel over the workers; each takes at most timeout_s + kill_grace_s.
    """
    verdicts: list[Verdict | None] = [None] * len(pairs)
    todo = collections.deque()
    limit = self.config.max_answer_chars
    with self._lock:
      for i, (gold, prediction) in enumerate(pairs):
        pair = (gold, prediction)
        if limit is not None and (len(gold) > limit or len(prediction) > limit):
          verdicts[i] = Verdict.TOO_LONG
        elif pair in self._cache:
          verdicts[i] = self._cache[pair]
          self._cache.move_to_end(pair)
          self.stats["cache_hits"] += 1
        else:
          todo.append(i)
      fresh = list(todo)
      if todo:
        while len(self._workers) < self.config.workers:
          self._workers.append(self._spawn())
        self._run(pairs, todo, verdicts)
      for i in fresh:
        # Only verdicts about the answers themselves; a timeout also depends on the host's load.
        if verdicts[i] in (Verdict.EQUAL, Verdict.DIFFERENT, Verdict.UNPARSABLE):
          self._cache[tuple(pairs[i])] = verdicts[i]
      while len(self._cache) > self.config.cache_size:
        self._cache.popitem(last=False)
      for v in verdicts:
        self.stats[v.name] += 1
    return verdicts  # type: ignore[return-value]

  # -- internals (called with the lock held) --

  def _spawn(self) -> _Worker:
    parent_conn, child_conn = self._ctx.Pipe(duplex=True)
    hard = self.config.timeout_s + self.config.kill_grace_s
    process = self._ctx.Process(
        target=_worker_main, name="ksjax-math-checker", daemon=True,
        args=(child_conn, self.config.timeout_s, hard, self.config.memory_limit_bytes))
    process.start()
    child_conn.close()
    return _Worker(process=process, conn=parent_conn, started=time.monotonic())

  def _replace(self, worker: _Worker) -> None:
    index = self._workers.index(worker)
    _shutdown([worker])
    self._workers[index] = self._spawn()
    self.stats["worker_restarts"] += 1

  def _on_message(self, worker: _Worker, message, verdicts) -> None:
    if not worker.ready:
      kind, detail = message
      if kind != "ready":
        raise RuntimeError(f"an answer-checker worker failed to start: {detail} "
                           f"(memory_limit_bytes={self.config.memory_limit_bytes})")
      worker.ready = True
      return
    task_id, verdict = message
    if task_id == worker.task:
      verdicts[task_id] = Verdict(verdict)
      worker.task, worker.deadline = None, math.inf

  def _poll(self, verdicts, timeout: float) -> None:
    """Waits up to `timeout` for replies or deaths, then handles them and expired deadlines."""
    waitables = {}
    for worker in self._workers:
      waitables[worker.conn] = worker
      waitables[worker.process.sentinel] = worker
    ready = multiprocessing.connection.wait(list(waitables), timeout=max(timeout, 0.0))
    dead = []
    for obj in ready:
      worker = waitables[obj]
      if obj is worker.conn:
        try:
          self._on_message(worker, worker.conn.recv(), verdicts)
        except (EOFError, OSError):
          dead.append(worker)
      elif not worker.conn.poll():  # Died with nothing left to read.
        dead.append(worker)
    now = time.monotonic()
    for worker in self._workers:
      if worker in dead:
        continue
      if worker.task is not None and now >= worker.deadline:
        verdicts[worker.task] = Verdict.TIMEOUT
        self.stats["hard_kills"] += 1
        logger.warning("an answer check ran past %.2f s; killing its worker",
                       self.config.timeout_s + self.config.kill_grace_s)
        dead.append(worker)
      elif not worker.ready and now - worker.started > self.config.startup_timeout_s:
        _shutdown([worker])
        raise RuntimeError(f"an answer-checker worker did not start within "
                           f"{self.config.startup_timeout_s} s")
    for worker in {id(w): w for w in dead}.values():
      if not worker.ready:
        worker.process.join(timeout=5)
        raise RuntimeError(
            f"an answer-checker worker died while starting (exit code {worker.process.exitcode}, "
            f"its traceback is on stderr; memory_limit_bytes={self.config.memory_limit_bytes}). "
            "Scripts that score math answers need the `if __name__ == '__main__':` guard, since "
            "worker processes import the main module")
      crashed = worker.task is not None and verdicts[worker.task] is None
      if crashed:
        verdicts[worker.task] = Verdict.CRASHED
      self._replace(worker)
      if crashed:
        logger.warning("an answer-checker worker died during a check (exit code %s); replaced",
                       worker.process.exitcode)

  def _wait_ready(self) -> None:
    while not all(w.ready for w in self._workers):
      self._poll([], timeout=1.0)

  def _run(self, pairs, todo: collections.deque, verdicts: list) -> None:
    hard = self.config.timeout_s + self.config.kill_grace_s
    while todo or any(w.task is not None for w in self._workers):
      for worker in self._workers:
        if todo and worker.ready and worker.task is None:
          i = todo.popleft()
          try:
            worker.conn.send((i, *pairs[i]))
          except (OSError, ValueError):  # Died while idle: requeue on a fresh worker.
            todo.appendleft(i)
            self._replace(worker)
            continue
          worker.task, worker.deadline = i, time.monotonic() + hard
      now = time.monotonic()
      deadlines = [w.deadline for w in self._workers if w.task is not None]
      self._poll(verdicts, timeout=min(deadlines, default=now + 1.0) - now)
