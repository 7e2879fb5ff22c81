"""The regime map (issue #65, exploratory): when does training for pass@k pay on the embedded task?

  python experiments/regime_map.py --report          # the report from the published runs
  python experiments/regime_map.py                   # run what is missing (hours), then report
  python experiments/regime_map.py --budget=20       # measure, print the projected CPU-hours

In every cell, pass@k training (unbiased leave-one-out, the paper's eq. 2; PKPO's U-statistic
when n > k) minus mean training (RLOO) at matched steps, paired by seed, at held-out pass@k (the
cell's training k), pass@1 (the price), pass@64 (test-time k far above the training k) and the
KL to the start, at every checkpoint (250 steps apart, to 2,000), and in the training log's KL
along training (the KL-per-step sign). One-factor-at-a-time around a centre cell (k = 4, n = 4,
level 2, 16 prompts a step, Adam at the trade-off study's 1e-4): k in {2, 4, 8, 16} with n = k and
n = 2k, difficulty by level (1 to 4) from one shared start, 64 prompts a step, Adam at 2.5e-5
and plain SGD at 0.05 and 0.2. Registered as exploratory, with its design, pilots and budget,
in `experiments/preregistration/embedded_regime_map.json` before its first run; `ksjax.studies`
(`cells.py`, `maps.py`) runs, mirrors and reports it. No verdict: numbers with 95% intervals.

The runner works in a clone at the map's fixed commit and publishes into the main checkout,
committing each finished run there (only its paths). To start it, or to resume it after any
stop, from the main checkout's root (the clone: any directory outside the checkout):

  experiments/regime_map_runner.sh <clone directory> [commit]

(the commit defaults to the one the published runs were made at, which
experiments/results/regime_map/provenance.json records). A run stopped mid-way resumes from its
newest checkpoint in the clone; a run published in the main checkout is copied back and never
run again, so a fresh clone loses only unfinished runs. `--status` lists the runs; `--report`
regenerates the report from the published ones and trains nothing.
"""

import os
import sys

from ksjax.studies import cells
from ksjax.studies import maps
from ksjax.studies.trainer_runs import TrainerRuns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KS = (1, 2, 4, 8, 16, 32, 64)
STEPS, EVERY = 2000, 250
SGD_RATES = (0.05, 0.2)  # from the pilot on training problems (the registration's design.pilot)
ADAM_RATES = (1e-4, 2.5e-5)  # the trade-off study's, and a quarter of it


def cell(name, factor, value, rank, k=4, n=None, **overrides):
  """A cell: its k and n, and any other overrides of both arms."""
  return cells.Cell(name, factor, value, {"k": k, "n": n or k, **overrides},
                    {"pass@k": f"pass@{k}", "pass@1": "pass@1", "pass@64": "pass@64"}, rank)


CELLS = [  # the order they run: the centre, the optimizer (the KL-sign test), then the rest
    cell("centre", "centre", "k4 n4 L2 B16 adam1e-4", 0),
    cell("sgd_lo", "optimizer", f"sgd {SGD_RATES[0]:g}", 1, optimizer="sgd",
         learning_rate=SGD_RATES[0]),
    cell("sgd_hi", "optimizer", f"sgd {SGD_RATES[1]:g}", 2, optimizer="sgd",
         learning_rate=SGD_RATES[1]),
    cell("adam_lo", "optimizer", f"adam {ADAM_RATES[1]:g}", 3, learning_rate=ADAM_RATES[1]),
    cell("level3", "difficulty", "level 3", 3, **{"synthetic.levels": (3,)}),
    cell("level4", "difficulty", "level 4", 4, **{"synthetic.levels": (4,)}),
    cell("level1", "difficulty", "level 1", 1, **{"synthetic.levels": (1,)}),
    cell("k2", "k, n", "k2 n2", 2.0, k=2),
    cell("k8", "k, n", "k8 n8", 8.0, k=8),
    cell("k4_n8", "k, n", "k4 n8", 4.5, k=4, n=8),
    cell("k2_n4", "k, n", "k2 n4", 2.5, k=2, n=4),
    cell("b64", "prompts per step", "64", 64, batch_prompts=64),
    cell("k16", "k, n", "k16 n16", 16.0, k=16),
    cell("k8_n16", "k, n", "k8 n16", 8.5, k=8, n=16),
    cell("k16_n32", "k, n", "k16 n32", 16.5, k=16, n=32),
]
# The centre's value on each factor's axis in the small multiples.
CENTRE_AT = {"optimizer": ("adam 0.0001", 4), "difficulty": ("level 2", 2),
             "k, n": ("k4 n4", 4.0), "prompts per step": ("16", 16)}
LOG_STEPS = (1, 2, 3, 5, 10, 20, 50, 100, 250, 500, 1000, 2000)


def log(run_dir):
  """The training log, each step the mean over the 10 steps up to it (fewer at the start)."""
  return maps.trainer_log(run_dir, window=10)


MAP = cells.Map(
    name="regime_map", root=ROOT,
    registration="experiments/preregistration/embedded_regime_map.json",
    out="experiments/results/regime_map", command="python experiments/regime_map.py",
    seeds=(0, 1, 2), workers=1, a="pass_at_k", b="mean",
    arms={"mean": {"config": "configs/mean.py"}, "pass_at_k": {"config": "configs/pass_at_k.py"}},
    cells=CELLS, centre_at=CENTRE_AT,
    work=TrainerRuns(
        root=ROOT,
        # One start for every cell: the trade-off study's warm-up on levels 1-3 (modulus 50);
        # each cell then trains on one level (the difficulty) from it.
        common={"synthetic.levels": (1, 2, 3), "synthetic.modulus": 50, "max_new_tokens": 50,
                "synthetic.test_per_level": 100, "learning_rate": ADAM_RATES[0],
                "progress_bar": False, "eval.at_start": False, "eval.at_end": False},
        start={"config": "configs/pass_at_k.py", "sft_warmup.steps": 400, "num_steps": 0,
               "sft_warmup.target_pass_at_1": 0.0},
        run={"synthetic.levels": (2,), "sft_warmup.steps": 0, "num_steps": STEPS,
             "checkpoint_every": EVERY, "keep_checkpoints": STEPS // EVERY + 1},
        evaluation={"steps": "all", "num_samples": 64, "ks": KS, "batch_prompts": 8,
                    "breakdown": ("level",), "plots": False, "kl_samples": 16}),
    log=log, log_metrics=("kl/k3", "optim/grad_norm", "advantage/nonzero_fraction"),
    log_steps=LOG_STEPS,
    title="The regime map (exploratory): pass@k training minus mean training",
    setup=("Setup: embedded task, modulus 50, a tiny Llama; one supervised warm-up of 400 steps on "
           "levels 1-3 is every run's start and KL reference; each run trains 2,000 RL steps on "
           "one level (level 2 unless the cell says otherwise) from it, checkpoints every 250 "
           "steps, each evaluated on the level's 100 held-out problems x 64 samples at "
           "temperature 1 (pass@k, the KL to the start on the first 16 samples). Seeds 0, 1, 2, "
           "paired: a seed's two runs share the start, data order, commit and machine."),
    notes=("The training log's gaps are on the training batches (each value the mean of the 10 "
           "steps up to the step): `kl/k3` the KL to the start, `optim/grad_norm` the gradient's "
           "norm before clipping, `advantage/nonzero_fraction` the share of completions with a "
           "non-zero weight."))
STUDY = cells.study(MAP)

if __name__ == "__main__":
  cells.main(MAP, __file__, sys.argv[1:])
