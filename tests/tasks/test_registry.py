"""Tests of building tasks by name, from built datasets where they need one."""

import pytest

from tests.support import chat as support_chat
from tests.support import dataset_files
from ksjax.tasks import data, registry, synthetic
from ksjax.tasks.base import DataError, GroupScore, Task


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


@pytest.mark.parametrize("name", registry.TASKS)
def test_every_task_offers_what_the_trainer_uses(tmp_path, name):
  """Built by name, each task yields tokenized prompts, scores its reference solutions right and
  a completion without an answer wrong, makes the same prompt from a pipeline record as from its
  split, and stops the workers it started when its `with` block ends."""
  if name == "synthetic":
    split, options = "test", {"train_per_level": 2, "test_per_level": 2}
    records = list(synthetic.SyntheticTask(**options).records(split))
  elif name == "planted":  # its first instances are right with A, its first warm-up solution
    split, records, options = "test", None, {}
  elif name in registry.CHAT_TASKS:  # generated in memory: prompts come from its splits alone
    split, records = "test", None
    options = {"tokenizer": support_chat.make_tokenizer(bos=None),
               "chat_template": support_chat.CHATML, "train_per_level": 2, "test_per_level": 2,
               "workers": 1}
  else:
    split = sorted(dataset_files.WRITERS[name](tmp_path / "manual"))[0]
    data.build(name, data_dir=tmp_path / "out", manual_dir=tmp_path / "manual")
    options = {"tokenizer": synthetic.make_tokenizer(), "data_dir": tmp_path / "out",
               **({"workers": 1} if name in registry.MATH_TASKS else {})}
    records = data.load_records(name, split, data_dir=tmp_path / "out")
  with registry.make_task(name, **options) as task:
    assert isinstance(task, Task) and task.name == name
    prompts = {p.id: p for p in task.prompts(split)}
    if records is not None:
      assert ([task.prompt_from_record(r) for r in records]
              == [prompts[r["id"]] for r in records])
    assert all(p.tokens == tuple(task.tokenizer.encode(p.text)) for p in prompts.values())
    solved = [p for p in prompts.values() if task.reference_solutions(p)][:2]
    assert solved
    scores = task.score(solved, [[task.reference_solutions(p)[0], "No answer."] for p in solved])
    assert all(isinstance(s, GroupScore) and s.correct.tolist() == [True, False]
               and s.rewards.tolist() == [1.0, -1.0] for s in scores)
    assert {p.metadata.get("level") for p in prompts.values()} <= set(task.levels()) | {None}
    if name in registry.MATH_TASKS + registry.CHAT_TASKS:
      task.checker.start()  # the answers above equal the gold as text: no worker was needed
    assert workers_running(task) is (name not in registry.EMBEDDED_TASKS)
  assert not workers_running(task)


def workers_running(task):
  if hasattr(task, "checker"):
    return bool(task.checker.worker_pids())
  if hasattr(task, "sandbox"):
    return task.sandbox._pool is not None  # pylint: disable=protected-access  (no public state)
  return False


def test_bad_requests(tmp_path):
  with pytest.raises(ValueError, match="needs the model's tokenizer and the data_dir"):
    registry.make_task("harp", data_dir=tmp_path)
  with pytest.raises(DataError, match="dataset 'harp' is not built"):
    registry.make_task("harp", tokenizer=synthetic.make_tokenizer(), data_dir=tmp_path)
  with pytest.raises(ValueError, match="task 'gsm8k' is not accepted"):
    registry.make_task("gsm8k")
