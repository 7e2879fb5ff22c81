"""experiments/tradeoff.py's declaration at the smoke-run sizes (a 2-step warm-up, 4 RL steps, 2
held-out problems per level, 4 samples): the trainer and the eval binary through the study library
in seconds (tests/studies/test_trainer_runs.py)."""

import dataclasses
import os

from ksjax.studies import declaration
from ksjax.studies.trainer_runs import TrainerRuns

_FULL = declaration.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                      os.pardir, "experiments", "tradeoff.py"))
_WORK = _FULL.work
STUDY = dataclasses.replace(
    _FULL,
    work=TrainerRuns(
        root=_WORK.root, common={**_WORK.common, "synthetic.test_per_level": 2},
        start={**_WORK.start, "sft_warmup.steps": 2},
        run={**_WORK.run, "num_steps": 4, "checkpoint_every": 2, "keep_checkpoints": 3},
        evaluation={**_WORK.evaluation, "num_samples": 4, "ks": (1, 2, 4), "kl_samples": 2,
                    "batch_prompts": 2}),
    report=dataclasses.replace(_FULL.report, columns=("pass@1", "pass@4", "maj@4", "kl"),
                               figure_metrics=("pass@1", "pass@4")))
