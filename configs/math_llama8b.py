"""The paper's MATH run: Llama 3.1 8B, B = 64 prompts, k = 4, temperature 1, top-p 1 (appendix A).

For accelerators. Needs the model and the dataset on local disk:
  python -m ksjax.tasks.data --dataset=math --manual_dir=<MATH> --data_dir=<DATA>
  python -m ksjax.main --config=configs/math_llama8b.py --config.init_hf=<Llama-3.1-8B dir> \
      --config.data.data_dir=<DATA>
The paper warms up with supervised fine-tuning on MATH's training solutions; it does not give its
settings, so the ones below are a starting point.
"""

from ksjax.run import config as run_config


def get_config():
  config = run_config.accelerator_config(task="math", preset="llama3.1-8b", k=4, mesh=(1, -1, 1),
                                       max_new_tokens=1024, eval_top_p=1.0)
  config.aggregator = "pass_at_k"
  config.baseline = "loo"
  config.num_steps = 2000
  config.sft_warmup.steps = 250  # about two epochs of MATH's 7,500 solutions
  config.sft_warmup.batch_size = 64
  config.sft_warmup.learning_rate = 1e-6
  config.sft_warmup.lr_warmup_steps = 20
  return config
