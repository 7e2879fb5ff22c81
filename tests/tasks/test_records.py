"""Tests of the shared file reading of the dataset readers and builders (ksjax.tasks.records)."""

import pytest

from ksjax.tasks import records
from ksjax.tasks.base import DataError

SUFFIXES = (".jsonl", ".parquet")


@pytest.fixture
def layout(tmp_path):
  (tmp_path / "file.jsonl").write_text("{}\n")
  (tmp_path / "dir").mkdir()
  (tmp_path / "dir" / "b.jsonl").write_text("{}\n")
  (tmp_path / "dir" / "a.parquet").write_bytes(b"")
  (tmp_path / "dir" / "notes.txt").write_text("")
  (tmp_path / "empty").mkdir()
  for name in ("train-00001-of-00002.jsonl", "train-00000-of-00002.jsonl", "train.md",
               "other-00000.txt"):
    (tmp_path / "shards" / name).parent.mkdir(exist_ok=True)
    (tmp_path / "shards" / name).write_text("{}\n")
  return tmp_path


def test_data_files_of_a_file_a_directory_and_a_shard_prefix(layout):
  assert records.data_files(layout / "file.jsonl", SUFFIXES, "x") == [str(layout / "file.jsonl")]
  assert records.data_files(layout / "dir", SUFFIXES, "x") == [
      str(layout / "dir" / "a.parquet"), str(layout / "dir" / "b.jsonl")]  # sorted, .txt left
  assert records.data_files(layout / "shards" / "train", SUFFIXES, "x") == [
      str(layout / "shards" / f"train-0000{i}-of-00002.jsonl") for i in (0, 1)]


@pytest.mark.parametrize("path, exists", [
    ("file.jsonl", True), ("dir", True), ("shards/train", True), ("missing", False),
    ("shards/tra", False), ("missing/train", False)])
def test_input_exists_agrees_with_what_the_readers_find(layout, path, exists):
  assert records.input_exists(layout / path) == exists
  if exists:
    assert records.data_files(layout / path, SUFFIXES, "x")
  else:
    with pytest.raises(DataError, match=f"{layout / path}: no such file or directory, and no "
                       "shards named like it; expected the format"):
      records.data_files(layout / path, SUFFIXES, "the format")


def test_a_directory_without_data_files_names_the_accepted_suffixes(layout):
  with pytest.raises(DataError, match=r"empty: a directory without \.jsonl, \.parquet files; "
                     "expected F"):
    records.data_files(layout / "empty", SUFFIXES, "F")


def test_read_jsonl_names_the_line_and_the_format(tmp_path):
  path = tmp_path / "a.jsonl"
  path.write_text('{"id": 1}\n\n  \n{"id": 2}\n')
  assert list(records.read_jsonl(str(path), "F")) == [(f"{path}:1", {"id": 1}),
                                                      (f"{path}:4", {"id": 2})]
  for text, line, what in (('{"id": 1}\n{oops\n', 2, "invalid JSON"),
                           ('\n[1]\n', 2, "a JSON list, not an object")):
    path.write_text(text)
    with pytest.raises(DataError, match=f"{path}:{line}: {what}.*; expected JSONL of F"):
      list(records.read_jsonl(str(path), "JSONL of F"))


def test_read_jsonl_empty_files(tmp_path):
  path = tmp_path / "a.jsonl"
  path.write_text("\n \n")
  assert not list(records.read_jsonl(str(path), "F"))
  with pytest.raises(DataError, match=f"{path}: no records; expected F"):
    list(records.read_jsonl(str(path), "F", allow_empty=False))
