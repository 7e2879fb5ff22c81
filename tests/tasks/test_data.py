"""Tests of the data pipeline: TFDS builds from local files, grain reading, sharding, state."""

import json
import os
import socket
import subprocess
import sys

import grain
import orbax.checkpoint as ocp
import pytest

from tests.support import dataset_files
from ksjax.tasks import data, synthetic
from ksjax.tasks.base import DataError

SIZES = {"train_per_level": 12, "test_per_level": 8}  # 48 + ~12 train, 40 test problems


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("tfds")
  data.build("synthetic", data_dir=path, **SIZES)
  return path


@pytest.fixture(scope="module")
def task():
  return synthetic.SyntheticTask(**SIZES)


def _ids(batches):
  return [r["id"] for batch in batches for r in batch]


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def _canonical(records):
  """Records as sorted JSON texts: TFDS does not keep the generation order."""
  return sorted(json.dumps(r, sort_keys=True) for r in records)


def test_build_stores_the_task_records_as_array_record(data_dir, task):
  for split in ("train", "test"):
    records = data.load_records("synthetic", split, data_dir=data_dir, **SIZES)
    assert _canonical(records) == _canonical(task.records(split))
  variant = data.make_builder("synthetic", data_dir=data_dir, **SIZES).data_path
  assert any(".array_record-" in name for name in os.listdir(variant))
  assert os.listdir(data_dir) == ["synthetic"]  # tfds's download directory did not stay behind


def test_a_modulus_50_build_stores_the_modulus_50_task(tmp_path):
  data.build("synthetic", data_dir=tmp_path, modulus=50, **SIZES)
  task = synthetic.SyntheticTask(modulus=50, **SIZES)
  for split in synthetic.SPLITS:
    records = list(data.load_records("synthetic", split, data_dir=tmp_path, modulus=50, **SIZES))
    assert _canonical(records) == _canonical(task.records(split))
    assert all(r["problem"].endswith(" mod 50\n") for r in records)
  # The default modulus keeps the directory name it had before the option existed.
  names = {m: data.make_builder("synthetic", data_dir=tmp_path, modulus=m, **SIZES)
           .builder_config.name for m in (10, 50)}
  assert names == {10: "num_solutions4_seed0_test_per_level8_train_per_level12",
                   50: "modulus50_num_solutions4_seed0_test_per_level8_train_per_level12"}
  assert data.make_builder("synthetic", data_dir=tmp_path, **SIZES).builder_config.name == names[10]


@pytest.mark.parametrize("modulus", [1, 101, True, 10.0, "50"])
def test_a_modulus_the_task_refuses_is_the_tasks_error_before_any_build(tmp_path, modulus):
  with pytest.raises(ValueError) as refused_by_task:
    synthetic.SyntheticTask(modulus=modulus)
  with pytest.raises(ValueError, match=r"modulus=.* is not accepted; expected an integer from 2 "
                     r"to 100") as refused:
    data.build("synthetic", data_dir=tmp_path, modulus=modulus, **SIZES)
  assert str(refused.value) == str(refused_by_task.value)
  assert repr(modulus) in str(refused.value)
  assert not os.listdir(tmp_path)


def test_build_never_uses_the_network(tmp_path, monkeypatch):
  attempts = []

  def refuse(*args, **kwargs):
    attempts.append(args)
    raise OSError("network access during a dataset build")

  class NoSocket(socket.socket):
    def __init__(self, *args, **kwargs):
      refuse(*args)

  monkeypatch.setattr(socket, "socket", NoSocket)
  for name in ("create_connection", "getaddrinfo", "gethostbyname"):
    monkeypatch.setattr(socket, name, refuse)
  builder = data.build("synthetic", data_dir=tmp_path, seed=7, **SIZES)
  assert builder.info.splits["test"].num_examples == 40
  assert not attempts


def test_local_files_builder_reads_through_its_reader(tmp_path, monkeypatch):
  (tmp_path / "fake_reader.py").write_text(
      "import json\n"
      "from ksjax.tasks.base import DataError\n"
      "FORMAT = 'a JSONL file of records'\n"
      "def read(path):\n"
      "  for n, line in enumerate(open(path)):\n"
      "    if line.startswith('!'):\n"
      "      raise DataError(f'{path}:{n + 1}: not JSON')\n"
      "    yield json.loads(line)\n")
  monkeypatch.syspath_prepend(str(tmp_path))

  FakeBuilder = data.local_files_builder(data.LocalFiles(  # pylint: disable=invalid-name
      "fake", "fake_reader:read", "fake_reader:FORMAT", {"train": "train.jsonl"}))

  manual, out = tmp_path / "manual", tmp_path / "out"
  manual.mkdir()
  with pytest.raises(DataError, match=f"{manual / 'train.jsonl'} does not exist; expected a JSONL"):
    FakeBuilder.check_manual_dir(manual)

  def build(lines):
    (manual / "train.jsonl").write_text("".join(line + "\n" for line in lines))
    builder = FakeBuilder(data_dir=str(out), file_format="array_record")
    builder.download_and_prepare(download_dir=str(tmp_path / "dl"), download_config=(
        data.tfds.download.DownloadConfig(manual_dir=str(manual), try_download_gcs=False)))
    return builder

  for lines, error in (([json.dumps({"id": "a"}), json.dumps({"id": "a"})], "occurs twice"),
                       ([json.dumps({"problem": "x"})], "no string 'id'"),
                       ([json.dumps({"id": "a"}), "!"], "train.jsonl:2: not JSON")):
    with pytest.raises(DataError, match=error):
      build(lines)
    assert not os.path.exists(out / "fake" / "1.0.0")  # nothing half-written
  records = [{"id": f"p{i}", "problem": "\u2211 x", "tests": {"input": ["1"]}} for i in range(5)]
  builder = build([json.dumps(r) for r in records])
  stored = grain.MapDataset.source(builder.as_data_source("train")).map(data._decode)
  assert sorted(stored, key=lambda r: r["id"]) == records


@pytest.mark.parametrize("name", sorted(dataset_files.WRITERS))
def test_builds_each_dataset_from_its_published_format(tmp_path, name):
  expected = dataset_files.WRITERS[name](tmp_path / "manual")
  assert all(expected.values())
  data.build(name, data_dir=tmp_path / "out", manual_dir=tmp_path / "manual")
  assert data.built_splits(name, data_dir=tmp_path / "out") == tuple(sorted(expected))
  for split, records in expected.items():
    stored = data.load_records(name, split, data_dir=tmp_path / "out")
    assert sorted(stored, key=lambda r: r["id"]) == sorted(records, key=lambda r: r["id"])


def test_splits_may_be_shard_prefixes(tmp_path):
  """Hugging Face's CodeContests layout, `train-00000-of-00002.jsonl`... with no `train` path:
  the build accepts what the reader accepts."""
  expected = dataset_files.code_contests_files(tmp_path / "manual", shard_prefixes=True)
  assert not os.path.exists(tmp_path / "manual" / "train") and len(expected["train"]) == 2
  data.build("code_contests", data_dir=tmp_path / "out", manual_dir=tmp_path / "manual")
  for split, records in expected.items():
    stored = data.load_records("code_contests", split, data_dir=tmp_path / "out")
    assert sorted(stored, key=lambda r: r["id"]) == sorted(records, key=lambda r: r["id"])
  (tmp_path / "manual" / "valid-00000-of-00001.jsonl").unlink()
  with pytest.raises(DataError, match=r"code_contests': .*valid does not exist; expected "
                     "CodeContests"):
    data.build("code_contests", data_dir=tmp_path / "again", manual_dir=tmp_path / "manual")


def test_missing_inputs_are_one_clear_error(tmp_path):
  with pytest.raises(DataError, match=r"math500': .*test\.jsonl does not exist; expected "
                     r"MATH-500 JSONL: one JSON object per line"):
    data.build("math500", data_dir=tmp_path / "out", manual_dir=tmp_path)
  with pytest.raises(DataError, match="pass manual_dir"):
    data.build("harp", data_dir=tmp_path / "out")
  assert not os.path.exists(tmp_path / "out")
  with pytest.raises(DataError, match="is not built at .*synthetic"):
    data.load_records("synthetic", "train", data_dir=tmp_path / "out")
  with pytest.raises(ValueError, match="dataset 'mnist' is not accepted"):
    data.make_builder("mnist", data_dir=tmp_path)
  with pytest.raises(ValueError, match=r"options \['levels'\] are not accepted"):
    data.make_builder("synthetic", data_dir=tmp_path, levels=3)


def test_unknown_split_and_bad_batch_size(data_dir):
  with pytest.raises(DataError, match="has no split 'valid'; it has test, train"):
    data.load_records("synthetic", "valid", data_dir=data_dir, **SIZES)
  records = data.load_records("synthetic", "test", data_dir=data_dir, **SIZES)
  with pytest.raises(ValueError, match="batch_size=5 .* multiple of .* 2"):
    data.batch_iterator(records, batch_size=5, seed=0,
                        shard_options=grain.sharding.ShardOptions(0, 2))
  with pytest.raises(DataError, match="empty"):
    data.batch_iterator([], batch_size=2, seed=0)


def test_shuffle_is_seeded_and_each_epoch_a_permutation(data_dir):
  records = data.load_records("synthetic", "test", data_dir=data_dir, **SIZES)  # 40 records
  everything = sorted(r["id"] for r in records)

  def epochs(seed, n=2):
    ids = _ids(data.batch_iterator(records, batch_size=8, seed=seed, num_epochs=n))
    return [ids[i * 40:(i + 1) * 40] for i in range(n)]

  first, second = epochs(seed=1)
  assert sorted(first) == sorted(second) == everything
  assert first != second  # reshuffled every epoch
  assert epochs(seed=1) == [first, second]
  assert epochs(seed=2)[0] != first
  assert _ids(data.batch_iterator(records, batch_size=8, seed=0, shuffle=False,
                                  num_epochs=1)) == [r["id"] for r in records]


def test_process_shards_are_disjoint_cover_and_form_the_global_batch(data_dir):
  records = data.load_records("synthetic", "test", data_dir=data_dir, **SIZES)

  def shard(index, count):
    return list(data.batch_iterator(records, batch_size=8, seed=3, num_epochs=1,
                                    shard_options=grain.sharding.ShardOptions(index, count)))

  whole, first, second = shard(0, 1), shard(0, 2), shard(1, 2)
  assert len(first) == len(second) == len(whole) == 5
  assert all(len(b) == 4 for b in first + second)
  assert not set(_ids(first)) & set(_ids(second))
  assert sorted(_ids(first) + _ids(second)) == sorted(r["id"] for r in records)
  assert [a + b for a, b in zip(first, second)] == whole


def test_uneven_shards_take_the_same_number_of_steps(data_dir):
  records = data.load_records("synthetic", "test", data_dir=data_dir, **SIZES)  # 40 = 6*6 + 4
  counts = [len(list(data.batch_iterator(records, batch_size=6, seed=0, num_epochs=1,
                                         shard_options=grain.sharding.ShardOptions(i, 3))))
            for i in range(3)]
  assert counts == [6, 6, 6]  # 20 local batches of 2, trimmed to a multiple of 3 shards


def test_restored_state_continues_with_the_same_elements(data_dir):
  records = data.load_records("synthetic", "train", data_dir=data_dir, **SIZES)

  def fresh():
    return data.batch_iterator(records, batch_size=16, seed=5)

  iterator = fresh()
  _take(iterator, len(records) // 16 - 1)  # mid-epoch, one batch before the epoch boundary
  state = iterator.get_state()
  expected = _take(iterator, 4)  # crosses into the reshuffled second epoch
  restored = fresh()
  restored.set_state(state)
  assert _take(restored, 4) == expected


def test_iterator_state_through_orbax(data_dir, tmp_path, task):
  records = data.load_records("synthetic", "train", data_dir=data_dir, **SIZES)

  def fresh():
    return data.batch_iterator(records, batch_size=4, seed=9, transform=task.prompt_from_record)

  iterator = fresh()
  assert all(isinstance(p, synthetic.Prompt) for p in next(iterator))
  _take(iterator, 6)
  manager = ocp.CheckpointManager(tmp_path / "ckpt", options=ocp.CheckpointManagerOptions(
      enable_async_checkpointing=False))
  manager.save(7, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(iterator)))
  expected = _take(iterator, 3)
  restored = manager.restore(7, args=ocp.args.Composite(
      data=grain.checkpoint.CheckpointRestore(fresh())))["data"]
  assert _take(restored, 3) == expected
  manager.close()


def test_prompts_can_feed_the_pipeline_directly(task):
  prompts = task.prompts("test")
  batches = list(data.batch_iterator(prompts, batch_size=10, seed=0, num_epochs=1))
  assert sorted(p.id for b in batches for p in b) == sorted(p.id for p in prompts)


def test_command_line_reports_missing_files_in_one_line(tmp_path):
  missing = subprocess.run([sys.executable, "-m", "ksjax.tasks.data", "--dataset=harp",
                            f"--data_dir={tmp_path}", f"--manual_dir={tmp_path}"],
                           capture_output=True, text=True, timeout=120)
  assert missing.returncode == 2  # bad input: one line, exit 2 (ksjax/errors.py)
  lines = [line for line in missing.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and f"{tmp_path / 'HARP.jsonl'} does not exist" in lines[0], lines
