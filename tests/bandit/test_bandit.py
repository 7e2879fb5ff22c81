"""Tests of the bandit study: exact metrics by enumeration, estimator means against exact gradients,
the run's outputs and config errors, and the paper's qualitative statements on its Figure 1.

The statements are checked on the default config (configs/bandit.py: 200 bandits x 100 actions,
k = 4, lr = 1, 2000 steps), exactly the run behind the figure. Seeds share their bandit and sampling
keys across estimators, so every comparison is a paired difference over the 200 bandits, and a
direction counts as shown when the paired mean is more than 3 standard errors from zero.
"""

import itertools
import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import matplotlib.image
import numpy as np
import pytest

from ksjax.bandit import comparisons
from ksjax.bandit import exact
from ksjax.bandit import policy_gradient
from ksjax.bandit import study
from ksjax.bandit import variance
from ksjax.bandit.variants import Variant
from ksjax.config_validation import ConfigError

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "configs"))
import bandit as bandit_config  # pylint: disable=g-import-not-at-top,wrong-import-position

# A small bandit with tied rewards (actions 0 and 2; 3 and 5).
REWARDS_A = np.array([0.5, -1.0, 0.5, 2.0, 0.1, 2.0])
THETA_A = np.array([0.3, -0.2, 0.0, -0.5, 0.8, 0.1])


def _tuples(num_actions, m):
  """All m-tuples of actions [A^m, m] and their probabilities under softmax(THETA_A[:A])."""
  tuples = np.array(list(itertools.product(range(num_actions), repeat=m)))
  pi = np.exp(THETA_A[:num_actions]) / np.exp(THETA_A[:num_actions]).sum()
  return tuples, pi[tuples].prod(-1)


def _majority(rewards_m, actions_m):
  """Reference f for majority voting: the mean reward of the plurality actions."""
  values, counts = np.unique(actions_m, return_counts=True)
  return np.mean([rewards_m[list(actions_m).index(v)] for v in values[counts == counts.max()]])


def _softmax_f(rewards_m, beta):
  p = np.exp(beta * rewards_m - np.max(beta * rewards_m))
  return np.sum(p / p.sum() * rewards_m)


# ---------------------------------------------------------------------------------------------
# Exact quantities, by enumeration (float64).


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_expected_max_equals_enumeration_with_ties(m):
  tuples, prob = _tuples(6, m)
  expected = np.sum(prob * REWARDS_A[tuples].max(-1))
  with jax.enable_x64(True):
    got = exact.expected_max(jnp.asarray(THETA_A), jnp.asarray(REWARDS_A), m)
    grad = jax.grad(exact.expected_max)(jnp.asarray(THETA_A), jnp.asarray(REWARDS_A), m)
    # The same expectation written as a differentiable sum over tuples: gradients must agree too.
    by_tuples = lambda th: jnp.sum(
        jnp.prod(jax.nn.softmax(th)[tuples], -1) * REWARDS_A[tuples].max(-1))
    grad_by_tuples = jax.grad(by_tuples)(jnp.asarray(THETA_A))
  np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
  np.testing.assert_allclose(grad, grad_by_tuples, rtol=0, atol=1e-12)


def test_expected_reward_and_kl_match_definitions():
  pi = np.exp(THETA_A) / np.exp(THETA_A).sum()
  reference = np.array([1.0, 0.0, -1.0, 0.5, 0.0, 2.0])
  pi_ref = np.exp(reference) / np.exp(reference).sum()
  with jax.enable_x64(True):
    mean = exact.expected_reward(jnp.asarray(THETA_A), jnp.asarray(REWARDS_A))
    kl = exact.kl_divergence(jnp.asarray(THETA_A), jnp.asarray(reference))
  np.testing.assert_allclose(mean, pi @ REWARDS_A, atol=1e-12)
  np.testing.assert_allclose(kl, np.sum(pi * np.log(pi / pi_ref)), atol=1e-12)


@pytest.mark.parametrize("variant, paper_form", [
    (Variant("mean", "loo", k=4), lambda r: r.mean()),
    (Variant("pass_at_k", "loo", k=4), lambda r: r.max()),
    # The paper's biased objective: ((k-1)/k) r_(k) + (1/k) r_(k-1).
    (Variant("pass_at_k", "loo_demeaned", k=4),
     lambda r: 0.75 * np.sort(r)[-1] + 0.25 * np.sort(r)[-2]),
    # The appendix's leave-p-out objective: (1/C(k,p)) sum_{|s|=p} max_{i not in s} r_i.
    (Variant("pass_at_k", "leave_p_out", k=4, p=2),
     lambda r: np.mean([np.delete(r, s).max() for s in itertools.combinations(range(4), 2)])),
    (Variant("softmax", "loo", k=3, beta=0.7), lambda r: _softmax_f(r, 0.7)),
    (Variant("softmax", "loo_demeaned", k=4, beta=2.0),
     lambda r: np.mean([_softmax_f(np.delete(r, i), 2.0) for i in range(4)])),
], ids=lambda x: x.key if isinstance(x, Variant) else "")
def test_target_objective_equals_paper_form_by_enumeration(variant, paper_form):
  tuples, prob = _tuples(6, variant.k)
  expected = sum(pr * paper_form(REWARDS_A[t]) for t, pr in zip(tuples, prob))
  with jax.enable_x64(True):
    got = exact.target_objective(jnp.asarray(THETA_A), jnp.asarray(REWARDS_A), variant)
  np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("baseline", ["loo", "loo_demeaned"])
def test_majority_vote_target_equals_enumeration(baseline):
  variant = Variant("majority_vote", baseline, k=4)
  tuples, prob = _tuples(6, 4)
  if baseline == "loo":
    values = [_majority(REWARDS_A[t], t) for t in tuples]
  else:  # E[(1/k) sum_i f(y_-i)]
    values = [np.mean([_majority(REWARDS_A[np.delete(t, i)], np.delete(t, i)) for i in range(4)])
              for t in tuples]
  with jax.enable_x64(True):
    got = exact.target_objective(jnp.asarray(THETA_A), jnp.asarray(REWARDS_A), variant)
  np.testing.assert_allclose(got, np.dot(prob, values), rtol=0, atol=1e-12)


def test_target_objective_refuses_too_many_multisets():
  variant = Variant("softmax", "loo", k=8)
  assert not exact.has_exact_target(variant, 100)
  with pytest.raises(ValueError, match="multisets"):
    exact.target_objective(jnp.zeros(100), jnp.zeros(100), variant)


# ---------------------------------------------------------------------------------------------
# The estimator pipeline: exact expectation, then Monte Carlo.


def test_group_gradients_equal_autodiff_of_weighted_log_probs():
  key_actions, key_weights = jax.random.split(jax.random.key(0))
  actions_gn = jax.random.randint(key_actions, (5, 7), 0, 6)  # repeats within groups
  weights_gn = jax.random.normal(key_weights, (5, 7))
  theta = jnp.asarray(THETA_A, jnp.float32)
  got = policy_gradient.group_gradients(theta, actions_gn, weights_gn)
  surrogate = lambda th, a, w: jnp.sum(w * jax.nn.log_softmax(th)[a])
  expected = jax.vmap(jax.grad(surrogate), in_axes=(None, 0, 0))(theta, actions_gn, weights_gn)
  np.testing.assert_allclose(got, expected, atol=1e-6)


def test_sampler_frequencies_match_policy():
  theta = jnp.asarray(np.append(THETA_A, -1e9), jnp.float32)  # last action has probability 0
  actions = np.asarray(policy_gradient.sample_groups(jax.random.key(1), theta, 50_000, 4)).ravel()
  counts = np.bincount(actions, minlength=7)
  pi = np.asarray(jax.nn.softmax(theta), np.float64)
  expected = pi * actions.size
  assert counts[6] == 0
  z = (counts[:6] - expected[:6]) / np.sqrt(expected[:6] * (1 - pi[:6]))
  assert np.max(np.abs(z)) < 4.5, z


@pytest.mark.parametrize("variant, n", [
    (Variant("mean", "loo", k=4), 4),
    (Variant("mean", "none", k=4), 4),
    (Variant("pass_at_k", "loo", k=4), 4),
    (Variant("pass_at_k", "loo_demeaned", k=4), 4),
    (Variant("pass_at_k", "leave_p_out", k=4, p=2), 4),
    (Variant("softmax", "loo", k=4, beta=0.7), 4),
    (Variant("majority_vote", "loo", k=4), 4),
    (Variant("majority_vote", "loo_demeaned", k=4), 4),
    (Variant("pass_at_k", "loo", k=3), 5),
    (Variant("majority_vote", "leave_p_out", k=3, p=1), 5),
], ids=lambda x: x.key if isinstance(x, Variant) else f"n={x}")
def test_expected_estimate_equals_exact_target_gradient(variant, n):
  """E[sum_i w_i grad log pi(y_i)] over all n-tuples equals grad J exactly (float64)."""
  num_actions = 4 if n == 5 else 6
  tuples, prob = _tuples(num_actions, n)
  with jax.enable_x64(True):
    theta = jnp.asarray(THETA_A[:num_actions])
    rewards = jnp.asarray(REWARDS_A[:num_actions])
    actions = jnp.asarray(tuples)
    weights = policy_gradient.estimator_weights(rewards[actions], actions, variant)
    mean_estimate = jnp.asarray(prob) @ policy_gradient.group_gradients(theta, actions, weights)
    exact_grad = jax.grad(exact.target_objective)(theta, rewards, variant)
  np.testing.assert_allclose(mean_estimate, exact_grad, rtol=0, atol=1e-10)


def test_monte_carlo_mean_converges_to_exact_gradient():
  """The MC mean of 100k single-group estimates (float32) is within 4.5 standard errors of grad J
  in every coordinate, and the test has power: the biased estimator is > 10 standard errors away
  from the gradient of E[max of k], the objective it does not optimise."""
  rng = np.random.default_rng(0)
  theta = jnp.asarray(rng.normal(size=10) * 0.7, jnp.float32)
  rewards = jnp.asarray(rng.normal(size=10), jnp.float32)
  draws = 100_000

  def z_scores(variant, target_variant, key):
    grads = policy_gradient.gradient_estimates(key, theta, rewards, variant, draws, variant.k)
    exact_grad = jax.grad(exact.target_objective)(theta, rewards, target_variant)
    return (grads.mean(0) - exact_grad) / (grads.std(0) / math.sqrt(draws))

  variants = [Variant("mean", "loo"), Variant("pass_at_k", "loo"),
              Variant("pass_at_k", "loo_demeaned")]
  for i, variant in enumerate(variants):
    z = z_scores(variant, variant, jax.random.key(i))
    assert np.max(np.abs(z)) < 4.5, (variant.key, z)
  z_wrong = z_scores(variants[2], variants[1], jax.random.key(2))
  assert np.max(np.abs(z_wrong)) > 10, z_wrong


def test_gradient_error_matches_enumerated_mse_and_bias():
  """variance.gradient_error at the uniform policy against E||g - grad J||^2 and ||E g - grad J||^2
  computed over all 6^4 tuples: an unbiased estimator and a biased one (group_std scaling)."""
  num_draws = 40_000
  rewards = jnp.asarray(REWARDS_A, jnp.float32)
  tuples = jnp.asarray(list(itertools.product(range(6), repeat=4)))
  for variant, biased in ((Variant("pass_at_k", "loo"), False),
                          (Variant("pass_at_k", "loo", scale="group_std"), True)):
    exact_grad = variance.exact_gradient(rewards, variant)
    weights = policy_gradient.estimator_weights(rewards[tuples], tuples, variant)
    grads = policy_gradient.group_gradients(jnp.zeros(6), tuples, weights)  # uniform: equal probs
    exact_mse = float(jnp.mean(jnp.sum((grads - exact_grad) ** 2, -1)))
    exact_bias_sq = float(jnp.sum((grads.mean(0) - exact_grad) ** 2))
    err = variance.gradient_error(jax.random.key(3), rewards, exact_grad, variant=variant, n=4,
                                  num_draws=num_draws)
    assert abs(float(err.mse) - exact_mse) < 4 * float(err.mse_stderr), (variant, err, exact_mse)
    # Var(||mean g - grad J||^2) <= 4 b'Cov b / D + 2 tr(Cov^2) / D^2 <= 4 |b|^2 tr Cov / D
    # + 2 (tr Cov / D)^2, and tr Cov <= E||g - grad J||^2.
    trace_over_d = exact_mse / num_draws
    tolerance = 5 * math.sqrt(4 * exact_bias_sq * trace_over_d + 2 * trace_over_d**2)
    assert abs(float(err.bias_sq) - exact_bias_sq) < tolerance, (variant.key, err, exact_bias_sq)
    # The unbiased estimator's bias is 0 up to float rounding; the scaled one's is far outside the
    # tolerance an unbiased estimator gets, so the check above can tell them apart.
    zero_bias_tolerance = 5 * math.sqrt(2) * trace_over_d
    assert (exact_bias_sq > 10 * zero_bias_tolerance) if biased else (exact_bias_sq < 1e-10)


# ---------------------------------------------------------------------------------------------
# The run: outputs and config errors.


def _small_config(workdir):
  config = bandit_config.get_config()
  config.workdir = str(workdir)
  config.num_actions, config.num_seeds, config.num_steps, config.variance_draws = 6, 3, 20, 200
  config.extra_variants = " majority_vote:loo_demeaned, "
  return config


def test_run_writes_csv_png_summary_and_config(tmp_path, capsys):
  workdir = tmp_path / "nested" / "run"
  config = _small_config(workdir)
  curves = study.run(config)

  keys = ["mean:loo", "pass_at_k:loo", "pass_at_k:loo_demeaned", "majority_vote:loo_demeaned"]
  assert list(curves) == keys
  assert sorted(os.listdir(workdir)) == ["config.json", "curves.csv", "curves.png", "summary.txt"]
  lines = (workdir / "curves.csv").read_text().splitlines()
  assert lines[0] == "step,variant,mean_reward,mean_reward_std,pass_at_k,pass_at_k_std,kl,kl_std"
  rows = [line.split(",") for line in lines[1:]]
  assert len(rows) == len(keys) * 21
  assert [r[1] for r in rows[::21]] == keys and [int(r[0]) for r in rows[:21]] == list(range(21))
  values = np.array([[float(x) for x in r[2:]] for r in rows])
  assert np.all(np.isfinite(values))
  np.testing.assert_allclose(values[:21, 4], curves["mean:loo"]["kl"].mean(0), rtol=1e-5, atol=1e-6)
  assert np.all(values[::21, 4:6] == 0)  # KL 0 at step 0 for every estimator
  image = matplotlib.image.imread(workdir / "curves.png")
  assert image.ndim == 3 and image.shape[1] > 2 * image.shape[0] > 600
  assert json.loads((workdir / "config.json").read_text()) == config.to_dict()
  printed = capsys.readouterr().out
  assert "E||g - grad J||^2" in printed and printed.count("majority_vote:loo_demeaned") >= 3
  assert (workdir / "summary.txt").read_text() in printed


@pytest.mark.parametrize("field, value, named", [
    ("task", "bandits", "config.task"),
    ("workdir", "", "config.workdir"),
    ("k", 1, "config.k"),
    ("n", 2, "config.n"),
    ("p", 4, "config.p"),
    ("beta", -1.0, "config.beta"),
    ("scale", "std", "config.scale"),
    ("aggregator", "max", "config.aggregator"),
    ("baseline", "rloo", "config.baseline"),
    ("num_seeds", 0, "config.num_seeds"),
    ("num_actions", 1, "config.num_actions"),
    ("learning_rate", 0.0, "config.learning_rate"),
    ("learning_rate", float("nan"), "config.learning_rate"),
    ("num_steps", 0, "config.num_steps"),
    ("variance_draws", 1, "config.variance_draws"),
    ("extra_variants", "pass_at_k", "config.extra_variants"),
    ("extra_variants", "softmax:loo:bogus", "config.extra_variants"),
    ("num_step", 10, "config.num_step"),  # not a field
])
def test_bad_field_raises_config_error_naming_it(tmp_path, field, value, named):
  config = _small_config(tmp_path / "out")
  config[field] = value
  with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
    study.parse_config(config)
  assert not (tmp_path / "out").exists()


def test_workdir_that_is_a_file_is_refused(tmp_path):
  (tmp_path / "file").write_text("x")
  with pytest.raises(ConfigError, match=r"config\.workdir"):
    study.parse_config(_small_config(tmp_path / "file"))


def test_cli_bad_combination_exits_2_with_one_line_and_writes_nothing(tmp_path):
  workdir = tmp_path / "out"
  result = subprocess.run(
      [sys.executable, "-m", "ksjax.main", "--config=configs/bandit.py",
       f"--config.workdir={workdir}", "--config.scale=group_std", "--config.baseline=none"],
      cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 2, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and "config.baseline='none'" in lines[0] and "group_std" in lines[0], lines
  assert not workdir.exists()


# ---------------------------------------------------------------------------------------------
# The paper's statements on Figure 1, on the default config.


# The default config's three variants over its seeds: a study (a minute of the suite), so `slow`.
paper_figure = pytest.mark.slow


@pytest.fixture(scope="module")
def figure_curves():
  settings = study.parse_config(bandit_config.get_config())
  rewards_sa, keys_s, _ = study.bandits(settings)
  curves = {v.key: study.train_variant(settings, v, rewards_sa, keys_s) for v in settings.variants}
  assert list(curves) == ["mean:loo", "pass_at_k:loo", "pass_at_k:loo_demeaned"]
  return settings, curves["mean:loo"], curves["pass_at_k:loo"], curves["pass_at_k:loo_demeaned"]


def _z(a_s, b_s):
  """Paired mean of a - b over seeds, in standard errors."""
  d = np.asarray(a_s, np.float64) - np.asarray(b_s, np.float64)
  assert not np.any(np.isnan(d)), "a run did not reach the KL budget"
  return d.mean() / (d.std(ddof=1) / math.sqrt(len(d)))


def _at_kl(curves, metric, budget):
  return comparisons.value_at_kl(curves["kl"], curves[metric], np.array([budget]))[:, 0]


@paper_figure
def test_paper_a_mean_pg_fastest_on_mean_reward_holds_only_mid_training(figure_curves):
  """Paper: mean PG "makes the fastest improvement on the mean performance" per step.

  Holds only in a window: at step 80 mean PG leads the unbiased pass@k PG (it is level with the
  biased one). At step 10 both pass@k variants lead, and at the end mean PG is last: with lr = 1 it
  collapses onto one action (KL = log 100) that is often not the best, while the pass@k estimators
  keep the policy spread and keep finding better actions.
  """
  settings, mean_pg, passk_pg, biased = figure_curves
  r = lambda c, t: c["mean_reward"][:, t]
  assert _z(r(mean_pg, 80), r(passk_pg, 80)) > 3
  assert _z(r(passk_pg, 10), r(mean_pg, 10)) > 3 and _z(r(biased, 10), r(mean_pg, 10)) > 3
  last = settings.num_steps
  assert _z(r(passk_pg, last), r(mean_pg, last)) > 3 and _z(r(biased, last), r(mean_pg, last)) > 3
  assert mean_pg["kl"][:, -1].mean() > math.log(settings.num_actions) - 0.01
  assert passk_pg["kl"][:, -1].mean() < math.log(settings.num_actions) - 0.3


@paper_figure
@pytest.mark.parametrize("metric", ["mean_reward", "pass_at_k"])
def test_paper_b_kl_efficiency_holds_only_at_large_kl(figure_curves, metric):
  """Paper: the pass@k estimators are "more KL-efficient" (mean reward vs KL; here also pass@k vs
  KL). At a matched budget KL = 3.5 both pass@k variants beat mean PG on both metrics. At KL = 0.5
  mean PG is ahead of the unbiased pass@k PG on both (and of the biased one on mean reward): near
  the reference, mean PG's lower-variance steps buy more of either metric per unit of KL."""
  _, mean_pg, passk_pg, biased = figure_curves
  at = lambda c, b: _at_kl(c, metric, b)
  assert _z(at(passk_pg, 3.5), at(mean_pg, 3.5)) > 3 and _z(at(biased, 3.5), at(mean_pg, 3.5)) > 3
  assert _z(at(mean_pg, 0.5), at(passk_pg, 0.5)) > 3
  if metric == "mean_reward":
    assert _z(at(mean_pg, 0.5), at(biased, 0.5)) > 3


@paper_figure
def test_paper_c_biased_variant_sits_between(figure_curves):
  """The biased pass@k estimator lies between mean PG and pass@k PG (seed means) at every read-out
  below, except mean reward at the end of training, where it is significantly the highest."""
  settings, mean_pg, passk_pg, biased = figure_curves
  last = settings.num_steps
  readouts = [(lambda c, t=t, m=m: c[m][:, t]) for m, t in
              [("mean_reward", 10), ("mean_reward", 80), ("pass_at_k", 10), ("pass_at_k", last)]]
  readouts += [(lambda c, b=b, m=m: _at_kl(c, m, b)) for m in ("mean_reward", "pass_at_k")
               for b in (0.5, 3.5)]
  for read in readouts:
    m, p, b = read(mean_pg).mean(), read(passk_pg).mean(), read(biased).mean()
    assert min(m, p) < b < max(m, p), (m, p, b)
  final = lambda c: c["mean_reward"][:, last]
  assert _z(final(biased), final(passk_pg)) > 3 and _z(final(biased), final(mean_pg)) > 3


@paper_figure
def test_paper_d_pass_at_k_estimators_improve_pass_at_k_faster(figure_curves):
  """Paper: the k-sample estimators improve pass@k "significantly faster". Both lead mean PG on
  pass@k at every step, by more than 3 standard errors at steps 10 and at the end."""
  settings, mean_pg, passk_pg, biased = figure_curves
  for variant in (passk_pg, biased):
    lead_t = (variant["pass_at_k"] - mean_pg["pass_at_k"]).mean(0)
    assert np.all(lead_t[1:] > 0)
    for t in (10, settings.num_steps):
      assert _z(variant["pass_at_k"][:, t], mean_pg["pass_at_k"][:, t]) > 3
