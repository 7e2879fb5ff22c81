"""Finding and reading the published files that dataset readers turn into records.

The math readers (`ksjax.tasks.math_data`), the code readers (`ksjax.tasks.code_data`) and the
dataset builders (`ksjax.tasks.data`) share three things, kept here so they cannot drift apart:

* one form of error, `DataError("<where>: <what is wrong>; expected <format>")`, where `where` is
  a file, "file:line" or "file[index]";
* one meaning of a dataset path: a file, a directory of data files, or the common prefix of
  shards beside it (`data/train` for Hugging Face's `data/train-00000-of-00039.parquet`...).
  `data.py` asks `input_exists` before a build writes anything and the code readers list the
  files with `data_files`, so a path the readers accept is never refused before they see it;
* one JSONL reader, which checks every line is a JSON object and names the line that is not.

The standard library's `json` reads JSONL line by line well enough; `datasets`/`pyarrow`'s JSON
readers would infer a schema across lines and hide which line was malformed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

from ksjax.tasks.base import DataError


def data_error(where: str, what: str, expected: str) -> DataError:
  """The one error of a malformed or missing input: where, what is wrong, what is accepted."""
  return DataError(f"{where}: {what}; expected {expected}")


def _shards(path: str, suffixes: Sequence[str]) -> list[str]:
  """The files `<path>-*` (ending in one of `suffixes`, if any are given), sorted."""
  parent, prefix = os.path.dirname(path) or ".", os.path.basename(path) + "-"
  return _files_in(parent, prefix, suffixes) if os.path.isdir(parent) else []


def _files_in(directory: str, prefix: str, suffixes: Sequence[str]) -> list[str]:
  return sorted(os.path.join(directory, name) for name in os.listdir(directory)
                if name.startswith(prefix) and (not suffixes or name.endswith(tuple(suffixes)))
                and os.path.isfile(os.path.join(directory, name)))


def input_exists(path: str | os.PathLike) -> bool:
  """Whether `path` names input: a file, a directory, or the prefix of shards `<path>-*`."""
  path = os.fspath(path)
  return os.path.exists(path) or bool(_shards(path, ()))


def data_files(path: str | os.PathLike, suffixes: Sequence[str], expected: str) -> list[str]:
  """The files `path` names, in reading order.

  Args:
    path: a file; a directory, whose files ending in `suffixes` are read; or, for a path that
      does not exist, the prefix of the shards `<path>-*` (ending in `suffixes`) beside it.
    suffixes: the accepted file endings, e.g. (".parquet", ".jsonl").
    expected: the accepted format, for the error message.

  Raises:
    DataError: naming `path` when it names no data file.
  """
  path = os.fspath(path)
  if os.path.isfile(path):
    return [path]
  if os.path.isdir(path):
    files = _files_in(path, "", suffixes)
    if not files:
      raise data_error(path, f"a directory without {', '.join(suffixes)} files", expected)
    return files
  shards = _shards(path, suffixes)
  if not shards:
    raise data_error(path, "no such file or directory, and no shards named like it", expected)
  return shards


def read_jsonl(path: str, expected: str, *, allow_empty: bool = True
               ) -> Iterator[tuple[str, dict[str, Any]]]:
  """("path:line", object) for each non-blank line of a JSONL file.

  Args:
    path: the file.
    expected: the accepted format, for error messages.
    allow_empty: False raises DataError for a file without records (once it is read through).

  Raises:
    DataError: naming the file and line of the first line that is not a JSON object (or not
      UTF-8 text).
  """
  count = 0
  # Lines are split on b"\n" (JSON Lines' separator, "\r\n" included) and decoded one by one,
  # so that a line that is not UTF-8 is named like a line that is not JSON.
  with open(path, "rb") as f:
    for line_number, raw in enumerate(f, start=1):
      where = f"{path}:{line_number}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise data_error(where, f"not UTF-8 text (byte {e.start + 1}: {e.reason})",
                         expected) from None
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise data_error(where, f"invalid JSON ({e.msg} at column {e.colno})", expected) from None
      except (ValueError, RecursionError) as e:  # an integer of more digits than int() takes,
        # or nesting deeper than the recursion limit: JSON, but not what a record can be
        raise data_error(where, f"invalid JSON ({type(e).__name__}: {e})", expected) from None
      if not isinstance(record, dict):
        raise data_error(where, f"a JSON {type(record).__name__}, not an object", expected)
      count += 1
      yield where, record
  if count == 0 and not allow_empty:
    raise data_error(path, "no records", expected)
