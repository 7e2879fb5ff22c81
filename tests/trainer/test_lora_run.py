"""The trainer under LoRA (config.lora): only the adapters train and carry optimizer state, the
sampler's log-probs equal the learner's, the reference is the base, checkpoints hold the adapters
and name their base, and a killed run resumes bitwise (dropout included)."""

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from ksjax import model
from ksjax.config_validation import ConfigError
from ksjax.model import lora
from ksjax.run import spec as spec_lib
from ksjax.run.directory import RunDirectory
from ksjax.trainer import loop, metrics
from tests.support import resume
from tests.trainer import test_run

# Rank 4 on every weight; a learning rate at which the adapters move the policy within steps.
LORA = {"lora.rank": 4, "lora.alpha": 8.0, "learning_rate": 3e-2,
        # Every reward is the fresh model's -1: without a baseline each is a signal.
        "aggregator": "mean", "baseline": "none"}


def _adapters(path):
  """The adapters of an adapter checkpoint, as host arrays by name (read as Orbax stored them:
  a fresh preset's base has no file for `lora.load` to rebuild it from)."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  stored = ocp.StandardCheckpointer().restore(os.path.abspath(path))
  flat = jax.tree_util.tree_flatten_with_path(stored)[0]
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("lora") / "run"
  loop.run(test_run._tiny_config(workdir, num_steps=4, kl_every=1, **LORA))
  return workdir


def test_only_the_adapters_train_and_hold_optimizer_state():
  config = test_run._tiny_config("unused", **LORA)
  spec = spec_lib.from_config(config)
  mesh = model.make_mesh((1, 1, 1))
  base = model.Llama(model.preset("tiny", vocab_size=32, hidden_size=32, num_layers=1,
                                  num_heads=2, num_kv_heads=1, head_dim=16,
                                  intermediate_size=64), rngs=nnx.Rngs(0))
  adapted = lora.apply(model.shard(base, mesh), spec.lora, rngs=nnx.Rngs(0))
  graphdef, trainable, frozen = lora.split(adapted)
  from ksjax.trainer import update  # pylint: disable=import-outside-toplevel
  updater = update.build_updater(spec, graphdef, mesh, frozen)
  state = updater.init_state(trainable, jax.random.key(0))
  names = {".".join(map(str, k)) for k, _ in nnx.to_flat_state(state.params)}
  assert names and all(n.endswith(("_lora_a", "_lora_b")) for n in names)
  adapter_size = sum(x.size for x in jax.tree.leaves(state.params))
  opt_size = sum(x.size for x in jax.tree.leaves(state.opt_state))
  assert opt_size <= 2 * adapter_size + 8  # AdamW's two moments of the adapters, and counters
  base_size = sum(x.size for x in jax.tree.leaves(nnx.state(base)))
  assert adapter_size < base_size / 4


def test_a_lora_run_trains_the_adapters_against_the_base(lora_run):
  run_dir = RunDirectory(lora_run)
  start, final = _adapters(run_dir.start_dir), _adapters(run_dir.final_dir)
  # B starts at zero (the adapted start computes what the base computes) and moves.
  assert all(not v.any() for k, v in start.items() if k.endswith("_lora_b']"))
  assert any(v.any() for k, v in final.items() if k.endswith("_lora_b']"))
  lines = metrics.read_jsonl(run_dir.metrics_jsonl)
  # The sampler's log-probs equal the learner's under LoRA, also once the adapters have moved
  # (the is/ metric is |log pi_learner - log mu_sampler| per token).
  assert all(line["is/log_ratio_abs_mean"] < 1e-4 for line in lines), [
      line["is/log_ratio_abs_mean"] for line in lines]
  # The reference (the start: the base) differs from the policy once the adapters moved.
  assert lines[0]["kl/k3"] == pytest.approx(0.0, abs=1e-6) and lines[-1]["kl/k3"] > 0
  # The checkpoints hold the adapters, and name the base with its sha256.
  step_dir = run_dir.step_dir(4)
  with open(os.path.join(step_dir, "config", "metadata"), encoding="utf-8") as f:
    recorded = json.load(f)[loop.LORA_BASE_KEY]
  assert len(recorded["sha256"]) == 64 and recorded["name"] == "preset tiny"
  _, record = lora.read_metadata(run_dir.final_dir)
  assert record["sha256"] == recorded["sha256"]


def test_a_resume_on_another_base_is_refused_in_one_line(lora_run, tmp_path):
  import shutil  # pylint: disable=import-outside-toplevel
  copy = tmp_path / "run"
  shutil.copytree(lora_run, copy)
  for step in os.listdir(copy / "checkpoints"):
    path = copy / "checkpoints" / step / "config" / "metadata"
    recorded = json.loads(path.read_text())
    recorded[loop.LORA_BASE_KEY]["sha256"] = "0" * 64
    path.write_text(json.dumps(recorded))
    os.remove(copy / "checkpoints" / step / "checksums.sha256.json")  # else a damaged step
  with pytest.raises(ConfigError, match=r"holds adapters for the base .* expected the base the "
                     r"adapters were trained on") as e:
    loop.run(test_run._tiny_config(copy, num_steps=6, resume=True, **LORA))
  assert "\n" not in str(e.value)


def _lora_main(workdir, **overrides):
  return test_run._main(workdir, **{**LORA, "lora.dropout": 0.1, **overrides})


@pytest.mark.slow  # two 16-step runs in subprocesses: about 50 s; the resume itself is tested
# without LoRA in tests/trainer/test_run.py
def test_a_killed_lora_run_resumes_bitwise_with_dropout(tmp_path):
  steps = 16  # long enough to be killed after its second checkpoint (a step takes milliseconds)
  straight, killed = resume.straight_and_killed(_lora_main, tmp_path, steps, test_run._env())
  a = _adapters(os.path.join(straight, "final"))
  b = _adapters(os.path.join(killed, "final"))
  assert a.keys() == b.keys()
  for name in a:
    np.testing.assert_array_equal(a[name], b[name])
  assert any(v.any() for k, v in a.items() if k.endswith("_lora_b']"))


@pytest.mark.slow  # two more LoRA runs, about 25 s
@pytest.mark.parametrize("overrides", [
    {"dynamic_sampling": True, "dynamic_max_rounds": 2, "sparse_updates": True},
    {"max_lag": 1},
], ids=["dynamic_sampling_sparse", "async_rollouts"])
def test_dynamic_sampling_sparse_updates_and_async_rollouts_train_the_adapters(tmp_path,
                                                                                 overrides):
  workdir = tmp_path / "run"
  loop.run(test_run._tiny_config(workdir, num_steps=3, **LORA, **overrides))
  run_dir = RunDirectory(workdir)
  final = _adapters(run_dir.final_dir)
  assert any(v.any() for k, v in final.items() if k.endswith("_lora_b']"))
  lines = metrics.read_jsonl(run_dir.metrics_jsonl)
  assert len(lines) == 3 and all(line["optim/steps"] >= 1 for line in lines)
  if "max_lag" in overrides:  # sampled one step behind the learner, from the adapters pushed
    assert [line["async/lag"] for line in lines][1:] == [1.0, 1.0]
