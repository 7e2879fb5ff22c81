"""Tests of building tasks by name, from built datasets where they need one."""

import pytest

import dataset_files
from ksjax.tasks import data, registry, synthetic
from ksjax.tasks.base import DataError


def test_synthetic_needs_nothing():
  task = registry.make_task("synthetic", train_per_level=5, test_per_level=5, seed=3)
  assert isinstance(task, synthetic.SyntheticTask) and task.seed == 3
  assert task.tokenizer.vocab_size == len(synthetic.SPECIAL_TOKENS) + len(synthetic.CHARACTERS)


def test_math_task_holds_every_built_split(tmp_path):
  expected = dataset_files.math_files(tmp_path / "manual")
  data.build("math", data_dir=tmp_path / "out", manual_dir=tmp_path / "manual")
  tokenizer = synthetic.make_tokenizer()
  with registry.make_task("math", tokenizer=tokenizer, data_dir=tmp_path / "out",
                          workers=1) as task:
    assert task.name == "math"
    for split, records in expected.items():
      prompts = task.prompts(split)
      assert sorted(p.id for p in prompts) == sorted(r["id"] for r in records)
      assert all(p.tokens[0] == tokenizer.bos_id and p.reference for p in prompts)


def test_code_task_fed_by_the_pipeline_only(tmp_path):
  expected = dataset_files.taco_files(tmp_path / "manual")
  data.build("taco", data_dir=tmp_path / "out", manual_dir=tmp_path / "manual")
  task = registry.make_task("taco", tokenizer=synthetic.make_tokenizer(),
                            data_dir=tmp_path / "out", splits=())
  try:
    with pytest.raises(ValueError, match="split 'train'"):
      task.prompts("train")
    batches = data.batch_iterator(data.load_records("taco", "train", data_dir=tmp_path / "out"),
                                  batch_size=1, seed=0, num_epochs=1,
                                  transform=task.prompt_from_record)
    assert sorted(p.id for [p] in batches) == sorted(r["id"] for r in expected["train"])
  finally:
    task.close()


def test_bad_requests(tmp_path):
  with pytest.raises(ValueError, match="needs the model's tokenizer and the data_dir"):
    registry.make_task("harp", data_dir=tmp_path)
  with pytest.raises(DataError, match="dataset 'harp' is not built"):
    registry.make_task("harp", tokenizer=synthetic.make_tokenizer(), data_dir=tmp_path)
  with pytest.raises(ValueError, match="task 'gsm8k' is not accepted"):
    registry.make_task("gsm8k")
