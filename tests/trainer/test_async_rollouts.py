"""Asynchronous rollouts (`ksjax.trainer.async_rollouts`): the importance correction of a lagged
sampler, shown exact on the softmax bandit; lockstep (max_lag=0) unchanged bit for bit; a run with
rollouts in flight resumed exactly; the sub-mesh split and its config errors; the rollouts file,
data only: read back bit for bit, refused when damaged or when it would run code."""

import dataclasses
import hashlib
import io
import itertools
import json
import os
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ksjax import errors, objectives
from ksjax.bandit import exact
from ksjax.bandit.variants import Variant
from ksjax.config_validation import ConfigError
from ksjax.run import checkpoints
from ksjax.run import spec as spec_lib
from ksjax.run.directory import RunDirectory
from ksjax.tasks.base import Prompt
from ksjax.trainer import async_rollouts, loop, losses, memory_plan, metrics
from ksjax.trainer import draw as draw_lib
from ksjax.trainer.rollout import Rollout
from tests.trainer.test_run import _final_params, _tiny_config

# ---------------------------------------------------------------------------------------------
# The correction, by exact enumeration on the softmax bandit (ESTIMATORS.md, last section)
# ---------------------------------------------------------------------------------------------

REWARDS_A = np.array([1.0, 0.0, -0.5, 0.25])
THETA_PI = np.array([0.3, -0.2, 0.1, -0.4])  # the learner's policy pi
THETA_MU = np.array([-0.5, 0.6, 0.0, 0.2])   # the lagged sampler's mu


def _expected_update(variant: Variant, correction: str, loss: str) -> np.ndarray:
  """E_{y ~ mu^k}[-grad_theta of the trainer's loss on the group y] at theta = THETA_PI, summed
  exactly over all A^k ordered groups (each a row per sample, one token per row)."""
  k, num_actions = variant.k, len(REWARDS_A)
  groups_gk = np.asarray(list(itertools.product(range(num_actions), repeat=k)))
  theta_mu = jnp.asarray(THETA_MU)
  log_mu_gk = jax.nn.log_softmax(theta_mu)[groups_gk]
  prob_mu_g = jnp.exp(log_mu_gk.sum(-1))
  adv_gk = objectives.k_sample_advantages(
      jnp.asarray(REWARDS_A[groups_gk]), aggregator=variant.aggregator,
      baseline=variant.baseline, k=k,
      answer_ids=groups_gk if variant.aggregator == "majority_vote" else None)

  def group_loss(theta, group_k, adv_k, log_mu_k):
    logp_k1 = jax.nn.log_softmax(theta)[group_k][:, None]  # [R = k rows, T = 1]
    behaviour_k1 = log_mu_k[:, None]
    if correction == "none":
      rho_k1 = jnp.ones_like(logp_k1)
    elif correction == "token":
      rho_k1 = losses.truncated_is_weight(logp_k1, behaviour_k1, np.inf)
    else:
      log_ratio_k = jax.lax.stop_gradient(logp_k1 - behaviour_k1)[:, 0]
      rho_k1 = losses.group_is_weight(log_ratio_k, k, np.inf)[:, None]
    if loss == "pg":
      loss_k1 = losses.policy_gradient(logp_k1, adv_k, rho_k1)
    else:  # the clipped surrogate at theta = theta_old: PPO's first step
      loss_k1, _ = losses.clipped_surrogate(logp_k1, jax.lax.stop_gradient(logp_k1), adv_k,
                                            rho_k1, 0.2)
    return loss_k1.sum()

  grads_ga = jax.vmap(jax.grad(group_loss), in_axes=(None, 0, 0, 0))(
      jnp.asarray(THETA_PI), groups_gk, adv_gk, log_mu_gk)
  return np.asarray(-(prob_mu_g[:, None] * grads_ga).sum(0))


def _true_gradient(variant: Variant) -> np.ndarray:
  return np.asarray(jax.grad(exact.target_objective)(jnp.asarray(THETA_PI),
                                                     jnp.asarray(REWARDS_A), variant))


PASS_AT_K = Variant("pass_at_k", "loo", k=3)
MEAN = Variant("mean", "loo", k=3)
MAJORITY = Variant("majority_vote", "loo", k=3)


@pytest.mark.parametrize("loss", ["pg", "clipped"])
@pytest.mark.parametrize("variant", [PASS_AT_K, MEAN, MAJORITY], ids=lambda v: v.key)
def test_a_lagged_sampler_biases_the_update_and_the_group_weight_removes_it(variant, loss):
  with jax.enable_x64(True):
    truth = _true_gradient(variant)
    assert np.linalg.norm(truth) > 1e-2  # a gradient worth estimating
    uncorrected = _expected_update(variant, "none", loss)
    group = _expected_update(variant, "group", loss)
  # mu != pi and no correction: the expected update is another policy's gradient.
  assert np.linalg.norm(uncorrected - truth) > 0.05 * np.linalg.norm(truth)
  # The group's likelihood ratio, untruncated: unbiased whatever the aggregator.
  np.testing.assert_allclose(group, truth, atol=1e-8, rtol=0)


@pytest.mark.parametrize("variant", [PASS_AT_K, MAJORITY], ids=lambda v: v.key)
def test_per_token_weights_leave_k_sample_estimators_biased_but_not_the_mean(variant):
  """w_i depends on the whole group; min(pi/mu, inf) on sample i alone corrects its own factor
  of the group's probability only. The mean's LOO weight depends on y_i's reward and on the
  others only through a baseline with zero expected score, so for it per-token weights suffice."""
  with jax.enable_x64(True):
    token = _expected_update(variant, "token", "pg")
    truth = _true_gradient(variant)
    mean_token = _expected_update(MEAN, "token", "pg")
    mean_truth = _true_gradient(MEAN)
  assert np.linalg.norm(token - truth) > 0.05 * np.linalg.norm(truth)
  np.testing.assert_allclose(mean_token, mean_truth, atol=1e-8, rtol=0)


def test_on_policy_every_correction_is_the_plain_estimator():
  """mu = pi (lag 0): the weights are 1 and nothing changes."""
  global THETA_MU  # pylint: disable=global-statement
  saved, THETA_MU = THETA_MU, THETA_PI
  try:
    with jax.enable_x64(True):
      truth = _true_gradient(PASS_AT_K)
      for correction in ("none", "token", "group"):
        np.testing.assert_allclose(_expected_update(PASS_AT_K, correction, "pg"), truth,
                                   atol=1e-8, rtol=0)
  finally:
    THETA_MU = saved


def test_group_weights_are_truncated_in_log_space():
  log_ratio_r = jnp.asarray([1.0, 2.0, -0.5, 400.0, 300.0, 0.0], jnp.float32)
  w = np.asarray(losses.group_is_weight(log_ratio_r, 3, 5.0))
  np.testing.assert_allclose(w, [5.0] * 6)  # e^2.5 and e^700 (inf in float32) capped at 5
  w = np.asarray(losses.group_is_weight(jnp.asarray([0.1, -0.3]), 2, np.inf))
  np.testing.assert_allclose(w, [np.exp(-0.2)] * 2, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------

# A tiny run whose updates move the parameters (the mean's weights are never all zero).
MOVING = {"aggregator": "mean", "baseline": "none", "num_steps": 3}

# The same 3-step run on the commit before asynchronous rollouts existed (a3be7dc, lockstep only):
# three fixed random projections of its final parameters (float64 sums over every element). Its
# sha256 there, 97b39a11..., is what max_lag=0 gives here bit for bit on the machine that pinned
# it; the projections are what the test checks, to 1e-3, because another CPU may round a float32
# update differently in the last bits, while a changed update moves them far more (max_lag=1 on
# the same run: by 0.14 to 1.06).
LOCKSTEP_PARAMS_PROJECTIONS = (1.0028688286873715, 5.58893603460018, 18.39021813664823)


def _params_projections(workdir) -> list[float]:
  rng = np.random.default_rng(0)
  out = [0.0, 0.0, 0.0]
  for leaf in jax.tree.leaves(_final_params(str(workdir))):
    x = np.asarray(leaf, np.float64).ravel()
    for i in range(3):
      out[i] += float(x @ rng.standard_normal(x.size))
  return out


def _params_sha256(workdir) -> str:
  import hashlib  # pylint: disable=g-import-not-at-top
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(_final_params(str(workdir))):
    digest.update(np.asarray(leaf).tobytes())
  return digest.hexdigest()


def _lines(workdir):
  return metrics.read_jsonl(RunDirectory(str(workdir)).metrics_jsonl)


def test_lockstep_is_the_trainer_before_asynchronous_rollouts_bit_for_bit(tmp_path):
  loop.run(_tiny_config(tmp_path / "run", **MOVING))
  lines = _lines(tmp_path / "run")
  assert not any(name.startswith("async/") for line in lines for name in line)
  assert not os.path.exists(tmp_path / "run" / async_rollouts.ROLLOUTS_DIR)
  np.testing.assert_allclose(_params_projections(tmp_path / "run"), LOCKSTEP_PARAMS_PROJECTIONS,
                             rtol=0, atol=1e-3)


ASYNC = {**MOVING, "max_lag": 1, "sampler_devices": 4, "mesh": (-1, 1, 1), "is_cap": np.inf,
         "num_steps": 4, "keep_checkpoints": 4}


@pytest.mark.slow  # three tiny runs: about a minute of CPU
def test_rollouts_ahead_log_their_lag_and_resume_exactly_with_rollouts_in_flight(tmp_path):
  straight, stopped = tmp_path / "straight", tmp_path / "stopped"
  loop.run(_tiny_config(straight, **ASYNC))
  # Stopped after step 2 with the rollout of step 3 (and 4, sampled ahead) in flight.
  loop.run(_tiny_config(stopped, **{**ASYNC, "num_steps": 2}))
  assert sorted(os.listdir(stopped / async_rollouts.ROLLOUTS_DIR)) == ["1.rollouts", "2.rollouts"]
  loop.run(_tiny_config(stopped, **{**ASYNC, "resume": True}))
  a, b = _lines(straight), _lines(stopped)
  assert [line["async/lag"] for line in a] == [0.0, 1.0, 1.0, 1.0]
  assert all(0 < line["is/weight_max"] and "is/truncated_fraction" in line for line in a)
  assert any(line["is/weight_mean"] != 1.0 for line in a[2:])  # pi has left mu by step 3
  for name in ("loss/total", "reward/mean", "is/weight_mean", "is/weight_max"):
    assert [line[name] for line in a] == [line[name] for line in b], name
  assert _params_sha256(straight) == _params_sha256(stopped)


def test_every_checkpoint_saves_the_rollouts_ahead_orbaxs_first_step_save_included(tmp_path):
  # Orbax saves a fresh run's first step whatever the interval; the rollouts sampled ahead of it
  # must be written with it, or a resume from it skips the prompts the worker had drawn.
  workdir = tmp_path / "run"
  loop.run(_tiny_config(workdir, **{**ASYNC, "num_steps": 2, "checkpoint_every": 5}))
  steps = checkpoints.Checkpointer(str(workdir / "checkpoints"), save_every=5, keep=4).steps()
  assert steps == [1, 2]
  assert sorted(os.listdir(workdir / async_rollouts.ROLLOUTS_DIR)) == ["1.rollouts",
                                                                       "2.rollouts"]


def test_the_sampler_gets_the_last_devices_and_bad_splits_are_refused():
  def spec(**overrides):
    return spec_lib.from_config(_tiny_config("unused", **overrides))

  learner, sampler = async_rollouts.meshes(spec(max_lag=1, sampler_devices=2, mesh=(-1, 1, 1)))
  devices = jax.devices()
  assert list(learner.devices.flat) == devices[:6] and list(sampler.devices.flat) == devices[6:]
  assert async_rollouts.meshes(spec(max_lag=1))[1] is None  # shared devices
  cases = [({"max_lag": -1}, "config.max_lag=-1"),
           ({"sampler_devices": 2}, "config.sampler_devices=2 is not accepted with "
                                    "config.max_lag=0"),
           ({"max_lag": 1, "sampler_devices": 8}, "config.sampler_devices=8"),
           ({"max_lag": 1, "sampler_devices": 3, "sampler_mesh": (2, 1, 1)},
            "config.sampler_mesh=(2, 1, 1)"),
           ({"max_lag": 1, "sampler_devices": 3, "mesh": (2, 1, 1)}, "config.mesh=(2, 1, 1)"),
           ({"is_cap": 0.5}, "config.is_cap=0.5"),
           ({"is_level": "group"}, "config.is_level='group'"),
           ({"is_level": "sequence"}, "config.is_level='sequence'")]
  for overrides, message in cases:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
      async_rollouts.meshes(spec(**overrides))


def test_the_memory_plan_counts_the_samplers_parameter_copy():
  def spec(**overrides):
    return spec_lib.from_config(_tiny_config("unused", **{"mesh": (1, 8, 1), **overrides}))

  cfg, mesh = memory_plan.resolve(spec(), 8, vocab_size=64)
  params = memory_plan.state_bytes(spec(), cfg, mesh).params  # FSDP: an eighth on each device
  assert memory_plan.sampler_copy_bytes(spec(), cfg, mesh) == 0  # lockstep: no copy
  assert memory_plan.sampler_copy_bytes(spec(max_lag=2), cfg, mesh) == params
  own = spec(max_lag=1, sampler_devices=2, sampler_mesh=(1, 2, 1), mesh=(1, 6, 1))
  assert memory_plan.sampler_copy_bytes(own, cfg, mesh) > 3 * params  # halves, not eighths
  program = memory_plan.ProgramMemory(arguments=10, outputs=5, aliased=0, temps=7)
  plan = memory_plan.MemoryPlan(
      model=cfg, mesh={"data": 1, "fsdp": 8, "tensor": 1}, platform="cpu",
      shapes=memory_plan.Shapes(*[1] * len(dataclasses.fields(memory_plan.Shapes))),
      params=10, optimizer=20, reference=10, update=program, kv_cache=1, prefill=program,
      decode=program, eval_kv_cache=1, eval_prefill=program, eval_decode=program,
      extrapolated=False, reference_forward=program)
  shared = dataclasses.replace(plan, sampler_params=10, sampler_shared=True)
  for learner_phase in ("update", "reference"):  # the sampler samples ahead beside both
    assert shared.phases[learner_phase] == plan.phases[learner_phase] + 22 - 10 + 10
  assert shared.phases["sampling"] == plan.phases["sampling"] + 10
  apart = dataclasses.replace(plan, sampler_params=10)
  assert apart.phases["update"] == plan.phases["update"]
  assert apart.phases["reference"] == plan.phases["reference"]
  assert apart.phases["sampler devices"] == 22 and "sampler's parameter copy" in apart.table()


def test_saved_rollouts_load_back_and_a_changed_file_is_refused_by_name(tmp_path):
  workdir = str(tmp_path)
  pending = [async_rollouts.Pending(7, 6, ({"tokens": np.arange(5)}, {"sampling": 1.5})),
             async_rollouts.Pending(8, 6, ({"tokens": np.arange(3)}, {"sampling": 2.0}))]
  async_rollouts.save_pending(workdir, 6, pending, keep_from=None)
  loaded = async_rollouts.load_pending(workdir, 6)
  assert [(p.step, p.params_step, p.lag) for p in loaded] == [(7, 6, 1), (8, 6, 2)]
  np.testing.assert_array_equal(loaded[1].get()[0]["tokens"], np.arange(3))
  assert async_rollouts.load_pending(workdir, 5) is None  # a checkpoint without rollouts

  path = async_rollouts.rollouts_path(workdir, 6)
  raw = open(path, "rb").read()
  flipped = bytearray(raw)
  flipped[-3] ^= 1
  for bad, match in ((bytes(flipped), "differ from their sha256"),
                     (raw[:-10], "differ from their sha256"),
                     (raw[raw.index(b"\n") + 1:], "not a ksjax rollouts file")):
    with open(path, "wb") as f:
      f.write(bad)
    with pytest.raises(checkpoints.ChecksumError, match=match) as e:
      async_rollouts.load_pending(workdir, 6)
    assert path in str(e.value) and "Delete it to resume from step 6" in str(e.value)


def _drawn() -> draw_lib.Drawn:
  """A step's rollout as dynamic sampling makes one (an update of kept and padding groups beside
  what was sampled), with every kind of value a rollouts file stores."""
  rng = np.random.default_rng(3)
  prompts = (
      Prompt("a", "1+2=", (1, 5, 9), {"level": 1, "weight": 0.5}, "3", "1+2=3"),
      Prompt("b", "f(x)", (1, 7), {"level": "hard"},
             {"tests": [{"input": [[1, 2], None, True], "output": "3\n"}], "fn_name": None,
              "time_limit_s": 1.5, "memory_limit_bytes": 2 << 40, 7: (-0.0, float("inf"))},
             None))
  rows, columns = 4, 6
  sampled = Rollout(
      prompts=prompts, tokens_rt=rng.integers(0, 50, (rows, columns), np.int32),
      attention_mask_rt=rng.random((rows, columns)) < 0.8,
      completion_mask_rt=rng.random((rows, columns)) < 0.5,
      behaviour_logp_rt=np.asarray(rng.standard_normal((rows, columns)), np.float32),
      prompt_len=3, finished_r=np.asarray([True, False, True, True]),
      texts=("3", "x", "\u00e9\udcff", ""),  # a lone surrogate too
      rewards_bn=np.asarray([[1, -1], [np.nan, 0]], np.float32),
      correct_bn=np.asarray([[True, False], [False, False]]),
      answer_ids_bn=np.asarray([[0, 1], [0, 0]], np.int32))
  update = draw_lib.take_groups(sampled, np.asarray([0]), 2)  # group 0, then a padding copy of it
  return draw_lib.Drawn(sampled, np.asarray([[0.5, -0.5], [0.0, 0.0]], np.float32),
                       np.asarray([0]), update, np.asarray([0.5, -0.5, 0, 0], np.float32), 1,
                       np.int64(2), k=2)


def _same(a, b) -> None:
  """a and b equal, type for type, arrays dtype for dtype and bit for bit."""
  assert type(a) is type(b), (a, b)
  if isinstance(a, np.ndarray):
    assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
  elif isinstance(a, np.generic):
    assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
  elif isinstance(a, float):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes() or (a != a and b != b)
  elif dataclasses.is_dataclass(a):
    for field in dataclasses.fields(a):
      _same(getattr(a, field.name), getattr(b, field.name))
  elif isinstance(a, (list, tuple)):
    assert len(a) == len(b)
    for x, y in zip(a, b):
      _same(x, y)
  elif isinstance(a, dict):
    assert list(a) == list(b)
    for key in a:
      _same(a[key], b[key])
  else:
    assert a == b


def test_saved_rollouts_read_back_value_for_value_and_bit_for_bit(tmp_path):
  drawn = _drawn()
  seconds = {"time/sampling": 0.1 + 0.2, "time/scoring": 1e-300}
  pending = [async_rollouts.Pending(4, 3, (drawn, seconds)),
             async_rollouts.Pending(5, 3, (drawn, {}))]
  async_rollouts.save_pending(str(tmp_path), 4, pending, keep_from=None)
  loaded = async_rollouts.load_pending(str(tmp_path), 4)
  assert [(p.step, p.params_step) for p in loaded] == [(4, 3), (5, 3)]
  _same(loaded[0].get(), (drawn, seconds))
  _same(loaded[1].get(), (drawn, {}))
  back = loaded[0].get()[0]
  assert back is loaded[1].get()[0]  # an object met twice is written once and read back as one
  assert back.update.prompts[0] is back.update.prompts[1] is back.sampled.prompts[0]
  assert back.sampled.tokens_rt.flags.writeable  # as the sampler's own arrays are

  with pytest.raises(TypeError, match="a rollout holds a builtins.set"):
    async_rollouts.save_pending(str(tmp_path), 6, [async_rollouts.Pending(6, 5, ({1}, {}))], None)
  with pytest.raises(TypeError, match="dtype object"):
    async_rollouts.save_pending(str(tmp_path), 6, [async_rollouts.Pending(
        6, 5, (np.asarray([None]), {}))], None)
  assert not os.path.exists(async_rollouts.rollouts_path(str(tmp_path), 6))


def test_rollouts_of_format_2_whose_steps_carry_no_k_are_refused_by_name(tmp_path):
  workdir = str(tmp_path)
  async_rollouts.save_pending(workdir, 6, [async_rollouts.Pending(7, 6, (_drawn(), {}))], None)
  path = async_rollouts.rollouts_path(workdir, 6)
  with open(path, "rb") as f:
    raw = f.read()
  with open(path, "wb") as f:
    f.write(raw.replace(b"ksjax-rollouts 3 ", b"ksjax-rollouts 2 ", 1))
  with pytest.raises(checkpoints.CheckpointInputError, match="rollouts of format 2") as e:
    async_rollouts.load_pending(workdir, 6)
  line = str(e.value)
  assert "\n" not in line and line.startswith(f"{path}: ")
  assert "Delete it to resume from step 6" in line


class _WritesAMarker:
  """Unpickled, it creates the file `path`: what a planted pickle could do instead."""

  def __init__(self, path: str):
    self.path = path

  def __reduce__(self):
    return open, (self.path, "w")


def _rollouts_file(payload: bytes) -> bytes:
  """A file with the current header and `payload`'s true sha256: what anyone who can write the
  run directory can make, so the digest says nothing about what the payload may do."""
  header = async_rollouts._HEADER  # pylint: disable=protected-access
  return header + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


def _npz(structure, **arrays) -> bytes:
  buffer = io.BytesIO()
  np.savez(buffer, structure=np.frombuffer(json.dumps(structure).encode(), np.uint8), **arrays)
  return buffer.getvalue()


def test_a_rollouts_file_that_would_run_code_is_refused_unread(tmp_path, capsys):
  workdir, marker = str(tmp_path), str(tmp_path / "marker")
  bait = pickle.dumps([(7, 6, _WritesAMarker(marker))])
  pickle.loads(pickle.dumps(_WritesAMarker(str(tmp_path / "control"))))
  assert os.path.exists(tmp_path / "control")  # the bait is live: unpickled, it writes
  os.makedirs(tmp_path / async_rollouts.ROLLOUTS_DIR)
  old = tmp_path / async_rollouts.ROLLOUTS_DIR / "6.pkl"
  # A file of the old format, header and digest right: the loader before this one unpickled it.
  old.write_bytes(b"ksjax-rollouts 1 sha256 " + hashlib.sha256(bait).hexdigest().encode() + b"\n"
                  + bait)
  with pytest.raises(checkpoints.CheckpointInputError) as e:
    async_rollouts.load_pending(workdir, 6)
  line = str(e.value)
  assert "\n" not in line and line.startswith(f"{old}: pickled rollouts are not accepted")
  assert async_rollouts.rollouts_path(workdir, 6) in line and "Delete it to resume" in line
  # The entry points' boundary: that one line and exit status 2.
  main = errors.boundary("ksjax.main", lambda argv: async_rollouts.load_pending(workdir, 6))
  with pytest.raises(SystemExit) as exit_info:
    main([])
  assert exit_info.value.code == errors.EXIT_INPUT == 2
  assert capsys.readouterr().err == f"ksjax.main: {line}\n"

  structure = {"step": 6, "objects": [], "pending": [{"step": 7, "params_step": 6,
                                                      "result": {"array": 0}}]}
  path = async_rollouts.rollouts_path(workdir, 6)
  cases = [
      (bait, "not a ksjax rollouts file"),  # a bare pickle where the rollouts file goes
      (_rollouts_file(bait), "not the data-only rollouts file ksjax writes \\(not an npz archive"),
      (_rollouts_file(b"\x93NUMPY" + bait), "not an npz archive"),
      (_rollouts_file(_npz(structure, **{"0": np.asarray([_WritesAMarker(marker)], object)})),
       "Object arrays cannot be loaded when allow_pickle=False"),
      (_rollouts_file(_npz({**structure, "objects": [
          {"class": "posix.system", "fields": {"command": "touch marker"}}]})),
       "class 'posix.system' is not one of Drawn, Rollout, Prompt"),
      (_rollouts_file(_npz({**structure, "step": 5})), "holds the rollouts of checkpoint 5"),
  ]
  for content, match in cases:
    with open(path, "wb") as f:
      f.write(content)
    with pytest.raises(checkpoints.CheckpointInputError, match=match) as e:
      async_rollouts.load_pending(workdir, 6)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{path}: ")
    assert "Delete it to resume from step 6" in str(e.value)
  assert not os.path.exists(marker)
