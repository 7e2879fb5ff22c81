"""configs/math_llama8b.py with low-rank adapters (LoRA) in place of full fine-tuning: rank 16 on
every weight matrix of every decoder layer; the bfloat16 base stays frozen.

Plain LoRA, not QLoRA. On the config's 8-device mesh (1 x 8 x 1) the memory plan
(`python benchmarks/memory_plan.py --lora --devices=8`, XLA:CPU) gives per device: full
fine-tuning 7.48 GiB of state, peak 24.88 GiB; LoRA 2.30 GiB (AdamW and the reference are the
adapters'), peak 21.57 GiB; QLoRA int4 1.23 GiB, peak 19.62 GiB. The peak is the sampling
phase's either way (its KV cache and prefill), and LoRA and QLoRA fit the same devices (32 GB
and up, not 16 GB): an int4 base would buy no device size here, while it would start RL (and
the reference policy) from a quantized approximation of the model the paper trains and
dequantize every weight in every product. QLoRA is for where the base itself is the problem
(the 70B model on 8 devices).
Commands as in configs/math_llama8b.py; what LoRA changes in a run (what trains, the reference,
the checkpoints): `ksjax.model.lora`.
"""

from ksjax.run import config as run_config


def get_config():
  config = run_config.math_config("llama3.1-8b")
  config.workdir = "runs/math_llama3.1-8b_lora"
  # Rank 16 on attention and MLP alike, alpha fixed at 32 (scale 2): as in
  # configs/smollm2_pass_at_k_lora.py, which says why.
  config.lora.rank = 16
  config.lora.targets = "all"
  config.lora.alpha = 32.0
  # Ten times math_config's full fine-tuning rates (2e-7 for RL, 1e-6 for the warm-up, which
  # trains the adapters too): the adapters' best rate is about 10x full fine-tuning's (Schulman
  # et al. 2025, "LoRA Without Regret"). Chosen before any run, not tuned on results.
  config.learning_rate = 2e-6
  config.sft_warmup.learning_rate = 1e-5
  return config
