"""One line naming the machine a result came from, for studies' and benchmarks' provenance; and
the entry points' re-execution with transparent huge pages for glibc's malloc
(`reexec_with_hugepages`).

CPU results depend on the machine as much as on the commit: XLA:CPU picks its kernels by the
instruction set, so a bfloat16 matmul runs on matrix units where the CPU has AMX and is emulated
(slower than float32) where it has only AVX2, and summation orders differ with the vector width.
`describe()` reads the model name and those instruction-set flags from /proc/cpuinfo. Written by
hand: the standard library's `platform.processor()` is empty or just the architecture on Linux, and
py-cpuinfo (a new dependency) would spend about a second in a subprocess for the same line.
"""

from __future__ import annotations

import os
import platform
import sys

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


def bfloat16_operand_note(operand_dtype: str, backend: str,
                          cpuinfo: str = "/proc/cpuinfo") -> str | None:
  """A line for the log where bfloat16 matmul operands are slower than float32 ones: on a CPU
  without bfloat16 dot instructions (no amx_bf16 or avx512_bf16) XLA converts the operands and
  runs float32 kernels: its matmuls at SmolLM2's shapes ran at 0.6-0.7x float32's speed on an
  AVX2 machine (`benchmarks/real_model.py --parts=roofline`, which times both). None elsewhere, or
  where cpuinfo is unreadable."""
  if operand_dtype != "bfloat16" or backend != "cpu":
    return None  # the common case reads no file
  _, flags = _cpuinfo(cpuinfo)
  if not flags or flags & {"amx_bf16", "avx512_bf16"}:
    return None
  return ("note: config.model.matmul_dtype='bfloat16' on a CPU without bfloat16 dot instructions "
          "(no amx_bf16 or avx512_bf16): XLA emulates them, slower than float32 here; "
          "--config.model.matmul_dtype=float32 runs them in float32")


# glibc's malloc tunable that backs the large blocks it maps with transparent huge pages.
HUGEPAGES_TUNABLE = "glibc.malloc.hugetlb=1"
HUGEPAGES_OPT_OUT = "KSJAX_HUGEPAGES"  # =0 keeps the environment as it is


def hugepages_environment(environ: dict[str, str] | None = None,
                          libc: tuple[str, str] | None = None,
                          thp_enabled: str = "/sys/kernel/mm/transparent_hugepage/enabled"
                          ) -> dict[str, str] | None:
  """The environment to re-execute this process in so that glibc's malloc asks the kernel for
  transparent huge pages, or None where there is nothing to do: not glibc 2.35 or later (the
  tunable's first release), huge pages off ('[never]' or no such file), the tunable already in
  GLIBC_TUNABLES, or KSJAX_HUGEPAGES=0.

  Why: XLA:CPU allocates a program's buffers afresh on every call, glibc maps each large one
  with mmap and unmaps it when freed, so every call faults its temporaries in again, 4 KiB at a
  time. On the SmolLM2 update (64 x 128 rows) that was 3.6 million page faults and 23 s of
  system time per 63 s step; with this tunable 9 thousand faults, 9 s, and the step 1.15x faster
  (benchmarks/real_model.py --parts=hugepages). The tunable is read when the process starts,
  hence the re-execution; nothing else in the environment changes. Why not keep freed memory
  instead (glibc.malloc.arena_max=1 with mmap_max=0 and a high trim_threshold; as fast): the
  process then keeps its peak, fragmented, and ran out of this machine's 24 GiB."""
  environ = dict(os.environ if environ is None else environ)
  if environ.get(HUGEPAGES_OPT_OUT) == "0":
    return None
  name, version = platform.libc_ver() if libc is None else libc
  try:
    major, minor = (int(x) for x in version.split(".")[:2])
  except ValueError:
    return None
  if name != "glibc" or (major, minor) < (2, 35):
    return None
  try:
    with open(thp_enabled, encoding="utf-8") as f:
      if "[never]" in f.read():
        return None
  except OSError:
    return None
  tunables = environ.get("GLIBC_TUNABLES", "")
  if "glibc.malloc.hugetlb=" in tunables:
    return None
  environ["GLIBC_TUNABLES"] = f"{tunables}:{HUGEPAGES_TUNABLE}" if tunables else HUGEPAGES_TUNABLE
  return environ


def reexec_with_hugepages() -> None:
  """Re-executes this process (same interpreter, same command line, `sys.orig_argv`) in
  `hugepages_environment()`, or returns where that is None. For entry points, before jax loads."""
  environ = hugepages_environment()
  if environ is None:
    return
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, sys.orig_argv, environ)
