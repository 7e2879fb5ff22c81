"""The machine a result came from, for studies' and benchmarks' provenance (`describe`), and the
log line that says where bfloat16 matmul operands are slower than float32 ones
(`bfloat16_operand_note`), and whether this CPU lacks bfloat16 dot instructions
(`lacks_bfloat16_dots`, which `ksjax.model.layers` reads to run bfloat16 products on float32
kernels), and what a child process cost on it (`run_child`). Standard library only: `.ci/run` loads this file by path, before the
install, to name the CI machine.

CPU results depend on the machine as much as on the commit: XLA:CPU picks its kernels by the
instruction set, so a bfloat16 matmul runs on matrix units where the CPU has AMX and is emulated
(slower than float32) where it has only AVX2, and summation orders differ with the vector width.
`describe()` reads the model name and those instruction-set flags from /proc/cpuinfo: the standard
library's `platform.processor()` is empty or just the architecture on Linux, and py-cpuinfo would
be a new dependency that starts a subprocess for the same line.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import sys
import time

# The flags that decide which matmul kernels XLA:CPU can use, widest first.
MATMUL_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


def _cpuinfo(path: str) -> tuple[str | None, set[str]]:
  """The first processor's model name and flags in a /proc/cpuinfo file (None and {} if absent)."""
  model, flags = None, set()
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model is None:
          model = value.strip()
        elif key.strip() == "flags":
          flags = set(value.split())
          break
  except OSError:
    pass
  return model, flags


def describe(cpuinfo: str = "/proc/cpuinfo") -> str:
  """E.g. 'AMD EPYC, 2 CPUs, avx2' or 'Intel(R) Xeon(R) Platinum 8481C, 2 CPUs, amx_bf16 ...'."""
  model, flags = _cpuinfo(cpuinfo)
  found = [f for f in MATMUL_FLAGS if f in flags]
  return ", ".join([model or platform.processor() or platform.machine(),
                    f"{os.cpu_count()} CPUs", *([" ".join(found)] if found else [])])


_BF16_DOT_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})
_LACKS_BF16_DOTS: dict[str, bool] = {}


def lacks_bfloat16_dots(cpuinfo: str = "/proc/cpuinfo") -> bool:
  """Whether this CPU has no bfloat16 dot instructions (neither amx_bf16 nor avx512_bf16), read
  once per file; False where cpuinfo is unreadable or has no flags (not a Linux x86 CPU)."""
  if cpuinfo not in _LACKS_BF16_DOTS:
    _, flags = _cpuinfo(cpuinfo)
    _LACKS_BF16_DOTS[cpuinfo] = bool(flags) and not flags & _BF16_DOT_FLAGS
  return _LACKS_BF16_DOTS[cpuinfo]


def bfloat16_operand_note(operand_dtype: str, backend: str,
                          cpuinfo: str = "/proc/cpuinfo") -> str | None:
  """A line for the log where bfloat16 matmul operands are slower than float32 ones: on a CPU
  without bfloat16 dot instructions (no amx_bf16 or avx512_bf16) the model widens the rounded
  operands to float32 before each dot (`layers.kernel_operands`), and the rounding and widening
  cost time that float32 operands do not (`benchmarks/bfloat16_dots.py` times the three ways).
  None elsewhere, or where cpuinfo is unreadable."""
  if operand_dtype != "bfloat16" or backend != "cpu":
    return None  # the common case reads no file
  if not lacks_bfloat16_dots(cpuinfo):
    return None
  return ("note: config.model.matmul_dtype='bfloat16' on a CPU without bfloat16 dot instructions "
          "(no amx_bf16 or avx512_bf16): its products run as float32 dots of the rounded "
          "operands, slower than float32 operands here; "
          "--config.model.matmul_dtype=float32 runs them in float32")


@dataclasses.dataclass(frozen=True)
class ChildRun:
  """What one child process cost, from the kernel's accounting of it."""
  exit_status: int      # as os.waitstatus_to_exitcode: negative for a signal
  wall_seconds: float
  cpu_seconds: float    # user + system, every thread, and the children it waited for
  peak_rss_bytes: int   # its high-water resident memory (ru_maxrss)


def run_child(command, **popen) -> ChildRun:
  """Runs `command` (with subprocess.Popen's keywords) to its end and measures it with
  os.wait4, which reports the child's own usage: `resource.getrusage(RUSAGE_CHILDREN)` would sum
  every child this process ever waited for. On Linux a child's ru_maxrss starts from the
  launching process's resident pages at the fork, so its peak reads at least that size (the
  launchers here are small scripts). The studies and benchmarks that time a run or record its
  peak memory share this."""
  start = time.time()
  child = subprocess.Popen(command, **popen)
  _, status, usage = os.wait4(child.pid, 0)
  # ru_maxrss is in KiB on Linux, bytes on macOS.
  peak = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
  return ChildRun(exit_status=os.waitstatus_to_exitcode(status),
                  wall_seconds=time.time() - start, cpu_seconds=usage.ru_utime + usage.ru_stime,
                  peak_rss_bytes=peak)
