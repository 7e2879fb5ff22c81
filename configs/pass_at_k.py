"""pass@k policy gradient, unbiased leave-one-out estimator (the paper's eq. 2): the default run.

Run: python -m ksjax.main --config=configs/pass_at_k.py [--config.field=value ...]

The embedded synthetic task and a tiny Llama on CPU: a supervised warm-up on reference
solutions, pass@k training, and a held-out evaluation at the warmed-up start and at the end.
Every field, its default and meaning: `python -m ksjax.run.config` (declared in ksjax/run/spec.py).
"""

from ksjax.run import config as run_config


def get_config():
  config = run_config.embedded_task_config()
  config.workdir = "runs/pass_at_k"
  config.aggregator = "pass_at_k"
  config.baseline = "loo"
  return config
