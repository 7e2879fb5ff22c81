"""Atomic files: a reader, or a run killed mid-write, never sees half a file.

Every file ksjax writes outside Orbax (run directories' JSON and tables, evaluation results,
figures, metric logs, the bandit study's report) goes through `atomic_write`: the content is
written to a temporary file in the same folder, which is then renamed over the target (a rename
within one file system is atomic on POSIX), and removed if writing fails. A write that fails for
want of space (ENOSPC, EDQUOT, or EFBIG: a file larger than the file system or the process's file
size limit allows) is raised as `DiskFull`, one line naming the file and the bytes it needed
(`disk_full`, which the checkpoints and the step log use too); the file is left as it was. The
entry points' boundary prints that line and exits with status 74 (`ksjax.errors`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any


# ---------------------------------------------------------------------------------------------
# A full disk
# ---------------------------------------------------------------------------------------------

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# TensorStore (Orbax's array writer) reports a failed write as a ValueError whose text ends with
# the OS error's number: `... Failed to write 61918 bytes to file 7: File too large
# [os_error_code='27']`.
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


class DiskFull(Exception):
  """A write failed for want of space; the message says what failed, how much space it needed
  and what is left whole (`disk_full`)."""


def _errno_in_text(text: str) -> int | None:
  for match in _OS_ERROR_CODE.finditer(text):
    if int(match.group(1)) in DISK_FULL_ERRNOS:
      return int(match.group(1))
  return None


def disk_full_errno(error: BaseException | None) -> int | None:
  """ENOSPC, EDQUOT or EFBIG when `error`, or an exception it was raised from or while handling
  (or a member of an exception group), is that OSError or TensorStore's report of one; else
  None."""
  seen: set[int] = set()
  stack = [error]
  while stack:
    e = stack.pop()
    if e is None or id(e) in seen:
      continue
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
      return e.errno
    code = _errno_in_text(str(e))
    if code is not None:
      return code
    stack += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
  return None


def size_text(nbytes: float) -> str:
  """1536 -> '1.5 KiB'."""
  for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
    if abs(nbytes) < 1024 or unit == "TiB":
      return f"{nbytes:.0f} {unit}" if unit == "bytes" else f"{nbytes:.1f} {unit}"
    nbytes /= 1024
  raise AssertionError("unreachable")


def _free_text(where: str) -> str:
  folder = os.path.abspath(where)
  while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
    folder = os.path.dirname(folder)
  try:
    return f"{size_text(shutil.disk_usage(folder).free)} free there"
  except OSError:
    return "the free space unknown"


def disk_full(what: str, error: BaseException, *, needs: int | None, where: str, left: str,
              at_least: bool = False) -> DiskFull | None:
  """The DiskFull to raise for `error` when it is a disk-full error (`disk_full_errno`), else
  None: '<what> failed (<the OS error>): it needs <needs>, <free space> there; <left>'.

  Args:
    what: what was being written ("checkpoint 12 in runs/x/checkpoints").
    error: the exception the write raised.
    needs: the bytes the write needed (a checkpoint: its size estimate); None if unknown.
    where: the path written, whose file system's free space the line gives.
    left: what is whole and how to go on.
    at_least: `needs` is what was written before the failure, so the least it needed.
  """
  code = disk_full_errno(error)
  if code is None:
    return None
  reason = os.strerror(code)
  if code == errno.EFBIG:
    reason += ": larger than the file system or the file size limit (ulimit -f) allows"
  needed = ("" if needs is None else
            f"it needs {'more than ' if at_least else ''}{size_text(needs)}, ")
  return DiskFull(f"{what} failed ({reason}): {needed}{_free_text(where)}; {left}")


# ---------------------------------------------------------------------------------------------
# Atomic writes
# ---------------------------------------------------------------------------------------------

def atomic_write(path: str, write: Callable[[str], None], *, size: int | None = None) -> None:
  """Calls write(temporary_path) in path's folder, then renames the result to path.

  `size`: the bytes `write` writes, when known, for the line a full disk gives (else the bytes it
  had written when it failed, as "at least")."""
  folder, name = os.path.split(os.path.abspath(path))
  root, extension = os.path.splitext(name)
  fd, tmp = tempfile.mkstemp(prefix=f".{root}.", suffix=f".tmp{extension}", dir=folder)
  os.close(fd)
  umask = os.umask(0)
  os.umask(umask)
  try:
    write(tmp)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file ordinary permissions
    os.replace(tmp, path)
  except BaseException as e:
    written = os.path.getsize(tmp)
    os.unlink(tmp)
    full = disk_full(f"writing {path}", e, needs=written if size is None else size,
                            at_least=size is None, where=folder,
                            left=f"{name} is as it was (a file is written whole or not at all)")
    if full is None:
      raise
    raise full from None


@contextlib.contextmanager
def new_directory(out: str) -> Iterator[str]:
  """Yields a path to fill in `out`'s folder, renamed to `out` once the block ends without an
  error (and removed otherwise): a directory written by a tool (a converted or merged model) is
  whole or absent. FileExistsError, before anything is written, if `out` exists."""
  if os.path.exists(out):
    raise FileExistsError(f"--out={out!r} exists; choose a new directory")
  parent = os.path.dirname(os.path.abspath(out))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".tmp_{os.path.basename(os.path.normpath(out))}_", dir=parent)
  try:
    result = os.path.join(tmp, "result")
    yield result
    os.rename(result, out)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def write_text(path: str, text: str) -> None:
  data = text.encode("utf-8")

  def write(tmp: str) -> None:
    with open(tmp, "wb") as f:
      f.write(data)
  atomic_write(path, write, size=len(data))


def write_json(path: str, data: Any, *, indent: int = 1, sort_keys: bool = False) -> None:
  write_text(path, json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n")
