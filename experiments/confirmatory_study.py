"""The confirmatory study (#65): pass@8 against mean training on SmolLM2-135M-Instruct, on
reasoning-gym tasks nobody here wrote, at matched steps, pre-registered and powered to see a
held-out pass@8 difference of 0.03.

    python experiments/confirmatory_study.py            # runs what is missing, then reports;
                                                        # trains nothing once every run is published
    python experiments/confirmatory_study.py [--partial | --status | --quick] [--seeds=...]
    python experiments/confirmatory_study.py --carry=save|restore|seeds|commit
    python experiments/confirmatory_study.py --budget=3 [--arms=pass_at_k,mean]

The design is the pre-registration's (`experiments/preregistration/smollm2_confirmatory.json`,
committed before the first run: the study refuses to start while it is not): the two arms and
the objective fields each sets on `configs/smollm2_reasoning_gym.py`, the fields every run shares
(k = 8, n), the seeds, the matched steps and checkpoints, the two evaluations ("eval": a subset of
the held-out problems with the KL to the start at each checkpoint; "ladder": every held-out
problem with 64 samples at the last step), the statements and the decision rule. This file
declares only what the registration does not; `ksjax.studies.registered` does the rest, as for
the decisive study (`experiments/decisive_study.py` says how: runs seed by seed, resumed after a
stop, published with `published.json` last, paired by seed within one machine, judged as
registered, no verdict before every run is published).
"""

import os
import sys

from ksjax.studies import registered

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STUDY = registered.Spec(
    name="confirmatory_study", root=ROOT,
    registration=os.path.join("experiments", "preregistration", "smollm2_confirmatory.json"),
    out=os.path.join("experiments", "results", "confirmatory_study"), runs="confirmatory_study",
    title=("The confirmatory study: pass@8 against mean training on SmolLM2-135M-Instruct, "
           "reasoning-gym tasks"),
    command="python experiments/confirmatory_study.py",
    objective_fields=("aggregator", "baseline"),
    # --quick: registered.QUICK with k = 2 from n = 4, and the eval on a subset, as registered.
    quick={**registered.QUICK, "run_fields": {"k": 2, "n": 4},
           "eval": {**registered.QUICK["eval"], "test_per_level": 1},
           "ladder": {**registered.QUICK["ladder"], "test_per_level": 2}})

if __name__ == "__main__":
  registered.main(STUDY, __doc__, sys.argv[1:])
