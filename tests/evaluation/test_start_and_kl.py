"""The eval binary's start policy (config.include_start) and KL to a reference
(config.kl_reference): the estimators by exact enumeration, the binary's numbers against the
policy itself and against a direct computation, their survival when a record is rescored, and bad
input as one line with nothing written."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from ksjax import model
from ksjax.config_validation import ConfigError
from ksjax.evaluation import results, runner
from ksjax.evaluation import settings as settings_lib
from ksjax.run import scoring

from tests.support import eval_run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, worker_id) -> pathlib.Path:
  return eval_run.tiny_run(eval_run.session_dir(tmp_path_factory, worker_id))


def _private_run(run: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
  return eval_run.copy_run(run, dest, with_eval=False)


_configured = eval_run.configured


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def test_k1_and_k3_are_unbiased_for_the_sequence_kl_by_enumeration():
  """Two-token completions over a 3-token vocabulary, pi and pi_ref autoregressive (the second
  token's distribution depends on the first), one completion of length 1 allowed (token 0 ends
  it): the expectation of each estimator under pi, summed over every completion weighted by its
  probability, equals KL(pi || pi_ref) of the completion distributions, computed directly."""
  rng = np.random.default_rng(0)
  pi1, ref1 = _softmax(rng.normal(size=3)), _softmax(rng.normal(size=3))
  pi2, ref2 = _softmax(rng.normal(size=(3, 3))), _softmax(rng.normal(size=(3, 3)))
  probs, ref_probs, logp, ref_logp, masks = [], [], [], [], []
  for first in range(3):
    seconds = [None] if first == 0 else range(3)
    for second in seconds:
      p = [pi1[first]] + ([] if second is None else [pi2[first, second]])
      q = [ref1[first]] + ([] if second is None else [ref2[first, second]])
      probs.append(np.prod(p))
      ref_probs.append(np.prod(q))
      logp.append(np.log(p + [1.0] * (2 - len(p))))   # padding: log 1 = 0, masked anyway
      ref_logp.append(np.log(q + [1.0] * (2 - len(q))))
      masks.append([True, second is not None])
  probs, ref_probs = np.asarray(probs), np.asarray(ref_probs)
  assert probs.sum() == pytest.approx(1.0) and ref_probs.sum() == pytest.approx(1.0)
  exact = float((probs * np.log(probs / ref_probs)).sum())
  k1_r, k3_r = scoring.kl_per_completion(np.asarray(logp), np.asarray(ref_logp),
                                         np.asarray(masks))
  assert exact > 0.01
  assert float((probs * k1_r).sum()) == pytest.approx(exact, rel=1e-12)
  assert float((probs * k3_r).sum()) == pytest.approx(exact, rel=1e-12)
  assert (k3_r >= 0).all() and (k1_r < 0).any()  # k3 per sample >= 0; k1 is not
  # Padding past a completion (masked) changes nothing, whatever its values.
  noisy = np.where(np.asarray(masks), np.asarray(logp), 7.0)
  np.testing.assert_array_equal(scoring.kl_per_completion(noisy, np.asarray(ref_logp),
                                                          np.asarray(masks))[0], k1_r)


def _perturbed(policy, scale: float, seed: int):
  """`policy` with N(0, scale^2) noise added to every parameter (a reference it differs from)."""
  graphdef, state = nnx.split(policy)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  noisy = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, noisy))


# slow: a zero KL to itself is the start's test below; a reference by path is the next test's
@pytest.mark.slow
def test_kl_to_the_policy_itself_is_zero(run_dir, tmp_path):
  run = _private_run(run_dir, tmp_path / "run")
  # final/ holds the weights of step 3: every completion's log-ratio is the sampler's log-prob
  # against a forward of the same weights, so a misaligned position would show here.
  runner.run(_configured(run, steps="3", kl_reference=str(run / "final"), kl_samples=3))
  (out,) = (run / "eval").iterdir()
  (record,) = results.load_records(str(out))
  assert record["sampling"]["kl_reference"] == str(run / "final")
  assert record["sampling"]["kl_samples"] == 3
  assert abs(record["metrics"]["kl_k1"]) < 1e-4 and 0 <= record["metrics"]["kl_k3"] < 1e-6


def test_kl_to_another_reference_equals_a_direct_computation(run_dir, tmp_path):
  """Against a perturbed copy of the policy: the binary's per-problem KL (its samples drawn on
  the run's 8-device mesh, the reference's forward sharded there) equals the same samples drawn
  again on one device and scored by unsharded forwards of both models."""
  run = _private_run(run_dir, tmp_path / "run")
  policy, _ = model.load_checkpoint(str(run / "final"))
  reference = _perturbed(policy, 0.05, seed=1)
  model.save_checkpoint(str(tmp_path / "reference"), reference)
  config = _configured(run, steps="3", kl_reference=str(tmp_path / "reference"), kl_samples=3)
  runner.run(config)
  (out,) = (run / "eval").iterdir()
  (record,) = results.load_records(str(out))

  s = settings_lib.validate(config)
  task = runner.open_task(s)
  prompts = runner.select_prompts(task, s)
  assert len(prompts) <= s.batch_prompts  # one sampler call, seeded with config.seed
  scored = scoring.sample_and_score(policy, task, prompts, s.draw(), seed=s.seed)
  tokens_rt, mask_rt = scored.output.sequences()
  t = scored.output.prompt_tokens.shape[1]
  forward = nnx.jit(lambda m, x, k: model.token_logprobs(m, x, k)[0])  # eager: op by op
  logp = {name: np.asarray(forward(m, tokens_rt, mask_rt))[:, t:]
          for name, m in (("policy", policy), ("reference", reference))}
  mask_rn = np.asarray(mask_rt)[:, t:]
  k1_r = np.where(mask_rn, logp["policy"] - logp["reference"], 0.0).sum(1)
  k1_g = k1_r.reshape(len(prompts), s.num_samples)[:, :3].mean(1)
  np.testing.assert_allclose(record["problems"]["kl_k1"], k1_g, rtol=1e-3, atol=1e-4)
  k3_g = np.asarray(record["problems"]["kl_k3"])
  assert (k3_g >= 0).all() and k3_g.mean() > 1e-3
  assert record["metrics"]["kl_k3"] == pytest.approx(k3_g.mean())
  assert record["groups"]["level=1"]["kl_k3"] == pytest.approx(k3_g[:3].mean())

  # Evaluated again with other ks: pass@k is recomputed from the stored classes, the KL kept.
  runner.run(_configured(run, steps="3", kl_reference=str(tmp_path / "reference"),
                         kl_samples=3, ks=(1, 4)))
  (again,) = results.load_records(str(out))
  assert again["ks"] == [1, 4] and "pass@2" not in again["metrics"]
  assert again["metrics"]["kl_k3"] == record["metrics"]["kl_k3"]
  assert again["groups"]["level=2"]["kl_k1"] == record["groups"]["level=2"]["kl_k1"]
  summary = json.loads((out / "results.json").read_text())
  assert summary["records"][0]["metrics"]["kl_k3"] == record["metrics"]["kl_k3"]


@pytest.mark.parametrize("field,value,message", [
    ("temperature", 0.7, "expected temperature 1, top_p 1 and top_k 0"),
    ("kl_samples", 5, "config.kl_samples"),
    ("kl_reference", "", "expected 'start'"),
])
def test_kl_settings_are_checked(run_dir, field, value, message):
  with pytest.raises(ConfigError, match=message):
    settings_lib.validate(_configured(run_dir, **{"kl_reference": "start", field: value}))


def test_a_missing_reference_is_one_line_exit_2_and_nothing_written(run_dir, tmp_path):
  run = _private_run(run_dir, tmp_path / "run")
  before = sorted(str(p) for p in run.rglob("*"))
  result = eval_run.run_eval(run, f"--config.kl_reference={tmp_path / 'nowhere'}")
  assert result.returncode == 2, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and "config.kl_reference=" in lines[0] and "not a directory" in lines[0]
  assert sorted(str(p) for p in run.rglob("*")) == before
  assert not os.path.exists(run / "eval")


def test_the_start_policy_is_step_0_with_zero_kl_to_itself(run_dir, tmp_path):
  run = _private_run(run_dir, tmp_path / "run")
  runner.run(_configured(run, steps="3", include_start=True, kl_reference="start"))
  (out,) = (run / "eval").iterdir()
  records = results.load_records(str(out))
  assert [r["step"] for r in records] == [0, 3]
  assert records[0]["checkpoint"] == str(run / "start")
  assert abs(records[0]["metrics"]["kl_k1"]) < 1e-4 and records[0]["metrics"]["kl_k3"] < 1e-6
  # The start evaluated alone, as a policy: the same samples and numbers.
  config = _configured(run, kl_reference="start")
  s = settings_lib.validate(config)
  task = runner.open_task(s)
  os.makedirs(tmp_path / "alone")
  evaluator = runner.open_evaluator(s, runner.locate(str(run)), task, str(tmp_path / "alone"))
  start = runner.load_policy(str(run / "start"), "start", evaluator.cfg, evaluator.mesh)
  alone = evaluator.evaluate_policy(0, start, str(run / "start"))
  assert alone["problems"]["num_correct"] == records[0]["problems"]["num_correct"]
  assert alone["problems"]["classes"] == records[0]["problems"]["classes"]


def test_a_run_without_its_start_is_one_line_exit_2_and_nothing_written(run_dir, tmp_path):
  run = _private_run(run_dir, tmp_path / "run")
  shutil.rmtree(run / "start")
  result = eval_run.run_eval(run, "--config.include_start=True")
  assert result.returncode == 2, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and "config.include_start" in lines[0] and "not a directory" in lines[0]
  assert not os.path.exists(run / "eval")
