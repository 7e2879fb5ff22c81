"""The typed run specification: one reader of a ConfigDict, specs that check their own fields."""

import dataclasses
import importlib.util
import os

import pytest

from ksjax.config_validation import ConfigError
from ksjax.run import config as run_config
from ksjax.run import spec as spec_lib
from tests import support

CONFIGS = sorted(name[:-3] for name in os.listdir(support.REPO / "configs")
                 if name.endswith(".py") and name not in ("eval.py", "bandit.py"))


def load(name):
  module_spec = importlib.util.spec_from_file_location(name, support.REPO / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config()


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_file_reads_into_a_spec_that_says_what_the_file_says(name):
  config = load(name)
  if config.task != "synthetic" and not (config.init_hf or config.init_checkpoint
                                         or config.init_gguf):
    config.init_hf = "some Hugging Face directory"
  spec = spec_lib.from_config(config)
  assert spec.task.name == config.task
  assert spec.sampling.batch_prompts == config.batch_prompts
  assert spec.sampling.n == (config.k if config.n is None else config.n)
  assert spec.estimator.k == config.k and spec.estimator.aggregator == config.aggregator
  assert spec.loss.algorithm == config.algorithm
  assert spec.loss.aggregation == config.loss_aggregation
  assert spec.optimizer.learning_rate == config.learning_rate
  assert spec.optimizer.b2 == config.adam_b2
  assert spec.warmup.steps == config.sft_warmup.steps
  assert spec.held_out.ks == tuple(config.eval.ks)
  assert spec.run.mesh == tuple(config.mesh)
  assert spec.config_json["learning_rate"] == config.learning_rate
  # Resolved defaults: n = k, the token_sum constant, the micro-batch, the eval budget.
  assert spec.loss.loss_constant == (config.loss_constant or config.max_new_tokens)
  assert spec.loss.micro_batch_size == (config.micro_batch_size or spec.minibatch_rows)
  assert spec.held_out.max_new_tokens == (config.eval.max_new_tokens or config.max_new_tokens)
  with pytest.raises(dataclasses.FrozenInstanceError):
    spec.loss.algorithm = "ppo"


@pytest.mark.parametrize("spec_class, field, config_name, value", [
    (spec_lib.LossSpec, "algorithm", "config.algorithm", "reinforce"),
    (spec_lib.LossSpec, "aggregation", "config.loss_aggregation", "token_max"),
    (spec_lib.LossSpec, "clip_eps", "config.clip_eps", 1.5),
    (spec_lib.OptimizerSpec, "b2", "config.adam_b2", 1.0),
    (spec_lib.OptimizerSpec, "learning_rate", "config.learning_rate", 0.0),
    (spec_lib.SamplingSpec, "top_p", "config.top_p", 0.0),
    (spec_lib.EstimatorSpec, "baseline", "config.baseline", "median"),
    (spec_lib.EstimatorSpec, "k_schedule", "config.k_schedule", "cosine"),
    (spec_lib.EstimatorSpec, "k_start", "config.k_start", 0),
    (spec_lib.EstimatorSpec, "k_schedule_steps", "config.k_schedule_steps", -1),
    (spec_lib.WarmupSpec, "batch_size", "config.sft_warmup.batch_size", 0),
    (spec_lib.HeldOutSpec, "ks", "config.eval.ks", (1, 64)),
    (spec_lib.RunSpec, "mesh", "config.mesh", (0, 1, 1)),
    (spec_lib.ModelSpec, "dtype", "config.model.dtype", "float8"),
    (spec_lib.TaskSpec, "synthetic_levels", "config.synthetic.levels", (1, 6)),
])
def test_a_spec_made_in_python_checks_its_fields_and_names_the_config_field(
    spec_class, field, config_name, value):
  base = {"name": "synthetic"} if spec_class is spec_lib.TaskSpec else {}
  spec_class(**base)  # the defaults are accepted
  with pytest.raises(ConfigError, match=config_name.replace(".", r"\.")) as error:
    spec_class(**base, **{field: value})
  assert "\n" not in str(error.value)


def test_combinations_are_checked_by_the_whole_spec():
  config = run_config.embedded_task_config()
  config.algorithm = "grpo"
  with pytest.raises(ConfigError, match="config.scale='none' is not accepted with algorithm='grpo'"):
    spec_lib.from_config(config)
  config = run_config.embedded_task_config()
  config.k, config.n = 8, 4
  with pytest.raises(ConfigError, match="config.k=8 is not accepted with config.n=4"):
    spec_lib.from_config(config)
  config = run_config.embedded_task_config()
  config.num_minibatches, config.is_cap = 3, 2.0  # 64 rows
  with pytest.raises(ConfigError, match="config.num_minibatches=3"):
    spec_lib.from_config(config)
  config = run_config.embedded_task_config()
  config.task = "math"
  with pytest.raises(ConfigError, match="config.init_hf is missing"):
    spec_lib.from_config(config)


def test_comparison_baselines_are_named_and_checked_against_the_group_size():
  spec_lib.EstimatorSpec(baseline="normalized").check_with(8)
  spec_lib.EstimatorSpec(baseline="verl_grpo_passk").check_with(4)
  with pytest.raises(ConfigError, match=r"^config\.k=4 is not accepted with "
                                        r"baseline='normalized' and n=4; expected k < n") as error:
    spec_lib.EstimatorSpec(baseline="normalized").check_with(4)
  assert "\n" not in str(error.value)
  with pytest.raises(ConfigError, match=r"^config\.aggregator='mean' is not accepted with "
                                        r"baseline='verl_grpo_passk'"):
    spec_lib.EstimatorSpec(aggregator="mean", baseline="verl_grpo_passk").check_with(4)
  config = run_config.embedded_task_config()
  config.baseline, config.n = "normalized", 8
  assert spec_lib.from_config(config).estimator.baseline == "normalized"


def test_the_k_schedule_is_checked_at_every_k_it_takes():
  spec = spec_lib.EstimatorSpec(k=2, k_schedule="linear", k_start=8, k_schedule_steps=6)
  assert [spec.k_at(step) for step in range(8)] == [8, 7, 6, 5, 4, 3, 2, 2]
  assert spec.scheduled_ks() == (2, 3, 4, 5, 6, 7, 8)
  assert spec_lib.EstimatorSpec(k=3).scheduled_ks() == (3,)
  spec.check_with(8)
  with pytest.raises(ConfigError, match=r"^config\.k_start=8 is not accepted with config\.n=4"):
    spec.check_with(4)
  with pytest.raises(ConfigError, match=r"^config\.k_start=8 is not accepted with "
                                        r"k_schedule='none'"):
    spec_lib.EstimatorSpec(k_start=8)
  with pytest.raises(ConfigError, match=r"^config\.k_schedule_steps=0 is not accepted with "
                                        r"k_schedule='step'"):
    spec_lib.EstimatorSpec(k_schedule="step", k_start=8)
  # k = 1, 10, 18 of 18 samples: C(18, 10) softmax subsets exceed the enumeration limit.
  middle = spec_lib.EstimatorSpec(aggregator="softmax", baseline="none", k=18, k_schedule="linear",
                                  k_start=1, k_schedule_steps=2)
  with pytest.raises(ConfigError, match=r"C\(18, 10\) = 43758 exceeds .*k=10 taken by "
                                        r"config\.k_schedule='linear' from k_start=1, n=18\)$"):
    middle.check_with(18)


def test_a_run_accepts_a_k_schedule():
  config = run_config.embedded_task_config()
  config.k_schedule, config.k_start, config.k_schedule_steps, config.n = "linear", 8, 10, 8
  assert spec_lib.from_config(config).estimator.k_at(0) == 8


def test_sparse_updates_are_decided_in_one_place():
  assert spec_lib.LossSpec().use_sparse
  assert not spec_lib.LossSpec(algorithm="ppo").use_sparse  # the value loss reads every row
  assert not spec_lib.LossSpec(kl_coef=0.1).use_sparse  # so does a KL penalty
  assert not spec_lib.LossSpec(sparse_updates=False).use_sparse


def test_the_reference_forward_runs_when_the_loss_or_the_kl_metrics_need_it():
  every = spec_lib.LossSpec()
  assert all(every.reference_at(step, 10) for step in range(1, 11))
  sparse_kl = spec_lib.LossSpec(kl_every=4)
  assert [s for s in range(1, 11) if sparse_kl.reference_at(s, 10)] == [1, 4, 8, 10]
  penalty = spec_lib.LossSpec(kl_coef=0.1, sparse_updates=False)
  assert all(penalty.reference_at(step, 10) for step in range(1, 11))
  with pytest.raises(ConfigError, match="config.kl_every=4 is not accepted with config.kl_coef"):
    spec_lib.LossSpec(kl_coef=0.1, kl_every=4)
  with pytest.raises(ConfigError, match="config.sparse_min_rows"):
    spec_lib.LossSpec(sparse_min_rows=0)


def test_the_optimizer_spec_builds_the_schedule_it_describes():
  spec = spec_lib.OptimizerSpec(learning_rate=0.5, lr_warmup_steps=4)
  schedule = spec.schedule()
  assert [float(schedule(i)) for i in (0, 2, 4, 10)] == [0.0, 0.25, 0.5, 0.5]
  assert float(spec_lib.OptimizerSpec(learning_rate=0.5, lr_warmup_steps=0).schedule()(0)) == 0.5


def test_configs_load_without_jax():
  """Config files import the ConfigDict defaults alone; jax comes with the specs."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = ("import sys, importlib.util; s = importlib.util.spec_from_file_location('c', "
          f"{str(support.REPO / 'configs' / 'pass_at_k.py')!r}); m = importlib.util.module_from_spec(s); "
          "s.loader.exec_module(m); m.get_config(); "
          "assert 'jax' not in sys.modules, sorted(k for k in sys.modules if 'jax' in k)")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=support.REPO, timeout=60)
