"""The objectives beyond the paper in a run: the mixture over k and the leave-two-out baseline
through the config, voting without labels (and that the label cannot reach its reward), the
labelled probe, and the gradient-noise metrics; one tiny run that takes steps with them; and a k
schedule's k, logged as the k of the weights each step's update used."""

import dataclasses

import numpy as np
import pytest

from ksjax.config_validation import ConfigError
from ksjax.run import config as run_config
from ksjax.run import scoring
from ksjax.run import spec as spec_lib
from ksjax import sampling
from ksjax.run.directory import RunDirectory
from ksjax.tasks import synthetic
from ksjax.trainer import learner, loop, metrics, probe, rollout
from tests.trainer import test_draw
from tests.trainer.test_run import _tiny_config


@pytest.mark.parametrize("fields,message", [
    (dict(k_mixture="harmonic"), r"^config\.k_mixture='harmonic' is not accepted; expected one "
                                 r"of 'none', 'maxrl', 'weights'$"),
    (dict(k_mixture="weights"), r"^config\.k_weights=None is not accepted; expected a non-empty "
                                r"tuple"),
    (dict(k_mixture="weights", k_weights=(1.0, 0.5)), r"^config\.k_weights has 2 entries; "
                                                      r"expected k=4"),
    (dict(k_mixture="weights", k_weights=(1.0, -1.0, 0.0, 0.0)),
     r"^config\.k_weights=\(1\.0, -1\.0, 0\.0, 0\.0\) is not accepted"),
    (dict(k_mixture="maxrl", k_weights=(1.0,) * 4), r"^config\.k_weights=.* is not accepted with "
                                                    r"k_mixture='maxrl'"),
])
def test_mixture_fields_are_checked_and_named(fields, message):
  with pytest.raises(ConfigError, match=message) as error:
    spec_lib.EstimatorSpec(**fields)
  assert "\n" not in str(error.value)


def test_mixture_and_leave_two_out_combinations_are_checked_against_n():
  spec_lib.EstimatorSpec(k_mixture="maxrl").check_with(4)
  spec_lib.EstimatorSpec(baseline="leave_two_out", k=3).check_with(4)
  with pytest.raises(ConfigError, match=r"^config\.baseline='loo_demeaned' is not accepted with "
                                        r"a mixture over k"):
    spec_lib.EstimatorSpec(k_mixture="maxrl", baseline="loo_demeaned").check_with(4)
  with pytest.raises(ConfigError, match=r"^config\.k=4 is not accepted in a mixture with "
                                        r"baseline='leave_two_out' and n=4"):
    spec_lib.EstimatorSpec(k_mixture="maxrl", baseline="leave_two_out").check_with(4)
  with pytest.raises(ConfigError, match=r"^config\.k=4 is not accepted with "
                                        r"baseline='leave_two_out' and n=4; expected k < n"):
    spec_lib.EstimatorSpec(baseline="leave_two_out").check_with(4)
  # A schedule truncates the mixture at its k; explicit weights end at k.
  scheduled = spec_lib.EstimatorSpec(k=2, k_mixture="weights", k_weights=(1.0, 0.5),
                                     k_schedule="step", k_start=4, k_schedule_steps=3)
  with pytest.raises(ConfigError, match=r"^config\.k=4 is not accepted with k_mixture='weights' "
                                        r"and 2 k_weights.*taken by config\.k_schedule='step'"):
    scheduled.check_with(4)
  maxrl = spec_lib.EstimatorSpec(k=2, k_mixture="maxrl", k_schedule="step", k_start=4,
                                 k_schedule_steps=3)
  assert len(maxrl.weights_at(maxrl.k_at(0))) == 4 and len(maxrl.weights_at(maxrl.k_at(3))) == 2
  config = run_config.embedded_task_config()
  config.label_free, config.n, config.k = True, 1, 1
  with pytest.raises(ConfigError, match=r"^config\.label_free=True is not accepted with n=1"):
    spec_lib.from_config(config)
  with pytest.raises(ConfigError, match=r"^config\.eval\.probe_every=-1 is out of range"):
    spec_lib.HeldOutSpec(probe_every=-1)


ANSWERS = [("3", "3", "7", None, "3"), ("1", "1", "2", "2", "2"), ("4", "4", "4", "4", "9")]


def _stub_generate(task):
  """`sampling.generate` without a model: prompt g's samples state ANSWERS[g] (None: no answer)."""
  tok = task.tokenizer

  def generate(llama, prompt_tokens, *, num_samples, max_new_tokens, pad_id, **_):
    texts = [("no answer" if a is None else f"The final answer is {a}.")
             for group in ANSWERS[:len(prompt_tokens)] for a in group[:num_samples]]
    rows = [tok.encode(t, add_bos=False)[:max_new_tokens - 1] + [tok.eos_ids[0]] for t in texts]
    tokens = np.full((len(rows), max_new_tokens), pad_id, np.int32)
    for r, row in enumerate(rows):
      tokens[r, :len(row)] = row
    width = max(len(p) for p in prompt_tokens)
    prompts = np.array([[pad_id] * (width - len(p)) + list(p) for p in prompt_tokens for _ in
                        range(num_samples)], np.int32)
    return sampling.SampleOutput(
        tokens=tokens, lengths=np.array([len(r) for r in rows], np.int32),
        logprobs=np.zeros(tokens.shape, np.float32), finished=np.ones(len(rows), bool),
        prompt_tokens=prompts, prompt_lengths=np.array([len(p) for p in prompt_tokens
                                                        for _ in range(num_samples)], np.int32))
  return generate


def test_label_free_rewards_are_agreement_and_never_see_the_label(monkeypatch):
  task = synthetic.SyntheticTask(levels=(1,), train_per_level=8, test_per_level=4)
  monkeypatch.setattr(scoring.sampling, "generate", _stub_generate(task))
  prompts = list(task.prompts("train")[:3])
  spec = spec_lib.SamplingSpec(batch_prompts=3, n=5, max_new_tokens=40, label_free=True)
  rolled = rollout.collect(None, task, prompts, spec, seed=0)
  # 2 vs 3 votes: a "2" sees a 2-2 tie among the others (1/2), a "1" sees "2" win (0).
  np.testing.assert_allclose(rolled.rewards_bn, [[1, 1, 0, 0, 1], [0, 0, 0.5, 0.5, 0.5],
                                                 [1, 1, 1, 1, 0]])
  # Other labels: the task's correctness changes, the reward and its classes do not.
  relabelled = [dataclasses.replace(p, reference=str((int(p.reference) + 3) % 10))
                for p in prompts]
  again = rollout.collect(None, task, relabelled, spec, seed=0)
  assert not np.array_equal(again.correct_bn, rolled.correct_bn)
  np.testing.assert_array_equal(again.rewards_bn, rolled.rewards_bn)
  np.testing.assert_array_equal(again.answer_ids_bn, rolled.answer_ids_bn)
  labelled = rollout.collect(None, task, prompts, dataclasses.replace(spec, label_free=False),
                             seed=0)
  assert set(np.unique(labelled.rewards_bn)) <= {-1.0, 1.0}
  # Classes a task formed with the label (as math's are) are not read either.
  scored = scoring.sample_and_score(None, task, relabelled, scoring.Draw(5, 40, 1.0, 1.0, 0),
                                    seed=0)
  leaky = dataclasses.replace(scored, answer_ids_gn=scored.correct_gn.astype(np.int32),
                              rewards_gn=scored.correct_gn.astype(np.float32))
  np.testing.assert_array_equal(scoring.hide_labels(leaky).rewards_gn, rolled.rewards_bn)


def test_weight_noise_metrics():
  weights_bn = np.array([[0.0, 0.0, 0.0, 0.0], [0.6, -0.2, -0.2, -0.2], [1.0, 0.0, 0.0, 1.0]])
  got = metrics.weight_noise(weights_bn)
  assert got["advantage/signal_groups"] == pytest.approx(2 / 3)
  variances = [0.0, np.var([0.6, -0.2, -0.2, -0.2]), 0.25]
  assert got["advantage/group_variance"] == pytest.approx(np.mean(variances))
  assert got["advantage/signal_group_variance"] == pytest.approx(np.mean(variances[1:]))
  assert got["advantage/square_mean"] == pytest.approx(np.mean(weights_bn ** 2))
  assert metrics.weight_noise(np.zeros((2, 3)))["advantage/signal_group_variance"] == 0.0


def test_probe_prompts_spread_over_the_levels():
  task = synthetic.SyntheticTask(levels=(1, 2, 3), train_per_level=8, test_per_level=10)
  chosen = probe.prompts(task, spec_lib.HeldOutSpec(probe_prompts=6))
  assert sorted({p.metadata["level"] for p in chosen}) == [1, 2, 3]
  assert len(probe.prompts(task, spec_lib.HeldOutSpec(probe_prompts=100))) == 30


@pytest.mark.slow  # a whole tiny run, about 15 CPU-seconds; the pieces are tested above
def test_a_tiny_run_takes_steps_with_a_mixture_without_labels_and_probes(tmp_path):
  """One run for both, with tests/trainer's shapes (the probe's sampler is the training one's)."""
  workdir = tmp_path / "run"
  loop.run(_tiny_config(workdir, num_steps=2, label_free=True, k_mixture="maxrl", **{
      "eval.probe_every": 2, "eval.probe_prompts": 4, "eval.probe_samples": 4,
      "eval.batch_prompts": 4}))
  lines = metrics.read_jsonl(RunDirectory(workdir).metrics_jsonl)
  assert [line["step"] for line in lines] == [1, 2]
  for line in lines:
    assert 0.0 <= line["reward/mean"] <= 1.0  # agreement, not the task's -1/+1
    assert 0.0 <= line["advantage/signal_groups"] <= 1.0
    assert line["optim/steps"] == 1.0
  assert "probe/pass_at_1" not in lines[0]
  assert 0.0 <= lines[1]["probe/pass_at_1"] <= lines[1]["probe/pass_at_4"] <= 1.0
  assert "probe/maj_at_4" in lines[1] and "probe/level2/pass_at_1" in lines[1]


@pytest.mark.parametrize("max_lag", [0, 1])  # lockstep; a worker drawing a step ahead
def test_each_step_logs_the_k_its_weights_used_under_a_schedule(tmp_path, monkeypatch, max_lag):
  test_draw.hashed_rewards(monkeypatch)  # groups with signal: weights that depend on k
  updates = []
  learn = learner.learn

  def recording_learn(updater, state, batch, advantage_r, *args, **kwargs):
    updates.append((batch, np.array(advantage_r)))
    return learn(updater, state, batch, advantage_r, *args, **kwargs)

  monkeypatch.setattr(learner, "learn", recording_learn)
  config = _tiny_config(tmp_path / "run", num_steps=3, k_schedule="linear", k_start=2,
                        k_schedule_steps=2, max_lag=max_lag)
  loop.run(config)
  estimator = spec_lib.from_config(config).estimator
  lines = metrics.read_jsonl(RunDirectory(tmp_path / "run").metrics_jsonl)
  assert [line["objective/k"] for line in lines] == [2.0, 3.0, 4.0]
  assert len(updates) == len(lines)
  distinct = False  # whether some step's weights tell its k from the schedule's others
  for (batch, advantage_r), line in zip(updates, lines):
    by_k = {k: estimator.advantages(batch.rewards_bn, batch.answer_ids_bn, k=k).reshape(-1)
            for k in estimator.scheduled_ks()}
    np.testing.assert_array_equal(advantage_r, by_k[int(line["objective/k"])])
    distinct |= any(not np.array_equal(advantage_r, other) for other in by_k.values())
  assert distinct, "the test should see weights that differ between the schedule's ks"
