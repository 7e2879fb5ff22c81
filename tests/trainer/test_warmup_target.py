"""The warm-up's target: calibration checks on training prompts that stop it at a pass@1.

The stopping rule is tested with a scripted calibration (the pass@1 of each check given in
advance); that the checks read training prompts only and leave the warm-up's parameters exactly as
a fixed-step warm-up leaves them is tested with the real sampler and scorer on a tiny model.
"""

import dataclasses

import jax
import numpy as np
import pytest

from ksjax.config_validation import ConfigError
from ksjax.run import config as run_config
from ksjax.run import policy
from ksjax.run import spec as spec_lib
from ksjax.run import tasks as run_tasks
from ksjax.trainer import async_rollouts, warmup

TINY = {
    "model.hidden_size": 32, "model.num_layers": 1, "model.num_heads": 2, "model.num_kv_heads": 1,
    "model.head_dim": 16, "model.intermediate_size": 64, "mesh": (1, 1, 1),
    "synthetic.levels": (1, 2), "synthetic.train_per_level": 24, "synthetic.test_per_level": 4,
    "sft_warmup.steps": 6, "sft_warmup.batch_size": 8, "sft_warmup.check_every": 2,
    "sft_warmup.calibration_prompts": 6, "sft_warmup.calibration_samples": 2,
}


def _spec(**overrides) -> spec_lib.TrainSpec:
  config = run_config.embedded_task_config()
  for name, value in {**TINY, **overrides}.items():
    *parents, leaf = name.split(".")
    node = config
    for part in parents:
      node = node[part]
    node[leaf] = value
  return spec_lib.from_config(config)


@pytest.fixture(scope="module")
def setting():
  """(spec, task, mesh) of a tiny synthetic run."""
  spec = _spec()
  task = run_tasks.make_task(spec.task, spec.model, spec.eval.split)
  mesh, _ = async_rollouts.meshes(spec)
  return spec, task, mesh


@pytest.fixture(scope="module")
def fixed_six(setting):
  """The parameters after a fixed warm-up of 6 steps, without a target."""
  return _warm_up(setting, steps=6, target_pass_at_1=None)[0]


def _warm_up(setting, lines=None, **changes):
  """Warms up a fresh tiny model (the same initial weights every call) with the warm-up spec
  changed by `changes`; returns (parameters as numpy arrays, summary)."""
  spec, task, mesh = setting
  llama = policy.build_model(spec.model, task.tokenizer.vocab_size, mesh, value_head=False, seed=0)
  w = dataclasses.replace(spec.sft_warmup, **changes)
  log = (lambda line: None) if lines is None else lines.append
  params, summary = warmup.warm_up(llama, task, w, seed=spec.run.seed, mesh=mesh, log=log,
                                   log_every=100, max_new_tokens=8)
  return jax.tree.map(np.asarray, params), summary


def _same(a, b) -> bool:
  return all(jax.tree.leaves(jax.tree.map(np.array_equal, a, b)))


def _scripted(monkeypatch, values):
  """Replaces the calibration by `values`, one per check; returns the prompts each check got."""
  seen = []

  def calibration(llama, task, prompts, spec, *, max_new_tokens, seed, mesh):
    seen.append(list(prompts))
    return values[len(seen) - 1]

  monkeypatch.setattr(warmup, "calibration_pass_at_1", calibration)
  return seen


def test_the_target_stops_the_warm_up_at_the_first_check_that_reaches_it(setting, fixed_six,
                                                                         monkeypatch):
  seen = _scripted(monkeypatch, [0.1, 0.29, 0.3, 0.9, 0.9])
  lines = []
  params, summary = _warm_up(setting, lines, steps=10, target_pass_at_1=0.3)
  assert len(seen) == 3 and summary["steps"] == 6  # checks at steps 2, 4, 6; 0.3 reaches 0.3
  assert summary["calibration_pass_at_1"] == 0.3
  checks = [line for line in lines if ": calibration pass@1" in line]
  assert [line.split(":")[0] for line in checks] == [
      "warm-up step 2", "warm-up step 4", "warm-up step 6"]
  assert "calibration pass@1 0.290 (target 0.3;" in checks[1]
  assert not any("maximum" in line for line in lines)
  # Stopped at step 6: the parameters of a fixed warm-up of 6 steps, bit for bit.
  assert _same(params, fixed_six)


def test_a_target_never_reached_stops_at_the_maximum_and_says_so_once(setting, monkeypatch):
  seen = _scripted(monkeypatch, [0.1, 0.2, 0.25])
  lines = []
  _, summary = _warm_up(setting, lines, steps=6, target_pass_at_1=0.3)
  assert len(seen) == 3 and summary["steps"] == 6
  stopped = [line for line in lines if "maximum" in line]
  assert stopped == ["warm-up stopped at its maximum of 6 steps without reaching calibration "
                     "pass@1 0.3; the last check gave 0.250"]


def test_a_warm_up_shorter_than_one_check_interval_says_no_check_ran(setting, monkeypatch):
  seen = _scripted(monkeypatch, [])
  lines = []
  _, summary = _warm_up(setting, lines, steps=3, check_every=5, target_pass_at_1=0.3)
  assert not seen and summary["steps"] == 3
  assert lines[-1].endswith("no check ran (check_every=5)")


def test_without_a_target_the_warm_up_runs_its_steps_as_before(setting, monkeypatch):
  def no_calibration(*args, **kwargs):
    raise AssertionError("a warm-up without a target ran a calibration check")

  monkeypatch.setattr(warmup, "calibration_pass_at_1", no_calibration)
  lines = []
  _, summary = _warm_up(setting, lines, steps=4, target_pass_at_1=None)
  assert summary["steps"] == 4
  assert len(lines) == 1 and lines[0].startswith("warm-up step 4/4: loss ")


def test_real_checks_read_training_prompts_only_and_leave_the_warm_up_unchanged(setting,
                                                                                fixed_six):
  _, task, _ = setting
  requested = []
  original = type(task).prompts

  def recording(self, split):
    requested.append(split)
    return original(self, split)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(type(task), "prompts", recording)
    lines = []
    checked, summary = _warm_up(setting, lines, steps=6, target_pass_at_1=0.99)
  assert requested and set(requested) == {"train"}
  checks = [line for line in lines if ": calibration pass@1" in line]
  assert len(checks) == 3 and summary["steps"] == 6
  assert 0.0 <= summary["calibration_pass_at_1"] <= 1.0
  # The checks sample from their own seed: the parameters are the fixed warm-up's, bit for bit,
  # and a second targeted warm-up repeats the first exactly (the same checks too).
  assert _same(checked, fixed_six)
  again_lines = []
  again, _ = _warm_up(setting, again_lines, steps=6, target_pass_at_1=0.99)
  assert _same(checked, again)
  assert [line.split(" (")[0] for line in checks] == [
      line.split(" (")[0] for line in again_lines if ": calibration pass@1" in line]


def test_calibration_prompts_are_a_fixed_seeded_draw_of_training_prompts(setting):
  _, task, _ = setting
  train = {p.id: p for p in task.prompts("train")}
  test_ids = {p.id for p in task.prompts("test")}
  chosen = warmup.calibration_prompts(task, 6, seed=0)
  assert len(chosen) == 6
  assert all(p.id in train and p == train[p.id] for p in chosen)
  assert not {p.id for p in chosen} & test_ids
  assert [p.id for p in chosen] == [p.id for p in warmup.calibration_prompts(task, 6, seed=0)]
  assert [p.id for p in chosen] != [p.id for p in warmup.calibration_prompts(task, 6, seed=1)]
  levels = [p.metadata["level"] for p in chosen]
  assert levels.count(1) == levels.count(2) == 3  # an equal share of each level
  assert len(warmup.calibration_prompts(task, 10_000, seed=0)) == len(train)


NO_TARGET_OR_TARGET = "None or 0 (a fixed number of steps) or a number in (0, 1)"


@pytest.mark.parametrize("field, value, accepted", [
    ("target_pass_at_1", -0.1, NO_TARGET_OR_TARGET),
    ("target_pass_at_1", 1.0, NO_TARGET_OR_TARGET),
    ("target_pass_at_1", float("nan"), NO_TARGET_OR_TARGET),
    ("target_pass_at_1", "0.3", NO_TARGET_OR_TARGET),
    ("target_pass_at_1", True, NO_TARGET_OR_TARGET),
    ("check_every", 0, "an integer >= 1"),
    ("check_every", 2.5, "an integer >= 1"),
    ("calibration_prompts", 0, "an integer >= 1"),
    ("calibration_samples", -1, "an integer >= 1"),
])
def test_a_bad_warm_up_value_is_one_line_naming_the_field(field, value, accepted):
  spec_lib.WarmupSpec(target_pass_at_1=0.5)  # accepted
  with pytest.raises(ConfigError) as error:
    spec_lib.WarmupSpec(**{field: value})
  message = str(error.value)
  assert "\n" not in message
  assert message.startswith(f"config.sft_warmup.{field}={value!r} ")
  assert f"expected {accepted}" in message


def test_the_config_file_values_reach_the_spec_and_are_checked():
  spec = _spec(**{"sft_warmup.target_pass_at_1": 0.4, "sft_warmup.check_every": 7})
  assert spec.sft_warmup.target_pass_at_1 == 0.4 and spec.sft_warmup.check_every == 7
  assert _spec(**{"sft_warmup.target_pass_at_1": None}).sft_warmup.targeted is False
  # 0 as well: a command-line override cannot set the field to None.
  assert _spec(**{"sft_warmup.target_pass_at_1": 0.0}).sft_warmup.targeted is False
  with pytest.raises(ConfigError, match=r"^config\.sft_warmup\.target_pass_at_1=1\.5 is not "):
    _spec(**{"sft_warmup.target_pass_at_1": 1.5})
  with pytest.raises(ConfigError, match=r"^config\.sft_warmup\.calibration_samples=0 is out of "):
    _spec(**{"sft_warmup.calibration_samples": 0})


def test_the_default_run_warms_up_to_a_target_and_the_base_config_to_a_step_count():
  default = spec_lib.from_config(run_config.embedded_task_config()).sft_warmup
  assert default.targeted and 0.0 < default.target_pass_at_1 < 1.0
  assert default.steps >= default.check_every
  assert not spec_lib.from_config(run_config.base_config()).sft_warmup.targeted
