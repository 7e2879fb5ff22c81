"""Readers for the published files of MATH, MATH-500 and HARP, yielding one normalised record each.

Every reader yields dicts of the same shape, so `MathTask` and the data pipeline treat the three
datasets alike:

  {"id": str, "problem": str, "answer": str, "solution": str | None, "level": int | None,
   "subject": str | None, ...extra metadata (str/int values)}

Formats (as published):
* MATH (Hendrycks et al.): a directory tree `root/[split/]subject/NNN.json`, each file
  {"problem", "level": "Level 1".."Level 5" or "Level ?", "type", "solution"}. The gold answer is
  the content of the last `\\boxed{}` (or `\\fbox{}`) of the solution. The id is the file's path
  relative to `root` ("test/algebra/1.json"), which is how MATH-500 names the same problems.
* MATH-500 (PRM800K's test subset): JSONL with {"problem", "solution", "answer", "subject",
  "level": int or "Level N" or "N", "unique_id"}.
* HARP (Yue et al. 2024): JSONL with {"problem", "answer", "solution_1", "solution_2", ...,
  "year", "contest", "number", "level", "subject"}; numbers may be strings or ints. The id is HARP's
  own "year/contest/number".

Nothing is skipped silently: a missing path or a malformed record raises `DataError` naming the
file (and line), what is wrong and the expected format.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ksjax.tasks.math_answer import clean_answer, last_boxed
from ksjax.tasks.records import data_error, read_jsonl

MATH_DIR_FORMAT = ("MATH directory root/[split/]subject/NNN.json, each file a JSON object with string "
                   "fields problem, level (\"Level 1\"..\"Level 5\" or \"Level ?\"), type and solution "
                   "(ending in \\boxed{answer})")
MATH500_FORMAT = ("MATH-500 JSONL: one JSON object per line with string fields problem, answer, "
                  "unique_id, and optional solution, subject, level (int or \"Level N\")")
HARP_FORMAT = ("HARP JSONL: one JSON object per line with string fields problem, answer, optional "
               "solution_1, solution_2, ..., subject, and year, contest, number, level as strings or "
               "ints")


def _level(value: Any, where: str, expected: str) -> int | None:
  """1..9 from 3, "3", "Level 3"; None from "Level ?" or a missing level."""
  if value is None or value == "Level ?":
    return None
  if isinstance(value, bool):
    raise data_error(where, f"level {value!r} is not a level", expected)
  if isinstance(value, int):
    number = value
  elif isinstance(value, str):
    text = value.removeprefix("Level ").strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 4:  # not "²", nor 5000 digits
      raise data_error(where, f"level {value!r} is not a level", expected)
    number = int(text)
  else:
    raise data_error(where, f"level {value!r} is not a level", expected)
  if not 1 <= number <= 9:
    raise data_error(where, f"level {value!r} is out of range 1..9", expected)
  return number


def _string(record: Mapping[str, Any], key: str, where: str, expected: str, *,
            required: bool = True, numbers_ok: bool = False) -> str | None:
  value = record.get(key)
  if value is None:
    if required:
      raise data_error(where, f"field {key!r} is missing", expected)
    return None
  if numbers_ok and isinstance(value, (int, float)) and not isinstance(value, bool):
    return str(value)
  if not isinstance(value, str):
    raise data_error(where, f"field {key!r} is {type(value).__name__}, not a string", expected)
  if required and not value.strip():
    raise data_error(where, f"field {key!r} is empty", expected)
  return value


def _check_exists(path: str, expected: str, *, directory: bool) -> None:
  if not (os.path.isdir(path) if directory else os.path.isfile(path)):
    kind = "directory" if directory else "file"
    raise data_error(os.fspath(path), f"no such {kind}", expected)


def _unique(records: Iterator[dict[str, Any]], path: str, expected: str) -> Iterator[dict[str, Any]]:
  seen: set[str] = set()
  for record in records:
    if record["id"] in seen:
      raise data_error(path, f"id {record['id']!r} occurs twice", expected)
    seen.add(record["id"])
    yield record


def read_math_dir(path: str) -> Iterator[dict[str, Any]]:
  """Records of a MATH directory (`root/[split/]subject/NNN.json`), in sorted path order.

  The directory layout is checked at the call; each file when its record is reached.
  """
  _check_exists(path, MATH_DIR_FORMAT, directory=True)
  files = []
  for directory, subdirs, names in os.walk(path):
    subdirs.sort()
    files.extend(os.path.join(directory, name) for name in names if name.endswith(".json"))
  files = [f for f in files if 2 <= len(os.path.relpath(f, path).split(os.sep)) <= 3]
  if not files:
    raise data_error(path, "no subject/NNN.json or split/subject/NNN.json files", MATH_DIR_FORMAT)

  def sort_key(file):
    parts = os.path.relpath(file, path).split(os.sep)
    stem = parts[-1].removesuffix(".json")
    return parts[:-1], (0, int(stem), "") if stem.isdigit() else (1, 0, stem)

  return _math_dir_records(path, sorted(files, key=sort_key))


def _math_dir_records(path: str, files: list[str]) -> Iterator[dict[str, Any]]:
  for file in files:
    relative = os.path.relpath(file, path).replace(os.sep, "/")
    try:
      with open(file, encoding="utf-8") as f:
        record = json.load(f)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, an integer
      # of more digits than int() takes, nesting deeper than the recursion limit
      raise data_error(file, f"invalid JSON ({e})", MATH_DIR_FORMAT) from None
    if not isinstance(record, dict):
      raise data_error(file, f"a JSON {type(record).__name__}, not an object", MATH_DIR_FORMAT)
    solution = _string(record, "solution", file, MATH_DIR_FORMAT)
    box = last_boxed(solution)
    if box is None or not clean_answer(box[1] or ""):
      raise data_error(file, "the solution has no complete \\boxed{...} or \\fbox{...} answer",
                       MATH_DIR_FORMAT)
    if not isinstance(record.get("level"), str):
      raise data_error(file, f"level {record.get('level')!r} is not a string", MATH_DIR_FORMAT)
    out = {
        "id": relative,
        "problem": _string(record, "problem", file, MATH_DIR_FORMAT),
        "answer": clean_answer(box[1]),
        "solution": solution,
        "level": _level(record["level"], file, MATH_DIR_FORMAT),
        "subject": _string(record, "type", file, MATH_DIR_FORMAT),
    }
    parts = relative.split("/")
    if len(parts) == 3:
      out["split"] = parts[0]
    yield out


def read_math500_jsonl(path: str) -> Iterator[dict[str, Any]]:
  """Records of a MATH-500 JSONL file, in file order (each line checked when reached)."""
  _check_exists(path, MATH500_FORMAT, directory=False)

  def records():
    for where, record in read_jsonl(path, MATH500_FORMAT, allow_empty=False):
      yield {
          "id": _string(record, "unique_id", where, MATH500_FORMAT),
          "problem": _string(record, "problem", where, MATH500_FORMAT),
          "answer": clean_answer(_string(record, "answer", where, MATH500_FORMAT, numbers_ok=True)),
          "solution": _string(record, "solution", where, MATH500_FORMAT, required=False),
          "level": _level(record.get("level"), where, MATH500_FORMAT),
          "subject": _string(record, "subject", where, MATH500_FORMAT, required=False),
      }
  return _unique(records(), path, MATH500_FORMAT)


def _int_or_str(value: Any, key: str, where: str) -> int | str | None:
  if value is None or (isinstance(value, int) and not isinstance(value, bool)):
    return value
  if isinstance(value, str):  # ASCII digits only ("²".isdigit() too, but int() refuses it)
    digits = value.strip()
    return int(digits) if digits.isascii() and digits.isdigit() and len(digits) < 100 else value
  raise data_error(where, f"field {key!r} is {type(value).__name__}, not a string or int",
                   HARP_FORMAT)


def read_harp_jsonl(path: str) -> Iterator[dict[str, Any]]:
  """Records of a HARP JSONL file, in file order (each line checked when reached).

  Extra metadata: year, contest, number (ints where they are digits) and num_solutions.
  """
  _check_exists(path, HARP_FORMAT, directory=False)

  def records():
    for where, record in read_jsonl(path, HARP_FORMAT, allow_empty=False):
      solutions = []
      index = 1
      while f"solution_{index}" in record:
        solutions.append(_string(record, f"solution_{index}", where, HARP_FORMAT))
        index += 1
      ident = {k: _int_or_str(record.get(k), k, where) for k in ("year", "contest", "number")}
      if any(v is None for v in ident.values()):
        raise data_error(where,
                         "fields year, contest and number are needed to identify the problem",
                         HARP_FORMAT)
      out = {
          "id": "/".join(str(ident[k]) for k in ("year", "contest", "number")),
          "problem": _string(record, "problem", where, HARP_FORMAT),
          "answer": clean_answer(_string(record, "answer", where, HARP_FORMAT, numbers_ok=True)),
          "solution": solutions[0] if solutions else None,
          "level": _level(record.get("level"), where, HARP_FORMAT),
          "subject": _string(record, "subject", where, HARP_FORMAT, required=False),
          **ident,
          "num_solutions": len(solutions),
      }
      yield out
  return _unique(records(), path, HARP_FORMAT)


# Format name (as used in configs) -> reader.
READERS: Mapping[str, Callable[[str], Iterator[dict[str, Any]]]] = {
    "math_dir": read_math_dir,
    "math500_jsonl": read_math500_jsonl,
    "harp_jsonl": read_harp_jsonl,
}


def read_records(path: str, fmt: str) -> Iterator[dict[str, Any]]:
  """Records of `path` read as format `fmt` (a key of READERS)."""
  if fmt not in READERS:
    raise ValueError(f"unknown math data format {fmt!r}; expected one of {', '.join(READERS)}")
  return READERS[fmt](path)
