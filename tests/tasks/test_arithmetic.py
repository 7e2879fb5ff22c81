"""The arithmetic word-problem task: splits, answers, prompts in a chat template, scoring."""

import collections
import dataclasses
import re
import time

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

from ksjax.tasks import arithmetic, registry
from ksjax.tasks.arithmetic import ArithmeticTask, extract_answer
from ksjax.tasks.chat import ChatTemplate
from tests.support.chat import CHATML, LLAMA3, make_tokenizer

SIZES = {"train_per_level": 60, "test_per_level": 30}
TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def tokenizer():
  return make_tokenizer(bos=None)


@pytest.fixture(scope="module")
def task(tokenizer):
  with ArithmeticTask(tokenizer=tokenizer, chat_template=CHATML, seed=0, workers=2,
                      timeout_s=TIMEOUT_S, **SIZES) as t:
    yield t


# -- Independent reading of the questions (not the task's code) --

_GAIN_WORDS = ("buys", "finds", "gets", "wins")
_LOSS_WORDS = ("gives away", "loses", "sells", "gives")


def parse(question: str) -> tuple[int, tuple]:
  """(answer, key up to wording) read from the question text alone."""
  numbers = [int(n) for n in re.findall(r"[0-9]+", question)]
  if " has " in question:
    start, *amounts = numbers
    clauses = re.split(r", and then |, then | and then ", question.split(". ", 1)[1])
    assert len(clauses) == len(amounts), question
    total, ops = start, []
    for clause, amount in zip(clauses, amounts):
      clause = re.sub(r"^(He|She) ", "", clause)
      gain = clause.split()[0] in _GAIN_WORDS
      assert gain or any(clause.startswith(w) for w in _LOSS_WORDS), clause
      total += amount if gain else -amount
      assert total >= 1, question
      ops.append(("+" if gain else "-", amount))
    return total, (len(amounts) + 2, start, *ops)
  a, b = numbers
  product = "times" in question or "*" in question or "Multiply" in question
  level = 2 if product and max(a, b) >= 6 else 1
  return (a * b if product else a + b), (level, "*" if product else "+", min(a, b), max(a, b))


def test_answers_and_keys_recomputed_from_the_text(task):
  for split in ("train", "test"):
    for prompt, problem in zip(task.prompts(split), task.problems(split)):
      answer, key = parse(problem.question)
      assert prompt.reference == str(answer) == str(problem.answer)
      assert key == problem.key and key[0] == prompt.metadata["level"]


def test_levels_sizes_and_ranges(task):
  assert tuple(task.levels()) == (1, 2, 3, 4)
  for split, per_level in (("train", 60), ("test", 30)):
    counts = collections.Counter(p.metadata["level"] for p in task.prompts(split))
    assert counts == {1: per_level, 2: per_level, 3: per_level, 4: per_level}
    for problem in task.problems(split):
      numbers = [int(n) for n in re.findall(r"[0-9]+", problem.question)]
      if problem.level == 1:
        assert len(numbers) == 2 and all(1 <= n <= 9 for n in numbers), problem.question
        assert "+" in problem.question or "plus" in problem.question or "Add" in problem.question \
            or max(numbers) <= 5, problem.question  # products of 2-5
      elif problem.level == 2:  # times tables up to 12, not both factors of level 1's 2-5
        assert len(numbers) == 2 and all(2 <= n <= 12 for n in numbers), problem.question
        assert max(numbers) >= 6 and "+" not in problem.question, problem.question
      else:
        assert len(numbers) == problem.level - 1, problem.question  # start + level - 2 steps
        assert all(n <= 15 for n in numbers), problem.question
  answers = {p.reference for p in task.prompts("train")}
  assert len(answers) > 40  # a large answer space
  ids = [p.id for p in task.prompts("train")]
  assert len(set(ids)) == len(ids) and ids[0] == "L1-0000" and "L4-0059" in ids


def test_splits_are_deterministic_and_seeded(task, tokenizer):
  again = ArithmeticTask(tokenizer=tokenizer, chat_template=CHATML, seed=0, checker=task.checker,
                         **SIZES)
  other = ArithmeticTask(tokenizer=tokenizer, chat_template=CHATML, seed=1, checker=task.checker,
                         **SIZES)
  for split in ("train", "test"):
    assert again.prompts(split) == task.prompts(split)
    texts = [p.text for p in task.prompts(split)]
    assert [p.text for p in other.prompts(split)] != texts
  bigger = ArithmeticTask(tokenizer=tokenizer, chat_template=CHATML, seed=0, train_per_level=90,
                          test_per_level=30, levels=(3, 4, 2, 1), checker=task.checker)
  assert bigger.prompts("test") == task.prompts("test")  # independent of the training size
  assert bigger.prompts("train")[:60] == task.prompts("train")[:60]  # level 1 comes first
  assert tuple(bigger.levels()) == (1, 2, 3, 4)


def test_splits_are_disjoint_even_reworded(task):
  train = {p.question for p in task.problems("train")}
  test = [p.question for p in task.problems("test")]
  assert len(set(test)) == len(test) and len(train) == len(task.problems("train"))
  assert not train & set(test)
  train_keys = {parse(q)[1] for q in train}
  test_keys = [parse(q)[1] for q in test]
  assert len(set(test_keys)) == len(test_keys) and not train_keys & set(test_keys)


def test_level_capacity(task, tokenizer):
  """55 problems up to wording (45 sums of 1-9, 10 products of 2-5): all can go to test.
  Level 2 has the other 56 products of factors 2-12."""
  full = arithmetic.generate_split_problems(seed=0, train_per_level=500, test_per_level=55,
                                            levels=(1,))
  assert len({p.key for p in full["test"]}) == 55 and full["train"] == []
  some = arithmetic.generate_split_problems(seed=0, train_per_level=500, test_per_level=30,
                                            levels=(1,))
  assert 25 * 2 < len(some["train"]) < 500  # the rewordings of the 25 keys left
  with pytest.raises(ValueError, match="level 1 has only 55 distinct problems"):
    arithmetic.generate_split_problems(seed=0, train_per_level=1, test_per_level=56, levels=(1,))
  level2 = arithmetic.generate_split_problems(seed=0, train_per_level=0, test_per_level=56,
                                              levels=(2,))["test"]
  assert len({parse(p.question)[1] for p in level2}) == 56
  with pytest.raises(ValueError, match="level 5 is not accepted"):
    ArithmeticTask(tokenizer=tokenizer, chat_template=CHATML, levels=(5,), checker=task.checker)


def test_prompts_in_the_chat_template(task):
  prompt, problem = task.prompts("test")[0], task.problems("test")[0]
  user = f"{problem.question} Give the final answer as a number."
  assert prompt.text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                         "trained by Hugging Face<|im_end|>\n<|im_start|>user\n" + user +
                         "<|im_end|>\n<|im_start|>assistant\n")
  assert prompt.tokens == tuple(task.tokenizer.encode(prompt.text, add_bos=False))
  assert prompt.tokens[0] == task.tokenizer.tok.token_to_id("<|im_start|>")


@pytest.mark.parametrize("template, bos, add_bos", [
    (LLAMA3, "<|begin_of_text|>", True),  # the template writes BOS: not a second one
    (LLAMA3, "<|begin_of_text|>", False),
    (CHATML, "<|im_start|>", True),  # SmolLM2's BOS is its turn marker
    (CHATML, "<|im_start|>", False),  # SmolLM2's GGUF: add_bos_token=false
    (CHATML, "<s>", True),  # a template without BOS: the tokenizer's goes first
    (CHATML, "<s>", False),
])
def test_tokens_equal_transformers_and_bos_once(task, template, bos, add_bos):
  transformers = pytest.importorskip("transformers")
  tok = make_tokenizer(bos=bos, add_bos=add_bos)
  chat = ChatTemplate.from_string(template, bos_token=bos, eos_token="<|eot_id|>")
  t = ArithmeticTask(tokenizer=tok, chat_template=chat, levels=(3,), train_per_level=3,
                     test_per_level=3, system_prompt="Be brief.", checker=task.checker)
  hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.tok, bos_token=bos,
                                            eos_token="<|eot_id|>", chat_template=template)
  for prompt, problem in zip(t.prompts("train"), t.problems("train")):
    expected = list(hf.apply_chat_template(
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": t.user_message(problem)}],
        tokenize=True, add_generation_prompt=True, return_dict=False))
    if bos == "<s>" and add_bos:
      expected = [tok.bos_id] + expected
    assert list(prompt.tokens) == expected
    assert (prompt.tokens[0] == tok.bos_id) is (bos != "<s>" or add_bos)
    assert prompt.tokens[1] != tok.bos_id
    assert "Be brief." in prompt.text and "SmolLM" not in prompt.text


def test_instruction_is_configurable(task, tokenizer):
  t = ArithmeticTask(tokenizer=tokenizer, chat_template=CHATML, levels=(2,), train_per_level=2,
                     test_per_level=2, instruction="", checker=task.checker)
  assert "Give the final answer" not in t.prompts("test")[0].text
  assert t.prompts("test")[0].text.endswith("?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("completion", [
    "The answer is 85",
    "\\boxed{85}",
    "85.",
    "**85**",
    "The final answer is $85$.",
    "The final answer is **85** apples.",
    "Let's add: 40 + 45 = 85",
    "Answer: 85",
    "the answer is: $\\boxed{85}$",
    "The final answer is $\\frac{170}{2}$.",
    "He has 85.0 apples",
    "The answer is 84. Wait, no: the final answer is 85.",
])
def test_accepted_answer_forms(task, completion):
  prompt = dataclasses.replace(task.prompts("test")[0], reference="85")
  [score] = task.score([prompt], [[completion]])
  assert score.correct.tolist() == [True] and score.rewards.tolist() == [1.0]


@pytest.mark.parametrize("completion", [
    "The answer is 84",
    "\\boxed{86}",
    "850",
    "8.5",
    "85 + 1 = 86",
    "The final answer is 85. No wait, the answer is \\boxed{84}.",
    "I don't know.",
    "",
    "The final answer is \\boxed{85",  # cut off: no answer
    "x" * 1_000_000,
    "The final answer is 9^{9^{9^9}}",  # the checker's timeout, not a hang
])
def test_rejected_answers(task, completion):
  prompt = dataclasses.replace(task.prompts("test")[0], reference="85")
  start = time.monotonic()
  [score] = task.score([prompt], [[completion]])
  assert score.correct.tolist() == [False] and score.rewards.tolist() == [-1.0]
  assert time.monotonic() - start < 10 * TIMEOUT_S


def test_answer_classes_for_majority_voting(task):
  prompt = dataclasses.replace(task.prompts("test")[0], reference="85")
  group = ["The answer is 85", "84", "no idea", "\\boxed{84.0}", "**85**", "", "86", "1,000"]
  [score] = task.score([prompt], [group])
  assert score.answers == ("85", "84", None, "84.0", "85", None, "86", "1000")
  assert score.correct.tolist() == [True, False, False, False, True, False, False, False]
  assert score.answer_ids.dtype == np.int32
  assert score.answer_ids.tolist() == [0, 1, 2, 1, 0, 2, 3, 4]
  assert score.rewards.dtype == np.float32


def test_reference_solutions_score_correct_with_custom_rewards(task, tokenizer):
  t = ArithmeticTask(tokenizer=tokenizer, chat_template=CHATML, correct_reward=2.0,
                     wrong_reward=0.0, checker=task.checker, **SIZES)
  prompts = t.prompts("test")[::7]
  for prompt, problem in zip(prompts, t.problems("test")[::7]):
    [solution] = t.reference_solutions(prompt)
    assert solution == prompt.solution
    assert solution.endswith(f"\nThe final answer is {problem.answer}.")
    for step in solution.splitlines()[:-1]:  # each step's arithmetic is right
      match = re.fullmatch(r"([0-9]+) ([-+×]) ([0-9]+) = ([0-9]+)", step)
      left, op, right, result = match.groups()
      value = {"+": int(left) + int(right), "-": int(left) - int(right),
               "×": int(left) * int(right)}[op]
      assert value == int(result), solution
    assert len(solution.splitlines()) == max(2, problem.level - 1)  # steps + answer sentence
  scores = t.score(prompts, [[t.reference_solutions(p)[0], "No answer."] for p in prompts])
  assert all(s.rewards.tolist() == [2.0, 0.0] for s in scores)
  with pytest.raises(ValueError, match="2 prompts but 1 completion groups"):
    t.score(prompts[:2], [["1"]])


def test_registry_builds_it(task, tokenizer):
  with registry.make_task("arithmetic", tokenizer=tokenizer, chat_template=CHATML, seed=0,
                          levels=(1, 2), train_per_level=5, test_per_level=5, correct_reward=1.0,
                          wrong_reward=0.0, workers=1, system_prompt="Be brief.") as t:
    assert isinstance(t, ArithmeticTask) and t.name == "arithmetic"
    assert tuple(t.levels()) == (1, 2) and len(t.prompts("test")) == 10
    assert "Be brief." in t.prompts("test")[0].text
  with pytest.raises(ValueError, match="needs the model's tokenizer"):
    registry.make_task("arithmetic", chat_template=CHATML)
  with pytest.raises(ValueError, match="chat_template is a int"):
    ArithmeticTask(tokenizer=tokenizer, chat_template=3)
  with pytest.raises(ValueError, match="does not compile"):
    ArithmeticTask(tokenizer=tokenizer, chat_template="{% if %}")
  with pytest.raises(ValueError, match="split 'valid'"):
    task.prompts("valid")


@hypothesis.given(st.text(max_size=300))
@hypothesis.settings(max_examples=300, deadline=None)
def test_extraction_never_raises(text):
  answer = extract_answer(text)
  assert answer is None or (isinstance(answer, str) and answer)
  assert extract_answer(text + " The final answer is 7.") == "7"


def test_extraction_is_linear_on_long_inputs():
  for text in ("1 " * 500_000, "answer is " * 200_000, "\\boxed{" * 100_000, "-" * 1_000_000):
    start = time.monotonic()
    extract_answer(text)
    assert time.monotonic() - start < 5.0
