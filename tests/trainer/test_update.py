"""The trainer's update path on a tiny model: every config's stack, sparse == dense, micro-batching,
non-finite steps, and a 2-device mesh against 1 device.

Rollouts here are made up (random tokens and rewards) so that the update is tested without the
sampler; tests/trainer/test_run.py runs the whole loop.
"""

import dataclasses
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ksjax import model
from ksjax.model import logprobs
from ksjax.config_validation import ConfigError
from ksjax.run import spec as spec_lib
from ksjax.trainer import learner, rollout, sparse, update
from tests import support

CONFIG_DIR = str(support.REPO / "configs")
TRAINER_CONFIGS = [os.path.join(CONFIG_DIR, f"{name}.py") for name in (
    "pass_at_k", "biased_pass_at_k", "majority_vote", "biased_majority_vote", "mean",
    "ppo_pass_at_k", "grpo_pass_at_k", "dr_grpo_pass_at_k", "pkpo_pass_at_k",
    "math_llama8b", "code_contests_llama8b", "code_contests_llama70b")]
VOCAB = 32
_PROGRAMS = {}  # (loss config, mesh) -> Updater: configs with the same stack share compilations


def load_config(path):
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def tiny_llama(value_head=False, seed=0):
  cfg = model.preset("tiny", vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=2,
                     num_kv_heads=1, head_dim=16, intermediate_size=64, value_head=value_head)
  return model.Llama(cfg, rngs=nnx.Rngs(seed))


def fake_rollout(b, n, *, seed=0, prompt_len=6, new=6, answer_ids=None):
  """B prompts x n completions of random tokens, each group's rows sharing its prompt as a
  sampler's do; rewards +-1 by answer class (class 0 correct)."""
  rng = np.random.default_rng(seed)
  r, t = b * n, prompt_len + new
  tokens = rng.integers(4, VOCAB, size=(r, t)).astype(np.int32)
  tokens[:, :prompt_len] = np.repeat(tokens[::n, :prompt_len], n, axis=0)  # a group's one prompt
  prompt_lengths = np.repeat(rng.integers(2, prompt_len + 1, size=b), n)
  lengths = rng.integers(1, new + 1, size=r)
  cols = np.arange(t)[None]
  prompt_mask = (cols < prompt_len) & (cols >= prompt_len - prompt_lengths[:, None])
  completion_mask = (cols >= prompt_len) & (cols < prompt_len + lengths[:, None])
  if answer_ids is None:
    answer_ids = rng.integers(0, 3, size=(b, n))
  answer_ids = np.asarray(answer_ids, np.int32)
  correct = answer_ids == 0
  return rollout.Rollout(
      prompts=tuple(), tokens_rt=tokens, attention_mask_rt=prompt_mask | completion_mask,
      completion_mask_rt=completion_mask,
      behaviour_logp_rt=np.where(completion_mask, -2.0, 0.0).astype(np.float32),
      prompt_len=prompt_len, finished_r=np.ones(r, bool), texts=("",) * r,
      rewards_bn=np.where(correct, 1.0, -1.0).astype(np.float32), correct_bn=correct,
      answer_ids_bn=answer_ids)


def make_updater(spec, llama, mesh):
  # A constant learning rate from the first step: one step must move the parameters.
  spec = dataclasses.replace(spec, optimizer=dataclasses.replace(spec.optimizer,
                                                                 lr_warmup_steps=0))
  graphdef, params = nnx.split(model.shard(llama, mesh))
  key = (spec.loss, spec.optimizer, spec.sampling.temperature, mesh, graphdef)
  if key not in _PROGRAMS:
    _PROGRAMS[key] = update.build_updater(spec, graphdef, mesh)
  updater = _PROGRAMS[key]
  return updater, updater.init_state(params, jax.random.PRNGKey(0))


def tiny(config, **overrides):
  config.batch_prompts = 4
  config.max_new_tokens = 6
  for key, value in overrides.items():
    setattr(config, key, value)
  return config


def learn_once(config, *, mesh=None, seed=0, rollout_=None, ref=False, answer_ids=None):
  spec = spec_lib.from_config(config)
  mesh = mesh or model.make_mesh((1, 1, 1))
  llama = tiny_llama(value_head=config.algorithm == "ppo")
  updater, state = make_updater(spec, llama, mesh)
  batch = rollout_ or fake_rollout(config.batch_prompts, spec.sampling.n, seed=seed,
                                   answer_ids=answer_ids)
  adv = spec.estimator.advantages(batch.rewards_bn, batch.answer_ids_bn)
  ref_logp = None
  if ref or config.kl_coef > 0:
    ref_logp = learner.reference_rows(updater, state.params, batch, spec.loss.micro_batch_size)
  before = jax.tree.map(np.asarray, state.params)
  state, metrics = learner.learn(updater, state, batch, adv.reshape(-1),
                                 np.asarray(jax.random.PRNGKey(seed)), ref_logp)
  return before, state, metrics, adv


def max_abs_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("path", TRAINER_CONFIGS, ids=os.path.basename)
def test_every_config_validates_and_its_stack_takes_a_step(path):
  config = load_config(path)
  if config.task != "synthetic":
    with pytest.raises(ConfigError, match="config.init_hf is missing"):
      spec_lib.from_config(config)
    config.init_hf = "a Hugging Face directory"
    spec_lib.from_config(config)
    return  # their stack is the one of a synthetic config; they need a dataset and a checkpoint
  config = tiny(config)
  before, state, metrics, adv = learn_once(config)
  assert np.any(adv != 0)
  assert np.isfinite(metrics["loss/total"])
  assert metrics["optim/steps"] == config.ppo_epochs * config.num_minibatches
  assert metrics["optim/skipped_steps"] == 0
  assert max_abs_diff(before, state.params) > 0
  if config.algorithm == "ppo":
    assert "loss/value" in metrics and "ppo/clip_fraction" in metrics
  if config.algorithm in spec_lib.CLIPPED:
    assert 0.0 <= metrics["ppo/clip_fraction"] <= 1.0


LEARNING_RATE = 1e-2
# Parameters after AdamW steps whose gradients are the same real numbers summed in another order
# (sparse against dense rows, micro-batches against the whole batch, two devices against one).
# AdamW divides each gradient component by its own running magnitude, so a component that is
# rounding noise in both moves its weight by a share of the learning rate that differs between
# the two orders and between CPUs (up to 1.2e-5 seen on an AVX2 EPYC at lr 1e-2, under 1e-5 on an
# AVX-512 Xeon). The bound is 1% of the learning rate; a dropped or doubled row moves the weights
# it reaches by about the learning rate itself.
PARAMS_ATOL = 1e-2 * LEARNING_RATE


def _pass_at_k_config(**overrides):
  config = tiny(load_config(os.path.join(CONFIG_DIR, "pass_at_k.py")), k=8, **overrides)
  config.learning_rate = LEARNING_RATE
  return config


def test_sparse_update_equals_dense():
  """pass@k leave-one-out at k = 8: at most one row per group trains; the update is the same."""
  answers = np.ones((4, 8), int)  # groups 0 and 2 have a unique correct completion
  answers[0, 5] = answers[2, 0] = 0
  answers[1] = 0  # all correct: no signal
  dense = learn_once(_pass_at_k_config(sparse_updates=False), answer_ids=answers)
  sparse_ = learn_once(_pass_at_k_config(sparse_updates=True), answer_ids=answers)
  assert dense[2]["update/rows_fraction"] == 1.0
  assert sparse_[2]["update/rows_fraction"] == 2 / 32
  assert max_abs_diff(dense[1].params, sparse_[1].params) < PARAMS_ATOL
  assert max_abs_diff(dense[0], dense[1].params) > 10 * PARAMS_ATOL  # the update moved far more
  np.testing.assert_allclose(sparse_[2]["loss/total"], dense[2]["loss/total"], rtol=1e-5,
                             atol=1e-7)


@pytest.mark.parametrize("algorithm", ["pg", "dr_grpo"])
def test_a_sparse_step_without_signal_is_the_dense_step_without_its_backward(algorithm,
                                                                             monkeypatch):
  """Every group all correct or all wrong: the weights are all zero, and the sparse update applies
  the optimizer to a zero gradient without running the model, as the dense update does with its
  backward. AdamW's moments from a first step with signal still move the weights."""
  signal = np.ones((4, 8), int)
  signal[0, 5] = signal[2, 0] = 0
  none = np.ones((4, 8), int)
  none[1] = 0  # all correct; the other groups all wrong
  ends = {}
  for sparse_updates in (False, True):
    config = _pass_at_k_config(sparse_updates=sparse_updates, algorithm=algorithm)
    spec = spec_lib.from_config(config)
    updater, state = make_updater(spec, tiny_llama(), model.make_mesh((1, 1, 1)))
    runs = []  # the model's update programs called, per learn
    monkeypatch.setattr(updater, "step", lambda *a, step=updater.step: runs.append(1) or step(*a))
    seen = []
    for answers in (signal, none):
      batch = fake_rollout(4, 8, answer_ids=answers)
      adv = spec.estimator.advantages(batch.rewards_bn, batch.answer_ids_bn).reshape(-1)
      runs.clear()
      before = jax.tree.map(np.asarray, state.params)
      state, metrics = learner.learn(updater, state, batch, adv, np.asarray(jax.random.PRNGKey(0)))
      seen.append(len(runs))
    assert not adv.any() and max_abs_diff(before, state.params) > 0  # the moments moved them
    assert metrics["optim/steps"] == 1 and metrics["optim/skipped_steps"] == 0
    assert metrics["loss/total"] == 0 and metrics["optim/grad_norm"] == 0
    assert int(state.step) == 2
    ends[sparse_updates] = state, metrics, seen
  (dense, dense_metrics, _), (sparse_, sparse_metrics, seen) = ends[False], ends[True]
  assert seen == [1, 0]  # the no-signal step ran no forward or backward
  assert sparse_metrics["update/rows_fraction"] == 0
  assert max_abs_diff(dense.params, sparse_.params) < PARAMS_ATOL  # as sparse == dense above
  assert set(dense_metrics) - {"update/rows_fraction"} == (
      set(sparse_metrics) - {"update/rows_fraction"})


def test_the_zero_step_is_the_padded_step_it_replaces():
  """From one state with AdamW moments, the zero-gradient program and the update program on a
  batch of padding rows (zero token weights and advantages) give the same state and metrics."""
  spec = spec_lib.from_config(_pass_at_k_config())
  updater, state = make_updater(spec, tiny_llama(), model.make_mesh((1, 1, 1)))
  answers = np.ones((4, 8), int)
  answers[0, 5] = 0
  batch = fake_rollout(4, 8, answer_ids=answers)
  adv = spec.estimator.advantages(batch.rewards_bn, batch.answer_ids_bn).reshape(-1)
  state, _ = learner.learn(updater, state, batch, adv, np.asarray(jax.random.PRNGKey(0)))
  copy = jax.tree.map(jnp.copy, state)  # each program donates its input
  rows = np.zeros(8, np.int64)
  padded = update.MicroBatch(
      tokens=batch.tokens_rt[rows], attention_mask=batch.attention_mask_rt[rows],
      token_weight=np.zeros((8, batch.tokens_rt.shape[1]), np.float32),
      behaviour_logp=batch.behaviour_logp_rt[rows], advantage=np.zeros(8, np.float32),
      old_logp=None, old_value=None, value_weight=None, ref_logp=None, is_weight=None)
  stepped, step_metrics = updater.step(state, updater.place(padded.split(8)), batch.prompt_len)
  zeroed, zero_metrics = updater.zero_step(copy)
  # The same optimizer arithmetic on the same zeros (bitwise on an AMX Xeon); a rounding step of
  # slack for a CPU whose compiler fuses the two programs differently.
  assert max_abs_diff(stepped, zeroed) <= 1e-7
  assert jax.device_get(step_metrics) == jax.device_get(zero_metrics)


def test_an_update_runs_its_first_count_micro_batches_and_reads_no_others():
  """`Updater.step(count=c)` on 4 micro-batches is the step on the first c alone: the two after
  them are NaN and never reach the state (a NaN read would make the step skip), and one program
  serves every count."""
  spec = spec_lib.from_config(_pass_at_k_config())
  updater, state = make_updater(spec, tiny_llama(), model.make_mesh((1, 1, 1)))
  batch = fake_rollout(4, 8)
  rows = np.arange(32)
  weight = batch.completion_mask_rt.astype(np.float32) / batch.completion_mask_rt.sum()
  advantage = np.linspace(-1, 1, 32).astype(np.float32)
  weight[16:], advantage[16:] = np.nan, np.nan  # micro-batches 2 and 3 of 8 rows
  whole = update.MicroBatch(
      tokens=batch.tokens_rt[rows], attention_mask=batch.attention_mask_rt[rows],
      token_weight=weight, behaviour_logp=batch.behaviour_logp_rt[rows], advantage=advantage)
  first = jax.tree.map(lambda v: v[:16], whole)
  copy = jax.tree.map(jnp.copy, state)  # each program donates its input
  counted, counted_metrics = updater.step(state, updater.place(whole.split(8)), batch.prompt_len,
                                          count=2)
  alone, alone_metrics = updater.step(copy, updater.place(first.split(8)), batch.prompt_len)
  assert int(counted.skipped) == 0 and float(counted_metrics["finite"]) == 1
  assert max_abs_diff(counted.params, alone.params) <= 1e-7
  np.testing.assert_allclose(float(counted_metrics["loss"]), float(alone_metrics["loss"]),
                             rtol=1e-6)
  program = updater.step_program(counted, updater.place(whole.split(8)), batch.prompt_len)
  programs = len(updater._steps)  # pylint: disable=protected-access
  skipped = {}
  for count in (1, 4):
    after, _ = updater.step(jax.tree.map(jnp.copy, counted), updater.place(whole.split(8)),
                            batch.prompt_len, count=count)
    skipped[count] = int(after.skipped)
  assert skipped == {1: 0, 4: 1}  # reading the NaN micro-batches is what a skip shows
  assert updater.step_program(counted, updater.place(whole.split(8)),
                              batch.prompt_len) is program
  assert len(updater._steps) == programs  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="count=5"):
    updater.step(counted, updater.place(whole.split(8)), batch.prompt_len, count=5)


@pytest.mark.parametrize("overrides", [{}, {"algorithm": "dr_grpo"}, {"is_cap": 2.0},
                                       {"algorithm": "ppo"}, {"kl_coef": 0.1}])
def test_the_zero_step_reports_the_metrics_a_step_reports(overrides):
  config = _pass_at_k_config(**overrides)
  spec = spec_lib.from_config(config)
  updater, state = make_updater(spec, tiny_llama(value_head=config.algorithm == "ppo"),
                                model.make_mesh((1, 1, 1)))
  batch = fake_rollout(4, 8)
  rows = np.arange(32)
  micro = update.MicroBatch(
      tokens=batch.tokens_rt[rows], attention_mask=batch.attention_mask_rt[rows],
      token_weight=batch.completion_mask_rt[rows].astype(np.float32),
      behaviour_logp=batch.behaviour_logp_rt[rows], advantage=np.ones(32, np.float32),
      old_logp=batch.behaviour_logp_rt[rows] if spec.loss.clipped else None,
      old_value=np.zeros(32, np.float32) if config.algorithm == "ppo" else None,
      value_weight=np.ones(32, np.float32) if config.algorithm == "ppo" else None,
      ref_logp=batch.behaviour_logp_rt[rows] if config.kl_coef > 0 else None, is_weight=None)
  copy = jax.tree.map(jnp.copy, state)  # each program donates its input
  _, metrics = updater.step(state, updater.place(micro.split(32)), batch.prompt_len)
  if not spec.loss.use_sparse:  # ppo's value loss and a KL penalty read every row
    with pytest.raises(ValueError, match="sparse"):
      updater.zero_step(copy)
    return
  _, zero_metrics = updater.zero_step(copy)
  assert sorted(zero_metrics) == sorted(metrics)


def test_sparse_selection_keeps_the_nonzero_rows_in_few_shapes():
  adv = np.zeros(128, np.float32)
  adv[[3, 50, 77]] = [0.5, -1.0, 2.0]
  # No configured micro-batch (the whole mini-batch): the kept rows fill one of a bucket's size.
  selection = sparse.select_rows(adv, multiple=2)
  assert selection.kept == 3 and list(selection.rows[:3]) == [3, 50, 77]
  assert (selection.micro, selection.count, len(selection.rows)) == (8, 1, 128)
  assert selection.padding.tolist() == [False] * 3 + [True] * 125
  assert {sparse.bucket_rows(kept, 128, 2) for kept in range(129)} == {8, 16, 32, 64, 128}
  # config.sparse_min_rows=1 (a model whose rows cost more than a compilation): from the shards up.
  assert {sparse.bucket_rows(kept, 128, 2, 1) for kept in range(129)} == {2, 4, 8, 16, 32, 64,
                                                                           128}
  small = sparse.select_rows(adv, multiple=2, min_rows=1)
  assert list(small.rows[:4]) == [3, 50, 77, 0] and (small.micro, small.count) == (4, 1)
  # Micro-batches of 16: 40 kept rows run 3 of the 8, not the 64-row bucket's 4.
  adv = np.zeros(128, np.float32)
  adv[np.arange(0, 120, 3)] = 1.0
  many = sparse.select_rows(adv, multiple=2, micro_batch=16)
  assert (many.kept, many.micro, many.count, len(many.rows)) == (40, 16, 3, 128)
  assert list(many.rows[:40]) == list(range(0, 120, 3)) and not many.padding[:40].any()
  assert many.padding[40:].all()
  dense = sparse.select_rows(np.ones(128), multiple=2)
  assert dense.rows.tolist() == list(range(128)) and not dense.padding.any()
  every = sparse.every_row(128, 2, micro_batch=16)
  assert every.rows.tolist() == list(range(128)) and (every.micro, every.count) == (16, 8)
  assert spec_lib.LossSpec(algorithm="ppo").needs_every_row
  assert spec_lib.LossSpec(kl_coef=0.1).needs_every_row
  assert not spec_lib.LossSpec(algorithm="grpo").needs_every_row
  assert not spec_lib.LossSpec(algorithm="pg", kl_coef=0.1).use_sparse
  assert not spec_lib.LossSpec(sparse_updates=False).use_sparse
  assert spec_lib.LossSpec(algorithm="grpo").use_sparse


def test_shared_prompts_lay_out_blocks_of_one_group_where_that_is_cheaper():
  """sparse.shared: each kept group's rows whole, blocks of gcd(micro / shards, n) rows of one
  group per device, the rows without a weight marked, and the cost rule choosing it only where
  it computes fewer positions than a prompt per row."""
  n, total = 4, 32
  dense = sparse.shared(np.arange(total), total, n, 1, total, 4, prompt_len=128,
                        completion_len=80)
  assert (dense.share, dense.micro, dense.count, dense.kept) == (4, 4, 8, 32)
  assert dense.rows.tolist() == list(range(32)) and not dense.padding.any()
  # Micro-batches of 2 rows: blocks of 2 of a group's 4 rows, the prompt run twice a group.
  half = sparse.shared(np.arange(total), total, n, 1, total, 2, 128, 80)
  assert (half.share, half.micro, half.count) == (2, 2, 16)
  # Three groups keep rows (one of them 1 row of 4): every row of each, the others weightless.
  kept = np.array([4, 5, 6, 7, 9, 20, 21, 22])
  some = sparse.shared(kept, total, n, 1, 1, 4, 128, 80)
  assert some.share == 4 and some.kept == 8 and some.count == 3
  assert some.rows[:12].tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 20, 21, 22, 23]
  assert some.padding[:12].tolist() == [False] * 4 + [True, False, True, True] + [False] * 3 + [
      True]
  assert some.padding[12:].all() and (some.rows[12:] == 0).all()
  for micro in range(0, len(some.rows), some.micro):  # every block continues one prompt
    groups = some.rows[micro:micro + some.micro].reshape(-1, some.share) // n
    assert (groups == groups[:, :1]).all()
  # pass@k at n = k keeps one row per group: a prompt per row costs less.
  assert sparse.shared(np.array([1, 6, 15]), total, n, 1, 1, 4, 128, 80) is None
  # A 4-row micro-batch over 2 devices: 2 rows each, blocks of 2 that no device splits.
  sharded = sparse.shared(np.arange(total), total, n, 2, total, 4, 128, 80)
  assert (sharded.share, sharded.micro) == (2, 4)
  # Odd micro-batches share nothing; neither do short prompts against long completions.
  assert sparse.shared(np.arange(30), 30, 3, 1, 30, 4, 128, 80) is None
  assert sparse.shared(np.arange(total), total, n, 1, total, 2, 4, 400) is not None
  assert sparse.shared(np.arange(total), total, n, 1, total, 1, 128, 80) is None
  assert not spec_lib.LossSpec(num_minibatches=2, is_cap=2.0).shares_prompts
  assert not spec_lib.LossSpec(algorithm="ppo").shares_prompts
  assert not spec_lib.LossSpec(share_prompts=False).shares_prompts
  assert spec_lib.LossSpec(algorithm="dr_grpo").shares_prompts


@pytest.mark.parametrize("overrides", [
    {"aggregator": "mean", "sparse_updates": False},  # dense: every group's prompt once
    # sparse: the groups with a signal (0 and 2), whole; and pi_old's forward shared too
    {"aggregator": "mean", "algorithm": "dr_grpo", "micro_batch_size": 4},
    # dense, for the KL penalty (slow: the shared reference forward is
    # test_the_reference_runs_each_prompt_once_and_gives_every_rows_log_probs's)
    pytest.param({"baseline": "loo_demeaned", "kl_coef": 0.1, "micro_batch_size": 4},
                 marks=pytest.mark.slow),
])
def test_an_update_sharing_prompts_equals_a_prompt_per_row(overrides, monkeypatch):
  """config.share_prompts: the same optimizer step (parameters, loss, gradient norm, token and
  row counts) as running each row's prompt, and the update takes the shared programs."""
  answers = np.ones((4, 8), int)
  answers[0, 5] = answers[2, :3] = 0
  answers[1] = 0  # all correct: no signal for the mean either
  calls = []
  step = update.Updater.step
  monkeypatch.setattr(update.Updater, "step", lambda self, *a, **k: (
      calls.append(a[-1] if len(a) > 3 else 1), step(self, *a, **k))[1])
  alone = learn_once(_pass_at_k_config(share_prompts=False, **overrides), answer_ids=answers)
  assert calls == [1] and alone[2]["update/shared_prompts"] == 0
  shared = learn_once(_pass_at_k_config(**overrides), answer_ids=answers)
  assert calls[1] > 1 and shared[2]["update/shared_prompts"] == 1
  assert max_abs_diff(alone[1].params, shared[1].params) < PARAMS_ATOL
  assert max_abs_diff(alone[0], alone[1].params) > 10 * PARAMS_ATOL
  for name in ("loss/total", "optim/grad_norm", "update/rows_fraction", "is/weight_mean"):
    np.testing.assert_allclose(shared[2][name], alone[2][name], rtol=2e-5, atol=1e-7)


def test_micro_batches_accumulate_to_the_full_batch_gradient():
  whole = learn_once(_pass_at_k_config(baseline="loo_demeaned"))
  micro = learn_once(_pass_at_k_config(baseline="loo_demeaned", micro_batch_size=8))
  assert max_abs_diff(whole[1].params, micro[1].params) < PARAMS_ATOL
  np.testing.assert_allclose(micro[2]["optim/grad_norm"], whole[2]["optim/grad_norm"], rtol=1e-5)


def test_non_finite_loss_skips_the_update_and_is_counted():
  config = _pass_at_k_config(baseline="loo_demeaned")
  spec = spec_lib.from_config(config)
  mesh = model.make_mesh((1, 1, 1))
  updater, state = make_updater(spec, tiny_llama(), mesh)
  batch = fake_rollout(config.batch_prompts, spec.sampling.n)
  before = jax.tree.map(np.array, (state.params, state.opt_state))
  adv = np.ones(spec.sampling.rows, np.float32)
  adv[3] = np.nan
  state, metrics = learner.learn(updater, state, batch, adv,
                                 np.asarray(jax.random.PRNGKey(0)))
  assert metrics["optim/skipped_steps"] == 1 and int(state.skipped) == 1
  assert int(state.step) == 1
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves((state.params, state.opt_state))):
    np.testing.assert_array_equal(a, np.asarray(b))  # bitwise: nothing reached the state
  adv[3] = 0.5
  state, metrics = learner.learn(updater, state, batch, adv,
                                 np.asarray(jax.random.PRNGKey(0)))
  assert metrics["optim/skipped_steps"] == 0 and int(state.skipped) == 1
  assert max_abs_diff(before[0], state.params) > 0


def test_two_device_mesh_gives_the_loss_of_one_device():
  assert jax.device_count() >= 2, "tests/conftest.py provides 8 fake CPU devices"
  config = _pass_at_k_config(baseline="loo_demeaned", kl_coef=0.1)
  # Groups 0 and 2 with a unique correct completion: a gradient to compare, not rounding noise
  # (with every reward equal the advantages are all 0, and at the start the KL's gradient is 0).
  answers = np.ones((4, 8), int)
  answers[0, 5] = answers[2, 0] = 0
  one = learn_once(config, mesh=model.make_mesh((1, 1, 1)), answer_ids=answers)
  two = learn_once(config, mesh=model.make_mesh((2, 1, 1)), answer_ids=answers)
  assert one[2]["optim/grad_norm"] > 1e-3
  np.testing.assert_allclose(two[2]["loss/total"], one[2]["loss/total"], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(two[2]["optim/grad_norm"], one[2]["optim/grad_norm"], rtol=1e-5)
  assert max_abs_diff(one[1].params, two[1].params) < PARAMS_ATOL
  shard_devices = {s.device for s in jax.tree.leaves(two[1].params)[0].addressable_shards}
  assert len(shard_devices) == 2


def test_ppo_reuses_completions_off_policy_with_clipping():
  """Second epoch: the learner has moved, so ratios leave 1 and some tokens are clipped."""
  config = tiny(load_config(os.path.join(CONFIG_DIR, "ppo_pass_at_k.py")), ppo_epochs=4,
                learning_rate=3e-2)
  _, _, metrics, _ = learn_once(config)
  assert metrics["optim/steps"] == 8
  assert metrics["ppo/clip_fraction"] > 0


@pytest.mark.parametrize("overrides,field", [
    ({"k": 0}, "config.k"), ({"n": 2, "k": 4}, "config.k"), ({"aggregator": "max"}, "aggregator"),
    ({"baseline": "leave_p_out", "p": 4}, "config.p"), ({"algorithm": "a2c"}, "config.algorithm"),
    ({"algorithm": "grpo"}, "config.scale"), ({"temperature": 0.0}, "config.temperature"),
    ({"top_p": 1.5}, "config.top_p"), ({"num_minibatches": 3}, "config.num_minibatches"),
    ({"micro_batch_size": 5}, "config.micro_batch_size"), ({"is_cap": 0.5}, "config.is_cap"),
    ({"loss_aggregation": "sum"}, "config.loss_aggregation"), ({"mesh": (1, 1)}, "config.mesh"),
    ({"learning_rate": -1.0}, "config.learning_rate"), ({"init_hf": ""}, "config.init_hf"),
    ({"ppo_epochs": 2}, "config.ppo_epochs"), ({"num_minibatches": 2}, "config.num_minibatches"), ({"eval.ks": (1, 32)}, "config.eval.ks"),
    ({"synthetic.levels": (1, 6)}, "config.synthetic.levels"), ({"eval.ks": ()}, "config.eval.ks"),
    ({"model.preset": "gpt2"}, "config.model.preset")])
def test_bad_field_is_one_error_naming_it(overrides, field):
  config = load_config(os.path.join(CONFIG_DIR, "pass_at_k.py"))
  for key, value in overrides.items():
    node = config
    *parents, leaf = key.split(".")
    for parent in parents:
      node = node[parent]
    node[leaf] = value
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as error:
    spec_lib.from_config(config)
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("mesh_shape,micro,prompts,rows_per_micro", [
    ((1, 1, 1), 2, 4, 4), ((2, 1, 1), 2, 4, 4),
    ((8, 1, 1), 4, 4, 8),   # 2 groups a micro-batch, each shard half a group
    ((1, 1, 1), 8, 3, 8),   # 12 rows in micro-batches of 8: the last one padded by a group
])
def test_the_reference_runs_each_prompt_once_and_gives_every_rows_log_probs(
    mesh_shape, micro, prompts, rows_per_micro, monkeypatch):
  """`reference_rows` (the loop's reference forward) lays whole groups in each micro-batch and
  runs each prompt once (`continuation_logprobs`): every row's log-probs are the row-by-row
  forward's within float32 rounding, at the loss temperature, 0 in the prompt columns."""
  config = tiny(load_config(os.path.join(CONFIG_DIR, "pass_at_k.py")), k=4, temperature=0.7,
                micro_batch_size=micro)
  spec = spec_lib.from_config(config)
  mesh = model.make_mesh(mesh_shape)
  graphdef, params = nnx.split(model.shard(tiny_llama(seed=3), mesh))
  updater = update.build_updater(spec, graphdef, mesh)  # its own: traced here, not reused
  groups = []
  continuation = logprobs.continuation_logprobs

  def counting(llama, tokens, mask, prompt_len, group, temperature):
    groups.append((tokens.shape[0], group, temperature))
    return continuation(llama, tokens, mask, prompt_len, group, temperature)

  monkeypatch.setattr(logprobs, "continuation_logprobs", counting)
  batch = fake_rollout(prompts, 4, seed=5)
  rows, p = len(batch.tokens_rt), batch.prompt_len
  shared = learner.reference_rows(updater, params, batch, micro)
  whole = learner.forward_rows(updater, params, batch, np.arange(rows), micro)["logp"]
  assert groups and set(groups) == {(rows_per_micro, 4, 0.7)}  # traced for shapes, then run
  assert shared.shape == whole.shape == batch.tokens_rt.shape
  assert not shared[:, :p].any()
  assert np.abs(whole).max() > 0.1
  np.testing.assert_allclose(shared, whole, atol=2e-5, rtol=0)


def test_unknown_field_is_refused():
  config = load_config(os.path.join(CONFIG_DIR, "pass_at_k.py"))
  config.unlock()
  config.lerning_rate = 0.1
  with pytest.raises(ConfigError, match="config.lerning_rate is not a field"):
    spec_lib.from_config(config)




def test_policy_starts_from_hugging_face_or_orbax_with_a_zero_value_head_for_ppo(tmp_path):
  from ksjax.run import config as defaults, policy  # pylint: disable=g-import-not-at-top
  llama = tiny_llama(seed=3)
  hf_dir, orbax_dir = str(tmp_path / "hf"), str(tmp_path / "orbax")
  model.save_hf(llama, llama.cfg, hf_dir)
  model.save_checkpoint(orbax_dir, llama)
  expected = dict(nnx.to_flat_state(nnx.state(llama)))
  mesh = model.make_mesh((1, 1, 1))
  for field, path in (("init_hf", hf_dir), ("init_checkpoint", orbax_dir)):
    for algorithm in ("pg", "ppo"):
      config = defaults.base_config()
      config[field] = path
      config.algorithm = algorithm
      spec = spec_lib.from_config(config)
      got = dict(nnx.to_flat_state(nnx.state(policy.build_model(
          spec.model, VOCAB, mesh, value_head=spec.loss.value_head, seed=0))))
      assert policy.policy_config(spec.model, VOCAB,
                                  value_head=spec.loss.value_head).value_head == (algorithm == "ppo")
      for name, variable in expected.items():
        np.testing.assert_array_equal(got[name][...], variable[...])
      if algorithm == "ppo":
        np.testing.assert_array_equal(got[("value_head",)][...], 0.0)
      else:
        assert ("value_head",) not in got
  config = defaults.base_config()
  config.init_hf = str(tmp_path / "missing")
  with pytest.raises(ConfigError, match="config.init_hf"):
    policy.build_model(spec_lib.from_config(config).model, VOCAB, mesh, value_head=False, seed=0)
  config.init_hf = hf_dir
  with pytest.raises(ConfigError, match="vocab_size=32 is smaller"):
    policy.build_model(spec_lib.from_config(config).model, VOCAB + 1, mesh, value_head=False,
                       seed=0)
