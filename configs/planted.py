"""The planted task: the tiny Llama trained toward an optimum known in closed form.

Run: python -m ksjax.main --config=configs/planted.py:<objective>
  <objective>: mean | pass_at_k | biased_pass_at_k | majority_vote | maxrl (OBJECTIVES below;
  pass_at_k without one), or any --config.aggregator / --config.baseline / --config.k_mixture.

Instances of one prompt that are right with A 60% of the time and with B 40%
(ksjax/tasks/planted.py), a supervised warm-up that starts the policy at q_A = 0.2, then k = 4
samples per instance. Each objective's optimum and its value are derived in docs/objectives.md
("A planted optimum"); experiments/planted.py measures the policy exactly along training
(`ksjax.evaluation.planted`) and tests/trainer/test_planted.py checks that every objective gets
within a tolerance of its own optimum.

Why these settings. A completion is one token (max_new_tokens = 1), so the probability of each
answer read from the model is exactly the probability of being graded that answer. batch_prompts
is four times the training split (5 instances), so every step grades each instance four times and
the labels' frequencies hold exactly within a step. Micro-batches of 16 rows with a 16-row
smallest bucket bound the sparse update to few programs. The learning rate was chosen on
training trajectories (every objective's distance to its own optimum, measured every 5 steps over
100, two seeds): at 2e-3 and 3e-3 Adam overshoots early and some runs put nearly all mass on
the end token (an empty completion, wrong) for 10 to 20 steps before coming back.
"""

from ksjax.run import config as run_config

# Each objective's estimator: the config fields that differ from pass_at_k's.
OBJECTIVES = {
    "mean": {"aggregator": "mean"},
    "pass_at_k": {},
    "biased_pass_at_k": {"baseline": "loo_demeaned"},  # the paper's de-meaned leave-one-out
    "majority_vote": {"aggregator": "majority_vote"},
    "maxrl": {"k_mixture": "maxrl"},  # sum_{j<=k} (1/j) pass@j
}


def get_config(objective: str = "pass_at_k"):
  if objective not in OBJECTIVES:
    raise ValueError(f"configs/planted.py:{objective} is not accepted; expected one of "
                     f"{', '.join(OBJECTIVES)}")
  c = run_config.base_config()
  c.task = "planted"
  c.workdir = f"runs/planted_{objective}"
  c.aggregator = "pass_at_k"
  c.baseline = "loo"
  c.k = 4
  c.max_new_tokens = 1  # a letter, or anything else (no answer)
  c.model.tie_embeddings = False
  c.sft_warmup.steps = 60
  c.sft_warmup.batch_size = 50
  c.sft_warmup.learning_rate = 3e-3
  c.sft_warmup.lr_warmup_steps = 10
  c.batch_prompts = 20
  c.micro_batch_size = 16
  c.sparse_min_rows = 16
  c.learning_rate = 1e-3
  c.lr_warmup_steps = 5
  c.num_steps = 100
  c.checkpoint_every = 25
  c.kl_every = 10
  c.eval.num_samples = 16
  c.eval.ks = (1, 4, 16)
  for field, value in OBJECTIVES[objective].items():
    c[field] = value
  return c
