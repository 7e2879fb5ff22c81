"""The entry points' re-execution with a faster allocator for XLA:CPU's buffers
(`reexec_with_allocator`): jemalloc where the system has it, else glibc's malloc on transparent
huge pages; `KSJAX_MALLOC` chooses. Standard library only, so that it runs before jax loads.

Why: XLA:CPU allocates a program's buffers afresh on every call. glibc maps each large one with
mmap and hands it back when freed, so every call has the kernel fault in and zero its
temporaries again. `benchmarks/real_model.py --parts=malloc` times the update under each
allocator (glibc as it is, glibc on huge pages, jemalloc) and prints each process's peak memory.
"""

from __future__ import annotations

import functools
import os
import platform
import resource
import sys

# glibc's malloc tunable that backs the large blocks it maps with transparent huge pages.
HUGEPAGES_TUNABLE = "glibc.malloc.hugetlb=1"
# KSJAX_MALLOC: which allocator the entry points re-execute with (`malloc_environment`).
MALLOC_CHOICE = "KSJAX_MALLOC"
MALLOC_CHOICES = ("auto", "jemalloc", "glibc", "off")
_ACCEPTED = f"{', '.join(MALLOC_CHOICES)}, or the path of a jemalloc shared library"
# jemalloc's settings: transparent huge pages for its extents and metadata, and freed pages kept
# for reuse instead of handed back to the kernel after its default decay. A caller's own
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
  time; huge pages take far fewer faults and less system time per step
  (benchmarks/real_model.py --parts=malloc). The tunable is read when the process starts,
  hence the re-execution; nothing else in the environment changes. Why not keep freed memory
  with glibc's own tunables (glibc.malloc.arena_max=1 with mmap_max=0 and a high trim_threshold):
  the process then keeps its peak, fragmented, without a bound, and can run the machine out of
  memory. jemalloc (`jemalloc_environment`) keeps freed memory without that growth."""
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
  each XLA:CPU call has its temporaries zeroed afresh by the kernel. jemalloc keeps freed pages
  and reuses them, which makes the update faster than under glibc on huge pages, at the price of
  a higher peak resident memory (the process keeps what each program freed; KSJAX_MALLOC=glibc
  gives it back). With jemalloc's default decay, which hands freed pages back to the kernel over
  time, it was no faster than glibc on huge pages, so the decay is off. The figures:
  benchmarks/real_model.py --parts=malloc, and docs/benchmarks.md."""
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


def peak_resident_gib() -> float:
  """This process's peak resident memory so far (or since `reset_peak_resident`), in GiB: what
  the machine had to hold for it, the pages its allocator kept after a free included (the figure
  that decides whether two runs fit one machine; `benchmarks/peak_memory.py` splits it by
  allocator setting). Linux's VmHWM, which can be reset; elsewhere ru_maxrss."""
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) / 2**20  # kB
  except OSError:
    pass
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
  return peak / 2**30 if sys.platform == "darwin" else peak / 2**20


def reset_peak_resident() -> bool:
  """Starts `peak_resident_gib` again from the memory resident now, after handing the freed
  pages the allocator keeps back to the system (`release_free_memory`); returns whether the
  system can reset it (Linux: writing 5 to /proc/self/clear_refs resets VmHWM). For benchmarks
  that measure a step's peak apart from the set-up's (building, quantizing, compiling)."""
  release_free_memory()
  try:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
      f.write("5")
    return True
  except OSError:
    return False


def release_free_memory() -> bool:
  """Hands the free pages glibc's malloc holds back to the kernel (`malloc_trim(0)`); returns
  whether the C library has the call (nothing happens where it does not: macOS, musl).

  Why: XLA:CPU frees a phase's temporaries when the phase ends (the sampler's, the reference
  forward's, the update's), and glibc keeps many of those pages for reuse. The next phase's
  temporaries, of other sizes, then land beside them, so a run's peak resident memory was the
  sum of two phases instead of the larger one. The trainer calls this between phases
  (`ksjax.trainer.loop`); `benchmarks/peak_memory.py` measures the peak with and without. A
  phase then faults its pages in afresh, which the huge pages above keep cheap. With jemalloc
  preloaded the call trims glibc's own, unused arenas: harmless.
  """
  global _MALLOC_TRIM
  if _MALLOC_TRIM is None:
    import ctypes  # pylint: disable=g-import-not-at-top
    try:
      _MALLOC_TRIM = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
      _MALLOC_TRIM = False
  if _MALLOC_TRIM is False:
    return False
  _MALLOC_TRIM(0)
  return True


_MALLOC_TRIM = None  # glibc's malloc_trim once looked up; False where the C library has none


def allocated_bytes() -> int | None:
  """Bytes glibc's malloc has handed out and not taken back (`mallinfo2`: its arenas' chunks in
  use plus its mapped blocks), or None where that is not what this process's malloc reports: a
  preloaded allocator (jemalloc and the like replace malloc, and glibc's figures would then count
  only glibc's own, unused arenas), or a C library without `mallinfo2` (glibc before 2.33,
  macOS, musl).

  Why not the resident memory: the pages glibc keeps after a free, and huge pages partly used,
  make the resident memory move by more or less than what was allocated, while the memory plan
  needs what a program holds (`memory_plan.held_since`)."""
  if any(_is_allocator(p, os.environ) for p in _preloaded(dict(os.environ))):
    return None
  mallinfo2 = _mallinfo2()
  if mallinfo2 is None:
    return None
  info = mallinfo2()
  return int(info.uordblks + info.hblkhd)


@functools.cache
def _mallinfo2():
  """glibc's `mallinfo2` through ctypes, its result type declared (None where the C library has
  none), looked up once: `allocated_bytes` is read around every compile the memory plan makes."""
  import ctypes  # pylint: disable=g-import-not-at-top

  class _Mallinfo2(ctypes.Structure):  # glibc's struct mallinfo2, every field a size_t
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

  try:
    mallinfo2 = ctypes.CDLL(None).mallinfo2
  except (AttributeError, OSError):
    return None
  mallinfo2.restype = _Mallinfo2
  return mallinfo2
