"""Atomic files: a reader, or a run killed mid-write, never sees half a file.

Every file ksjax writes outside Orbax (run directories' JSON and tables, evaluation results,
figures, metric logs, the bandit study's report) goes through `atomic_write`: the content is
written to a temporary file in the same folder, which is then renamed over the target (a rename
within one file system is atomic on POSIX), and removed if writing fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any


def atomic_write(path: str, write: Callable[[str], None]) -> None:
  """Calls write(temporary_path) in path's folder, then renames the result to path."""
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
  except BaseException:
    os.unlink(tmp)
    raise


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
  def write(tmp: str) -> None:
    with open(tmp, "w", encoding="utf-8") as f:
      f.write(text)
  atomic_write(path, write)


def write_json(path: str, data: Any, *, indent: int = 1, sort_keys: bool = False) -> None:
  write_text(path, json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n")
