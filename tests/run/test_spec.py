"""The typed run specification: every config field declared once, one reader of a ConfigDict,
specs that check their own fields."""

import dataclasses
import importlib.util
import os
import typing

import numpy as np
import pytest
from ml_collections import config_dict

from ksjax import config_fields as cf
from ksjax.config_validation import ConfigError
from ksjax.run import config as run_config
from ksjax.run import spec as spec_lib
from ksjax.tasks import arithmetic, planted, reasoning_gym, registry, synthetic
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
  if config.task not in registry.EMBEDDED_TASKS and not (config.init_hf or config.init_checkpoint
                                         or config.init_gguf):
    config.init_hf = "some Hugging Face directory"
  spec = spec_lib.from_config(config)
  assert spec.task.name == config.task
  assert spec.sampling.batch_prompts == config.batch_prompts
  assert spec.sampling.n == (config.k if config.n is None else config.n)
  assert spec.estimator.k == config.k and spec.estimator.aggregator == config.aggregator
  assert spec.loss.algorithm == config.algorithm
  assert spec.loss.loss_aggregation == config.loss_aggregation
  assert spec.optimizer.learning_rate == config.learning_rate
  assert spec.optimizer.adam_b2 == config.adam_b2
  assert spec.sft_warmup.steps == config.sft_warmup.steps
  assert spec.eval.ks == tuple(config.eval.ks)
  assert spec.run.mesh == tuple(config.mesh)
  assert dataclasses.asdict(spec.lora) == config.lora.to_dict()
  assert spec.config_json["learning_rate"] == config.learning_rate
  # Resolved defaults: n = k, the token_sum constant, the micro-batch, the eval budget.
  assert spec.loss.loss_constant == (config.loss_constant or config.max_new_tokens)
  assert spec.loss.micro_batch_size == (config.micro_batch_size or spec.minibatch_rows)
  assert spec.eval.max_new_tokens == (config.eval.max_new_tokens or config.max_new_tokens)
  with pytest.raises(dataclasses.FrozenInstanceError):
    spec.loss.algorithm = "ppo"


def flat(config, prefix=""):
  """A config's leaves by dotted name."""
  out = {}
  for name, value in config.items():
    if isinstance(value, config_dict.ConfigDict):
      out.update(flat(value, f"{prefix}{name}."))
    else:
      out[f"{prefix}{name}"] = value
  return out


@pytest.mark.parametrize("name, learning_rates", [
    ("smollm2_pass_at_k", ("learning_rate",)),
    ("math_llama8b", ("learning_rate", "sft_warmup.learning_rate"))])
def test_a_lora_config_is_its_full_fine_tuning_config_with_adapters_and_10x_the_rates(
    name, learning_rates):
  full, adapted = flat(load(name)), flat(load(f"{name}_lora"))
  changed = {key for key in full if full[key] != adapted[key]}
  assert changed == {"workdir", "lora.rank", "lora.alpha", *learning_rates}
  assert adapted["workdir"] != full["workdir"]  # its own run directory
  config = load(f"{name}_lora")
  if not (config.init_hf or config.init_gguf):  # the weights are not read here
    config.init_hf = "some Hugging Face directory"
  assert spec_lib.from_config(config).lora.enabled
  for key in learning_rates:  # the rates the adapters train at, as the configs say why
    assert adapted[key] == pytest.approx(10 * full[key])


@pytest.mark.parametrize("spec_class, field, config_name, value", [
    (spec_lib.LossSpec, "algorithm", "config.algorithm", "reinforce"),
    (spec_lib.LossSpec, "loss_aggregation", "config.loss_aggregation", "token_max"),
    (spec_lib.LossSpec, "clip_eps", "config.clip_eps", 1.5),
    (spec_lib.OptimizerSpec, "adam_b2", "config.adam_b2", 1.0),
    (spec_lib.OptimizerSpec, "learning_rate", "config.learning_rate", 0.0),
    (spec_lib.SamplingSpec, "top_p", "config.top_p", 0.0),
    (spec_lib.EstimatorSpec, "baseline", "config.baseline", "median"),
    (spec_lib.EstimatorSpec, "k_schedule", "config.k_schedule", "cosine"),
    (spec_lib.EstimatorSpec, "k_start", "config.k_start", 0),
    (spec_lib.EstimatorSpec, "k_schedule_steps", "config.k_schedule_steps", -1),
    (spec_lib.WarmupSpec, "batch_size", "config.sft_warmup.batch_size", 0),
    (spec_lib.HeldOutSpec, "ks", "config.eval.ks", (1, 64)),
    (spec_lib.RunSpec, "mesh", "config.mesh", (0, 1, 1)),
    (spec_lib.LlamaSpec, "dtype", "config.model.dtype", "float8"),
    (synthetic.SyntheticOptions, "levels", "config.synthetic.levels", (1, 6)),
])
def test_a_spec_made_in_python_checks_its_fields_and_names_the_config_field(
    spec_class, field, config_name, value):
  spec_class()  # the defaults are accepted
  with pytest.raises(ConfigError, match=config_name.replace(".", r"\.")) as error:
    spec_class(**{field: value})
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


def test_the_optimizer_is_adamw_or_plain_sgd():
  """SGD's update is the (clipped) gradient times the learning rate; Adam's first update is the
  learning rate times the gradient's sign (bias-corrected m / sqrt(v)), whatever its size."""
  import jax.numpy as jnp
  grads = {"w": jnp.array([[3.0, -4.0]]), "b": jnp.array([1e-3])}
  params = {"w": jnp.zeros((1, 2)), "b": jnp.zeros(1)}
  for name, expected in (("sgd", {"w": [[-0.3 * 0.6, 0.3 * 0.8]], "b": [-0.3 * 1e-3 / 5]}),
                         ("adamw", {"w": [[-0.3, 0.3]], "b": [-0.3]})):
    spec = spec_lib.OptimizerSpec(optimizer=name, learning_rate=0.3, lr_warmup_steps=0,
                                  max_grad_norm=1.0)  # the norm is 5: clipped to 1
    tx = spec.build()
    updates, _ = tx.update(grads, tx.init(params), params)
    for key in grads:
      np.testing.assert_allclose(updates[key], expected[key], rtol=1e-4, atol=1e-9)
  with pytest.raises(ConfigError, match="config.optimizer='adam'"):
    spec_lib.OptimizerSpec(optimizer="adam")
  config = run_config.embedded_task_config()
  config.optimizer = "sgd"
  assert spec_lib.from_config(config).optimizer.optimizer == "sgd"


def test_configs_load_without_jax():
  """Config files import the ConfigDict defaults alone; jax comes with the specs."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = ("import sys, importlib.util; s = importlib.util.spec_from_file_location('c', "
          f"{str(support.REPO / 'configs' / 'pass_at_k.py')!r}); m = importlib.util.module_from_spec(s); "
          "s.loader.exec_module(m); m.get_config(); "
          "assert 'jax' not in sys.modules, sorted(k for k in sys.modules if 'jax' in k)")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=support.REPO, timeout=60)


def _flat(config, prefix=""):
  """{dotted name: (value, field type or None for a plain value)} of a ConfigDict's leaves."""
  out = {}
  for key in config.keys():
    raw = config._fields[key]  # pylint: disable=protected-access
    if isinstance(raw, config_dict.ConfigDict):
      out.update(_flat(raw, f"{prefix}{key}."))
    elif isinstance(raw, config_dict.FieldReference):
      out[prefix + key] = (raw.get(), raw._field_type)  # pylint: disable=protected-access
    else:
      out[prefix + key] = (raw, None)
  return out


def test_the_base_config_is_every_declared_field_at_its_default_and_nothing_else():
  declared = list(cf.leaves(spec_lib.TrainSpec))
  names = [name for name, _, _ in declared]
  assert len(names) == len(set(names))  # each config field is declared by one spec field
  flat = _flat(run_config.base_config())
  assert sorted(flat) == sorted(names)
  for name, owner, f in declared:
    value, field_type = flat[name]
    assert value == f.default and type(value) is type(f.default), name
    kind, nullable = cf.value_type(owner, f.name)
    if nullable and field_type is None:  # only a field of no declared type may be a plain None
      assert kind is typing.Any and value is None, name
    if field_type is not None:  # None can be set over, and a value of the type over None
      assert nullable and field_type is (getattr(kind, "__origin__", None) or kind), name
  # Sections nest like the specs, under the dataclass field's name.
  assert flat["synthetic.levels"] == ((1, 2, 3, 4, 5), None)
  assert flat["eval.max_new_tokens"] == (None, int) and flat["max_grad_norm"] == (1.0, float)
  assert flat["k_weights"] == (None, tuple)


def test_every_field_and_section_says_what_it_means_in_one_line():
  def walk(cls):
    for f in dataclasses.fields(cls):
      declared = cf.declaration(f)
      if declared is None:
        continue
      yield f"{cls.__name__}.{f.name}", declared.meaning
      if declared.kind != cf.FIELD:
        yield from walk(f.default_factory)
  meanings = dict(walk(spec_lib.TrainSpec))
  assert len(meanings) > len(list(cf.leaves(spec_lib.TrainSpec)))  # sections and groups too
  for name, meaning in meanings.items():
    assert isinstance(meaning, str) and meaning.strip() and "\n" not in meaning, name
  assert "synthetic.levels = (1, 2, 3, 4, 5)  # " in cf.describe(spec_lib.TrainSpec)


def test_each_task_declares_its_options_and_the_run_takes_them_from_the_registry():
  task_fields = {f.name: f for f in dataclasses.fields(spec_lib.TaskSpec)}
  assert registry.OPTIONS == {"synthetic": synthetic.SyntheticOptions,
                              "arithmetic": arithmetic.ArithmeticOptions,
                              "reasoning_gym": reasoning_gym.ReasoningGymOptions,
                              "planted": planted.PlantedOptions}
  for task, options in registry.OPTIONS.items():
    assert task in registry.TASKS and task_fields[task].default_factory is options
  assert [name for name, _, _ in cf.leaves(spec_lib.TrainSpec)
          if name.startswith("arithmetic.")] == [
              "arithmetic.seed", "arithmetic.levels", "arithmetic.train_per_level",
              "arithmetic.test_per_level"]
  spec = spec_lib.TaskSpec(task="arithmetic", arithmetic=arithmetic.ArithmeticOptions(levels=(2,)))
  assert spec.name == "arithmetic" and spec.options.values()["levels"] == (2,)
  assert spec_lib.TaskSpec(task="math").options is None
  # The task's own defaults are its options' declarations.
  assert synthetic.SyntheticTask.__init__.__kwdefaults__["train_per_level"] == (
      synthetic.SyntheticOptions().train_per_level)
  with pytest.raises(ConfigError, match=r"^config\.task='chess' is not accepted; expected one "
                                        r"of 'synthetic', 'planted', 'arithmetic'"):
    spec_lib.TaskSpec(task="chess")


@pytest.mark.parametrize("spec_class, values, message", [
    (spec_lib.TaskSpec, dict(reward_workers=0),
     "config.reward_workers=0 is out of range; expected an integer >= 1"),
    (spec_lib.DataSpec, dict(train_split=""),
     "config.data.train_split='' is not accepted; expected a non-empty string"),
    (spec_lib.TokenizerSpec, dict(eos=()),
     "config.tokenizer.eos=() is not accepted; expected a non-empty tuple of token strings"),
    (spec_lib.ChatSpec, dict(system_prompt=3),
     "config.chat.system_prompt=3 is not accepted; expected a string or None"),
    (synthetic.SyntheticOptions, dict(test_per_level=200),
     "config.synthetic.test_per_level=200 is out of range; expected an integer in [1, 155]"),
    (arithmetic.ArithmeticOptions, dict(levels=(1, 5)),
     "config.arithmetic.levels=(1, 5) is not accepted; expected distinct levels among 1, 2, 3, 4"),
    (reasoning_gym.ReasoningGymOptions, dict(seed=-1),
     "config.reasoning_gym.seed=-1 is out of range; expected an integer in [0, 4294967295]"),
    (spec_lib.ModelSpec, dict(init_hf=""),
     "config.init_hf='' is not accepted; expected a non-empty string or None"),
    (spec_lib.LlamaSpec, dict(num_layers=0),
     "config.model.num_layers=0 is out of range; expected an integer >= 1"),
    (spec_lib.SamplingSpec, dict(n=1 << 20),
     "config.n=1048576 is out of range; expected an integer in [1, 16384]"),
    (spec_lib.EstimatorSpec, dict(scale="max"),
     "config.scale='max' is not accepted; expected one of 'none', 'group_std'"),
    (spec_lib.LossSpec, dict(clip_eps=1.0),
     "config.clip_eps=1.0 is out of range; expected a number in (0.0, 1.0)"),
    (spec_lib.OptimizerSpec, dict(max_grad_norm=0.0),
     "config.max_grad_norm=0.0 is out of range; expected a number > 0.0"),
    (spec_lib.RunSpec, dict(seed=-1),
     "config.seed=-1 is out of range; expected an integer in [0, 2147483647]"),
    (spec_lib.WarmupSpec, dict(learning_rate="fast"),
     "config.sft_warmup.learning_rate='fast' is not accepted; expected a finite number > 0.0"),
    (spec_lib.HeldOutSpec, dict(at_end=1),
     "config.eval.at_end=1 is not accepted; expected True or False"),
])
def test_a_bad_value_is_one_line_naming_the_field_and_what_it_accepts(spec_class, values,
                                                                      message):
  with pytest.raises(ConfigError) as error:
    spec_class(**values)
  assert str(error.value) == message


@pytest.mark.parametrize("rule, spec_class, values, message", [
    ("_label_free_needs_two_completions", spec_lib.SamplingSpec, dict(label_free=True, n=1),
     r"^config\.label_free=True is not accepted with n=1"),
    ("_sampler_devices_need_a_lag", spec_lib.SamplingSpec, dict(sampler_devices=2),
     r"^config\.sampler_devices=2 is not accepted with config\.max_lag=0"),
    ("_at_most_one_start", spec_lib.ModelSpec, dict(init_hf="a", init_gguf="b"),
     r"^config\.init_hf and config\.init_gguf are both set"),
    ("_correct_reward_exceeds_wrong_reward", spec_lib.TaskSpec, dict(wrong_reward=1.0),
     r"^config\.correct_reward=1\.0 is not accepted; expected more than config\.wrong_reward"),
    ("_ks_within_num_samples", spec_lib.HeldOutSpec, dict(num_samples=4),
     r"^config\.eval\.ks=\(1, 4, 8, 16\) is not accepted; expected every k <= "
     r"eval\.num_samples=4$"),
])
def test_a_rule_between_fields_is_one_method_named_after_it(rule, spec_class, values, message):
  assert callable(getattr(spec_class, rule))
  with pytest.raises(ConfigError, match=message):
    spec_class(**values)


def test_dependent_defaults_are_resolved_by_the_whole_spec():
  config = run_config.embedded_task_config()
  config.k, config.batch_prompts, config.max_new_tokens = 8, 2, 30
  config.num_minibatches, config.is_cap = 4, 2.0  # 16 rows, 4 per optimizer step
  spec = spec_lib.from_config(config)
  assert spec.sampling.n == 8 and spec.loss.loss_constant == 30.0
  assert spec.loss.micro_batch_size == 4 and spec.eval.max_new_tokens == 30
  assert spec_lib.SamplingSpec().n is None  # alone, a spec keeps the None it was given
  config.n, config.loss_constant, config.micro_batch_size = 16, 5.0, 2
  config.eval.max_new_tokens = 9
  spec = spec_lib.from_config(config)
  assert (spec.sampling.n, spec.loss.loss_constant, spec.loss.micro_batch_size,
          spec.eval.max_new_tokens) == (16, 5.0, 2, 9)
  config.label_free, config.k, config.n = True, 1, None  # n = k = 1: the rule sees the filled n
  with pytest.raises(ConfigError, match=r"^config\.label_free=True is not accepted with n=1"):
    spec_lib.from_config(config)


def test_command_line_overrides_keep_their_types_and_unknown_fields_are_refused():
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  argv = ["ksjax", f"--config={support.REPO / 'configs' / 'pass_at_k.py'}",
          "--config.synthetic.levels=(1,2)", "--config.eval.ks=(1,2,4)", "--config.n=8",
          "--config.max_grad_norm=0.5", "--config.is_cap=2.0", "--config.model.num_layers=1",
          "--config.tokenizer.bos=<s>", "--config.k_mixture=weights",
          "--config.k_weights=(1.0,0.5,0.25,0.125)"]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "a trainer config", flag_values=values,
                                  lock_config=True, sys_argv=argv)
  values(argv)
  spec = spec_lib.from_config(values.config)
  assert spec.task.synthetic.levels == (1, 2) and spec.eval.ks == (1, 2, 4)
  assert spec.sampling.n == 8 and spec.optimizer.max_grad_norm == 0.5
  assert spec.loss.is_cap == 2.0 and spec.model.model.num_layers == 1
  assert spec.task.tokenizer.bos == "<s>" and spec.estimator.k_weights == (1.0, 0.5, 0.25, 0.125)
  config = run_config.base_config()
  config.synthetic.level = (1,)
  with pytest.raises(ConfigError, match=r"^config\.synthetic\.level is not a field of the "
                                        r"trainer config"):
    spec_lib.from_config(config)
