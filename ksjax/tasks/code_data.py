"""Readers for the published files of CodeContests and TACO, yielding one normalised record each.

Both readers yield dicts of the same shape, so `CodeTask` and the data pipeline treat the two
datasets alike (all values JSON-serialisable):

  {"id": str, "name": str, "dataset": "code_contests" | "taco", "problem": str,
   "tests": [{"input": ..., "output": ...}], "num_public_tests": int,
   "fn_name": str | None, "starter_code": str, "time_limit_s": float | None,
   "memory_limit_bytes": int | None, "difficulty": str, "source": str, "solutions": [str]}

For stdin/stdout problems a test's input and output are strings; for call-based problems
(`fn_name` set, TACO only) the input is the list of arguments and the output the expected return
value. `solutions` holds the dataset's Python 3 solutions (for supervised warm-up), at most
`MAX_SOLUTIONS`.

Formats (as published):
* CodeContests (Li et al. 2022; the Hugging Face release `deepmind/code_contests`): one problem
  per row, with `name`, `description`, `public_tests`, `private_tests` and
  `generated_tests` as {"input": [...], "output": [...]}, `time_limit` {"seconds", "nanos"} or
  null, `memory_limit_bytes`, `difficulty` and `source` (enum ints or names), `solutions`
  {"language": [...], "solution": [...]} (language 3 is Python 3), `input_file`/`output_file`.
  Tests are public, then private, then generated. Problems that read or write named files
  instead of stdin/stdout (non-empty `input_file`/`output_file`) are dropped.
* TACO (Li et al. 2023; `BAAI/TACO`): one problem per row, with
  `question`, `input_output` (a JSON string {"inputs": [...], "outputs": [...], "fn_name"?}),
  `starter_code`, `difficulty`, `solutions` (a JSON string list of Python programs), `source`,
  `time_limit` ("1 second") and `memory_limit` ("256 megabytes"). Stdin inputs and outputs stored
  as lists of lines are joined with newlines. The id is the row's position in the split.

A path is a file, a directory of such files, or the common prefix of shards beside it (`data/train`
for Hugging Face's `data/train-00000-of-00039.parquet`...), read in sorted order. Files may be
parquet, Arrow streams (`.arrow`, as `datasets` saves them), JSONL or (TACO) a JSON list.

Problems with fewer than `min_tests` tests are dropped, as in the paper (5); the readers log how
many problems they kept and why they dropped the others. A missing path, a file in no known
format, a line that is not JSON or a record without the required fields raises `DataError`
naming the file and the expected format.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

from ksjax.errors import one_line
from ksjax.tasks.records import data_error, data_files, read_jsonl

MIN_TESTS = 5
MAX_SOLUTIONS = 4

CODE_CONTESTS_FORMAT = (
    "CodeContests parquet, Arrow or JSONL (one problem per row with name, description, "
    "public_tests/private_tests/generated_tests as {input: [...], output: [...]}, time_limit "
    "{seconds, nanos}, "
    "memory_limit_bytes, difficulty, source, solutions): a file, a directory of them or the "
    "prefix of shards <prefix>-*")
TACO_FORMAT = (
    "TACO parquet, Arrow, JSONL or JSON list (one problem per row with question, input_output as "
    "a JSON string {inputs, outputs, fn_name?}, starter_code, difficulty, solutions): a file, a "
    "directory of them or the prefix of shards <prefix>-*")

# contest_problem.proto of CodeContests.
_CC_DIFFICULTIES = ("UNKNOWN_DIFFICULTY", "EASY", "MEDIUM", "HARD", "HARDER", "HARDEST",
                    "EXTERNAL") + tuple("ABCDEFGHIJKLMNOPQRSTUV")
_CC_SOURCES = ("UNKNOWN_SOURCE", "CODECHEF", "CODEFORCES", "HACKEREARTH", "CODEJAM", "ATCODER",
               "AIZU")
_CC_PYTHON3 = (3, "PYTHON3")
_SUFFIXES = (".parquet", ".arrow", ".jsonl", ".json")

_log = logging.getLogger(__name__)


def _rows(path: str | os.PathLike, expected: str) -> Iterator[tuple[str, dict[str, Any]]]:
  """(location, row) for every row of every file under `path`."""
  for file in data_files(path, _SUFFIXES, expected):
    if file.endswith((".parquet", ".arrow")):
      yield from _arrow_rows(file, expected)
    elif file.endswith(".jsonl"):
      yield from read_jsonl(file, expected)
    elif file.endswith(".json"):
      yield from _json_list_rows(file, expected)
    else:
      raise data_error(file, "not a .parquet, .jsonl or .json file", expected)


def _arrow_rows(file: str, expected: str) -> Iterator[tuple[str, dict[str, Any]]]:
  """Rows of a parquet file or of an Arrow IPC stream (the `.arrow` files of Hugging Face
  `datasets`), batch by batch."""
  try:
    import pyarrow  # pylint: disable=g-import-not-at-top  (a dependency of tensorflow-datasets)
    import pyarrow.ipc  # pylint: disable=g-import-not-at-top
    import pyarrow.parquet  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise data_error(file, "reading it needs pyarrow, which is not installed", expected) from None
  kind = "parquet" if file.endswith(".parquet") else "Arrow stream"
  try:
    if kind == "parquet":
      batches = pyarrow.parquet.ParquetFile(file).iter_batches(batch_size=64)
    else:
      batches = iter(pyarrow.ipc.open_stream(file))
  except (pyarrow.ArrowException, OSError, UnicodeDecodeError) as e:  # (names not UTF-8)
    raise data_error(file, f"not a readable {kind} file ({one_line(e)})", expected) from None
  row = 0
  while True:
    try:  # a file damaged after its header fails here, batch by batch
      batch = next(batches, None)
      records = [] if batch is None else batch.to_pylist()
    except (pyarrow.ArrowException, OSError, UnicodeDecodeError) as e:  # (strings not UTF-8)
      raise data_error(f"{file}:row {row}", f"not a readable {kind} file from here on "
                       f"({one_line(e)})", expected) from None
    if batch is None:
      return
    for record in records:
      yield f"{file}:row {row}", record
      row += 1


def _json_list_rows(file: str, expected: str) -> Iterator[tuple[str, dict[str, Any]]]:
  try:
    with open(file, encoding="utf-8") as f:
      rows = json.load(f)
  except json.JSONDecodeError as e:
    raise data_error(file, f"invalid JSON ({e.msg} at line {e.lineno})", expected) from None
  except (UnicodeDecodeError, ValueError, RecursionError) as e:  # not UTF-8; an integer of more
    # digits than int() takes; nesting deeper than the recursion limit
    raise data_error(file, f"invalid JSON ({type(e).__name__}: {e})", expected) from None
  if not isinstance(rows, list):
    raise data_error(file, f"a JSON {type(rows).__name__}, not a list of objects", expected)
  for index, record in enumerate(rows):
    if not isinstance(record, dict):
      raise data_error(f"{file}[{index}]", f"a JSON {type(record).__name__}, not an object",
                       expected)
    yield f"{file}[{index}]", record


def _text(record: Mapping[str, Any], key: str, where: str, expected: str) -> str:
  value = record.get(key)
  if not isinstance(value, str) or not value.strip():
    raise data_error(where, f"field {key!r} is {str(value)[:80]!r}, not a non-empty string",
                     expected)
  return value


def _enum_name(value: Any, names: tuple[str, ...]) -> str:
  if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(names):
    return names[value]
  return str(value) if value not in (None, "") else names[0]


class _Counts:
  """Why problems were dropped, logged once a reader is exhausted."""

  def __init__(self, reader: str, path: str | os.PathLike, min_tests: int):
    self.reader, self.path, self.min_tests = reader, os.fspath(path), min_tests
    self.kept = 0
    self.dropped: collections.Counter[str] = collections.Counter()

  def log(self) -> None:
    reasons = ", ".join(f"{n} {why}" for why, n in sorted(self.dropped.items())) or "none"
    _log.info("%s(%s): kept %d problems; dropped: %s", self.reader, self.path, self.kept, reasons)


def _keep(record: dict[str, Any], counts: _Counts) -> bool:
  if len(record["tests"]) < counts.min_tests:
    counts.dropped[f"with fewer than {counts.min_tests} tests"] += 1
    return False
  counts.kept += 1
  return True


# ---------------------------------------------------------------------------------------------
# CodeContests.


def _cc_tests(record: Mapping[str, Any], key: str, where: str) -> list[dict[str, str]]:
  tests = record.get(key)
  if tests is None:
    return []
  inputs = tests.get("input") if isinstance(tests, Mapping) else None
  outputs = tests.get("output") if isinstance(tests, Mapping) else None
  if not (isinstance(inputs, list) and isinstance(outputs, list) and len(inputs) == len(outputs)
          and all(isinstance(x, str) for x in inputs + outputs)):
    raise data_error(where,
                     f"field {key!r} is not {{input: [str], output: [str]}} of equal lengths",
                     CODE_CONTESTS_FORMAT)
  return [{"input": i, "output": o} for i, o in zip(inputs, outputs)]


def _cc_time_limit(value: Any, where: str) -> float | None:
  if value is None:
    return None
  parts = (value.get("seconds") or 0, value.get("nanos") or 0) if isinstance(value, Mapping) else ()
  if not parts or not all(isinstance(p, (int, float)) and not isinstance(p, bool) for p in parts):
    raise data_error(where, f"time_limit {value!r} is not {{seconds, nanos}} (numbers)",
                     CODE_CONTESTS_FORMAT)
  try:
    seconds = float(parts[0]) + float(parts[1]) / 1e9
  except OverflowError:  # an integer beyond any float
    raise data_error(where, f"time_limit {value!r} is out of range", CODE_CONTESTS_FORMAT) from None
  if not math.isfinite(seconds):  # JSON's 1e999 reads as inf, NaN as nan
    raise data_error(where, f"time_limit {value!r} is not a finite number of seconds",
                     CODE_CONTESTS_FORMAT)
  return seconds if seconds > 0 else None


def _cc_solutions(value: Any) -> list[str]:
  if not isinstance(value, Mapping):
    return []
  languages, solutions = value.get("language"), value.get("solution")
  if not (isinstance(languages, list) and isinstance(solutions, list)):
    return []  # optional (for the warm-up), as TACO's: malformed ones are none
  return [s for lang, s in zip(languages, solutions)
          if lang in _CC_PYTHON3 and isinstance(s, str)][:MAX_SOLUTIONS]


def read_code_contests(path: str | os.PathLike, *, min_tests: int = MIN_TESTS
                       ) -> Iterator[dict[str, Any]]:
  """Normalised records of CodeContests problems (see the module docstring)."""
  counts = _Counts("read_code_contests", path, min_tests)
  seen: collections.Counter[str] = collections.Counter()
  for where, row in _rows(path, CODE_CONTESTS_FORMAT):
    name = _text(row, "name", where, CODE_CONTESTS_FORMAT)
    description = _text(row, "description", where, CODE_CONTESTS_FORMAT)
    if row.get("input_file") or row.get("output_file"):
      counts.dropped["reading or writing named files"] += 1
      continue
    public = _cc_tests(row, "public_tests", where)
    tests = (public + _cc_tests(row, "private_tests", where)
             + _cc_tests(row, "generated_tests", where))
    memory = row.get("memory_limit_bytes")
    seen[name] += 1
    record = {
        "id": name if seen[name] == 1 else f"{name}#{seen[name]}",
        "name": name, "dataset": "code_contests", "problem": description, "tests": tests,
        "num_public_tests": len(public), "fn_name": None, "starter_code": "",
        "time_limit_s": _cc_time_limit(row.get("time_limit"), where),
        "memory_limit_bytes": int(memory) if isinstance(memory, int) and memory > 0 else None,
        "difficulty": _enum_name(row.get("difficulty"), _CC_DIFFICULTIES),
        "source": _enum_name(row.get("source"), _CC_SOURCES),
        "solutions": _cc_solutions(row.get("solutions")),
    }
    if _keep(record, counts):
      yield record
  counts.log()


# ---------------------------------------------------------------------------------------------
# TACO.

_NUMBER_RE = re.compile(r"[0-9]+(?:\.[0-9]+)?")
_MEMORY_UNITS = {"kilobyte": 1 << 10, "megabyte": 1 << 20, "gigabyte": 1 << 30}


def _taco_time_limit(value: Any) -> float | None:
  """Seconds from "1 second", "2.5 seconds", 2; None when absent or unreadable."""
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return float(value) if value > 0 and math.isfinite(value) else None
  match = _NUMBER_RE.search(value) if isinstance(value, str) and "second" in value else None
  return float(match.group()) if match and float(match.group()) > 0 else None


def _taco_memory_limit(value: Any) -> int | None:
  """Bytes from "256 megabytes"; None when absent or unreadable."""
  if not isinstance(value, str):
    return None
  match = _NUMBER_RE.search(value)
  unit = next((size for name, size in _MEMORY_UNITS.items() if name in value), None)
  return int(float(match.group()) * unit) if match and unit and float(match.group()) > 0 else None


def _lines(value: Any) -> str | None:
  """Stdin/stdout text; a list of lines is joined. None for anything else."""
  if isinstance(value, str):
    return value
  if isinstance(value, list) and all(isinstance(v, str) for v in value):
    return "\n".join(value)
  return None


def _taco_tests(row: Mapping[str, Any], where: str, counts: _Counts
                ) -> tuple[list[dict[str, Any]], str | None] | None:
  """(tests, fn_name), or None (counted) when the problem's tests are unusable."""
  text = row.get("input_output")
  if text is None or (isinstance(text, str) and not text.strip()):
    return [], None
  try:
    spec = json.loads(text) if isinstance(text, str) else text
  except json.JSONDecodeError as e:
    raise data_error(where, f"input_output is not JSON ({e.msg})", TACO_FORMAT) from None
  except (ValueError, RecursionError) as e:  # too many digits for int(); too deeply nested
    raise data_error(where, f"input_output is not JSON ({type(e).__name__}: {e})",
                     TACO_FORMAT) from None
  if not isinstance(spec, Mapping):
    raise data_error(where, "input_output is not a JSON object", TACO_FORMAT)
  inputs, outputs, fn_name = spec.get("inputs"), spec.get("outputs"), spec.get("fn_name")
  if not (isinstance(inputs, list) and isinstance(outputs, list) and len(inputs) == len(outputs)):
    raise data_error(where, "input_output has no equally long inputs and outputs lists",
                     TACO_FORMAT)
  if fn_name is not None and (not isinstance(fn_name, str) or not fn_name.isidentifier()):
    raise data_error(where, f"fn_name {fn_name!r} is not a Python identifier", TACO_FORMAT)
  if fn_name:
    if not all(isinstance(i, list) for i in inputs):
      counts.dropped["with call-based inputs that are not argument lists"] += 1
      return None
    return [{"input": i, "output": o} for i, o in zip(inputs, outputs)], fn_name
  tests = [{"input": _lines(i), "output": _lines(o)} for i, o in zip(inputs, outputs)]
  if any(t["input"] is None or t["output"] is None for t in tests):
    counts.dropped["with stdin tests that are not text"] += 1
    return None
  return tests, None


def _taco_solutions(value: Any) -> list[str]:
  try:
    solutions = json.loads(value) if isinstance(value, str) else value
  except (ValueError, RecursionError):  # not JSON (JSONDecodeError), too many digits, too deep
    return []
  if not isinstance(solutions, list):
    return []
  return [s for s in solutions if isinstance(s, str) and s.strip()][:MAX_SOLUTIONS]


def read_taco(path: str | os.PathLike, *, min_tests: int = MIN_TESTS) -> Iterator[dict[str, Any]]:
  """Normalised records of TACO problems (see the module docstring)."""
  counts = _Counts("read_taco", path, min_tests)
  for index, (where, row) in enumerate(_rows(path, TACO_FORMAT)):
    question = _text(row, "question", where, TACO_FORMAT)
    parsed = _taco_tests(row, where, counts)
    if parsed is None:
      continue
    tests, fn_name = parsed
    starter = row.get("starter_code")
    record = {
        "id": str(index), "name": str(row.get("name") or index), "dataset": "taco",
        "problem": question, "tests": tests, "num_public_tests": 0, "fn_name": fn_name,
        "starter_code": starter if isinstance(starter, str) else "",
        "time_limit_s": _taco_time_limit(row.get("time_limit")),
        "memory_limit_bytes": _taco_memory_limit(row.get("memory_limit")),
        "difficulty": str(row.get("difficulty") or "UNKNOWN_DIFFICULTY"),
        "source": str(row.get("source") or ""),
        "solutions": _taco_solutions(row.get("solutions")),
    }
    if _keep(record, counts):
      yield record
  counts.log()
