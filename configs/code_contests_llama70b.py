"""The paper's CodeContests run: Llama 3.1 70B Instruct, k = 8, learning rate 2e-7, 50 warm-up
steps, weight decay 0.1, 8k steps; evaluation at top-p 0.95 (appendix A).

For accelerators. Needs the model and the dataset on local disk:
  python -m ksjax.tasks.data --dataset=code_contests --manual_dir=<CC> --data_dir=<DATA>
  python -m ksjax.main --config=configs/code_contests_llama70b.py \
      --config.init_hf=<Llama-3.1-70B-Instruct dir> --config.data.data_dir=<DATA>
"""

from ksjax.run import config as run_config


def get_config():
  return run_config.code_contests_config("llama3.1-70b", tensor=8)
