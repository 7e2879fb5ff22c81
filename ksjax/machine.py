"""One line naming the machine a result came from, for studies' and benchmarks' provenance; and
the entry points' re-execution with a faster allocator for XLA:CPU's buffers: jemalloc where the
system has it, else glibc's malloc on transparent huge pages (`reexec_with_allocator`).

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
# KSJAX_MALLOC: which allocator the entry points re-execute with (`malloc_environment`).
MALLOC_CHOICE = "KSJAX_MALLOC"
MALLOC_CHOICES = ("auto", "jemalloc", "glibc", "off")
_ACCEPTED = f"{', '.join(MALLOC_CHOICES)}, or the path of a jemalloc shared library"
# jemalloc's settings: transparent huge pages for its extents and metadata, and freed pages kept
# for reuse instead of handed back to the kernel after 10 s (the default decay). A caller's own
# MALLOC_CONF wins.
JEMALLOC_CONF = "thp:always,metadata_thp:auto,dirty_decay_ms:-1,muzzy_decay_ms:-1"


def _preloaded(environ: dict[str, str]) -> list[str]:
  """The libraries LD_PRELOAD names (ld.so splits it at colons and at spaces)."""
  return [p for p in environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]


def _is_allocator(library: str, environ: dict[str, str]) -> bool:
  """Whether a preloaded library replaces malloc: one named *malloc* (jemalloc, tcmalloc,
  mimalloc), or the library KSJAX_MALLOC names by path."""
  return "malloc" in os.path.basename(library) or library == environ.get(MALLOC_CHOICE)


def find_jemalloc() -> str | None:
  """The system's jemalloc shared library (e.g. 'libjemalloc.so.2' from Debian's and Ubuntu's
  libjemalloc2 package), or None."""
  import ctypes.util  # pylint: disable=g-import-not-at-top
  return ctypes.util.find_library("jemalloc")


def hugepages_environment(environ: dict[str, str] | None = None,
                          libc: tuple[str, str] | None = None,
                          thp_enabled: str = "/sys/kernel/mm/transparent_hugepage/enabled"
                          ) -> dict[str, str] | None:
  """The environment to re-execute this process in so that glibc's malloc asks the kernel for
  transparent huge pages, or None where there is nothing to do: not glibc 2.35 or later (the
  tunable's first release), huge pages off ('[never]' or no such file), or the tunable already in
  GLIBC_TUNABLES.

  Why: XLA:CPU allocates a program's buffers afresh on every call, glibc maps each large one
  with mmap and unmaps it when freed, so every call faults its temporaries in again, 4 KiB at a
  time. On the SmolLM2 update (64 x 128 rows) that was 3.6 million page faults and 23 s of
  system time per 63 s step; with this tunable 9 thousand faults, 9 s, and the step 1.15x faster
  (benchmarks/real_model.py --parts=malloc). The tunable is read when the process starts,
  hence the re-execution; nothing else in the environment changes. Why not keep freed memory
  with glibc's own tunables (glibc.malloc.arena_max=1 with mmap_max=0 and a high trim_threshold;
  as fast as jemalloc): the process then kept its peak, fragmented, and ran out of this machine's
  24 GiB once. jemalloc (`jemalloc_environment`) keeps freed memory without that growth."""
  environ = dict(os.environ if environ is None else environ)
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


def jemalloc_environment(library: str, environ: dict[str, str] | None = None) -> dict[str, str]:
  """The environment that preloads `library` (jemalloc) in place of glibc's malloc, with
  JEMALLOC_CONF unless MALLOC_CONF is set already.

  Why: even on huge pages, glibc hands every large block back to the kernel when it is freed, so
  each XLA:CPU call has its temporaries zeroed afresh by the kernel: the SmolLM2 update
  (64 x 128 rows) still spent 9-15 s of system time per step. jemalloc keeps freed pages and
  reuses them: in one run of benchmarks/real_model.py --parts=malloc the update took 49.9 s
  against 65.7 s with glibc on huge pages and 73.8 s with glibc as it is (74%, 62% and 54% of
  each process's dense matmul rate), with a peak resident memory of 17.0 GiB against glibc's
  16.5; the SmolLM2 config's trainer peaked at 10.3 GiB against 7.3 (it keeps what each program
  freed), for 24.7 s per step against 28.4. With jemalloc's default decay (pages handed back
  after about 10 s) the update took 69.2 s, and with a 30 s decay 68.6 s: no faster than glibc
  on huge pages, so the decay is off."""
  environ = dict(os.environ if environ is None else environ)
  preload = environ.get("LD_PRELOAD", "")
  environ["LD_PRELOAD"] = f"{library}:{preload}" if preload else library
  environ.setdefault("MALLOC_CONF", JEMALLOC_CONF)
  return environ


def malloc_environment(environ: dict[str, str] | None = None,
                       libc: tuple[str, str] | None = None,
                       thp_enabled: str = "/sys/kernel/mm/transparent_hugepage/enabled",
                       jemalloc: str | None = None) -> dict[str, str] | None:
  """The environment the entry points re-execute in for a faster allocator, or None to run as
  they are. KSJAX_MALLOC chooses:
    auto (default)  jemalloc where the system has it (`find_jemalloc`), else glibc on huge pages
                    where it takes them (`hugepages_environment`), else nothing;
    jemalloc        jemalloc, or an error where it is not installed;
    a path          that jemalloc library (e.g. one unpacked from a distribution's package);
    glibc           glibc on huge pages only;
    off             nothing.
  Nothing either off Linux (LD_PRELOAD is ld.so's), or where LD_PRELOAD already holds an
  allocator (`_is_allocator`): the chosen one (this process is the re-execution) or the user's
  own. `jemalloc` stands in for `find_jemalloc()` in tests.
  Raises ValueError, one line, on any other value or a path that is not a file."""
  environ = dict(os.environ if environ is None else environ)
  choice = environ.get(MALLOC_CHOICE, "auto") or "auto"
  is_path = os.sep in choice
  if is_path and not os.path.isfile(choice):
    raise ValueError(f"{MALLOC_CHOICE}={choice!r}: no such file; accepted: {_ACCEPTED}")
  if not is_path and choice not in MALLOC_CHOICES:
    raise ValueError(f"{MALLOC_CHOICE}={choice!r} is not accepted; expected one of {_ACCEPTED}")
  if (choice == "off" or not sys.platform.startswith("linux")
      or any(_is_allocator(p, environ) for p in _preloaded(environ))):
    return None
  if is_path or choice in ("auto", "jemalloc"):
    library = choice if is_path else jemalloc if jemalloc is not None else find_jemalloc()
    if library:
      return jemalloc_environment(library, environ)
    if choice == "jemalloc":
      raise ValueError(f"{MALLOC_CHOICE}=jemalloc: no jemalloc library found (Debian and "
                       f"Ubuntu: apt install libjemalloc2); accepted: {_ACCEPTED}")
  return hugepages_environment(environ, libc, thp_enabled)


def reexec_with_allocator(program: str) -> None:
  """Re-executes this process (same interpreter, same command line, `sys.orig_argv`) in
  `malloc_environment()`, or returns where that is None. For entry points, before jax loads. A bad
  KSJAX_MALLOC prints one line naming `program` and exits with status 2."""
  try:
    environ = malloc_environment()
  except ValueError as e:
    print(f"{program}: {e}", file=sys.stderr)
    sys.exit(2)
  if environ is None:
    return
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, sys.orig_argv, environ)


def without_allocator(environ: dict[str, str]) -> dict[str, str]:
  """`environ` less what `malloc_environment` adds (the preloaded allocator, JEMALLOC_CONF, the
  huge-pages tunable): for a child process that must choose its allocator afresh, such as the
  benchmark's runs under each one."""
  environ = dict(environ)
  preload = [p for p in _preloaded(environ) if not _is_allocator(p, environ)]
  environ.pop("LD_PRELOAD", None)
  if preload:
    environ["LD_PRELOAD"] = ":".join(preload)
  if environ.get("MALLOC_CONF") == JEMALLOC_CONF:
    del environ["MALLOC_CONF"]
  tunables = [t for t in environ.pop("GLIBC_TUNABLES", "").split(":")
              if t and t != HUGEPAGES_TUNABLE]
  if tunables:
    environ["GLIBC_TUNABLES"] = ":".join(tunables)
  return environ


def allocator_line(environ: dict[str, str] | None = None) -> str:
  """What this process allocates with, for benchmarks' first line: e.g. 'malloc:
  libjemalloc.so.2 preloaded, MALLOC_CONF=...' or 'malloc: glibc,
  GLIBC_TUNABLES=glibc.malloc.hugetlb=1'."""
  environ = os.environ if environ is None else environ
  preloaded = [p for p in _preloaded(environ) if _is_allocator(p, environ)]
  if preloaded:
    return (f"malloc: {os.path.basename(preloaded[0])} preloaded, "
            f"MALLOC_CONF={environ.get('MALLOC_CONF') or '(unset)'}")
  return f"malloc: glibc, GLIBC_TUNABLES={environ.get('GLIBC_TUNABLES') or '(unset)'}"
