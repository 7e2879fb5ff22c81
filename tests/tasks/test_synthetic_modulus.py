"""The embedded task's modulus: the default is the original task bit for bit, other moduli give
larger answer spaces with the same problems, and a bad modulus is one clear config error."""

import collections
import hashlib
import json
import re

import pytest

from ksjax import config_fields as cf
from ksjax.config_validation import ConfigError
from ksjax.run import config as run_config
from ksjax.run import spec as spec_lib
from ksjax.run import tasks as run_tasks
from ksjax.tasks import synthetic
from ksjax.tasks.base import DataError


def fingerprint(task: synthetic.SyntheticTask) -> str:
  """sha256 of everything the task shows a run: every prompt (text, tokens, reference, solution,
  metadata), every record (with its reference solutions), the scores of fixed completions, and
  the tokenizer."""
  h = hashlib.sha256()
  for split in synthetic.SPLITS:
    prompts = task.prompts(split)
    for prompt, record in zip(prompts, task.records(split)):
      h.update(json.dumps([prompt.id, prompt.text, list(prompt.tokens), prompt.reference,
                           prompt.solution, dict(prompt.metadata), record],
                          sort_keys=True).encode())
    completions = [[p.solution, "The final answer is 7.", "The final answer is 17.", "x"]
                   for p in prompts]
    for score in task.score(prompts, completions):
      h.update(json.dumps([score.rewards.tolist(), score.correct.tolist(), list(score.answers),
                           score.answer_ids.tolist()]).encode())
  h.update(task.tokenizer.tok.to_str().encode())
  return h.hexdigest()


# Computed with `fingerprint` on the code before the modulus existed (commit d3126ed, where the
# task was hard-wired to modulo 10): the default modulus must reproduce it exactly.
# (The second task is the first's split generator at other settings, with the modulus given.)
FINGERPRINTS = [
    ({}, "bccb3f3c7c70d91be7fc54881925d198643d411588f91fe3689ebe0786c754e1"),
    (dict(seed=7, train_per_level=30, test_per_level=155, levels=(1, 3), modulus=10),
     "c9d57843f5afb3178f91a78cf87ecd2a9dbf2e0c24557f22d8c2321b27b6632f"),
]


@pytest.mark.parametrize("options, expected", FINGERPRINTS)
def test_the_default_modulus_is_the_original_task_bit_for_bit(options, expected):
  assert fingerprint(synthetic.SyntheticTask(**options)) == expected
  assert (synthetic.max_prompt_chars(), synthetic.max_solution_chars()) == (19, 57)


def _value(text: str, modulus: int) -> int:
  """The answer of a prompt, read independently of the task's parser."""
  expression, suffix = text.split(" mod ")
  assert int(suffix) == modulus
  return sum(int(t) for t in re.findall(r"[+-]?[0-9]", "+" + expression)) % modulus


def _check_solution(text: str, prompt_text: str, modulus: int) -> int:
  """A solution is a chain `a±d=r, r±d=r', ...` over every signed term once, totals modulo
  `modulus`; returns its final answer."""
  body, final = text.split(". The final answer is ")
  terms = collections.Counter(re.findall(r"[+-][0-9]", "+" + prompt_text.split(" ")[0]))
  steps = [re.fullmatch(r"([0-9]+)([+-])([0-9])=([0-9]+)", s) for s in body.split(", ")]
  assert all(steps), text
  total, used = int(steps[0].group(1)), collections.Counter(["+" + steps[0].group(1)])
  for step in steps:
    a, sign, d, r = step.groups()
    assert int(a) == total and int(r) == (total + (int(d) if sign == "+" else -int(d))) % modulus
    assert 0 <= int(r) < modulus and r == str(int(r)), text  # no leading zeros
    used[sign + d] += 1
    total = int(r)
  assert used == terms, (text, prompt_text)
  assert final == f"{total}."
  return total


@pytest.fixture(scope="module")
def task100():
  return synthetic.SyntheticTask(seed=0, train_per_level=150, test_per_level=40, modulus=100)


def test_answers_range_over_the_modulus_and_many_occur(task100):
  prompts = list(task100.prompts("train")) + list(task100.prompts("test"))
  answers_by_level = collections.defaultdict(set)
  for p in prompts:
    assert p.text.endswith(" mod 100\n") and len(p.text) <= synthetic.max_prompt_chars(100)
    assert p.reference == _value(p.text.strip(), 100)
    assert 0 <= p.reference < 100
    answers_by_level[p.metadata["level"]].add(p.reference)
  distinct = [len(answers_by_level[level]) for level in synthetic.LEVELS]
  # At most 28, 46, 64, 82, 100 (the sums span 18 L + 10 values; 28, 40, 41, 48, 51 occur
  # here); ten at M = 10.
  assert distinct[0] >= 25 and all(d >= 35 for d in distinct[1:]), distinct
  assert len(set().union(*answers_by_level.values())) >= 50
  small = synthetic.SyntheticTask(train_per_level=100, test_per_level=20, levels=(2,), modulus=7)
  assert {p.reference for p in small.prompts("train")} == set(range(7))


def test_solutions_carry_totals_modulo_the_modulus(task100):
  for prompt in task100.prompts("train")[::7]:
    problem = synthetic.parse_problem(prompt.text)
    for text in synthetic.reference_solutions(problem, 4):
      assert _check_solution(text, prompt.text, 100) == prompt.reference
      assert len(text) <= synthetic.max_solution_chars(100, problem.level)
  # The longest solution: every total two digits, the first operand a digit.
  longest = synthetic.solution(synthetic.Problem((9, 1, 0, 0), ("+", "+", "+"), 11), range(4))
  assert longest == "9+1=10, 10+0=10, 10+0=10. The final answer is 10."
  assert len(longest) == synthetic.max_solution_chars(11, 3) == 49


def test_the_checker_accepts_the_answer_and_nothing_else_for_multi_digit_answers(task100):
  prompt = next(p for p in task100.prompts("test") if p.reference >= 10)
  right, other = str(prompt.reference), str((prompt.reference + 1) % 100)
  completions = [prompt.solution, f"The final answer is {right}.", f"The final answer is 0{right}.",
                 f"The final answer is {right[-1]}.", f"The final answer is {right[0]}.",
                 f"The final answer is {right}0.", f"The final answer is {right}.5",
                 f"The final answer is {prompt.reference + 100}.",
                 f"The final answer is {prompt.reference - 100}.",
                 f"The final answer is {other}."]
  (score,) = task100.score([prompt], [completions])
  assert score.correct.tolist() == [True, True, True] + [False] * 7
  assert score.answers[1] == score.answers[2] == right  # leading zeros are one answer class
  assert score.answer_ids[1] == score.answer_ids[2] != score.answer_ids[-1]


def test_splits_are_disjoint_and_the_same_problems_for_every_modulus():
  options = dict(seed=3, train_per_level=120, test_per_level=30)
  expressions = None
  for modulus in (20, 100, 10):
    problems = synthetic.generate_split_problems(**options, modulus=modulus)
    test_keys = [p.key for p in problems["test"]]
    assert len(set(test_keys)) == len(test_keys)
    assert not set(test_keys) & {p.key for p in problems["train"]}
    assert len(set(problems["train"])) == len(problems["train"])
    assert all(p.modulus == modulus for split in problems.values() for p in split)
    split_expressions = {s: [p.expression for p in problems[s]] for s in synthetic.SPLITS}
    assert expressions in (None, split_expressions)
    expressions = split_expressions


def test_records_round_trip_and_name_their_modulus(task100):
  record = next(task100.records("test"))
  assert task100.prompt_from_record(record) == task100.prompts("test")[0]
  task10 = synthetic.SyntheticTask(train_per_level=10, test_per_level=10, levels=(1,))
  with pytest.raises(DataError, match="modulo 100, but the task's modulus is 10"):
    task10.prompt_from_record(record)
  with pytest.raises(DataError, match=r"modulus=101 is not accepted"):
    synthetic.parse_problem("1+2 mod 101\n")


@pytest.mark.parametrize("value", [1, 0, -10, 101, 1000, "10", 10.0, True, None])
def test_a_bad_modulus_is_one_config_error_naming_field_value_and_range(value):
  with pytest.raises(ConfigError) as error:
    synthetic.SyntheticOptions(modulus=value)
  message = str(error.value)
  assert message.startswith(f"config.synthetic.modulus={value!r} is ")
  assert message.endswith("expected an integer in [2, 100]") and "\n" not in message
  with pytest.raises(ValueError, match=f"modulus={value!r} is not accepted"):
    synthetic.SyntheticTask(modulus=value)


def test_the_config_field_reaches_the_task():
  declared = {name: cf.declaration(f) for name, _, f in cf.leaves(spec_lib.TrainSpec)}
  assert declared["synthetic.modulus"].hi == synthetic.MAX_MODULUS
  assert isinstance(spec_lib.TaskSpec().synthetic, synthetic.SyntheticOptions)
  config = run_config.embedded_task_config()
  assert config.synthetic.modulus == synthetic.DEFAULT_MODULUS
  config.synthetic.modulus = 50
  config.synthetic.train_per_level = 5
  spec = spec_lib.from_config(config)
  task = run_tasks.make_task(spec.task, spec.model, "test")
  assert task.modulus == 50 and task.prompts("test")[0].text.endswith(" mod 50\n")
  config.synthetic.modulus = 1
  with pytest.raises(ConfigError, match=r"^config\.synthetic\.modulus=1 is out of range"):
    spec_lib.from_config(config)
