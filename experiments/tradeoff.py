"""The embedded task's trade-off study: every objective from one start, matched steps, paired seeds.

  python experiments/tradeoff.py                     # the pre-registered study (results/tradeoff/)
  python experiments/tradeoff.py --seeds=0,1 --out=/tmp/tradeoff2     # exploratory
  python experiments/tradeoff.py --engine=slurm --slurm_partition=cpu  # the runs as SLURM jobs

The registration (`experiments/preregistration/embedded_tradeoff.json`, committed before the first
run) fixes the question, seeds, arms, design, statements and decision rule; this file declares
the runs and the report, and `ksjax.studies` does the rest (docs/usage.md, "Studies"): one
supervised warm-up of the tiny Llama on the embedded task is the common start and KL reference;
each arm x seed trains `steps` RL steps from it (matched steps: 64 completions a step), every
checkpoint is evaluated by the eval binary on the held-out split (pass@k, maj@k per level, the KL
to the start); the report judges every statement paired over seeds. With every run published
(as committed) it trains nothing and regenerates the report byte for byte.
"""

import os
import sys

from ksjax import studies
from ksjax.studies import cli
from ksjax.studies.trainer_runs import TrainerRuns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KS = (1, 2, 4, 8, 16, 32, 64)
# The study's settings as summary.json records them (the registration's design fixes
# REGISTERED); `workers`, `worker` and `quick` are how the published study's runner was invoked.
SETTINGS = {
    "algorithms": ["pg"], "checkpoint_every": 50, "k": 4, "kl_window": 10,
    "eval": {"batch_prompts": 8, "kl_samples": 16, "ks": list(KS), "num_samples": 64,
             "test_per_level": 100},
    "learning_rate": 1e-4, "levels": [2, 3], "modulus": 50,
    "out": "experiments/results/tradeoff",
    "preregistration": "experiments/preregistration/embedded_tradeoff.json", "quick": False,
    "seeds": list(range(8)), "steps": 200, "variants": ["mean", "pass_at_k", "biased_pass_at_k"],
    "warmup_steps": 400, "worker": -1, "workers": 2}
REGISTERED = ("seeds", "variants", "algorithms", "levels", "warmup_steps", "modulus", "k", "steps",
              "checkpoint_every", "learning_rate", "eval.test_per_level", "eval.num_samples",
              "eval.ks", "eval.kl_samples")
S = SETTINGS
LABELS = {"mean": "mean", "pass_at_k": "pass@k", "biased_pass_at_k": "biased pass@k"}

STUDY = studies.Study(
    name="tradeoff", root=ROOT, registration=S["preregistration"], out=S["out"],
    command="python experiments/tradeoff.py", seeds=tuple(S["seeds"]), settings=SETTINGS,
    registered_fields=REGISTERED, prefix="pg_", statement_fields={"algorithm": "pg"},
    arms={arm: {"config": f"configs/{arm}.py"} for arm in S["variants"]},
    work=TrainerRuns(
        root=ROOT,
        # The sparse-signal regime chosen on training problems (the registration's "regime"):
        # levels 2 and 3, answers modulo 50 (solutions up to 49 characters and the EOS).
        common={"synthetic.levels": (2, 3), "synthetic.modulus": 50, "max_new_tokens": 50,
                "synthetic.test_per_level": 100, "learning_rate": 1e-4, "progress_bar": False,
                "eval.at_start": False, "eval.at_end": False},
        start={"config": "configs/pass_at_k.py", "sft_warmup.steps": 400, "num_steps": 0,
               "sft_warmup.target_pass_at_1": 0.0},  # the registered fixed-step warm-up
        run={"k": 4, "sft_warmup.steps": 0, "num_steps": 200, "checkpoint_every": 50,
             "keep_checkpoints": 5},
        evaluation={"steps": "all", "num_samples": 64, "ks": KS, "batch_prompts": 8,
                    "breakdown": ("level",), "plots": False, "kl_samples": 16}),
    report=studies.Report(
        title="Trade-off study: results",
        setup=("Setup: embedded task levels (2, 3), modulus 50, 100 held-out problems per level, "
               "tiny Llama; one supervised warm-up of 400 steps is the start of every run; 200 RL "
               "steps per run for every arm (matched steps; 64 completions a step, learning rate "
               "0.0001, k = 4); seeds (0, 1, 2, 3, 4, 5, 6, 7), paired: every arm of a seed shares "
               "its start, data order and machine; every checkpoint (50 steps apart) evaluated "
               "with 64 samples per problem at temperature 1."),
        columns=("pass@1", "pass@4", "pass@64", "maj@4", "level3/pass@1", "level3/pass@8", "kl"),
        label_columns=("method", "variant"), start_label=("start", "(warm-up only)"),
        labels={arm: ("policy gradient", label) for arm, label in LABELS.items()},
        figure_metrics=("pass@1", "pass@4", "pass@64", "maj@4"), figure_prefix="PG",
        ks_title="policy gradient",
        table_note=("KL: the eval binary's per-completion KL(policy || start) (k3) on the held-out "
                    "samples (the first 16 of each problem)."),
        files_note=("Figures: `metrics_vs_step.png`, `metrics_vs_kl.png`, `pass_at_k_vs_k.png`; "
                    "every number: `summary.json`; per-checkpoint records with per-problem "
                    "counts: `runs/<run>/eval/`.")))

if __name__ == "__main__":
  cli.main(STUDY, __file__, sys.argv[1:])
