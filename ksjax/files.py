"""Atomic files: a reader, or a run killed mid-write, never sees half a file.

Every file ksjax writes outside Orbax (run directories' JSON and tables, evaluation results,
figures, metric logs, the bandit study's report) goes through `atomic_write`: the content is
written to a temporary file in the same folder, which is then renamed over the target (a rename
within one file system is atomic on POSIX), and removed if writing fails.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
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


def write_text(path: str, text: str) -> None:
  def write(tmp: str) -> None:
    with open(tmp, "w", encoding="utf-8") as f:
      f.write(text)
  atomic_write(path, write)


def write_json(path: str, data: Any, *, indent: int = 1, sort_keys: bool = False) -> None:
  write_text(path, json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n")
