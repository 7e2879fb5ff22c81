"""Fuzzing the data readers (`ksjax.tasks.math_data`, `ksjax.tasks.code_data`): MATH JSON,
MATH-500 and HARP JSONL, CodeContests and TACO parquet, Arrow and JSON rows. What every reader
must do with garbage: `tests/support/fuzz.py`."""

from __future__ import annotations

import json
import os
import pathlib
import tempfile

import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ksjax.tasks import code_data, math_data
from tests.support.fuzz import (FUZZ, NASTY_STRINGS, RAW_LINES, assert_input_error, damaged,
                                input_error_or_result, json_values, jsonl_bytes, mutated)

MATH_RECORD = {"problem": "What is $1 + 1$?", "level": "Level 2", "type": "Algebra",
               "solution": "It is $\\boxed{2}$."}
MATH_FIELDS = {"level": st.one_of(st.sampled_from(NASTY_STRINGS), st.integers(-2, 12).map(
    lambda n: f"Level {n}")), "solution": st.sampled_from(
        ["\\boxed{}", "\\boxed{2", "\\fbox{3}", "$\\boxed{\\frac{1}{2}}$", "no box", "\\boxed"])}


@FUZZ
@given(files=st.lists(st.one_of(mutated(MATH_RECORD, MATH_FIELDS).map(
    lambda r: json.dumps(r).encode()), st.sampled_from(RAW_LINES)).flatmap(damaged),
    min_size=1, max_size=3),
       names=st.lists(st.sampled_from(["1.json", "2.json", "x.json", "00.json", "3.txt"]),
                      min_size=3, max_size=3, unique=True))
def test_math_json_directories(files, names):
  with tempfile.TemporaryDirectory() as root:
    os.makedirs(os.path.join(root, "test", "algebra"))
    for name, data in zip(names, files):
      pathlib.Path(root, "test", "algebra", name).write_bytes(data)
    input_error_or_result(lambda: list(math_data.read_math_dir(root)), where=root)


MATH500_RECORD = {"problem": "What is $2 + 2$?", "solution": "$\\boxed{4}$", "answer": "4",
                  "subject": "Algebra", "level": 1, "unique_id": "test/algebra/1.json"}
HARP_RECORD = {"problem": "Find $x$.", "answer": "3", "solution_1": "So $x = 3$.",
               "solution_2": "Or 3.", "year": "2019", "contest": "AMC", "number": 7,
               "level": 2, "subject": "algebra"}
IDS = {"unique_id": st.sampled_from(["a", "a", "b"]), "year": st.sampled_from(NASTY_STRINGS),
       "number": st.one_of(st.integers(), st.sampled_from(NASTY_STRINGS)),
       "level": st.one_of(st.integers(-2, 12), st.sampled_from(NASTY_STRINGS)),
       "answer": st.one_of(st.floats(), st.integers(), st.sampled_from(NASTY_STRINGS))}


@FUZZ
@given(data=st.sampled_from(["math500", "harp"]).flatmap(lambda fmt: st.tuples(
    st.just(fmt), jsonl_bytes(mutated(MATH500_RECORD if fmt == "math500" else HARP_RECORD,
                                      IDS)))))
def test_math500_and_harp_jsonl(data):
  fmt, content = data
  reader = {"math500": math_data.read_math500_jsonl, "harp": math_data.read_harp_jsonl}[fmt]
  with tempfile.TemporaryDirectory() as root:
    path = os.path.join(root, "test.jsonl")
    pathlib.Path(path).write_bytes(content)
    input_error_or_result(lambda: list(reader(path)), where=root)


def _cc_tests(n):
  return {"input": [f"{i}\n" for i in range(n)], "output": [f"{i}\n" for i in range(n)]}


CC_RECORD = {"name": "p", "description": "Echo.", "public_tests": _cc_tests(2),
             "private_tests": _cc_tests(2), "generated_tests": _cc_tests(1),
             "time_limit": {"seconds": 1, "nanos": 500}, "memory_limit_bytes": 1 << 28,
             "difficulty": 1, "source": 2, "input_file": "", "output_file": "",
             "solutions": {"language": [3, 2], "solution": ["print(input())", "x"]}}
CC_FIELDS = {
    "public_tests": st.one_of(st.integers(0, 6).map(_cc_tests), st.fixed_dictionaries(
        {"input": json_values, "output": json_values})),
    "time_limit": st.fixed_dictionaries({"seconds": json_values, "nanos": json_values}),
    "solutions": st.fixed_dictionaries({"language": json_values, "solution": json_values}),
    "memory_limit_bytes": st.one_of(st.integers(), st.floats()),
    "difficulty": st.one_of(st.integers(), st.text(max_size=5)),
}
TACO_SPEC = {"inputs": ["1\n"] * 5, "outputs": ["1\n"] * 5}
TACO_RECORD = {"question": "Echo.", "input_output": json.dumps(TACO_SPEC), "starter_code": "",
               "difficulty": "EASY", "solutions": json.dumps(["print(input())"]),
               "time_limit": "1 second", "memory_limit": "256 megabytes", "source": "x",
               "name": "echo"}
TACO_FIELDS = {
    "input_output": st.one_of(
        mutated({**TACO_SPEC, "fn_name": "f"}).map(json.dumps),
        st.sampled_from([raw.decode("utf-8", "replace") for raw in RAW_LINES])),
    "solutions": st.one_of(json_values.map(json.dumps),
                           st.sampled_from([raw.decode("utf-8", "replace") for raw in RAW_LINES])),
    "time_limit": st.one_of(st.floats(), st.integers(), st.sampled_from(NASTY_STRINGS)),
    "memory_limit": st.sampled_from(NASTY_STRINGS),
}
CODE_READERS = {"code_contests": (code_data.read_code_contests, CC_RECORD, CC_FIELDS),
                "taco": (code_data.read_taco, TACO_RECORD, TACO_FIELDS)}


def _json_rows(fmt):
  _, record, fields = CODE_READERS[fmt]
  return mutated(record, fields)


@FUZZ
@given(data=st.sampled_from(sorted(CODE_READERS)).flatmap(lambda fmt: st.tuples(
    st.just(fmt), st.sampled_from([".jsonl", ".json"]),
    st.lists(_json_rows(fmt), max_size=3), jsonl_bytes(_json_rows(fmt)),
    st.sampled_from(RAW_LINES))))
def test_code_readers_on_json_and_jsonl(data):
  fmt, suffix, rows, jsonl, raw = data
  content = jsonl if suffix == ".jsonl" else json.dumps(rows).encode() if rows else raw
  with tempfile.TemporaryDirectory() as root:
    path = os.path.join(root, "train" + suffix)
    pathlib.Path(path).write_bytes(content)
    input_error_or_result(lambda: list(CODE_READERS[fmt][0](path, min_tests=1)), where=root)


@pytest.mark.parametrize("solutions", [{"language": None, "solution": 1},
                                       {"language": [3], "solution": "print(1)"}, [3], "x"])
def test_code_contests_malformed_solutions_are_none(solutions, tmp_path):
  """Found by this fuzzing at KSJAX_FUZZ_SCALE=5 (a TypeError): the optional reference solutions,
  when not {language: [...], solution: [...]}, are none, as TACO's are."""
  path = tmp_path / "train.jsonl"
  path.write_text(json.dumps({**CC_RECORD, "solutions": solutions}) + "\n")
  (record,) = code_data.read_code_contests(str(path), min_tests=1)
  assert record["solutions"] == [] and len(record["tests"]) == 5


@pytest.mark.parametrize("seconds", ["1e999", "-1e999", "NaN", "Infinity"])
def test_code_contests_non_finite_time_limit_is_a_data_error(seconds, tmp_path):
  """JSON's 1e999 reads as inf (and Python's json takes NaN and Infinity): no time limit."""
  path = tmp_path / "train.jsonl"
  path.write_text(json.dumps(CC_RECORD).replace('"seconds": 1', f'"seconds": {seconds}') + "\n")
  message = assert_input_error(lambda: list(code_data.read_code_contests(str(path), min_tests=1)),
                               match=r"time_limit .* is not a finite number of seconds")
  assert str(path) in message


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e999])
def test_taco_non_finite_time_limit_is_none(value, tmp_path):
  """TACO's time limit is free text, read leniently: one it cannot read is none."""
  path = tmp_path / "train.jsonl"
  path.write_text(json.dumps({**TACO_RECORD, "time_limit": value}) + "\n")
  (record,) = code_data.read_taco(str(path), min_tests=1)
  assert record["time_limit_s"] is None


# Arrow columns: each field gets one type per file (a column has one type), values of that type.
ARROW_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)  # Arrow: UTF-8
ARROW_TYPES = {
    "string": (pa.string(), st.one_of(ARROW_TEXT, st.sampled_from(
        [t for t in NASTY_STRINGS if t.isascii() or t.isprintable()]))),
    "int": (pa.int64(), st.integers(-2**63, 2**63 - 1)),
    "float": (pa.float64(), st.floats()),
    "bool": (pa.bool_(), st.booleans()),
    "binary": (pa.binary(), st.binary(max_size=8)),
    "strings": (pa.list_(pa.string()), st.lists(ARROW_TEXT, max_size=3)),
    "ints": (pa.list_(pa.int64()), st.lists(st.integers(-5, 5), max_size=3)),
    "tests": (pa.struct([("input", pa.list_(pa.string())), ("output", pa.list_(pa.string()))]),
              st.fixed_dictionaries({"input": st.lists(ARROW_TEXT, max_size=6),
                                     "output": st.lists(ARROW_TEXT, max_size=6)})),
    "time": (pa.struct([("seconds", pa.int64()), ("nanos", pa.int64())]),
             st.fixed_dictionaries({"seconds": st.integers(-2**40, 2**40),
                                    "nanos": st.integers(-2**40, 2**40)})),
}


@st.composite
def arrow_table(draw, fmt):
  _, record, _ = CODE_READERS[fmt]
  names = draw(st.lists(st.sampled_from(sorted(record) + ["extra"]), unique=True, min_size=1))
  rows = draw(st.integers(0, 3))
  columns = {}
  for name in names:
    kind, values = ARROW_TYPES[draw(st.sampled_from(sorted(ARROW_TYPES)))]
    columns[name] = pa.array(draw(st.lists(st.one_of(st.none(), values), min_size=rows,
                                           max_size=rows)), type=kind)
  return pa.table(columns)


@FUZZ
@given(data=st.sampled_from(sorted(CODE_READERS)).flatmap(lambda fmt: st.tuples(
    st.just(fmt), st.sampled_from([".parquet", ".arrow"]), arrow_table(fmt),
    st.sampled_from(["as is", "as is", "cut", "flip"]), st.randoms(use_true_random=False))))
def test_code_readers_on_parquet_and_arrow(data):
  fmt, suffix, table, damage, rng = data
  with tempfile.TemporaryDirectory() as root:
    path = os.path.join(root, "train-00000-of-00001" + suffix)
    if suffix == ".parquet":
      pyarrow.parquet.write_table(table, path)
    else:
      with pa.OSFile(path, "wb") as sink, pyarrow.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    content = bytearray(pathlib.Path(path).read_bytes())
    if damage == "cut":
      content = content[:rng.randrange(len(content))]
    elif damage == "flip":
      for _ in range(rng.randint(1, 8)):
        content[rng.randrange(len(content))] = rng.randrange(256)
    pathlib.Path(path).write_bytes(bytes(content))
    # The shard prefix, as Hugging Face's files are named.
    input_error_or_result(lambda: list(CODE_READERS[fmt][0](os.path.join(root, "train"),
                                                            min_tests=1)), where=root)
