"""Runs untrusted Python programs against tests, many at a time, without harm to the host.

Programs come from a model under training, so they are adversarial: they loop, fork, allocate,
print without end, exit early, open sockets, write files, signal their parent, call ctypes. The
design keeps the trusted and untrusted parts apart:

* This module (trusted, in the trainer's process) starts one runner process per program
  (`sandbox_runner.py`, `python -I -S -B`, standard library only) in a new session, with a fresh
  temporary directory as its working directory and an environment holding only PATH and LANG,
  then sends it the program and the test inputs. Expected outputs never leave this process: the
  runner returns what the program printed, and `code_judge.judge` judges it here.
* The runner isolates itself (namespaces, a minimal read-only root, an unprivileged uid,
  resource limits; see its docstring) and runs every test in a child forked from one process, so
  a program's tests cost one interpreter start, not one each, while each test keeps its own CPU
  limit and wall clock. The first failing test ends the program (the reward needs every test),
  which also bounds the time a wrong program takes.
* A watchdog kills the runner (through a pidfd, so never a recycled pid) once the program's time
  is up; the runner's init dies with it, and the kernel then kills every process of its PID
  namespace.
* A bounded pool of worker threads drives the runners; results are read as length-prefixed frames
  whose size RLIMIT_FSIZE bounds, so a gigabyte of output never reaches this process.

What the host allows is detected at run time; `isolation_report()` says what is in force (the
trainer writes it to the run's log). On Linux with root or unprivileged user namespaces everything
above holds ("full"). Where namespaces are forbidden (e.g. a container without CAP_SYS_ADMIN)
the sandbox falls back to resource limits, an unprivileged uid (as root) and a child subreaper
that kills escaped processes ("rlimits_only"): no network or file-system isolation then, and the
program imports from the host's file system as that uid, so the interpreter's standard library
must be readable by every user (a virtual environment or pyenv under a 0700 home is not).

A sandbox tests itself when it is made: it runs an honest program that imports standard modules
(`PROBE`) and checks what it prints. If that fails, in any mode, the constructor raises
`SandboxUnavailable` with one line saying what failed, the child's error, and what to do (for an
unreadable interpreter: which directory, and the choices of another interpreter, permissions or
namespaces), instead of a sandbox that would fail every honest program.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import marshal
import math
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ksjax.tasks import code_judge

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_runner.py")
# What the runner's environment holds; nothing is inherited from the parent.
RUNNER_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
_MAX_HEADER_BYTES = 1 << 16
_STARTUP_ALLOWANCE_S = 5.0

_log = logging.getLogger(__name__)

# Program uids of this process (as root): a slot is taken for each running program.
_UID_SLOTS = 64
_uid_slots: queue.Queue[int] = queue.Queue()
for _slot in range(_UID_SLOTS):
  _uid_slots.put(_slot)

VERDICTS = ("passed", "wrong_answer", "runtime_error", "time_limit", "output_limit",
            "sandbox_error")

# The self-test: an honest program using the standard modules competitive programs import (pure
# Python packages, extension modules and built-ins alike), with its expected output.
PROBE = (
    "import bisect, collections, fractions, functools, heapq, itertools, json, math, re\n"
    "n = int(input())\n"
    "words = collections.Counter(re.findall(r'[a-z]+', 'to be or not to be'))\n"
    "print(math.isqrt(n), heapq.nsmallest(2, [n, 3, 9])[1], bisect.bisect([1, 5, 9], n),\n"
    "      words['be'], json.loads('[1, 2]')[1] + len(list(itertools.permutations('ab'))),\n"
    "      fractions.Fraction(n, 6), functools.reduce(max, [2, n, 5]))\n")
PROBE_TESTS = ({"input": "16\n", "output": "4 9 3 2 4 8/3 16\n"},)


class SandboxUnavailable(RuntimeError):
  """The sandbox's self-test failed: it cannot run honest programs here (the message says why
  and what to do)."""


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
  """Limits and resources of the sandbox.

  Attributes:
    workers: programs run at once (threads driving runner processes), 1..64.
    time_limit_s: CPU seconds per test when a problem states none.
    time_limit_scale: multiplies a problem's stated limit (the limits are set for C++).
    max_time_limit_s: upper bound on the per-test CPU limit after scaling.
    wall_time_factor, wall_time_slack_s: per-test wall clock = CPU limit * factor + slack, for
      programs that sleep or wait instead of computing.
    program_timeout_s: wall clock for all tests of one program.
    memory_bytes: address space a test may add beyond the interpreter when a problem states none.
    max_memory_bytes: upper bound on a problem's stated memory limit.
    output_bytes: most bytes a test may print (RLIMIT_FSIZE), and bound on any file it writes.
    scratch_bytes: size of the private tmpfs that is the program's working directory.
    processes: RLIMIT_NPROC: processes and threads of the program's uid, the main one included.
    open_files: RLIMIT_NOFILE.
    namespaces: use Linux namespaces where the host allows (False: resource limits only).
    python: the interpreter that runs the programs (it runs the runner too).
    temp_root: where temporary directories are made (default: the system's).
    uid_base: as root, a program runs as uid uid_base + 64 * (pid mod 65536) + slot, where slot
      (0..63) is free in this process while it runs: concurrent programs, in this and in other
      processes, never share a uid, hence an RLIMIT_NPROC count.
  """
  workers: int = max(1, os.cpu_count() or 1)
  time_limit_s: float = 2.0
  time_limit_scale: float = 1.0
  max_time_limit_s: float = 10.0
  wall_time_factor: float = 2.0
  wall_time_slack_s: float = 1.0
  program_timeout_s: float = 60.0
  memory_bytes: int = 512 << 20
  max_memory_bytes: int = 1 << 30
  output_bytes: int = 16 << 20
  scratch_bytes: int = 32 << 20
  processes: int = 8
  open_files: int = 32
  namespaces: bool = True
  python: str = sys.executable
  temp_root: str | None = None
  uid_base: int = 1_000_000_000

  def __post_init__(self):
    positive = ("time_limit_s", "time_limit_scale", "max_time_limit_s", "wall_time_factor",
                "program_timeout_s", "memory_bytes", "max_memory_bytes", "output_bytes",
                "scratch_bytes")
    for name in positive:
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"SandboxConfig.{name}={value!r} is not accepted; expected a number > 0")
    if not 1 <= self.workers <= 64:
      raise ValueError(f"SandboxConfig.workers={self.workers!r} is not accepted; expected 1..64")
    if self.processes < 1 or self.open_files < 8:
      raise ValueError(f"SandboxConfig processes={self.processes}, open_files={self.open_files} "
                       "are not accepted; expected processes >= 1 and open_files >= 8")
    if self.wall_time_slack_s < 0:
      raise ValueError(f"SandboxConfig.wall_time_slack_s={self.wall_time_slack_s!r} is not "
                       "accepted; expected >= 0")


@dataclasses.dataclass(frozen=True)
class Job:
  """One program and its tests.

  Attributes:
    program: Python 3 source.
    tests: [{"input": ..., "output": ...}]: stdin text and expected stdout text, or (with
      `fn_name`) the list of call arguments and the expected return value.
    fn_name: for call-based tests, the function to call (module level or a method of
      `class Solution`).
    time_limit_s: the problem's CPU limit per test (None: the config's default).
    memory_limit_bytes: the problem's memory limit (None or 0: the config's default).
  """
  program: str
  tests: Sequence[Mapping[str, Any]]
  fn_name: str | None = None
  time_limit_s: float | None = None
  memory_limit_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class Result:
  """What running one program gave.

  Attributes:
    passed: every test passed.
    verdict: "passed", or the verdict of the first failing test ("wrong_answer",
      "runtime_error", "time_limit", "output_limit"), or "sandbox_error" (the sandbox itself
      failed; logged; counts as failing).
    tests_run: tests that ran (up to and including the first failure).
    behaviour: a digest of what the program printed on the tests that ran and how the last one
      ended: programs with equal digests behaved identically on those tests.
    cpu_s, wall_s: summed over the tests that ran.
    detail: the failing test's stderr tail or the sandbox's error message.
  """
  passed: bool
  verdict: str
  tests_run: int
  behaviour: str
  cpu_s: float = 0.0
  wall_s: float = 0.0
  detail: str = ""


# ---------------------------------------------------------------------------------------------
# Running programs.


class _RunnerFailed(Exception):
  """The runner broke the protocol or died: a sandbox error, not the program's failure."""


class _Runner:
  """A started runner, signalled through a pidfd: a signal can never reach a recycled pid.

  Only the runner itself is signalled. Its init process (PID 1 of the sandbox's PID namespace)
  dies with it (PR_SET_PDEATHSIG), and the kernel then kills everything else in the namespace.
  """

  def __init__(self, proc: subprocess.Popen):
    self.proc = proc
    self._pidfd: int | None = os.pidfd_open(proc.pid)

  def kill(self, sig: int = signal.SIGKILL) -> None:
    if self._pidfd is None:
      return
    try:
      signal.pidfd_send_signal(self._pidfd, sig)
    except ProcessLookupError:
      pass

  def stop(self) -> None:
    """SIGTERM makes the runner kill its namespace and reap it; SIGKILL follows after 2 s."""
    if self._pidfd is None:
      return
    if self.proc.poll() is None:
      self.kill(signal.SIGTERM)
      timer = threading.Timer(2.0, self.kill)  # a blocking wait, not the polling wait(timeout)
      timer.start()
      self.proc.wait()
      timer.cancel()
    for stream in (self.proc.stdin, self.proc.stdout):
      try:
        stream.close()
      except OSError:
        pass
    os.close(self._pidfd)
    self._pidfd = None


class _Watchdog:
  """Kills the runner at a deadline, which unblocks every read and write on its pipes."""

  def __init__(self, runner: _Runner, seconds: float):
    self.fired = False
    self._runner = runner
    self._timer = threading.Timer(seconds, self._fire)
    self._timer.daemon = True
    self._timer.start()

  def _fire(self):
    self.fired = True
    self._runner.kill()

  def cancel(self):
    self._timer.cancel()
    self._timer.join()


def _read_exact(stream, size: int) -> bytes:
  data = stream.read(size)
  if data is None or len(data) != size:
    raise _RunnerFailed(f"runner output ended after {0 if data is None else len(data)} of {size} "
                        "bytes")
  return data


def _read_header(stream) -> dict:
  line = stream.readline(_MAX_HEADER_BYTES)
  if not line.endswith(b"\n"):
    raise _RunnerFailed("runner output ended" if not line else "runner header too long")
  try:
    header = json.loads(line)
  except ValueError as e:
    raise _RunnerFailed(f"malformed runner header: {e}") from None
  if not isinstance(header, dict):
    raise _RunnerFailed("malformed runner header")
  return header


class Sandbox:
  """Runs programs on tests in isolated processes; thread-safe.

  Args:
    config: limits and resources (see `SandboxConfig`).
  """

  def __init__(self, config: SandboxConfig | None = None):
    if sys.platform != "linux" or not hasattr(os, "pidfd_open"):
      raise RuntimeError("the code sandbox needs Linux (5.3 or newer: pidfd, memfd, namespaces); "
                         f"this is {sys.platform}")
    self.config = config or SandboxConfig()
    self._running = threading.BoundedSemaphore(self.config.workers)
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None
    self._pool_lock = threading.Lock()
    self._report = self._self_test()

  def close(self) -> None:
    with self._pool_lock:
      if self._pool is not None:
        self._pool.shutdown(wait=True)
        self._pool = None

  def __enter__(self) -> "Sandbox":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def uids(self) -> range:
    """The uids programs of this process may run as (when the trainer runs as root)."""
    first = self.config.uid_base + _UID_SLOTS * (os.getpid() % 65536)
    return range(first, first + _UID_SLOTS)

  def run_many(self, jobs: Sequence[Job]) -> list[Result]:
    """Runs `jobs` on the worker pool; results in the order of `jobs`."""
    with self._pool_lock:
      if self._pool is None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self.config.workers, thread_name_prefix="ksjax-sandbox")
      pool = self._pool
    return list(pool.map(self.run, jobs))

  def run(self, job: Job) -> Result:
    """Runs one program on its tests (blocks while `workers` programs are running)."""
    _check_tests(job)
    with self._running:
      return self._run(job)

  def isolation_report(self) -> dict[str, Any]:
    """What isolation is in force here, as found by the self-test when the sandbox was made."""
    return dict(self._report)

  def _self_test(self) -> dict[str, Any]:
    """Runs `PROBE`; the isolation report, or SandboxUnavailable if the probe did not pass."""
    hello: dict[str, Any] = {}
    with self._running:
      result = self._run(Job(program=PROBE, tests=PROBE_TESTS), hello_out=hello)
    report = _describe(self.config, hello, result)
    if not result.passed:
      raise SandboxUnavailable(_refusal(self.config, hello, report, result))
    return report

  # -------------------------------------------------------------------------------------------

  def _limits(self, job: Job) -> tuple[int, float, int]:
    cfg = self.config
    seconds = job.time_limit_s if job.time_limit_s and job.time_limit_s > 0 else cfg.time_limit_s
    cpu_s = int(math.ceil(min(cfg.max_time_limit_s, seconds * cfg.time_limit_scale)))
    cpu_s = max(1, cpu_s)
    wall_s = cpu_s * cfg.wall_time_factor + cfg.wall_time_slack_s
    memory = job.memory_limit_bytes if job.memory_limit_bytes else cfg.memory_bytes
    return cpu_s, wall_s, int(min(memory, cfg.max_memory_bytes))

  def _run(self, job: Job, hello_out: dict | None = None) -> Result:
    slot = _uid_slots.get()
    try:
      return self._run_as(job, self.uids()[slot], hello_out)
    finally:
      _uid_slots.put(slot)

  def _run_as(self, job: Job, uid: int, hello_out: dict | None) -> Result:
    cfg = self.config
    cpu_s, wall_s, memory = self._limits(job)
    call_based = job.fn_name is not None
    workdir = tempfile.mkdtemp(prefix="ksjax-sandbox-", dir=cfg.temp_root)
    try:
      if os.geteuid() == 0:
        os.chown(workdir, uid, uid)  # used as is when no mount namespace replaces it
      request = {
          "program": job.program, "fn_name": job.fn_name,
          "inputs": [json.dumps(t["input"]) if call_based else code_judge.as_text(t["input"])
                     for t in job.tests],
          "cpu_s": cpu_s, "wall_s": wall_s, "memory_bytes": memory,
          "output_bytes": cfg.output_bytes, "scratch_bytes": cfg.scratch_bytes,
          "processes": cfg.processes, "open_files": cfg.open_files, "uid": uid, "gid": uid,
          "namespaces": cfg.namespaces, "workdir": workdir,
      }
      deadline = min(cfg.program_timeout_s,
                     _STARTUP_ALLOWANCE_S + len(job.tests) * (wall_s + 0.5))
      with tempfile.TemporaryFile(dir=cfg.temp_root) as stderr:
        return self._communicate(job, request, workdir, deadline, stderr, hello_out)
    finally:
      shutil.rmtree(workdir, ignore_errors=True)

  def _communicate(self, job, request, workdir, deadline, stderr, hello_out) -> Result:
    cfg = self.config
    start = time.monotonic()
    digest = hashlib.sha256()
    tests_run, cpu = 0, 0.0
    try:
      proc = subprocess.Popen(
          [cfg.python, "-I", "-S", "-B", RUNNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
          stderr=stderr, cwd=workdir, env=RUNNER_ENV, start_new_session=True, close_fds=True)
    except OSError as e:
      return _sandbox_error(f"cannot start {cfg.python}: {e}", 0)
    runner = _Runner(proc)
    watchdog = _Watchdog(runner, deadline)
    try:
      try:
        proc.stdin.write(marshal.dumps(request))
        proc.stdin.close()
        hello = _read_header(proc.stdout)
        if "hello" not in hello:
          raise _RunnerFailed(f"expected the runner's hello, got {sorted(hello)}")
        if hello_out is not None:
          hello_out.update(hello["hello"])
        for index, test in enumerate(job.tests):
          header = _read_header(proc.stdout)
          size = header.get("bytes")
          if header.get("test") != index or not isinstance(size, int) or not (
              0 <= size <= cfg.output_bytes):
            raise _RunnerFailed(f"unexpected runner header for test {index}: {header}")
          payload = _read_exact(proc.stdout, size)
          tests_run += 1
          cpu += float(header.get("cpu_s", 0.0))
          verdict = header.get("verdict")
          passed, behaviour = code_judge.judge(verdict, payload, test, job.fn_name is not None)
          digest.update(behaviour)
          if not passed:
            if verdict == "ok":
              verdict = "wrong_answer"
            if verdict not in VERDICTS:
              raise _RunnerFailed(f"unknown verdict {verdict!r}")
            digest.update(verdict.encode())
            return Result(passed=False, verdict=verdict, tests_run=tests_run,
                          behaviour=digest.hexdigest(), cpu_s=cpu,
                          wall_s=time.monotonic() - start, detail=_failure_detail(header))
        if "done" not in _read_header(proc.stdout):
          raise _RunnerFailed("runner did not finish")
        proc.wait()  # it exits by itself now; the watchdog still guards
        return Result(passed=True, verdict="passed", tests_run=tests_run,
                      behaviour="passed", cpu_s=cpu, wall_s=time.monotonic() - start)
      except (_RunnerFailed, OSError) as e:
        if watchdog.fired:
          digest.update(b"program_timeout")
          return Result(passed=False, verdict="time_limit", tests_run=tests_run,
                        behaviour=digest.hexdigest(), cpu_s=cpu, wall_s=time.monotonic() - start,
                        detail=f"the program's {deadline:.1f} s were up")
        runner.stop()
        stderr.seek(max(0, os.fstat(stderr.fileno()).st_size - 2000))
        tail = stderr.read().decode("utf-8", "replace")
        _log.warning("sandbox error: %s; runner stderr: %s", e, tail)
        return _sandbox_error(f"{e}; runner stderr: {tail}", tests_run)
    finally:
      watchdog.cancel()
      runner.stop()


def _check_tests(job: Job) -> None:
  """ValueError for tests the runner cannot take (bad data, never the program's doing)."""
  if not job.tests:
    raise ValueError("a job needs at least one test")
  for index, test in enumerate(job.tests):
    if not isinstance(test, Mapping) or "input" not in test or "output" not in test:
      raise ValueError(f"test {index} is not a mapping with 'input' and 'output'")
    if job.fn_name is not None and not isinstance(test["input"], list):
      raise ValueError(f"test {index}: a call-based input is the list of arguments")
    if job.fn_name is None:
      code_judge.as_text(test["input"]), code_judge.as_text(test["output"])


def _failure_detail(header: Mapping[str, Any]) -> str:
  """The failing test's stderr tail, or how it ended when it wrote nothing there."""
  stderr = str(header.get("stderr") or "")
  if stderr.strip():
    return stderr
  verdict, signum, code = header.get("verdict"), header.get("signal"), header.get("exit_code")
  if verdict == "ok":
    return "wrong answer (nothing on stderr)"
  if isinstance(signum, int):
    try:
      name = signal.Signals(signum).name
    except ValueError:
      name = str(signum)
    return f"{verdict}: killed by {name}, nothing on stderr"
  return f"{verdict}: exit status {code}, nothing on stderr"


def _sandbox_error(message: str, tests_run: int) -> Result:
  return Result(passed=False, verdict="sandbox_error", tests_run=tests_run,
                behaviour="sandbox_error", detail=message)


def _describe(config: SandboxConfig, hello: dict, probe: Result) -> dict[str, Any]:
  namespaces = list(hello.get("namespaces", []))
  full = ({"network", "pid", "mount"} <= set(namespaces) and hello.get("minimal_root")
          and hello.get("capabilities_dropped"))
  private_uid = hello.get("euid") == 0 or "user" in namespaces
  return {
      "level": "full" if full and probe.passed else ("partial" if namespaces else "rlimits_only"),
      "probe": probe.verdict,
      "namespaces": namespaces,
      "network": "none (empty network namespace)" if "network" in namespaces else "host network",
      "filesystem": ("minimal read-only root, private tmpfs for /tmp and the working directory"
                     if hello.get("minimal_root") else "host file system"),
      "executables": ("none: directories of binaries are mounted noexec, so no shell or "
                      "subprocess can start" if hello.get("minimal_root") else "host's"),
      "processes": ("private PID namespace; all processes killed after each test"
                    if "pid" in namespaces else "process group only"),
      "program_uid": hello.get("program_uid"),
      "python": hello.get("python", config.python),
      "stdlib": hello.get("stdlib"),
      "capabilities_dropped": bool(hello.get("capabilities_dropped")),
      "fork_limit": (f"RLIMIT_NPROC={config.processes} on a uid private to the sandbox"
                     if private_uid else
                     f"RLIMIT_NPROC={config.processes} shared with the user's other processes"),
      "rlimits": {"cpu_s": "per test, from the problem", "address_space": "per problem, at most "
                  f"{config.max_memory_bytes}", "fsize": config.output_bytes + 1, "core": 0,
                  "nofile": config.open_files, "nproc": config.processes},
      "errors": list(hello.get("errors", [])) + ([probe.detail] if probe.detail else []),
  }


def _blocked_directory(path: str, uid: int, gid: int) -> str | None:
  """The first directory on the way to `path` (as written, then resolved) that `uid`, in group
  `gid` only, may not enter (or, for `path` itself, list), with its mode; None if there is none
  (by the permission bits; ACLs are not consulted)."""
  for candidate in dict.fromkeys((os.path.abspath(path), os.path.realpath(path))):
    parts = [part for part in candidate.split("/") if part]
    for depth in range(len(parts) + 1):
      directory = "/" + "/".join(parts[:depth])
      try:
        st = os.stat(directory)
      except OSError:
        return None
      need = 0o5 if depth == len(parts) else 0o1  # r-x for the library, --x on the way
      shift = 6 if st.st_uid == uid else 3 if st.st_gid == gid else 0
      if (st.st_mode >> shift) & need != need:
        return f"{directory} (mode {st.st_mode & 0o7777:04o}, owner uid {st.st_uid})"
  return None


def _refusal(config: SandboxConfig, hello: Mapping[str, Any], report: Mapping[str, Any],
             probe: Result) -> str:
  """One line: why the self-test failed and what to do."""
  lines = [line.strip() for line in probe.detail.splitlines() if line.strip()]
  error = lines[-1] if lines else "no error message"
  python = hello.get("python") or config.python
  text = (f"the code sandbox refuses to start: its self-test (an honest program importing "
          f"bisect, collections, fractions, functools, heapq, itertools, json, math and re) "
          f"ended in {probe.verdict} in isolation mode {report['level']} "
          f"(namespaces={config.namespaces}, interpreter {python}): {error}")
  uid, stdlib = hello.get("program_uid"), hello.get("stdlib")
  # On the host's file system (no minimal root), as another uid: can it read the library?
  if (isinstance(uid, int) and hello.get("euid") == 0 and uid != 0 and stdlib
      and not hello.get("minimal_root")):
    blocked = _blocked_directory(str(stdlib), uid, uid)
    where = (f"; the program runs as uid {uid}, which cannot read {blocked} on the way to the "
             f"interpreter's standard library {stdlib}" if blocked else
             f"; the program runs as uid {uid} and imports from {stdlib}")
    return text + where + (
        "; set SandboxConfig.python to an interpreter every user can read (e.g. "
        "/usr/bin/python3 of the same or a newer version) or make those directories readable "
        "by others (chmod o+rx)" + ("" if report["namespaces"] else
        ", or run where Linux namespaces are allowed (the sandbox then mounts the "
        "interpreter's prefix for the program)"))
  return text + ("; check that SandboxConfig.python is a working Python 3.9+ interpreter"
                 if probe.verdict == "sandbox_error" else "")


_default: Sandbox | None = None
_default_lock = threading.Lock()


def default_sandbox() -> Sandbox:
  """A process-wide sandbox with the default config."""
  global _default
  with _default_lock:
    if _default is None:
      _default = Sandbox()
    return _default


def isolation_report(sandbox: Sandbox | None = None) -> dict[str, Any]:
  """What isolation `sandbox` (default: the process-wide one) has here; see `Sandbox`."""
  return (sandbox or default_sandbox()).isolation_report()
