"""The decisive real-model study: pass@k against mean training on SmolLM2-135M-Instruct at
matched steps, pre-registered and powered to see a held-out pass@4 difference of 0.06 (#31).

    python experiments/decisive_study.py            # regenerates the report; trains nothing
                                                    # while every run is published
    python experiments/decisive_study.py [--out=DIR] [--runs_dir=DIR] [--seeds=0,1,...]
        [--arms=mean,pass_at_k,...] [--partial | --status | --quick]
    python experiments/decisive_study.py --carry=save|restore|seeds|commit [--carry_dir=DIR]
    python experiments/decisive_study.py --budget=3 [--arms=pass_at_k,mean,...]

The design is the pre-registration's (`experiments/preregistration/smollm2_decisive.json`,
committed before the first run: the study refuses to start while it is not): the arms, each with
the objective fields it sets on `configs/smollm2_pass_at_k.py`, its seeds and its stopping rule
(matched steps, or the equal-CPU arms' CPU-minutes); the checkpointed steps; the two evaluations
("eval": every test problem and the KL to the start at each checkpoint; "ladder": the large-k
ladder at the last step); the statements and the decision rule. This file declares what the
registration does not (the report's title, the command, the objective fields an arm may set,
the --quick sizes); `ksjax.studies.registered` does the rest: runs seed by seed, each trained,
evaluated per checkpoint, published to `<out>/<run>/` with `published.json` last, resumed after
a stop; the report judges every statement as registered, paired over seeds within one machine
(a seed whose two runs touched different machines is left out, and named), S2 at the held-out KL
both runs of each seed reach; exploratory where the registration does not precede every run's
commit or a restart superseded a run's commit. `--partial` is an interim report of the whole
seeds so far (no verdict), `--status` a table of the published runs, `--quick` the pipeline on
the embedded task's tiny model (never a verdict). `--carry` moves an unfinished run's records
to the next machine (`ksjax.studies.carry_runs`: save, restore, the seeds this machine may run,
commit the published runs); `--budget=STEPS` measures shortened runs here and projects the
registered design's CPU-hours (`ksjax.studies.budget_runs`; the registration's budget was
measured with the script this replaced, experiments/decisive_study_budget.py, with 3 steps).
"""

import os
import sys

from ksjax.studies import registered

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STUDY = registered.Spec(
    name="decisive_study", root=ROOT,
    registration=os.path.join("experiments", "preregistration", "smollm2_decisive.json"),
    out=os.path.join("experiments", "results", "decisive_study"), runs="decisive_study",
    title=("The decisive real-model study: pass@k against mean training on "
           "SmolLM2-135M-Instruct"),
    command="python experiments/decisive_study.py",
    # The only trainer fields an arm sets: everything else is the base config's or the study's.
    objective_fields=("aggregator", "baseline"),
    quick=registered.QUICK)  # --quick: the tiny model on the embedded task

if __name__ == "__main__":
  registered.main(STUDY, __doc__, sys.argv[1:])
