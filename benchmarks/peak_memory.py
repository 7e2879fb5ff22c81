"""A run's peak resident memory against its memory plan, under each allocator setting.

    python benchmarks/peak_memory.py [--config=configs/smollm2_mean.py] [--steps=4]
                                     [--variants=auto,off,threshold,cached] [--prompt_len=128]
                                     [--matmul_dtype=float32|bfloat16] [--checkpoint_every=N]

In one run, after the CPU line (`ksjax.machine.describe`): the memory plan's per-device peak
(`python -m ksjax.tools.plan`, what the buffers need), then the trainer itself for --steps RL
steps in one child process per variant, each with its own fresh work directory and no held-out
evaluation, and from each child's step log the peak resident memory after every step
(`memory/peak_rss_gib`, the kernel's high-water mark of the process) and the whole run's (the
child's `ru_maxrss`, which also sees the saves after the last step's log line), beside the update's
seconds and the share of rows it kept. The variants:
  auto       the entry points' allocator as shipped (`ksjax.allocator`: jemalloc where the system
             has it, else glibc on transparent huge pages);
  off        glibc as it is (KSJAX_MALLOC=off);
  threshold  glibc on huge pages with a fixed 1 MiB mmap threshold
             (GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1048576): every large buffer is mapped
             on allocation and handed back on free, so the resident memory follows the live
             buffers instead of what the allocator keeps for reuse;
  cached     auto, with every program read back from a persistent compilation cache that a first,
             unmeasured run of the same config filled: what XLA's compiler holds while it
             compiles (the first step compiles the sampler and the update) is the gap between
             auto and cached. The other variants run without a cache, so each compiles as a first
             run on a new machine does.
--matmul_dtype overrides the config's operand dtype (on a CPU without bfloat16 dot instructions
XLA converts bfloat16 operands to float32 copies, which the peak holds too).
The gap between the plan and `threshold` is what the plan misses (runtime, programs, copies); the
gap between `threshold` and `auto` is the allocator's retention, bought for speed (the update's
seconds show its price). Every variant samples the same completions (same seed, same machine),
so their steps keep the same rows. Peaks are per process: the reward workers are not counted.
A checkpoint is saved every --checkpoint_every steps (default: once, after the last step, whose
save the step log no longer sees), and after the first step (Orbax's initial save); the decisive
study saves every 4 of its 12 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, ROOT)

from ksjax import machine  # noqa: E402  pylint: disable=wrong-import-position

VARIANTS = {
    "auto": {},
    "cached": {},
    "off": {"KSJAX_MALLOC": "off"},
    "threshold": {"KSJAX_MALLOC": "glibc",
                  "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576"},
}


def _plan_peak(config: str, prompt_len: int, out: str, overrides: list[str],
               cache: str = "off") -> float:
  """The memory plan's per-device peak, GiB, planned with the compilation cache `cache`
  (KSJAX_COMPILATION_CACHE) as the run it is set beside: the plan counts what its compiled
  programs hold in its process, and an executable read back from the cache holds more than one
  just compiled."""
  path = os.path.join(out, "plan.json")
  env = dict(os.environ, KSJAX_COMPILATION_CACHE=cache)
  subprocess.run([sys.executable, "-m", "ksjax.tools.plan", f"--config={config}",
                  f"--prompt_len={prompt_len}", f"--json_out={path}", *overrides],
                 check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
  with open(path) as f:
    plan = json.load(f)
  return plan["peak"] / 2**30


def _run(config: str, steps: int, variant: str, out: str,
         overrides: list[str]) -> tuple[list[dict], float]:
  """The step log of `steps` RL steps of `config` under `variant`'s allocator and cache, and the
  whole run's peak (GiB)."""
  env = {k: v for k, v in os.environ.items() if k not in ("KSJAX_MALLOC", "GLIBC_TUNABLES")}
  env.update(VARIANTS[variant])
  env["KSJAX_COMPILATION_CACHE"] = "off"
  if variant == "cached":
    env["KSJAX_COMPILATION_CACHE"] = os.path.join(out, "compilation_cache")
    _train(config, steps, os.path.join(out, "cache_filling_run"), env, overrides)
  workdir = os.path.join(out, variant)
  whole = _train(config, steps, workdir, env, overrides)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()], whole


def _train(config: str, steps: int, workdir: str, env: dict, overrides: list[str]) -> float:
  """Trains; returns the process's whole-run peak resident memory in GiB (the kernel's
  ru_maxrss, which also sees the saves after the last step's log line and the forked reward
  workers)."""
  command = [sys.executable, "-m", "ksjax.main", f"--config={config}",
             f"--config.workdir={workdir}", f"--config.num_steps={steps}",
             "--config.eval.at_start=False", "--config.eval.at_end=False",
             "--config.progress_bar=False", *overrides]
  child = machine.run_child(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
  if child.exit_status:
    raise subprocess.CalledProcessError(child.exit_status, command)
  return child.peak_rss_bytes / 2**30


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default="configs/smollm2_mean.py")
  parser.add_argument("--steps", type=int, default=4)
  parser.add_argument("--variants", default="auto,off,threshold")
  parser.add_argument("--matmul_dtype", choices=("float32", "bfloat16"), default=None,
                      help="the matmul operand dtype (default: the config's)")
  parser.add_argument("--checkpoint_every", type=int, default=None,
                      help="steps between checkpoints (default: --steps, one save at the end)")
  parser.add_argument("--prompt_len", type=int, default=128,
                      help="the plan's longest prompt, tokens (the arithmetic prompts fit 128)")
  args = parser.parse_args()
  variants = args.variants.split(",")
  unknown = [v for v in variants if v not in VARIANTS]
  if unknown:
    sys.exit(f"--variants: {unknown[0]!r} is not accepted; expected some of "
             f"{', '.join(VARIANTS)}")
  overrides = ([f"--config.model.matmul_dtype={args.matmul_dtype}"] if args.matmul_dtype
               else [])
  overrides.append(f"--config.checkpoint_every={args.checkpoint_every or args.steps}")
  print(f"machine: {machine.describe()}")
  with tempfile.TemporaryDirectory() as out:
    planned = _plan_peak(args.config, args.prompt_len, out, overrides)
    print(f"{args.config} {' '.join(overrides)}, {args.steps} steps; the memory plan's peak: "
          f"{planned:.2f} GiB (no compilation cache; `cached` is set beside its own plan)\n")
    print("| variant | peak RSS after each step, GiB | whole run | whole / plan | "
          "update s per step | rows kept |")
    print("|---|---|---|---|---|---|")
    for variant in variants:
      lines, whole = _run(args.config, args.steps, variant, out, overrides)
      if variant == "cached":  # planned from the cache the run read its programs from
        planned = _plan_peak(args.config, args.prompt_len, out, overrides,
                             cache=os.path.join(out, "compilation_cache"))
        print(f"(the plan from that cache: {planned:.2f} GiB)")
      peaks = [line["memory/peak_rss_gib"] for line in lines]
      updates = ", ".join(f"{line['time/update']:.1f}" for line in lines)
      kept = ", ".join(f"{line['update/rows_fraction']:.2f}" for line in lines)
      print(f"| {variant} | {', '.join(f'{p:.2f}' for p in peaks)} | {whole:.2f} | "
            f"{whole / planned:.2f} | {updates} | {kept} |",
            flush=True)


if __name__ == "__main__":
  main()
