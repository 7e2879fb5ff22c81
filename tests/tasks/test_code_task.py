"""CodeContests/TACO readers on small files in the published formats, program extraction, and
CodeTask prompts and scoring through the real sandbox."""

import json
import logging

import numpy as np
import pytest

from ksjax.tasks import code_data, code_task
from ksjax.tasks import sandbox as sb
from ksjax.tasks.base import DataError
from ksjax.tasks.synthetic import make_tokenizer

ADD_SOLUTION = "a, b = map(int, input().split())\nprint(a + b)"


def _io(pairs):
  return {"input": [f"{a} {b}\n" for a, b in pairs], "output": [f"{a + b}\n" for a, b in pairs]}


def cc_row(name, public, private=(), generated=(), **fields):
  """A CodeContests row as the Hugging Face release stores it."""
  row = {
      "name": name, "description": f"Print the sum of two integers ({name}).",
      "public_tests": _io(public), "private_tests": _io(private),
      "generated_tests": _io(generated), "source": 2, "difficulty": 7,
      "solutions": {"language": [2, 3, 1], "solution": ["int main() {}", ADD_SOLUTION,
                                                         "print sum"]},
      "incorrect_solutions": {"language": [], "solution": []},
      "cf_contest_id": 1, "cf_index": "A", "cf_points": 500.0, "cf_rating": 800,
      "cf_tags": ["math"], "is_description_translated": False, "untranslated_description": "",
      "time_limit": {"seconds": 2, "nanos": 500000000}, "memory_limit_bytes": 256000000,
      "input_file": "", "output_file": "",
  }
  row.update(fields)
  return row


def cc_rows():
  pairs = [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 12)]
  return [
      cc_row("1000_A. Sum", pairs[:2], pairs[2:4], pairs[4:]),  # 6 tests: kept
      cc_row("1000_B. Few", pairs[:1], pairs[1:2], pairs[2:4]),  # 4 tests: dropped
      cc_row("1000_C. File", pairs[:2], pairs[2:4], pairs[4:], input_file="in.txt"),  # dropped
      cc_row("1000_A. Sum", pairs[:1], pairs[1:5], [], time_limit=None, difficulty=3, source=1,
             memory_limit_bytes=0),  # same name again: 5 tests, kept
  ]


def write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def taco_row(question, inputs, outputs, fn_name=None, **fields):
  spec = {"inputs": inputs, "outputs": outputs}
  if fn_name:
    spec["fn_name"] = fn_name
  row = {"question": question, "solutions": json.dumps([ADD_SOLUTION]), "starter_code": "",
         "input_output": json.dumps(spec), "difficulty": "EASY", "raw_tags": "['math']",
         "name": None, "source": "codeforces", "tags": "['Math']", "skill_types": "[]",
         "url": "https://example.org", "Expected Auxiliary Space": None,
         "time_limit": "1 second", "date": None, "picture_num": "0",
         "memory_limit": "256 megabytes", "Expected Time Complexity": None}
  row.update(fields)
  return row


def taco_rows():
  pairs = [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10)]
  stdio = taco_row("Add two numbers.", [[f"{a} {b}"] for a, b in pairs],
                   [[str(a + b)] for a, b in pairs])  # lists of lines
  call = taco_row("Return a * b.", [[a, b] for a, b in pairs], [[a * b] for a, b in pairs],
                  fn_name="multiply", starter_code="class Solution:\n    def multiply(self, a, b):",
                  difficulty="MEDIUM", solutions=json.dumps(
                      ["class Solution:\n    def multiply(self, a, b):\n        return a * b"]),
                  time_limit=None, memory_limit=None)
  few = taco_row("Too few tests.", ["1 2"], ["3"])
  empty = taco_row("No tests.", [], [], input_output="")
  return [stdio, call, few, empty]


# ---------------------------------------------------------------------------------------------
# Readers.


def test_read_code_contests_jsonl(tmp_path, caplog):
  path = write_jsonl(tmp_path / "train.jsonl", cc_rows())
  with caplog.at_level(logging.INFO, logger="ksjax.tasks.code_data"):
    records = list(code_data.read_code_contests(path))
  assert [r["id"] for r in records] == ["1000_A. Sum", "1000_A. Sum#2"]
  first, second = records
  assert first["tests"][0] == {"input": "1 2\n", "output": "3\n"}
  assert [t["input"] for t in first["tests"]] == [f"{a} {b}\n" for a, b in
                                                   [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10),
                                                    (11, 12)]]  # public, private, generated
  assert first["num_public_tests"] == 2
  assert first["time_limit_s"] == 2.5 and first["memory_limit_bytes"] == 256000000
  assert first["difficulty"] == "A" and first["source"] == "CODEFORCES"
  assert first["solutions"] == [ADD_SOLUTION]  # Python 3 only
  assert first["fn_name"] is None and first["dataset"] == "code_contests"
  assert second["time_limit_s"] is None and second["memory_limit_bytes"] is None
  assert second["difficulty"] == "HARD" and second["source"] == "CODECHEF"
  assert len(second["tests"]) == 5
  assert "kept 2 problems" in caplog.text
  assert "1 reading or writing named files" in caplog.text
  assert "1 with fewer than 5 tests" in caplog.text
  json.dumps(records, allow_nan=False)  # what the data pipeline stores


def test_code_contests_enums_as_names(tmp_path):
  # Some exports write the proto enums by name.
  row = cc_row("x", [(1, 2)] * 5, difficulty="HARDER", source="ATCODER",
               solutions={"language": ["PYTHON3"], "solution": ["print(3)"]})
  record, = code_data.read_code_contests(write_jsonl(tmp_path / "x.jsonl", [row]))
  assert (record["difficulty"], record["source"]) == ("HARDER", "ATCODER")
  assert record["solutions"] == ["print(3)"]


def test_read_code_contests_parquet_shards(tmp_path):
  import pyarrow as pa  # pylint: disable=g-import-not-at-top  (a tensorflow-datasets dependency)
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  rows = cc_rows()
  data = tmp_path / "data"
  data.mkdir()
  for i, shard in enumerate((rows[:2], rows[2:])):  # Hugging Face's layout
    pq.write_table(pa.Table.from_pylist(shard), data / f"train-0000{i}-of-00002.parquet")
  pq.write_table(pa.Table.from_pylist(rows[:1]), data / "test-00000-of-00001.parquet")
  from_jsonl = list(code_data.read_code_contests(write_jsonl(tmp_path / "cc.jsonl", rows)))
  assert list(code_data.read_code_contests(data / "train")) == from_jsonl  # a shard prefix
  (data / "test-00000-of-00001.parquet").unlink()
  assert list(code_data.read_code_contests(data)) == from_jsonl  # a directory


def test_read_taco_arrow_stream(tmp_path):
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  table = pa.Table.from_pylist(taco_rows())
  (tmp_path / "train").mkdir()
  with pa.ipc.new_stream(tmp_path / "train" / "data-00000-of-00001.arrow", table.schema) as writer:
    writer.write_table(table, max_chunksize=2)  # two record batches
  from_jsonl = list(code_data.read_taco(write_jsonl(tmp_path / "taco.jsonl", taco_rows())))
  assert list(code_data.read_taco(tmp_path / "train")) == from_jsonl


def test_read_taco(tmp_path, caplog):
  path = write_jsonl(tmp_path / "train.jsonl", taco_rows())
  with caplog.at_level(logging.INFO, logger="ksjax.tasks.code_data"):
    records = list(code_data.read_taco(path))
  assert [r["id"] for r in records] == ["0", "1"]
  stdio, call = records
  assert stdio["tests"][0] == {"input": "1 2", "output": "3"}  # lists of lines joined
  assert stdio["fn_name"] is None and stdio["time_limit_s"] == 1.0
  assert stdio["memory_limit_bytes"] == 256 << 20 and stdio["difficulty"] == "EASY"
  assert call["fn_name"] == "multiply" and call["tests"][1] == {"input": [3, 4], "output": [12]}
  assert call["starter_code"].startswith("class Solution")
  assert call["time_limit_s"] is None and call["memory_limit_bytes"] is None
  assert "kept 2 problems" in caplog.text and "2 with fewer than 5 tests" in caplog.text
  # The same rows as a JSON list.
  (tmp_path / "list").mkdir()
  (tmp_path / "list" / "train.json").write_text(json.dumps(taco_rows()))
  assert list(code_data.read_taco(tmp_path / "list")) == records


def test_min_tests_is_configurable(tmp_path):
  path = write_jsonl(tmp_path / "train.jsonl", cc_rows())
  assert len(list(code_data.read_code_contests(path, min_tests=4))) == 3


@pytest.mark.parametrize("reader, content, message", [
    (code_data.read_code_contests, "{not json\n", "invalid JSON"),
    (code_data.read_code_contests, "[1, 2]\n", "not an object"),
    (code_data.read_code_contests, json.dumps({"name": "x"}) + "\n", "'description'"),
    (code_data.read_code_contests,
     json.dumps(cc_row("x", [(1, 2)], public_tests={"input": ["1"], "output": []})) + "\n",
     "public_tests"),
    (code_data.read_taco, json.dumps({"question": "q", "input_output": "{oops"}) + "\n",
     "input_output is not JSON"),
    (code_data.read_taco, json.dumps({"input_output": "{}"}) + "\n", "'question'"),
    (code_data.read_taco,
     json.dumps(taco_row("q", ["1"], ["1"], fn_name="not an identifier")) + "\n", "fn_name"),
])
def test_malformed_files_raise_data_error(tmp_path, reader, content, message):
  path = tmp_path / "bad.jsonl"
  path.write_text(content)
  with pytest.raises(DataError, match=message) as info:
    list(reader(path))
  assert str(path) in str(info.value) and "expected" in str(info.value)


def test_missing_or_unreadable_paths_raise_data_error(tmp_path):
  with pytest.raises(DataError, match="no such file or directory, and no shards.*CodeContests"):
    list(code_data.read_code_contests(tmp_path / "missing"))
  (tmp_path / "empty").mkdir()
  with pytest.raises(DataError, match="without .parquet, .arrow, .jsonl, .json files.*TACO"):
    list(code_data.read_taco(tmp_path / "empty"))
  (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
  with pytest.raises(DataError, match="not a readable parquet file"):
    list(code_data.read_code_contests(tmp_path / "broken.parquet"))


# ---------------------------------------------------------------------------------------------
# Program extraction.


@pytest.mark.parametrize("completion, program", [
    ("Here:\n```python\nprint(1)\n```\nDone.", "print(1)"),
    ("```python\nprint(1)\n```\nBetter:\n```python\nprint(2)\n```", "print(2)"),  # the last
    ("```python\nprint(1)\n```\n```text\n3\n```", "print(1)"),  # the last *python* block
    ("```\nprint(3)\n```", "print(3)"),  # no python block: the last block
    ("```cpp\nint main() {}\n```", "int main() {}"),
    ("```py\nprint(4)\n```", "print(4)"),
    ("```Python3\nprint(5)\n```", "print(5)"),
    ("Some text\n```python\nx = 1\nprint(x)", "x = 1\nprint(x)"),  # still open at the end
    ("  ```python\n  if True:\n    print(6)\n  ```", "  if True:\n    print(6)"),
    ("print(7)", None),  # no block
    ("```python\n\n```", None),  # empty block
    ("``` python is great ```", None),  # not a fence line
    ("", None),
    (None, None),
])
def test_extract_program(completion, program):
  assert code_task.extract_program(completion) == program


# ---------------------------------------------------------------------------------------------
# CodeTask.


@pytest.fixture(scope="module")
def sandbox():
  config = sb.SandboxConfig(workers=2, time_limit_s=1.0, wall_time_factor=1.5,
                            wall_time_slack_s=0.5, program_timeout_s=20.0)
  with sb.Sandbox(config) as box:
    yield box


@pytest.fixture(scope="module")
def task(tmp_path_factory, sandbox):
  directory = tmp_path_factory.mktemp("code")
  write_jsonl(directory / "cc.jsonl", cc_rows())
  write_jsonl(directory / "taco.jsonl", taco_rows())
  cc = code_task.CodeTask({"train": directory / "cc.jsonl"}, make_tokenizer(),
                          fmt="code_contests", sandbox=sandbox, name="code_contests")
  taco = code_task.CodeTask({"test": directory / "taco.jsonl"}, make_tokenizer(), fmt="taco",
                            sandbox=sandbox, name="taco")
  return cc, taco, directory


def test_prompts(task):
  cc, taco, directory = task
  prompt = cc.prompts("train")[0]
  assert "Print the sum of two integers (1000_A. Sum)." in prompt.text
  assert "standard input" in prompt.text and "```python" in prompt.text
  assert prompt.tokens == tuple(cc.tokenizer.encode(prompt.text))
  assert prompt.metadata["level"] == "A" and prompt.metadata["num_tests"] == 6
  assert prompt.solution == f"```python\n{ADD_SOLUTION}\n```"
  assert code_task.extract_program(prompt.solution) == ADD_SOLUTION
  assert prompt.reference["time_limit_s"] == 2.5 and prompt.reference["fn_name"] is None
  call = taco.prompts("test")[1]
  assert "`multiply`" in call.text and "class Solution:\n    def multiply(self, a, b):" in call.text
  assert call.metadata["call_based"] == 1
  assert cc.levels() == ["A", "HARD"] and taco.levels() == ["EASY", "MEDIUM"]
  record = next(code_data.read_code_contests(directory / "cc.jsonl"))
  assert cc.prompt_from_record(json.loads(json.dumps(record))) == prompt  # as the pipeline stores
  with pytest.raises(ValueError, match="split 'test' is not accepted"):
    cc.prompts("test")


def test_reference_solutions_pass(task):
  cc, taco, _ = task
  prompts = list(cc.prompts("train")) + list(taco.prompts("test"))
  for prompt, owner in zip(prompts, [cc, cc, taco, taco]):
    score = owner.score([prompt], [[prompt.solution]])[0]
    assert score.correct.tolist() == [True], prompt.id


def test_score_rewards_and_answer_classes(task):
  cc, _, _ = task
  prompt = cc.prompts("train")[0]
  fence = "```python\n{}\n```"
  completions = [
      fence.format(ADD_SOLUTION),  # 0 correct
      "No code here.",  # 1 no program
      fence.format("print(0)"),  # 2 wrong
      fence.format("a, b = map(int, input().split())\nprint(b + a)"),  # 3 correct, other text
      fence.format("print( 0 )"),  # 4 wrong, same outputs as 2
      fence.format("print(1 // 0)"),  # 5 runtime error
      "```python\n```",  # 6 no program (empty)
      fence.format("print(0)"),  # 7 identical to 2
  ]
  score = cc.score([prompt], [completions])[0]
  assert score.correct.tolist() == [True, False, False, True, False, False, False, False]
  assert score.rewards.dtype == np.float32
  assert score.rewards.tolist() == [1, -1, -1, 1, -1, -1, -1, -1]
  assert score.answers[0] == ADD_SOLUTION and score.answers[1] is None
  assert score.answer_ids.tolist() == [0, 1, 2, 0, 2, 3, 1, 2]


def test_score_groups_and_custom_rewards(task, sandbox):
  records = list(code_data.read_taco(task[2] / "taco.jsonl"))
  task01 = code_task.CodeTask({"test": records}, make_tokenizer(), correct_reward=1.0,
                              wrong_reward=0.0, sandbox=sandbox)
  stdio, call = task01.prompts("test")
  right_call = ("```python\nclass Solution:\n    def multiply(self, a, b):\n"
                "        return a * b\n```")
  wrong_call = "```python\ndef multiply(a, b):\n    return a + b\n```"
  scores = task01.score([stdio, call], [[f"```python\n{ADD_SOLUTION}\n```"],
                                        [wrong_call, right_call]])
  assert [s.rewards.tolist() for s in scores] == [[1.0], [0.0, 1.0]]
  with pytest.raises(ValueError, match="2 prompts but 1 completion groups"):
    task01.score([stdio, call], [[""]])


def test_malformed_records_raise_data_error(task):
  cc = task[0]
  with pytest.raises(DataError, match="tests"):
    cc.prompt_from_record({"id": "x", "problem": "p", "tests": []})
  with pytest.raises(DataError, match="tests"):  # stdin tests must be text
    cc.prompt_from_record({"id": "x", "problem": "p", "tests": [{"input": 1, "output": "1"}]})
  with pytest.raises(DataError, match="tests"):  # call-based inputs are argument lists
    cc.prompt_from_record({"id": "x", "problem": "p", "fn_name": "f",
                           "tests": [{"input": "1", "output": 1}]})
  with pytest.raises(DataError, match="time_limit_s"):
    cc.prompt_from_record({"id": "x", "problem": "p", "tests": [{"input": "", "output": ""}],
                           "time_limit_s": -1})


def test_isolation_report_is_exposed(task):
  assert task[0].isolation_report()["probe"] == "passed"
