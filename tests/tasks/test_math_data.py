"""Readers of MATH, MATH-500 and HARP files: hand-written fixtures in the published formats, and one
clear DataError for each kind of malformed input."""

import json
import os

import pytest

from ksjax.tasks.base import DataError
from ksjax.tasks.math_data import (read_harp_jsonl, read_math500_jsonl, read_math_dir,
                                   read_records)
from tests import support

FIXTURES = str(support.FIXTURES / "math")
MATH_ROOT = os.path.join(FIXTURES, "MATH")


def test_math_dir_with_splits():
  records = list(read_math_dir(MATH_ROOT))
  # Sorted by directory, then numerically by problem number (2 before 10).
  assert [r["id"] for r in records] == [
      "test/number_theory/3.json", "train/algebra/2.json", "train/algebra/10.json",
      "train/geometry/7.json"]
  by_id = {r["id"]: r for r in records}
  assert by_id["train/algebra/2.json"] == {
      "id": "train/algebra/2.json",
      "problem": "What is the value of $x$ if $2x + 3 = 4$?",
      "answer": "\\frac{1}{2}",
      "solution": "Subtracting 3 from both sides gives $2x = 1$, so $x = \\boxed{\\frac{1}{2}}$.",
      "level": 1,
      "subject": "Algebra",
      "split": "train",
  }
  assert by_id["train/algebra/10.json"]["answer"] == "(-2,2)"  # the last of two boxes
  assert by_id["train/geometry/7.json"]["answer"] == "\\frac{\\sqrt{3}}{2}"  # \fbox{$...$}
  assert by_id["test/number_theory/3.json"]["answer"] == "\\{1,2,3\\}"  # escaped braces
  assert by_id["test/number_theory/3.json"]["level"] is None  # "Level ?"


def test_math_dir_of_one_split():
  records = list(read_math_dir(os.path.join(MATH_ROOT, "train")))
  assert [r["id"] for r in records] == ["algebra/2.json", "algebra/10.json", "geometry/7.json"]
  assert all("split" not in r for r in records)


def test_math500_jsonl():
  records = list(read_math500_jsonl(os.path.join(FIXTURES, "math500.jsonl")))
  assert [r["id"] for r in records] == [
      "test/counting_and_probability/12.json", "test/prealgebra/301.json",
      "test/precalculus/807.json"]
  assert [r["level"] for r in records] == [1, 2, 2]  # from 1, "Level 2" and "2"
  assert records[2]["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"
  assert records[0]["subject"] == "Counting & Probability"
  assert records[0]["solution"].endswith("\\boxed{10}$.")


def test_harp_jsonl():
  records = list(read_harp_jsonl(os.path.join(FIXTURES, "harp.jsonl")))
  assert [r["id"] for r in records] == ["2003/AMC_12A/5", "2010/AIME_I/7", "1999/AHSME/12"]
  first = records[0]
  assert (first["year"], first["contest"], first["number"]) == (2003, "AMC_12A", 5)
  assert first["solution"] == "Pairing terms gives $5 \\cdot 11 = \\boxed{55}$."
  assert first["num_solutions"] == 2
  assert [r["level"] for r in records] == [1, 3, 2]  # ints and strings
  assert records[2]["answer"] == "\\frac{1}{4}"  # "$\frac{1}{4}$" unwrapped


def test_read_records_dispatches_on_format():
  path = os.path.join(FIXTURES, "harp.jsonl")
  assert list(read_records(path, "harp_jsonl")) == list(read_harp_jsonl(path))
  with pytest.raises(ValueError, match="unknown math data format 'csv'"):
    read_records(path, "csv")


# ------------------------------------------------------------------------------------------------
# Malformed input.


def _write_math_file(root, relative, record):
  path = os.path.join(root, relative)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.write(record if isinstance(record, str) else json.dumps(record))
  return path


GOOD_MATH = {"problem": "p", "level": "Level 2", "type": "Algebra", "solution": "so \\boxed{3}."}


@pytest.mark.parametrize("record,message", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "a JSON list, not an object"),
    ({**GOOD_MATH, "solution": "no box here"}, "no complete \\\\boxed"),
    ({**GOOD_MATH, "solution": "cut off \\boxed{3"}, "no complete \\\\boxed"),
    ({**GOOD_MATH, "level": "Level six"}, "level 'Level six' is not a level"),
    ({**GOOD_MATH, "level": 2}, "level 2 is not a string"),
    ({k: v for k, v in GOOD_MATH.items() if k != "problem"}, "field 'problem' is missing"),
    ({**GOOD_MATH, "type": 7}, "field 'type' is int, not a string"),
])
def test_malformed_math_file(tmp_path, record, message):
  _write_math_file(tmp_path, "train/algebra/1.json", GOOD_MATH)
  bad = _write_math_file(tmp_path, "train/algebra/2.json", record)
  with pytest.raises(DataError, match=message) as error:
    list(read_math_dir(str(tmp_path)))
  assert bad in str(error.value) and "expected MATH directory" in str(error.value)


def test_math_dir_missing_or_empty(tmp_path):
  missing = str(tmp_path / "nowhere")
  with pytest.raises(DataError, match=f"{missing}: no such directory; expected MATH directory"):
    read_math_dir(missing)  # raised at the call, before iterating
  with pytest.raises(DataError, match="no subject/NNN.json"):
    read_math_dir(str(tmp_path))


def _write_lines(tmp_path, lines):
  path = tmp_path / "data.jsonl"
  path.write_text("".join(l if isinstance(l, str) else json.dumps(l) + "\n" for l in lines))
  return str(path)


GOOD_500 = {"problem": "p", "solution": "s", "answer": "3", "subject": "Algebra", "level": 3,
            "unique_id": "test/algebra/1.json"}
GOOD_HARP = {"year": 2001, "contest": "AMC_10", "number": 3, "level": 2, "problem": "p",
             "answer": "3", "solution_1": "s"}


@pytest.mark.parametrize("reader,good,bad,message", [
    (read_math500_jsonl, GOOD_500, "{oops\n", "invalid JSON"),
    (read_math500_jsonl, GOOD_500, "[]\n", "a JSON list, not an object"),
    (read_math500_jsonl, GOOD_500, {**GOOD_500, "answer": None}, "field 'answer' is missing"),
    (read_math500_jsonl, GOOD_500, {**GOOD_500, "answer": ["3"]}, "field 'answer' is list"),
    (read_math500_jsonl, GOOD_500, {**GOOD_500, "level": "hard"}, "level 'hard' is not a level"),
    (read_math500_jsonl, GOOD_500, {**GOOD_500, "level": 12}, "level 12 is out of range"),
    (read_math500_jsonl, GOOD_500, {**GOOD_500, "problem": " "}, "field 'problem' is empty"),
    (read_math500_jsonl, GOOD_500, GOOD_500, "id 'test/algebra/1.json' occurs twice"),
    (read_harp_jsonl, GOOD_HARP, {**GOOD_HARP, "number": None}, "year, contest and number"),
    (read_harp_jsonl, GOOD_HARP, {**GOOD_HARP, "year": [2001]}, "field 'year' is list"),
    (read_harp_jsonl, GOOD_HARP, {**GOOD_HARP, "solution_1": 5}, "field 'solution_1' is int"),
    (read_harp_jsonl, GOOD_HARP, {**GOOD_HARP, "level": True}, "level True is not a level"),
])
def test_malformed_jsonl(tmp_path, reader, good, bad, message):
  path = _write_lines(tmp_path, [good, "\n", bad])
  with pytest.raises(DataError, match=message) as error:
    list(reader(path))
  # Names the file and line (duplicates: the file), and the expected format.
  assert path in str(error.value) and "; expected" in str(error.value)
  if "twice" not in message:
    assert f"{path}:3:" in str(error.value)


@pytest.mark.parametrize("reader", [read_math500_jsonl, read_harp_jsonl])
def test_jsonl_missing_or_empty(tmp_path, reader):
  missing = str(tmp_path / "none.jsonl")
  with pytest.raises(DataError, match="no such file"):
    reader(missing)
  with pytest.raises(DataError, match="no records"):
    list(reader(_write_lines(tmp_path, ["\n"])))


def test_numeric_answers_are_accepted_as_text(tmp_path):
  path = _write_lines(tmp_path, [{**GOOD_500, "answer": 42}])
  assert next(read_math500_jsonl(path))["answer"] == "42"
