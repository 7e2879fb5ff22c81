"""Evaluation of a training run's checkpoints, in a process of its own.

Run: python -m ksjax.eval --config=configs/eval.py --config.checkpoint_dir=runs/pass_at_k
     python -m ksjax.eval --config=configs/eval.py:<train config> ...   (e.g. :grpo_pass_at_k)

`config.run` is the trainer config that says which task and model the checkpoints hold, and the
mesh: by default the default CPU run's config (`ksjax.run.config.embedded_task_config`, which every
CPU config in configs/ starts from); after the colon, the name of another config file in this
directory. Its fields can be set like any other (`--config.run.model.dtype=bfloat16`,
`--config.run.mesh=1,1,8`). The evaluation's own settings are the top-level fields below.

Large-k diagnostics, e.g. pass@k and maj@k for k = 1, 2, 4, ..., 256 on the first 50 problems:
  --config.num_prompts=50 --config.num_samples=256   (ks default to that ladder; with a large
  model, lower batch_rows, the sampler's rows per call, to what the device holds)
"""

import importlib.util
import os

import ml_collections
from ml_collections import config_dict

from ksjax.run import config as run_config


def _train_config(name: str | None) -> ml_collections.ConfigDict:
  if not name:
    return run_config.embedded_task_config()
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"configs/eval.py:{name}: no trainer config {path}")
  spec = importlib.util.spec_from_file_location(f"ksjax_train_config_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def get_config(train_config: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.checkpoint_dir = config_dict.placeholder(str)  # a run's workdir, or its checkpoints/ dir
  # Which checkpoints: "latest", "all", "last:N" (each of the N newest, and their average, as
  # the paper reports), or step numbers "S" / "S1,S2,...".
  c.steps = "latest"
  # Follow the directory and evaluate every checkpoint not evaluated yet (config.steps is not
  # used), now and as each lands; stop after idle_timeout_s seconds without a new one (None:
  # never).
  # Also the policy the run started from (<run>/start: the loaded or warmed-up model), as step 0,
  # before the checkpoints.
  c.include_start = False
  c.watch = False
  c.poll_interval_s = 30.0
  c.idle_timeout_s = config_dict.placeholder(float)

  c.split = "test"  # the task split the problems come from
  c.num_prompts = config_dict.placeholder(int)  # the first N problems of the split; None: all
  c.num_samples = 20  # n completions per problem (200 or more for pass@100; 256 or more for
  # the large-k diagnostics, on a subset of problems via num_prompts)
  # pass@k and maj@k for each k <= num_samples; None: the ladder 1, 2, 4, ..., num_samples
  # (`ksjax.run.scoring.k_ladder`; e.g. 1, 2, 4, 8, 16, 20 for 20 samples).
  c.ks = config_dict.placeholder(tuple)
  c.temperature = 1.0
  c.top_p = 1.0
  c.top_k = 0
  c.max_new_tokens = config_dict.placeholder(int)  # None: the run's eval.max_new_tokens
  # Problems per sampler call (batch_prompts * num_samples rows). 8 is the fastest on a CPU for
  # the tiny model (benchmarks/eval.py: 4 and 8 alike, 16 about 0.6x, 32 and 64 about 0.5x);
  # on an accelerator with a large model, raise it until the device is full.
  c.batch_prompts = 8
  # At most this many sampler rows (problems x samples) per call: batch_prompts drops to the
  # largest power of two <= batch_rows // num_samples (the sampler pads to powers of two) so that
  # large n fits, e.g. to 4 at num_samples=512, or to 1 with --config.batch_rows=256 at 256. All
  # n samples of a problem are drawn in one call, so num_samples > batch_rows is refused. The
  # default leaves batch_prompts=8 alone up to n=256. None: no cap. (A mesh whose batch axes do
  # not divide num_samples pads a call further: `ksjax.sampling.batching.bucket_prompt_batch`.)
  c.batch_rows = 2048
  c.seed = 0
  c.breakdown = ("level", "subject")  # problem metadata fields to report separately
  c.output_dir = config_dict.placeholder(str)  # None: <run dir>/eval/<split>_n<n>_t<T>_p<p>
  c.plots = True
  # KL(checkpoint || reference) on the held-out samples (temperature 1, no top-p/top-k): per
  # completion, summed over its tokens, the k1 and k3 estimators (`kl_k1`, `kl_k3` in the
  # metrics), from the sampler's log-probs and one reference forward. "start": the policy the
  # run started from (<run>/start); or a ksjax.model checkpoint directory; None: not measured.
  # kl_samples: the first this many samples of each problem are scored (None: all of them).
  c.kl_reference = config_dict.placeholder(str)
  c.kl_samples = config_dict.placeholder(int)

  c.run = _train_config(train_config)
  return c
