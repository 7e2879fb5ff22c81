"""A step's draw with dynamic sampling (`ksjax.trainer.draw`): which groups a step keeps, in
what order, up to which cap; the batch the update reads; a tiny run that logs dynamic/* and
updates on signal groups only; kill -9 and resume bitwise with it on; its config fields' validation.

A tiny random model solves no synthetic problem, so every group would weigh nothing. The runs here
score completions by a hash of their text instead (`hashed_rewards`): deterministic, so exact
resume still means something, and about 40% of groups of 4 get a unique correct completion.
Run as a module (`python -m tests.trainer.test_draw --config=...`) it is `ksjax.main` with that
scoring, for the subprocesses of the kill-and-resume test.
"""

import subprocess
import sys
import zlib

import jax
import numpy as np
import pytest

from ksjax.config_validation import ConfigError
from ksjax.run import spec as spec_lib
from ksjax.run.directory import RunDirectory
from ksjax.tasks.base import GroupScore, Prompt, answer_classes
from ksjax.trainer import draw as draw_lib
from ksjax.trainer import learner, loop, metrics, rollout
from tests.support import resume
from tests.trainer import test_run
from tests.trainer.test_run import REPO, _env, _final_params, _flags, _tiny_config

# pass@4 leave-one-out, the default objective: a group has signal only with a unique best sample.
ESTIMATOR = spec_lib.EstimatorSpec(aggregator="pass_at_k", baseline="loo", k=4)
DYNAMIC = {"dynamic_sampling": True, "dynamic_max_rounds": 3}


# ---------------------------------------------------------------------------------------------
# Scoring by a hash of the text
# ---------------------------------------------------------------------------------------------

class HashedRewards:
  """A task whose completions are correct when crc32(text) % 4 == 0; everything else is the
  wrapped task's."""

  def __init__(self, task):
    self._task = task

  def __getattr__(self, name):
    return getattr(self._task, name)

  def score(self, prompts, completions):
    del prompts
    out = []
    for group in completions:
      correct = np.asarray([zlib.crc32(text.encode()) % 4 == 0 for text in group])
      answers = tuple("right" if c else None for c in correct)
      out.append(GroupScore(rewards=np.where(correct, 1.0, -1.0).astype(np.float32),
                            correct=correct, answers=answers, answer_ids=answer_classes(answers)))
    return out


def hashed_rewards(monkeypatch=None):
  """Makes the trainer's task score by `HashedRewards` (in this process)."""
  from ksjax.run import tasks  # pylint: disable=g-import-not-at-top
  make_task = tasks.make_task
  patched = lambda *args, **kwargs: HashedRewards(make_task(*args, **kwargs))
  if monkeypatch is None:
    tasks.make_task = patched
  else:
    monkeypatch.setattr(tasks, "make_task", patched)


# ---------------------------------------------------------------------------------------------
# Selection, pure
# ---------------------------------------------------------------------------------------------

def test_a_group_has_signal_when_some_weight_is_not_exactly_zero():
  rewards_bn = np.asarray([[1, -1, -1, -1],    # a unique correct sample: signal
                           [1, 1, -1, -1],     # two correct: pass@4 loo weighs nothing
                           [-1, -1, -1, -1],   # all equal: nothing
                           [1, 1, 1, 1]], np.float32)
  advantage_bn = ESTIMATOR.advantages(rewards_bn, np.zeros((4, 4), np.int32))
  np.testing.assert_array_equal(draw_lib.signal_groups(advantage_bn), [True, False, False, False])
  np.testing.assert_array_equal(draw_lib.signal_groups(np.asarray([[0.0, 1e-30]])), [True])


def test_the_first_signal_groups_in_sampling_order_are_kept_up_to_the_target():
  rounds = [np.asarray([False, True, False, True]), np.asarray([True, True, False, True])]
  np.testing.assert_array_equal(draw_lib.choose(rounds, 3), [1, 3, 4])  # round 1's group 0 = 4
  np.testing.assert_array_equal(draw_lib.choose(rounds, 10), [1, 3, 4, 5, 7])
  np.testing.assert_array_equal(draw_lib.choose([np.zeros(4, bool)], 4), [])
  np.testing.assert_array_equal(draw_lib.choose([], 4), [])


def test_rounds_continue_until_the_target_or_the_cap():
  assert draw_lib.should_continue(3, 1, target=4, max_rounds=3)
  assert not draw_lib.should_continue(4, 1, target=4, max_rounds=3)
  assert not draw_lib.should_continue(7, 2, target=4, max_rounds=3)
  assert not draw_lib.should_continue(0, 3, target=4, max_rounds=3)


def test_the_kept_groups_are_bucketed_to_powers_of_two_that_split_like_a_full_batch():
  assert [draw_lib.bucket_groups(g, 16) for g in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
  # 2 mini-batches over 4 shards with n = 4: groups come in pairs (8 rows), capped at B = 12.
  multiple = draw_lib.group_multiple(4, 2 * 4)
  assert multiple == 2
  assert [draw_lib.bucket_groups(g, 12, multiple) for g in (1, 2, 3, 5, 12)] == [2, 2, 4, 8, 12]
  assert draw_lib.group_multiple(8, 4) == 1 and draw_lib.group_multiple(3, 6) == 2


def test_round_seeds_come_from_the_step_key_and_round_zero_is_the_plain_step_seed():
  key = jax.random.PRNGKey(7)
  plain = int(jax.random.randint(key, (), 0, 2**31 - 1))  # the loop's seed before this module
  seeds = [draw_lib.round_seed(key, r) for r in range(4)]
  assert seeds[0] == plain
  assert len(set(seeds)) == 4
  assert seeds == [draw_lib.round_seed(jax.random.PRNGKey(7), r) for r in range(4)]


def fake_rollout(groups, n=4, prompt_len=3, completion=2, first_id=0, rewards_bn=None):
  """A Rollout whose row r holds token ids from a per-row counter, `prompt_len` prompt columns
  (the first left-padded) and `completion` completion columns (the last one padding)."""
  rows = groups * n
  t = prompt_len + completion
  tokens_rt = (np.arange(rows * t).reshape(rows, t) + 1000 * first_id).astype(np.int32)
  attention_rt = np.ones((rows, t), bool)
  attention_rt[:, 0] = False
  attention_rt[:, -1] = False
  completion_rt = attention_rt.copy()
  completion_rt[:, :prompt_len] = False
  if rewards_bn is None:
    rewards_bn = -np.ones((groups, n), np.float32)
  return rollout.Rollout(
      prompts=tuple(Prompt(id=f"p{first_id + g}", text="", tokens=(first_id + g,))
                    for g in range(groups)),
      tokens_rt=tokens_rt, attention_mask_rt=attention_rt, completion_mask_rt=completion_rt,
      behaviour_logp_rt=np.where(completion_rt, -0.5, 0.0).astype(np.float32),
      prompt_len=prompt_len, finished_r=np.ones(rows, bool),
      texts=tuple(f"t{first_id}.{r}" for r in range(rows)),
      rewards_bn=np.asarray(rewards_bn, np.float32), correct_bn=np.asarray(rewards_bn) > 0,
      answer_ids_bn=np.zeros((groups, n), np.int32))


def test_rounds_with_different_prompt_widths_concatenate_left_padded():
  a, b = fake_rollout(2, prompt_len=3), fake_rollout(1, prompt_len=5, first_id=2)
  both = draw_lib.concatenate([a, b])
  assert both.prompt_len == 5 and both.tokens_rt.shape == (12, 7)
  assert both.prompts == a.prompts + b.prompts and both.texts == a.texts + b.texts
  np.testing.assert_array_equal(both.tokens_rt[:8, 2:], a.tokens_rt)
  assert not both.attention_mask_rt[:8, :2].any() and not both.completion_mask_rt[:8, :2].any()
  np.testing.assert_array_equal(both.tokens_rt[8:], b.tokens_rt)
  np.testing.assert_array_equal(both.behaviour_logp_rt[:8, 2:], a.behaviour_logp_rt)
  np.testing.assert_array_equal(both.rewards_bn, np.concatenate([a.rewards_bn, b.rewards_bn]))
  assert draw_lib.concatenate([a]) is a


def test_taken_groups_keep_their_order_and_padding_groups_carry_no_completion():
  r = fake_rollout(4)
  taken = draw_lib.take_groups(r, np.asarray([3, 1]), size=4)
  rows = [12, 13, 14, 15, 4, 5, 6, 7]
  np.testing.assert_array_equal(taken.tokens_rt[:8], r.tokens_rt[rows])
  np.testing.assert_array_equal(taken.completion_mask_rt[:8], r.completion_mask_rt[rows])
  assert taken.prompts == (r.prompts[3], r.prompts[1], r.prompts[3], r.prompts[3])
  assert taken.texts[:8] == tuple(r.texts[i] for i in rows) and taken.texts[8:] == ("",) * 8
  # Padding: the first kept row's tokens (a finite forward), no completion, no sampler log-probs.
  np.testing.assert_array_equal(taken.tokens_rt[8:], np.repeat(r.tokens_rt[12:13], 8, axis=0))
  assert taken.attention_mask_rt[8:].any() and not taken.completion_mask_rt[8:].any()
  assert not taken.behaviour_logp_rt[8:].any()
  with pytest.raises(ValueError, match="size=1"):
    draw_lib.take_groups(r, np.asarray([3, 1]), size=1)


def scripted_draw(signal_rounds, n=4):
  """draw(round) for `draw_step`: round r's groups have signal where signal_rounds[r] says."""
  calls = []

  def draw(round_index):
    calls.append(round_index)
    signal_b = np.asarray(signal_rounds[round_index], bool)
    rewards_bn = -np.ones((len(signal_b), n), np.float32)
    rewards_bn[signal_b, 0] = 1.0  # a unique correct sample
    batch = fake_rollout(len(signal_b), n, first_id=10 * round_index, rewards_bn=rewards_bn)
    return batch, ESTIMATOR.advantages(rewards_bn, batch.answer_ids_bn)
  return draw, calls


def test_off_one_round_keeps_every_group_in_place():
  draw, calls = scripted_draw([[True, False, False, True]])
  drawn = draw_lib.draw_step(draw, k=ESTIMATOR.k, target=4, enabled=False, max_rounds=3)
  assert calls == [0] and drawn.rounds == 1 and drawn.prompts_consumed == 4
  assert drawn.update is drawn.sampled  # the very rollout the sampler returned
  np.testing.assert_array_equal(drawn.kept, [0, 1, 2, 3])
  np.testing.assert_array_equal(drawn.update_advantage_r, drawn.advantage_bn.reshape(-1))


def test_on_it_samples_until_the_target_and_keeps_the_first_signal_groups():
  draw, calls = scripted_draw([[True, False, False, False], [False, True, True, False],
                               [True, True, True, True], [True] * 4])
  drawn = draw_lib.draw_step(draw, k=ESTIMATOR.k, target=4, enabled=True, max_rounds=5)
  assert calls == [0, 1, 2] and drawn.rounds == 3 and drawn.prompts_consumed == 12
  np.testing.assert_array_equal(drawn.kept, [0, 5, 6, 8])  # 9-11 had signal, beyond the target
  assert len(drawn.sampled.prompts) == 12 and drawn.advantage_bn.shape == (12, 4)
  assert drawn.update.tokens_rt.shape == drawn.sampled.tokens_rt[:16].shape  # B groups: today's
  expected = drawn.advantage_bn[[0, 5, 6, 8]].reshape(-1)
  np.testing.assert_array_equal(drawn.update_advantage_r, expected)
  assert drawn.update.prompts == tuple(drawn.sampled.prompts[g] for g in (0, 5, 6, 8))
  m = drawn.metrics()
  assert m["dynamic/rounds"] == 3 and m["dynamic/kept_fraction"] == 4 / 12
  assert m["dynamic/prompts_consumed"] == 12
  generated = drawn.sampled.completion_mask_rt.sum()
  assert m["dynamic/sampled_tokens_per_kept_row"] == generated / 16


def test_at_the_cap_the_update_pads_what_it_has_and_with_nothing_makes_none():
  draw, calls = scripted_draw([[False, True, False, False], [False, False, False, True],
                               [True] * 4])
  drawn = draw_lib.draw_step(draw, k=ESTIMATOR.k, target=4, enabled=True, max_rounds=2)
  assert calls == [0, 1] and drawn.kept_rows == 8
  np.testing.assert_array_equal(drawn.kept, [1, 7])
  assert len(drawn.update.prompts) == 2  # two groups bucket to 2: no padding
  drawn = draw_lib.draw_step(scripted_draw([[False, True, True, True]])[0], k=ESTIMATOR.k,
                             target=4, enabled=True, max_rounds=1)
  assert len(drawn.update.prompts) == 4  # three groups bucket to 4: one padding group
  assert not drawn.update.completion_mask_rt[12:].any()
  assert not drawn.update_advantage_r[12:].any() and drawn.update_advantage_r[:12].any()
  drawn = draw_lib.draw_step(scripted_draw([[False] * 4] * 3)[0], k=ESTIMATOR.k, target=4,
                             enabled=True, max_rounds=3)
  assert drawn.rounds == 3 and len(drawn.kept) == 0 and drawn.kept_rows == 0
  m = drawn.metrics()
  assert m["dynamic/kept_fraction"] == 0.0 and "dynamic/sampled_tokens_per_kept_row" not in m


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [0, -2])
def test_bad_dynamic_fields_are_one_config_error_naming_the_field(tmp_path, value):
  with pytest.raises(ConfigError, match=rf"^config\.dynamic_max_rounds={value} ") as error:
    spec_lib.from_config(_tiny_config(tmp_path / "run", dynamic_max_rounds=value))
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("field,value", [("dynamic_max_rounds", 0), ("dynamic_max_rounds", 2.5),
                                         ("dynamic_max_rounds", True),
                                         ("dynamic_sampling", "yes"), ("dynamic_sampling", 1)])
def test_a_sampling_spec_made_in_python_checks_the_dynamic_fields(field, value):
  # (A ConfigDict refuses a value of the wrong type itself, before any spec reads it.)
  with pytest.raises(ConfigError, match=rf"^config\.{field}={value!r} ") as error:
    spec_lib.SamplingSpec(**{field: value})
  assert "\n" not in str(error.value)


def test_the_defaults_are_off_and_the_fields_reach_the_spec(tmp_path):
  spec = spec_lib.from_config(_tiny_config(tmp_path / "run"))
  assert spec.sampling.dynamic_sampling is False and spec.sampling.dynamic_max_rounds >= 1
  spec = spec_lib.from_config(_tiny_config(tmp_path / "run", **DYNAMIC))
  assert spec.sampling.dynamic_sampling and spec.sampling.dynamic_max_rounds == 3


def test_a_bad_value_on_the_command_line_exits_2_with_one_line(tmp_path):
  workdir = tmp_path / "run"
  result = subprocess.run(test_run._main(str(workdir), dynamic_max_rounds=0), cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=300)
  assert result.returncode == 2
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and "config.dynamic_max_rounds=0" in lines[0], result.stderr
  assert not workdir.exists()


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------

def test_a_run_logs_dynamic_metrics_and_updates_on_signal_groups_only(tmp_path, monkeypatch):
  hashed_rewards(monkeypatch)
  updates, references, scored = [], [], []
  learn, reference_rows, batch_metrics = (learner.learn, learner.reference_rows,
                                          rollout.batch_metrics)

  def recording_learn(updater, state, batch, advantage_r, *args, **kwargs):
    updates.append((batch, np.array(advantage_r)))
    return learn(updater, state, batch, advantage_r, *args, **kwargs)

  def recording_reference(updater, params, batch, *args, **kwargs):
    out = reference_rows(updater, params, batch, *args, **kwargs)
    references.append(len(out))
    return out

  def recording_metrics(batch, k):
    scored.append(len(batch.prompts))
    return batch_metrics(batch, k)

  monkeypatch.setattr(learner, "learn", recording_learn)
  monkeypatch.setattr(learner, "reference_rows", recording_reference)
  monkeypatch.setattr(rollout, "batch_metrics", recording_metrics)
  workdir = tmp_path / "run"
  loop.run(_tiny_config(workdir, num_steps=4, **DYNAMIC))
  lines = metrics.read_jsonl(RunDirectory(workdir).metrics_jsonl)
  assert [line["step"] for line in lines] == [1, 2, 3, 4]
  for line in lines:
    for name in ("dynamic/rounds", "dynamic/kept_fraction", "dynamic/prompts_consumed",
                 "dynamic/sampled_tokens_per_kept_row", "batch/pass_at_k", "kl/k3"):
      assert name in line, name
    assert 1 <= line["dynamic/rounds"] <= 3
    assert line["dynamic/prompts_consumed"] == 4 * line["dynamic/rounds"]
    assert 0 < line["dynamic/kept_fraction"] <= 1
  assert any(line["dynamic/rounds"] > 1 for line in lines), "the test should resample"
  # The batch metrics read every sampled group; the update and the reference the kept ones.
  assert scored == [line["dynamic/prompts_consumed"] for line in lines]
  assert len(updates) == len(lines) and references == [len(a) for _, a in updates]
  n = 4
  for (batch, advantage_r), line in zip(updates, lines):
    groups = len(advantage_r) // n
    assert groups in (1, 2, 4) and len(batch.prompts) == groups
    kept = round(line["dynamic/kept_fraction"] * line["dynamic/prompts_consumed"])
    assert groups == draw_lib.bucket_groups(kept, 4)
    advantage_gn = advantage_r.reshape(groups, n)
    assert draw_lib.signal_groups(advantage_gn)[:kept].all()  # every kept group has signal
    assert not advantage_gn[kept:].any() and not batch.completion_mask_rt[kept * n:].any()
    recomputed = ESTIMATOR.advantages(batch.rewards_bn[:kept], batch.answer_ids_bn[:kept])
    np.testing.assert_array_equal(advantage_gn[:kept], recomputed)


def _main(workdir, **overrides):
  """`ksjax.main` with hashed rewards: this file run as a module."""
  return [sys.executable, "-m", "tests.trainer.test_draw", "--config=configs/pass_at_k.py",
          f"--config.workdir={workdir}"] + _flags({**test_run.TINY, **DYNAMIC, **overrides})


VOLATILE = ("time/", "throughput/", "compile/", "memory/")  # differ between runs


@pytest.mark.slow  # a straight run and a killed one; the default suite resumes bitwise without
# dynamic sampling (tests/trainer/test_run.py) and runs dynamic sampling (test_a_run_logs_...)
def test_killed_and_resumed_run_with_dynamic_sampling_matches_the_straight_run_bitwise(tmp_path):
  steps = 6
  straight, killed = resume.straight_and_killed(_main, tmp_path, steps, _env())
  for x, y in zip(jax.tree.leaves(_final_params(straight)), jax.tree.leaves(_final_params(killed))):
    np.testing.assert_array_equal(x, y)
  strip = lambda lines: [{k: v for k, v in line.items() if not k.startswith(VOLATILE)}
                         for line in lines]
  lines = strip(metrics.read_jsonl(RunDirectory(killed).metrics_jsonl))
  reference = strip(metrics.read_jsonl(RunDirectory(straight).metrics_jsonl))
  assert [line["step"] for line in lines] == list(range(1, steps + 1))
  assert lines == reference
  assert any(line["dynamic/rounds"] > 1 for line in reference), "the test should resample"


if __name__ == "__main__":
  from absl import app  # pylint: disable=g-import-not-at-top
  from ksjax import config_validation, errors, main  # pylint: disable=g-import-not-at-top
  hashed_rewards()
  app.run(errors.boundary("ksjax", main.main), flags_parser=config_validation.parse_flags_or_exit)
