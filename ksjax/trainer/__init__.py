"""The online trainer for k-sample objectives (the paper's Algorithm 1) on language models.

`run(config)` is the entry point (`python -m ksjax.main --config=configs/pass_at_k.py`). What a run
is (its typed spec, run directory, checkpoints, policy, task and scoring) is the run layer,
`ksjax.run`, which the eval binary shares. The trainer's pieces, one concept per file: rollout
(a step's completions laid out for the update); draw (every step's rounds of sampling and the
groups its update keeps: dynamic sampling); async_rollouts (rollouts sampled ahead on a worker
thread); losses (pure token-level losses); batch (the
micro-batches the loss reads); sparse (dropping zero-advantage completions); update (the jitted
optimizer step, `build_updater`); learner (a rollout's optimizer steps); warmup (supervised
warm-up through the same Updater); held_out (the start and end evaluation table); memory_plan
(what each device must hold, before allocating); metrics (TensorBoard, JSONL, progress bar);
loop (the run).
"""



def run(config) -> None:
  """`ksjax.trainer.loop.run`, imported on first use: `ksjax.main` answers --help and bad
  configs without loading jax, flax and TensorBoard."""
  from ksjax.trainer import loop  # pylint: disable=g-import-not-at-top
  loop.run(config)


__all__ = ["run"]
