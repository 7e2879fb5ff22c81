"""The eval binary's package: evaluation of a run's checkpoints apart from training
(`python -m ksjax.eval`).

"Evaluation" in ksjax means this: sampling n completions per held-out problem from a policy and
estimating pass@k, maj@k (by default along the ladder k = 1, 2, 4, ..., n) and the mean reward,
with how diverse each problem's final answers are (`ksjax.run.scoring`, with the estimators of
`ksjax.objectives.estimates`). The trainer's own evaluation at the start and the end of a run
(`ksjax.trainer.held_out`) runs the same function.

Files, one concept each: settings.py (the eval config's fields, declared once, and their
validation), results.py (a checkpoint's record, summaries and averages, atomic JSON/CSV files),
plots.py (the figures), runner.py (the binary's job: checkpoints -> samples -> scores -> files;
watch mode), batched.py (its throughput: chunks merged into large sampler calls, the KL's
reference forward over each completion's length). The checkpoints themselves
are read through `ksjax.run.checkpoints`.
"""
