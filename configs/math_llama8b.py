"""The paper's MATH run: Llama 3.1 8B, B = 64 prompts, k = 4, temperature 1, top-p 1 (appendix A).

For accelerators. Needs the model and the dataset on local disk:
  python -m ksjax.tasks.data --dataset=math --manual_dir=<MATH> --data_dir=<DATA>
  python -m ksjax.main --config=configs/math_llama8b.py --config.init_hf=<Llama-3.1-8B dir> \
      --config.data.data_dir=<DATA>
The paper warms up with supervised fine-tuning on MATH's training solutions; it does not give its
settings, so the ones in `ksjax.run.config.math_config` are a starting point.
"""

from ksjax.run import config as run_config


def get_config():
  return run_config.math_config("llama3.1-8b")
