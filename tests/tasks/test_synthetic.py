"""Tests of the embedded synthetic task: splits, reference solutions, scoring, tokenizer."""

import collections
import itertools
import re

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

from ksjax.tasks import synthetic
from ksjax.tasks.base import DataError


@pytest.fixture(scope="module")
def task():
  return synthetic.SyntheticTask(seed=0, train_per_level=300, test_per_level=40)


def _signed_terms(prompt_text: str) -> collections.Counter:
  """The multiset of signed terms, read independently of the task's parser."""
  expression = prompt_text.split(" ")[0]
  return collections.Counter(re.findall(r"[+-]?[0-9]", "+" + expression))


def _value(prompt_text: str) -> int:
  return sum(int(term) for term in _signed_terms(prompt_text).elements()) % 10


def _check_solution(prompt_text: str, text: str) -> None:
  """A solution is a chain `a±d=r, r±d=r', ...` using every signed term exactly once."""
  body, final = text.split(". The final answer is ")
  steps = [re.fullmatch(r"([0-9])([+-])([0-9])=([0-9])", step) for step in body.split(", ")]
  assert all(steps), text
  used = collections.Counter(["+" + steps[0].group(1)])
  total = int(steps[0].group(1))
  for step in steps:
    a, sign, d, r = step.groups()
    assert int(a) == total, text
    total = (total + int(d) if sign == "+" else total - int(d)) % 10
    assert int(r) == total, text
    used[sign + d] += 1
  assert used == _signed_terms(prompt_text), text
  assert final == f"{total}." and total == _value(prompt_text), text


def test_splits_are_deterministic_and_seeded(task):
  again = synthetic.SyntheticTask(seed=0, train_per_level=300, test_per_level=40)
  other = synthetic.SyntheticTask(seed=1, train_per_level=300, test_per_level=40)
  for split in ("train", "test"):
    assert task.prompts(split) == again.prompts(split)
    assert [p.id for p in task.prompts(split)] != [p.id for p in other.prompts(split)]


def test_test_split_does_not_depend_on_train_size(task):
  bigger = synthetic.SyntheticTask(seed=0, train_per_level=500, test_per_level=40)
  assert bigger.prompts("test") == task.prompts("test")
  assert len(bigger.prompts("train")) > len(task.prompts("train"))


def test_no_problem_shared_between_splits_even_reordered(task):
  def keys(split):
    return [tuple(sorted(_signed_terms(p.text).elements())) for p in task.prompts(split)]

  assert not set(keys("train")) & set(keys("test"))
  assert len(set(keys("test"))) == len(keys("test"))
  for split in ("train", "test"):
    ids = [p.id for p in task.prompts(split)]
    assert len(set(ids)) == len(ids)


def test_levels_sizes_and_lengths(task):
  assert tuple(task.levels()) == (1, 2, 3, 4, 5)
  for split, per_level in (("train", 300), ("test", 40)):
    counts = collections.Counter(p.metadata["level"] for p in task.prompts(split))
    assert set(counts) == {1, 2, 3, 4, 5}
    assert all(counts[level] == per_level for level in (2, 3, 4, 5))
    for p in task.prompts(split):
      assert p.metadata["level"] == sum(_signed_terms(p.text).values()) - 1
      assert len(p.text) <= synthetic.max_prompt_chars()
  # Level 1 has 155 problems up to reordering; 40 go to test, the reorderings of the rest to train.
  assert 0 < collections.Counter(p.metadata["level"] for p in task.prompts("train"))[1] <= 200 - 40


def test_every_reference_solution_is_a_correct_route(task):
  prompts = task.prompts("train")[::7] + task.prompts("test")
  for p in prompts:
    solutions = task.reference_solutions(p)
    assert solutions[0] == p.solution and len(set(solutions)) == len(solutions) >= 1
    for text in solutions:
      _check_solution(p.text, text)
      assert len(text) <= synthetic.max_solution_chars()
    assert p.reference == _value(p.text)
    scores = task.score([p], [list(solutions)])[0]
    assert scores.correct.all() and (scores.rewards == 1.0).all()
    assert set(scores.answer_ids.tolist()) == {0}


def test_routes_are_counted_exactly():
  # 1+2-3: start from 1 or 2 (the added terms), then either order of the rest: 2 * 2! = 4 routes.
  problem = synthetic.parse_problem("1+2-3 mod 10\n")
  texts = {synthetic.solution(problem, order)
           for order in itertools.permutations(range(3)) if synthetic.is_route(problem, order)}
  assert texts == {"1+2=3, 3-3=0. The final answer is 0.", "1-3=8, 8+2=0. The final answer is 0.",
                   "2+1=3, 3-3=0. The final answer is 0.", "2-3=9, 9+1=0. The final answer is 0."}
  assert set(synthetic.reference_solutions(problem, count=10)) == texts
  with pytest.raises(ValueError, match="not a route"):
    synthetic.solution(problem, (2, 0, 1))  # starts from the subtracted term


def test_reference_solutions_are_diverse(task):
  level5 = [p for p in task.prompts("test") if p.metadata["level"] == 5]
  assert all(len(task.reference_solutions(p)) == 4 for p in level5
             if len(set(_signed_terms(p.text).elements())) == 6)


@pytest.mark.parametrize("completion", [
    "",
    "The final answer is",
    "The final answer is .",
    "x" * 1_000_000,
    "The final answer is 3" + " " * 1_000_000,  # long tail after a wrong answer
    "The final answer is " + "9" * 5000,  # int() would refuse this many digits
    "The final answer is \u0667",  # ARABIC-INDIC DIGIT SEVEN is not an ASCII digit
    "The final answer is \uff17",  # FULLWIDTH DIGIT SEVEN
    "The final answer is 7.5",
    "The final answer is 7x",
    "The final answer is 17",
    "The final answer is -3",  # -3 is 7 mod 10, but the answer asked for is the residue
    "The final answer is 7. Wait. The final answer is 2.",
    "The final answer is 7. The final answer is",  # the last phrase counts, and has no answer
    "\x00\xff\ud7ff garbage \U0001f600 <eos> <pad>",
    "final answer is " * 100_000,
])
def test_adversarial_completions_score_wrong(task, completion):
  prompt = next(p for p in task.prompts("test") if p.reference == 7)
  score = task.score([prompt], [[completion]])[0]
  assert not score.correct[0] and score.rewards[0] == -1.0
  assert score.rewards.dtype == np.float32 and score.answer_ids.dtype == np.int32


@pytest.mark.parametrize("completion", [
    "The final answer is 7",
    "the FINAL ANSWER IS 07.",
    "The final answer is +7",
    "The final answer is: $7$",
    "The final answer is \\boxed{7}",
    "The final answer is 2. No: the final answer is 7.",
    "1+6=7. The final answer is 7.\n\n",
])
def test_accepted_answer_forms(task, completion):
  prompt = next(p for p in task.prompts("test") if p.reference == 7)
  assert task.score([prompt], [[completion]])[0].correct[0]


@hypothesis.given(st.text(max_size=200))
@hypothesis.settings(max_examples=300, deadline=None)
def test_extraction_never_raises(text):
  answer = synthetic.extract_answer(text)
  assert answer is None or re.fullmatch(r"0|-?[1-9][0-9]*", answer)
  assert synthetic.extract_answer("The final answer is 5. " + text) in (answer, "5")


def test_answer_ids_group_equal_answers(task):
  prompt = next(p for p in task.prompts("test") if p.reference == 7)
  group = ["The final answer is 7.", "The final answer is 3.", "oops", "The final answer is 07",
           "The final answer is -0", "", "The final answer is 0", "The final answer is 3"]
  score = task.score([prompt], [group])[0]
  assert score.answers == ("7", "3", None, "7", "0", None, "0", "3")
  assert score.answer_ids.tolist() == [0, 1, 2, 0, 3, 2, 3, 1]
  assert score.correct.tolist() == [True, False, False, True, False, False, False, False]
  for class_id in set(score.answer_ids.tolist()):
    assert len(set(score.rewards[score.answer_ids == class_id].tolist())) == 1


def test_configurable_rewards_and_group_shapes():
  task = synthetic.SyntheticTask(train_per_level=5, test_per_level=5, correct_reward=1.0,
                                 wrong_reward=0.0, levels=(2, 3))
  prompts = task.prompts("test")[:3]
  groups = [[p.solution, "no"] for p in prompts]
  scores = task.score(prompts, groups)
  assert [s.rewards.tolist() for s in scores] == [[1.0, 0.0]] * 3
  assert tuple(task.levels()) == (2, 3)
  with pytest.raises(ValueError, match="2 completion groups"):
    task.score(prompts, groups[:2])
  with pytest.raises(ValueError, match="split 'valid'"):
    task.prompts("valid")


def test_tokenizer_round_trip_and_save(task, tmp_path):
  tok = task.tokenizer
  assert tok.vocab_size == len(synthetic.SPECIAL_TOKENS) + len(synthetic.CHARACTERS)
  tok.save(str(tmp_path))
  loaded = synthetic.load_tokenizer(tmp_path)
  assert (loaded.bos_id, loaded.eos_ids, loaded.pad_id) == (tok.bos_id, tok.eos_ids, tok.pad_id)
  for p in task.prompts("test")[::10]:
    assert p.tokens[0] == tok.bos_id and len(p.tokens) == len(p.text) + 1
    for text in (p.text, p.text + p.solution):
      ids = tok.encode(text)
      assert loaded.encode(text) == ids
      assert tok.decode(ids) == text and loaded.decode(ids + [tok.eos_id, 50, 51]) == text
  assert tok.decode([tok.pad_id] + tok.encode("a b\n", add_bos=False)) == "a b\n"
  unknown = tok.encode("\u00e9", add_bos=False)
  assert unknown == [tok.tok.token_to_id(synthetic.UNK)]


def test_records_round_trip_to_prompts(task):
  records = list(task.records("test"))
  assert [task.prompt_from_record(r) for r in records] == list(task.prompts("test"))
  assert all(list(task.reference_solutions(p)) == r["solutions"]
             for p, r in zip(task.prompts("test"), records))
  with pytest.raises(DataError, match="has answer"):
    task.prompt_from_record(dict(records[0], answer=str((int(records[0]["answer"]) + 1) % 10)))
  with pytest.raises(DataError, match="not a synthetic-task prompt"):
    task.prompt_from_record(dict(records[0], problem="1+2+3+4+5+6+7 mod 10\n"))
  with pytest.raises(DataError, match="no 'problem'"):
    task.prompt_from_record({"id": "x"})
