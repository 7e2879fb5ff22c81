"""A toy study, the example of a study that is nothing but its registration and this declaration.

  python experiments/toy_study.py     # seconds, into runs/toy_study/; on a cluster: --engine=slurm

Two arms (mean-reward and pass@4 training) x three seeds on the softmax bandit
(`ksjax.studies.bandit_runs`), registered in `experiments/preregistration/toy_bandit.json`;
`ksjax.studies` runs, publishes, pairs, judges and reports it (docs/usage.md, "Studies").
"""

import os
import sys

from ksjax import studies
from ksjax.studies import cli
from ksjax.studies.bandit_runs import BanditRuns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STUDY = studies.Study(
    name="toy_bandit", root=ROOT, registration="experiments/preregistration/toy_bandit.json",
    out="runs/toy_study", command="python experiments/toy_study.py",
    seeds=(0, 1, 2), workers=2,
    settings={"steps": 40, "checkpoint_every": 10}, registered_fields=("steps", "checkpoint_every"),
    arms={"mean": {"aggregator": "mean", "baseline": "loo"},
          "pass_at_k": {"aggregator": "pass_at_k", "baseline": "loo"}},
    work=BanditRuns(defaults={"k": 4, "n": 4, "learning_rate": 1.0, "num_actions": 20,
                              "groups_per_step": 4, "steps": 40, "checkpoint_every": 10,
                              "ks": (1, 2, 4)}),
    report=studies.Report(
        title="Toy bandit study: results",
        setup="Setup: 20-armed softmax bandits (rewards N(0, 1), one per seed), 40 updates per "
              "run from the uniform policy, exact pass@k every 10 updates.",
        columns=("pass@1", "pass@4", "kl"), figure_metrics=("pass@1", "pass@4"),
        ks_title="bandit"))

if __name__ == "__main__":
  cli.main(STUDY, __file__, sys.argv[1:])
