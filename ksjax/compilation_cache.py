"""JAX's persistent compilation cache for the ksjax binaries: on by default, in the user's cache.

A run compiles dozens of programs (sampling, the update per row bucket, the held-out evaluation),
seconds each on a CPU, and a study runs the same programs again in every run and every resume.
With the cache, a program compiled once is read back from disk by every later process.

`KSJAX_COMPILATION_CACHE` chooses:
  * unset or empty: `$XDG_CACHE_HOME/ksjax/jax/<cpu>`, else `~/.cache/ksjax/jax/<cpu>` (created,
    mode 0700; one directory per CPU kind, see `default_dir`).
    If it cannot be created, one line on stderr says so and the program runs without a cache: the
    location is ksjax's choice, not the user's, and a read-only home (a container, a CI runner)
    must not stop a run that worked without a cache.
  * `off`: no cache.
  * a directory (created if missing): that one. If it is a file, cannot be created or is not
    writable, the program stops with one line and exit status 2 (an `errors.INPUT_ERRORS` type):
    the user asked for that directory, and a run that silently compiled everything again would
    be seconds or minutes slower without saying why.
When the variable is unset, JAX's own `JAX_COMPILATION_CACHE_DIR` and
`JAX_ENABLE_COMPILATION_CACHE`, if given, are left to decide; so are
`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` and `JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES`
whenever they are given.

Every program is cached, however quick its compilation: JAX writes only those that took at least
a second by default, but on a CPU most of a run's compilations take less than that and add up to
more than its few slow ones, while reading one back takes milliseconds.

Applied by `ksjax.errors.boundary`, so in every binary and before its first compilation; a
program that only imports ksjax keeps JAX's configuration as it was. The cache is trusted code:
a directory that others can write to would let them run programs as you (hence mode 0700 for the
default one). It only grows (JAX evicts entries only under a size limit, whose bookkeeping reads
every entry on each write); deleting it at any time is safe.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Mapping

from ksjax import machine

ENV = "KSJAX_COMPILATION_CACHE"
OFF = "off"

# JAX's environment variables for the options set here: one the user gave is left as it is.
_JAX_LOCATION = ("JAX_COMPILATION_CACHE_DIR", "JAX_ENABLE_COMPILATION_CACHE")
_THRESHOLDS = {
    # Write every program (JAX's default: only those that took >= 1 s to compile).
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    # No size floor, and none that JAX may substitute for a filesystem (0 lets it).
    "jax_persistent_cache_min_entry_size_bytes": -1,
}


class CompilationCacheError(ValueError):
  """KSJAX_COMPILATION_CACHE names a directory that cannot be used (an input error)."""


def default_dir(environ: Mapping[str, str] = os.environ) -> str:
  """`$XDG_CACHE_HOME/ksjax/jax/<cpu>`, else `~/.cache/ksjax/jax/<cpu>` (a relative
  XDG_CACHE_HOME is ignored, as the XDG base directory specification says). <cpu> is a short
  hash of the CPU model and its matmul instruction sets (`machine.describe`): XLA:CPU compiles
  for the CPU it runs on, and a home directory shared between machines (NFS, a copied image)
  must not hand one CPU's code to another."""
  base = environ.get("XDG_CACHE_HOME", "")
  if not os.path.isabs(base):
    base = os.path.join(os.path.expanduser("~"), ".cache")
  cpu = hashlib.sha256(machine.describe().encode()).hexdigest()[:12]
  return os.path.join(base, "ksjax", "jax", cpu)


def _usable(path: str) -> str | None:
  """Why `path` cannot hold the cache (after creating it if missing), or None if it can."""
  if os.path.exists(path) and not os.path.isdir(path):
    return "it is not a directory"
  try:
    os.makedirs(path, mode=0o700, exist_ok=True)
  except OSError as e:
    return f"it cannot be created: {e.strerror or e}"
  if not os.access(path, os.W_OK | os.X_OK):
    return "it is not writable"
  return None


def choose(prog: str, environ: Mapping[str, str] = os.environ) -> str | None:
  """The cache directory the environment asks for (created), None for none, or "" to leave
  the choice to JAX's own variables. Raises CompilationCacheError for an unusable explicit one;
  warns on stderr and returns None for an unusable default one."""
  value = environ.get(ENV, "").strip()
  if value.lower() == OFF:
    return None
  if value:
    path = os.path.abspath(os.path.expanduser(value))
    problem = _usable(path)
    if problem:
      raise CompilationCacheError(
          f"{ENV}={value!r} cannot hold the compilation cache: {problem}; expected a writable "
          f"directory (created if missing) or {OFF!r}")
    return path
  if any(name in environ for name in _JAX_LOCATION):
    return ""
  path = default_dir(environ)
  problem = _usable(path)
  if problem:
    print(f"{prog}: warning: running without a compilation cache: {path}: {problem} (set {ENV} "
          f"to a writable directory, or to {OFF})", file=sys.stderr, flush=True)
    return None
  return path


def configure(prog: str, environ: Mapping[str, str] = os.environ) -> str | None:
  """Sets JAX's persistent compilation cache as the environment asks (`choose`); returns the
  directory in use, or None when there is none (or JAX's own variables chose it)."""
  path = choose(prog, environ)
  import jax  # pylint: disable=g-import-not-at-top  # after the checks: a bad value fails fast
  if path is None:
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  if path:
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
  for option, value in _THRESHOLDS.items():
    if option.upper() not in environ:
      jax.config.update(option, value)
  return path or None
