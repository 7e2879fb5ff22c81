"""The online trainer for k-sample objectives (the paper's Algorithm 1) on language models.

`run(config)` is the entry point (`python -m ksjax.main --config=configs/pass_at_k.py`). The pieces,
one concept per file: defaults (every config field) and config (their validation); tasks (the task
and the prompt stream); rollout (sampling, scoring, advantages); losses (pure token-level losses);
sparse (dropping zero-advantage completions); update (the jitted optimizer step); learner (a
rollout's optimizer steps); warmup (supervised warm-up); evaluation (pass@k, maj@k);
checkpointing (Orbax); metrics (TensorBoard, JSONL, progress bar); loop (the run).
"""



def run(config) -> None:
  """`ksjax.trainer.loop.run`, imported on first use: the configs import
  `ksjax.trainer.defaults`, which must not load jax, flax and TensorBoard with it."""
  from ksjax.trainer import loop  # pylint: disable=g-import-not-at-top
  loop.run(config)


__all__ = ["run"]
