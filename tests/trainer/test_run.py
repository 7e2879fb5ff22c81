"""The whole trainer run: outputs of a tiny run, kill -9 and resume bitwise, damaged checkpoints,
and a bad config failing with exit code 2 before anything is written."""

import json
import os
import subprocess
import sys

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ksjax import model
from ksjax.config_validation import ConfigError
from ksjax.run import checkpoints as checkpointing
from ksjax.run.directory import RunDirectory
from ksjax.trainer import metrics
from ksjax.trainer import loop
from tests import support
from tests.support import resume

REPO = str(support.REPO)
TINY = {
    "model.hidden_size": 32, "model.num_layers": 1, "model.num_heads": 2, "model.num_kv_heads": 1,
    "model.head_dim": 16, "model.intermediate_size": 64, "mesh": (1, 1, 1),
    "synthetic.levels": (1, 2), "synthetic.train_per_level": 24, "synthetic.test_per_level": 4,
    "batch_prompts": 4, "k": 4, "max_new_tokens": 8, "checkpoint_every": 1,
    "keep_checkpoints": 2, "sft_warmup.steps": 0, "eval.at_start": False, "eval.at_end": False,
    "progress_bar": False, "learning_rate": 3e-2, "sparse_updates": False,  # one update shape
}


def _flags(overrides):
  # A string as it is: ml_collections takes the text after "=" as a string field's value.
  return [f"--config.{k}={v}" for k, v in overrides.items()]


def _main(workdir, **overrides):
  """The command line of a tiny run, on one CPU device."""
  return [sys.executable, "-m", "ksjax.main", "--config=configs/pass_at_k.py",
          f"--config.workdir={workdir}"] + _flags({**TINY, **overrides})


def _env():
  env = dict(os.environ)
  env["XLA_FLAGS"] = support.xla_flags(1)
  env["JAX_PLATFORMS"] = "cpu"
  return env


def _final_params(workdir):
  llama, _ = model.load_checkpoint(os.path.join(workdir, "final"))
  return jax.tree.map(np.asarray, nnx.state(llama))


def test_killed_and_resumed_run_ends_with_the_same_parameters_bitwise(tmp_path):
  steps = 8
  straight, killed = resume.straight_and_killed(_main, tmp_path, steps, _env())
  a, b = _final_params(straight), _final_params(killed)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)
  lines = metrics.read_jsonl(RunDirectory(killed).metrics_jsonl)
  assert [line["step"] for line in lines] == list(range(1, steps + 1))
  reference = metrics.read_jsonl(RunDirectory(straight).metrics_jsonl)
  assert [line["reward/mean"] for line in lines] == [line["reward/mean"] for line in reference]


def test_bad_config_exits_2_with_one_line_and_writes_nothing(tmp_path):
  workdir = tmp_path / "run"
  result = subprocess.run(_main(str(workdir), k=0), cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 2
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and "config.k=0" in lines[0], result.stderr
  assert not workdir.exists()


def _tiny_config(workdir, **overrides):
  from ksjax.run import config as defaults  # pylint: disable=g-import-not-at-top
  config = defaults.base_config()
  config.workdir = str(workdir)
  for key, value in {**TINY, **overrides}.items():
    node = config
    *parents, leaf = key.split(".")
    for parent in parents:
      node = node[parent]
    node[leaf] = value
  return config


def test_the_kl_metrics_follow_kl_every_and_compilations_are_counted(tmp_path):
  workdir = tmp_path / "run"
  loop.run(_tiny_config(workdir, num_steps=4, kl_every=3))
  lines = metrics.read_jsonl(RunDirectory(workdir).metrics_jsonl)
  assert [("kl/k3" in line) for line in lines] == [True, False, True, True]  # first, 3rd, last
  assert all("entropy/per_token" in line for line in lines)
  assert lines[0]["compile/count"] > 0 and lines[0]["compile/seconds"] > 0
  assert lines[-1]["compile/count"] == 0  # one update shape (TINY): nothing compiles again


def test_each_step_optimises_the_k_of_the_schedule(tmp_path):
  workdir = tmp_path / "run"
  loop.run(_tiny_config(workdir, num_steps=3, k_schedule="linear", k_start=2,
                        k_schedule_steps=2))
  lines = metrics.read_jsonl(RunDirectory(workdir).metrics_jsonl)
  assert [line["objective/k"] for line in lines] == [2.0, 3.0, 4.0]


def test_the_loaded_parameters_are_freed_and_freed_pages_handed_back_between_phases(
    tmp_path, monkeypatch):
  """The policy as loaded is copied into the train state and the reference; nothing may keep
  the loaded copy as well (a third copy of every weight for the whole run). And the allocator's
  freed pages are handed back before each step's sampling and before its update."""
  import gc  # pylint: disable=g-import-not-at-top
  import weakref  # pylint: disable=g-import-not-at-top
  from ksjax.run import policy  # pylint: disable=g-import-not-at-top
  from ksjax.trainer import learner  # pylint: disable=g-import-not-at-top
  loaded, alive = [], []
  build, learn = policy.build_model, learner.learn

  def build_model(*args, **kwargs):
    llama = build(*args, **kwargs)
    loaded.extend(weakref.ref(leaf) for leaf in jax.tree.leaves(nnx.state(llama, nnx.Param)))
    return llama

  def learn_and_look(updater, state, *args, **kwargs):
    gc.collect()
    held = {id(leaf) for leaf in jax.tree.leaves(state.params)}
    alive.append(sum(ref() is not None and id(ref()) not in held for ref in loaded))
    return learn(updater, state, *args, **kwargs)

  trims = []
  monkeypatch.setattr(policy, "build_model", build_model)
  monkeypatch.setattr(learner, "learn", learn_and_look)
  monkeypatch.setattr(loop.allocator, "release_free_memory", lambda: trims.append(len(alive)))
  loop.run(_tiny_config(tmp_path / "run", num_steps=2, sparse_updates=False))
  assert loaded and alive == [0, 0], (len(loaded), alive)
  assert trims == [0, 0, 1, 1], trims  # (updates before each call): sampling, update, twice


def test_a_run_writes_metrics_tensorboard_checkpoints_and_the_eval_table(tmp_path, capsys):
  workdir = tmp_path / "run"
  config = _tiny_config(workdir, num_steps=3, sparse_updates=True, **{
      "sft_warmup.steps": 3, "sft_warmup.batch_size": 8, "eval.at_start": True,
      "eval.at_end": True, "eval.num_samples": 4, "eval.ks": (1, 2, 4), "eval.num_prompts": 6,
      "eval.batch_prompts": 4})
  loop.run(config)
  out = capsys.readouterr().out
  lines = metrics.read_jsonl(RunDirectory(workdir).metrics_jsonl)
  assert [line["step"] for line in lines] == [1, 2, 3]
  for key in ("reward/mean", "batch/pass_at_k", "batch/maj_at_k", "level1/pass_at_k",
              "kl/k1", "kl/k3", "entropy/per_token", "advantage/nonzero_fraction",
              "optim/grad_norm", "optim/skipped_steps", "throughput/tokens_per_s",
              "time/sampling", "time/reward", "time/update", "update/rows_fraction"):
    assert key in lines[-1], key
  assert abs(lines[0]["kl/k1"]) < 1e-3  # the first rollout comes from the reference policy
  # The peak resident memory so far: a process holding a model has some, and it never falls.
  peaks = [line["memory/peak_rss_gib"] for line in lines]
  assert 0.05 < peaks[0] <= peaks[1] <= peaks[2] < 64, peaks
  assert any(name.startswith("events.out.tfevents")
             for name in os.listdir(RunDirectory(workdir).tensorboard_dir))
  table = (workdir / "eval_table.txt").read_text()
  for row in ("pass@1", "pass@4", "maj@4", "level2/pass@4"):
    assert row in table and row in out
  start = json.loads((workdir / "eval_start.json").read_text())["metrics"]
  assert 0.0 <= start["pass@1"] <= start["pass@2"] <= start["pass@4"] <= 1.0
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "3"]
  assert json.loads((workdir / "config.json").read_text())["num_steps"] == 3
  assert os.path.isfile(workdir / "tokenizer" / "tokenizer.json")
  model.load_checkpoint(str(workdir / "final"))
  # The same workdir without resume=True is refused, and nothing is touched.
  before = sorted(os.listdir(workdir))
  with pytest.raises(ConfigError, match="config.resume=True"):
    loop.run(_tiny_config(workdir, num_steps=3))
  assert sorted(os.listdir(workdir)) == before


def test_damaged_latest_checkpoint_is_skipped_for_the_previous_one(tmp_path, capsys):
  directory = str(tmp_path / "checkpoints")
  records = list(range(100))

  def fresh_iterator():
    return grain.MapDataset.source(records).batch(4).to_iter_dataset().__iter__()

  checkpointer = checkpointing.Checkpointer(directory, save_every=1, keep=3, use_async=True)
  iterator = fresh_iterator()
  for step in (1, 2):
    next(iterator)
    state = {"w": jnp.full((3,), float(step)), "step": jnp.int32(step)}
    checkpointer.save(step, state, iterator, {"step": step})
  checkpointer.close()
  # Step 2 is damaged after the fact; step 3 was being written when the process died.
  for root, _, files in os.walk(os.path.join(directory, "2", "state")):
    for name in files:
      os.remove(os.path.join(root, name))
  os.makedirs(os.path.join(directory, "3.orbax-checkpoint-tmp-0", "state"))

  abstract = {"w": jax.ShapeDtypeStruct((3,), jnp.float32), "step": jax.ShapeDtypeStruct(
      (), jnp.int32)}
  restored_iterator = fresh_iterator()
  step, state, config = checkpointing.Checkpointer(
      directory, save_every=1, keep=3).restore_latest(abstract, restored_iterator)
  assert step == 1 and config == {"step": 1}
  np.testing.assert_array_equal(state["w"], [1.0, 1.0, 1.0])
  np.testing.assert_array_equal(next(restored_iterator), [4, 5, 6, 7])  # where step 1 stood
  assert "checkpoint 2 cannot be restored" in capsys.readouterr().out
  assert any(name.startswith("corrupt_2_") for name in os.listdir(directory))
