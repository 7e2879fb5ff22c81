"""Studies: a pre-registration file plus a short declaration; the library does the rest.

A study is its registration (JSON, `ksjax.evaluation.preregistration`: seeds, arms, statements,
decision rule) and a `Study` (`declaration.py`): what one run is (`work`: the trainer and the eval
binary at checkpoints, `trainer_runs.py`; or the toy bandit, `bandit_runs.py`), each arm as its
overrides, the settings the registration fixes and how the report reads. `cli.main(study)` then
runs the missing runs on an engine (`engines.py`: a local pool of worker processes by default,
submitit for SLURM), each run trained, evaluated and published by `jobs.py` into the run store
(`store.py`, never overwriting a published run), then collects and pairs the published runs
(`analysis.py`), judges them against the registration (`verdicts.py`; no verdict while a
registered run is missing) and writes the tables, figures and README (`report.py`). Beside
them: the budget from shortened runs (`budget.py`) and the carry of unpublished runs' records to
the next machine (`carry.py`). docs/usage.md, "Studies", shows the commands.

Two real-model studies predate the run store, and their committed records are in the layout they
were made in: runs trained and evaluated by subprocesses in a runs directory and published to
`<out>/<run>/` (`runs_dir.py`). Their declarations use adapters of the same ideas for that layout:
`registered.py` (a registered study with matched-steps and CPU-budget arms and two evaluations
per run: experiments/decisive_study.py; its carry and budget: `carry_runs.py`, `budget_runs.py`)
and `equal_cpu.py` (an unregistered study at one CPU budget: experiments/real_model_study.py).

Nothing below this package imports it: it sits above the trainer and the eval binary.
"""

from ksjax.studies.declaration import Report, Study, StudyError

__all__ = ["Report", "Study", "StudyError"]
