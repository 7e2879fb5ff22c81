"""The run layer: what a training run is, shared by the trainer and the eval binary.

Below it: the objectives, the model, the sampler and the tasks. Above it, as siblings that never
import each other: `ksjax.trainer` (which makes runs) and `ksjax.evaluation` (which reads them).

  spec.py         typed, frozen specs of a run, which declare every config field once; read
                  from a config by `from_config` alone
  config.py       the trainer config (an ml_collections ConfigDict) derived from them, and presets
  directory.py    a run directory: every path and checkpoint item name
  checkpoints.py  its step checkpoints: written by the trainer, read by anyone
  policy.py       the policy a spec describes: shapes and starting weights
  tasks.py        the task, its tokenizer and the training prompt stream
  scoring.py      sample -> decode -> score, and the per-problem summary (pass@k, maj@k)

Importing the package loads nothing: configs import `ksjax.run.config` without jax.
"""
