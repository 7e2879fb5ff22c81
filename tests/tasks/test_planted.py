"""The planted task (`ksjax.tasks.planted`): labels in exact proportions per split, exact-letter
grading, the warm-up's start solutions, prompt types rotated, and its options' one-line errors."""

import collections

import numpy as np
import pytest

from ksjax.config_validation import ConfigError
from ksjax.run import config as run_config
from ksjax.run import spec
from ksjax.tasks import planted, registry, synthetic


def test_each_split_holds_every_label_in_exact_proportion():
  task = registry.make_task("planted", labels=(3, 2), prompts=1)
  for split in planted.SPLITS:
    prompts = task.prompts(split)
    assert len({p.id for p in prompts}) == len(prompts) == 5
    assert {p.text for p in prompts} == {"prompt 0\n"}
    assert collections.Counter(p.reference for p in prompts) == {"A": 3, "B": 2}
  np.testing.assert_allclose(task.frequencies(), [[0.6, 0.4]])
  assert not {p.id for p in task.prompts("train")} & {p.id for p in task.prompts("test")}


def test_prompt_types_are_rotated_and_the_policy_is_read_per_type():
  task = planted.PlantedTask(labels=(5, 3, 2), start=(1, 2, 7), prompts=3)
  np.testing.assert_allclose(task.frequencies(),
                             [[0.5, 0.3, 0.2], [0.2, 0.5, 0.3], [0.3, 0.2, 0.5]])
  by_type = collections.defaultdict(collections.Counter)
  for p in task.prompts("train"):
    by_type[p.metadata["level"]][p.reference] += 1
  assert by_type[1] == {"A": 2, "B": 5, "C": 3}
  types = task.type_prompts()
  assert [p.text for p in types] == ["prompt 0\n", "prompt 1\n", "prompt 2\n"]
  assert collections.Counter(task.reference_solutions(types[1])) == {"A": 7, "B": 1, "C": 2}
  assert list(task.levels()) == [0, 1, 2]


def test_a_completion_is_right_only_when_it_is_its_instance_s_letter():
  task = planted.PlantedTask()
  a, b = task.prompts("test")[0], task.prompts("test")[-1]
  assert (a.reference, b.reference) == ("A", "B")
  completions = ["A", "B", "a", " A", "A.", "", "C"]
  first, second = task.score([a, b], [completions, completions])
  assert first.correct.tolist() == [True, False, False, False, False, False, False]
  assert second.correct.tolist() == [False, True] + [False] * 5
  assert first.rewards.tolist() == [1.0] + [-1.0] * 6
  assert first.answers == ("A", "B", None, None, None, None, None)  # C: not one of 2 answers
  assert first.answer_ids.tolist() == [0, 1, 2, 2, 2, 2, 2]  # every non-answer is one class


def test_the_warm_up_solutions_are_the_start_not_the_labels():
  task = planted.PlantedTask(labels=(3, 2), start=(1, 4))
  for prompt in task.prompts("train"):
    assert collections.Counter(task.reference_solutions(prompt)) == {"A": 1, "B": 4}
  assert task.tokenizer.vocab_size == synthetic.make_tokenizer().vocab_size
  assert all(len(task.tokenizer.encode(a, add_bos=False)) == 1 for a in task.answers)


@pytest.mark.parametrize("field,value,match", [
    ("labels", (3,), r"config.planted.labels=\(3,\) is not accepted; expected 2 to 26 integers"),
    ("labels", (0, 0), "not all 0"),
    ("labels", (3, -1), "integers >= 0"),
    ("start", (1, 2, 3), r"config.planted.start=\(1, 2, 3\) is not accepted with "
                         r"config.planted.labels=\(3, 2\); expected 2 counts"),
    ("prompts", 0, "config.planted.prompts=0"),
])
def test_bad_options_fail_in_one_line_naming_the_field(field, value, match):
  config = run_config.base_config()
  config.task = "planted"
  config.planted[field] = value
  with pytest.raises(ConfigError, match=match) as raised:
    spec.from_config(config)
  assert "\n" not in str(raised.value)


def test_the_run_spec_builds_it_without_weights():
  config = run_config.base_config()
  config.task = "planted"
  config.planted.labels = (6, 4)
  made = spec.from_config(config)
  assert made.task.is_embedded and made.task.is_generated
  assert made.task.options == planted.PlantedOptions(labels=(6, 4))
