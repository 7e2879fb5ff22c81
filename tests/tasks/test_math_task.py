"""MathTask: prompts from the three formats, group scoring, answer classes for majority voting."""

import json
import os

import numpy as np
import pytest

from ksjax.tasks.base import DataError
from ksjax.tasks.math_answer import extract_answer
from ksjax.tasks.math_checker import Verdict
from ksjax.tasks.math_data import read_harp_jsonl
from ksjax.tasks.math_task import MathTask
from ksjax.tasks.synthetic import make_tokenizer
from tests import support

FIXTURES = str(support.FIXTURES / "math")
TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def tokenizer():
  return make_tokenizer()


@pytest.fixture(scope="module")
def task(tokenizer):
  splits = {"train": os.path.join(FIXTURES, "MATH", "train"),
            "test": os.path.join(FIXTURES, "MATH", "test")}
  with MathTask(splits, tokenizer, fmt="math_dir", timeout_s=TIMEOUT_S, workers=2) as t:
    yield t


def test_prompts(task, tokenizer):
  prompts = task.prompts("train")
  assert [p.id for p in prompts] == ["algebra/2.json", "algebra/10.json", "geometry/7.json"]
  first = prompts[0]
  assert "What is the value of $x$ if $2x + 3 = 4$?" in first.text
  assert "The final answer is" in first.text  # the paper's instruction
  assert first.tokens == tuple(tokenizer.encode(first.text))
  assert first.metadata == {"level": 1, "subject": "Algebra"}
  assert first.reference == "\\frac{1}{2}"
  assert first.solution.endswith("\nThe final answer is $\\frac{1}{2}$.")
  assert extract_answer(first.solution) == "\\frac{1}{2}"
  assert task.prompts("test")[0].metadata == {"subject": "Number Theory"}  # "Level ?"
  assert task.levels() == [1, 2, 3]
  with pytest.raises(ValueError, match="split 'valid' is not accepted"):
    task.prompts("valid")


def test_all_formats_and_reference_solutions_score_correct(tokenizer, task):
  """Each fixture problem's own reference solution earns the success reward: the readers' gold
  extraction and the solutions' final sentence agree, for every format."""
  sources = {"math_dir": os.path.join(FIXTURES, "MATH"),
             "math500_jsonl": os.path.join(FIXTURES, "math500.jsonl"),
             "harp_jsonl": os.path.join(FIXTURES, "harp.jsonl")}
  for fmt, path in sources.items():
    other = MathTask({"test": path}, tokenizer, fmt=fmt, checker=task.checker)
    prompts = other.prompts("test")
    scores = other.score(prompts, [[p.solution] for p in prompts])
    assert all(s.correct.tolist() == [True] for s in scores), fmt
    assert all(s.rewards.tolist() == [1.0] for s in scores), fmt


def test_score_group_classes(task):
  [prompt] = [p for p in task.prompts("train") if p.id == "algebra/2.json"]  # gold 1/2
  completions = [
      "The final answer is $\\frac{1}{2}$.",  # 0: correct
      "thus \\boxed{0.5}",  # 1: correct, same class
      "no answer stated",  # 2: no answer
      "The final answer is 3.",  # 3: wrong
      "The final answer is $3.0$.",  # 4: wrong, equal to 3
      "The final answer is 1/2",  # 5: correct
      "The final answer is 4",  # 6: wrong, new class
      "I give up",  # 7: no answer, same class as 2
      "The final answer is 9^{9^{9^9}}",  # 8: times out: wrong, its own class
      "The final answer is $\\frac{6}{2}$",  # 9: equal to 3
  ]
  [score] = task.score([prompt], [completions])
  assert score.correct.tolist() == [bool(c) for c in [1, 1, 0, 0, 0, 1, 0, 0, 0, 0]]
  assert score.rewards.dtype == np.float32
  assert score.rewards.tolist() == [1, 1, -1, -1, -1, 1, -1, -1, -1, -1]
  assert score.answer_ids.dtype == np.int32
  assert score.answer_ids.tolist() == [0, 0, 1, 2, 2, 0, 3, 1, 4, 2]
  assert score.answers[:4] == ("\\frac{1}{2}", "0.5", None, "3")


def test_score_many_groups_in_order_with_custom_rewards(tokenizer, task):
  harp = list(read_harp_jsonl(os.path.join(FIXTURES, "harp.jsonl")))
  custom = MathTask({"train": harp}, tokenizer, correct_reward=2.0, wrong_reward=0.0,
                    checker=task.checker)
  prompts = custom.prompts("train")  # golds 55, 24, 1/4
  completions = [["The final answer is 55.", "The final answer is 56."],
                 ["\\boxed{24}", "\\boxed{24.0}"],
                 ["The final answer is 0.25", "The final answer is 25\\%"]]
  scores = custom.score(prompts, completions)
  assert [s.correct.tolist() for s in scores] == [[True, False], [True, True], [True, True]]
  assert [s.rewards.tolist() for s in scores] == [[2.0, 0.0], [2.0, 2.0], [2.0, 2.0]]
  assert [s.answer_ids.tolist() for s in scores] == [[0, 1], [0, 0], [0, 0]]


def test_score_identical_adversarial_answers_share_a_class(task):
  """Identical texts are one class without any check; a group of hanging answers costs one
  timeout per distinct answer, not one per pair."""
  [prompt] = task.prompts("test")
  tower = "The final answer is 9^{9^{9^9}}"
  [score] = task.score([prompt], [[tower, tower, "The final answer is " + "(" * 3000]])
  assert score.correct.tolist() == [False, False, False]
  assert score.answer_ids.tolist() == [0, 0, 1]


def test_prompt_from_record_round_trips_through_json(task):
  records = [dict(r) for r in task._records["train"]]  # pylint: disable=protected-access
  assert [task.prompt_from_record(json.loads(json.dumps(r))) for r in records] == list(
      task.prompts("train"))
  with pytest.raises(DataError, match="field 'answer' is None"):
    task.prompt_from_record({"id": "x", "problem": "p", "answer": None})
  with pytest.raises(DataError, match="not a record"):
    task.prompt_from_record(["x"])


def test_closing_leaves_a_shared_checker_running(tokenizer, task):
  task.checker.start()
  with MathTask({}, tokenizer, checker=task.checker) as sharing:
    assert sharing.checker is task.checker
  assert task.checker.worker_pids()  # the module's task still scores with it


def test_bad_construction(tokenizer, task):
  with pytest.raises(ValueError, match="pass fmt="):
    MathTask({"train": os.path.join(FIXTURES, "harp.jsonl")}, tokenizer, checker=task.checker)
  with pytest.raises(DataError, match="split 'train', record 1: field 'problem'"):
    MathTask({"train": [{"id": "a", "problem": "p", "answer": "1"}, {"id": "b", "answer": "2"}]},
             tokenizer, checker=task.checker)
  with pytest.raises(ValueError, match="{problem}"):
    MathTask({}, tokenizer, template="no field", checker=task.checker)
  with pytest.raises(ValueError, match="1 prompts but 2 completion groups"):
    task.score(task.prompts("test"), [["a"], ["b"]])


class ScriptedChecker:
  """Stands in for AnswerChecker with verdicts chosen by the test, recording every pair asked."""

  def __init__(self, verdict):
    self.verdict = verdict
    self.pairs = []

  def check(self, pairs):
    self.pairs.extend(pairs)
    return [self.verdict(g, p) for g, p in pairs]


def _scripted_score(tokenizer, verdict, answers):
  checker = ScriptedChecker(verdict)
  task = MathTask({"t": [{"id": "0", "problem": "p", "answer": "G"}]}, tokenizer, checker=checker)
  [score] = task.score(task.prompts("t"), [[f"The final answer is {a}." for a in answers]])
  return score, checker.pairs


def test_classes_merge_through_representatives(tokenizer):
  equal = {frozenset(("b", "b2")), frozenset(("c", "c2")), frozenset(("G", "g"))}

  def verdict(x, y):
    return Verdict.EQUAL if frozenset((x, y)) in equal else Verdict.DIFFERENT

  score, pairs = _scripted_score(tokenizer, verdict, ["a", "b", "g", "c", "b2", "c2", "a"])
  assert score.correct.tolist() == [False, False, True, False, False, False, False]
  assert score.answer_ids.tolist() == [0, 1, 2, 3, 1, 3, 0]
  # Each distinct answer once against the gold; each distinct wrong answer against the
  # representative of every wrong class so far (one parallel batch per round), b2 and c2 not
  # becoming representatives since they joined classes.
  gold_pairs = [p for p in pairs if p[0] == "G"]
  assert sorted(gold_pairs) == [("G", x) for x in ["a", "b", "b2", "c", "c2", "g"]]
  assert sorted(p for p in pairs if p[0] != "G") == [
      ("a", "b"), ("a", "b2"), ("a", "c"), ("a", "c2"), ("b", "b2"), ("b", "c"), ("b", "c2"),
      ("c", "b2"), ("c", "c2")]


def test_a_hostile_answer_costs_one_pairwise_timeout(tokenizer):
  """An answer that hangs every pairwise comparison (though not the gold check) is dropped from
  comparisons after its first timeout, with its partner: no merges through it, rewards intact."""

  def verdict(x, y):
    if "h" in (x, y) and "G" not in (x, y):
      return Verdict.TIMEOUT
    return Verdict.EQUAL if {x, y} == {"x1", "x1b"} else Verdict.DIFFERENT

  score, pairs = _scripted_score(tokenizer, verdict, ["h", "x1", "x2", "x1b", "x3"])
  assert sum("h" in p for p in pairs if p[0] != "G") == 1  # (h, x1) only
  # x1 was in the timed-out pair, so x1b no longer merges with it: its own class.
  assert score.answer_ids.tolist() == [0, 1, 2, 3, 4]
  assert score.rewards.tolist() == [-1.0] * 5
