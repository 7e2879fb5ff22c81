"""Atomic files: a reader, or a run killed mid-write, never sees half a file.

Every file ksjax writes outside Orbax (run directories' JSON and tables, evaluation results,
figures, metric logs, the bandit study's report) goes through `atomic_write`: the content is
written to a temporary file in the same folder, which is then renamed over the target (a rename
within one file system is atomic on POSIX), and removed if writing fails. A write that fails for
want of space (`ksjax.errors.disk_full`) is raised as `DiskFull`, one line naming the file and the
bytes it needed; the file is left as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from ksjax import errors


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
    full = errors.disk_full(f"writing {path}", e, needs=written if size is None else size,
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
