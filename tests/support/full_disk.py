"""A full disk, simulated: the file size limit (RLIMIT_FSIZE) with SIGXFSZ ignored, so that a
write past the limit fails with EFBIG, as a write to a full disk fails with ENOSPC, instead of
the kernel killing the process. Files the process already has open are held to it too."""

import contextlib
import resource
import signal
import sys


@contextlib.contextmanager
def file_size_limit(nbytes: int):
  """No file of this process may grow past `nbytes` inside the block."""
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
  try:
    yield
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, previous)


def limited(nbytes: int, command: list[str]) -> list[str]:
  """`command` run under the same limit, set by a Python that then execs it (an ignored signal
  stays ignored across exec); a preexec_fn would fork the multithreaded test process instead."""
  setup = ("import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
           f"resource.setrlimit(resource.RLIMIT_FSIZE, ({nbytes}, resource.RLIM_INFINITY)); "
           "os.execv(sys.argv[1], sys.argv[1:])")
  return [sys.executable, "-c", setup, *command]
