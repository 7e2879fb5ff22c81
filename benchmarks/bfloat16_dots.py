"""bfloat16 matmul operands on a CPU without bfloat16 dot instructions: XLA:CPU's emulated
bfloat16 dot against the same product on widened (float32) operands, `layers.kernel_operands`.

    python benchmarks/bfloat16_dots.py [--parts=dots,model] [--repeats=2]

dots   the products of SmolLM2-135M's shape alone (a decode step's 128 rows and a training
       micro-batch's 4,096, the MLP and the head), three ways in one process: bfloat16 operands
       as XLA receives them ("emulated"), the same rounded operands widened to float32
       ("widened"), and float32 operands; the fastest of --repeats x 10 calls, and the largest
       difference of widened from emulated.
model  one call of the eval binary at the study's shape (8 prompts x 16 samples x 80 new tokens,
       a randomly initialised model of SmolLM2's shape): `sampling.generate` and the KL
       reference's forward (`logprobs.sharded_continuation_logprobs`), each way in its own
       process (the choice is made when a program is traced), one after another.
The first line names the CPU (`ksjax.machine.describe`). On a CPU with bfloat16 dot instructions
the library keeps bfloat16 operands, so "widened" there only shows what it would cost.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir))
sys.path.insert(0, HERE)

WAYS = ("emulated", "widened", "float32")


def fastest(fn, *args, calls: int) -> float:
  import jax  # pylint: disable=import-outside-toplevel
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(calls):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def dots(repeats: int) -> None:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  bf16, f32 = jnp.bfloat16, jnp.float32
  fns = {
      "emulated": lambda x, w: jnp.dot(x.astype(bf16), w.astype(bf16), preferred_element_type=f32),
      "widened": lambda x, w: jnp.dot(x.astype(bf16).astype(f32), w.astype(bf16).astype(f32),
                                      preferred_element_type=f32),
      "float32": lambda x, w: jnp.dot(x, w, preferred_element_type=f32)}
  fns = {k: jax.jit(v) for k, v in fns.items()}
  rng = np.random.default_rng(0)
  print("| [M, K] x [K, N] | emulated ms | widened ms | float32 ms | emulated / widened | "
        "largest difference |\n|---|---|---|---|---|---|")
  for m, k, n in ((128, 576, 1536), (128, 576, 49152), (4096, 576, 1536), (4096, 1536, 576)):
    x = jnp.asarray(rng.standard_normal((m, k)), f32)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.05, f32)
    t = {way: fastest(fn, x, w, calls=10 * repeats) for way, fn in fns.items()}
    diff = float(jnp.max(jnp.abs(fns["emulated"](x, w) - fns["widened"](x, w))))
    print(f"| [{m}, {k}] x [{k}, {n}] | {t['emulated'] * 1e3:.1f} | {t['widened'] * 1e3:.1f} | "
          f"{t['float32'] * 1e3:.1f} | {t['emulated'] / t['widened']:.2f}x | {diff:.1e} |",
          flush=True)


def model_call(way: str, repeats: int) -> None:
  """One way, in this process: prints 'sample S kl K tokens N'."""
  from ksjax import machine  # pylint: disable=import-outside-toplevel
  machine._LACKS_BF16_DOTS["/proc/cpuinfo"] = way != "emulated"  # pylint: disable=protected-access
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from ksjax import model, sampling  # pylint: disable=import-outside-toplevel
  from ksjax.model import logprobs  # pylint: disable=import-outside-toplevel
  from update_rate import SMOLLM2_135M  # pylint: disable=import-outside-toplevel
  cfg = model.LlamaConfig(**SMOLLM2_135M,
                          matmul_dtype="float32" if way == "float32" else "bfloat16")
  llama = model.Llama(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(0, cfg.vocab_size, int(n))) for n in rng.integers(80, 128, 8)]
  gen = lambda: sampling.generate(llama, prompts, num_samples=16, max_new_tokens=80, seed=0).tokens
  sample_s = fastest(gen, calls=repeats)
  out = sampling.generate(llama, prompts, num_samples=16, max_new_tokens=80, seed=0)
  tokens, mask = out.sequences()
  kl = logprobs.sharded_continuation_logprobs(llama, model.make_mesh((1, 1, 1), jax.devices()[:1]),
                                              16)
  kl_s = fastest(kl, tokens, mask, np.asarray(out.prompt_tokens).shape[1], calls=repeats)
  print(f"sample {sample_s:.2f} kl {kl_s:.2f} tokens {int(np.asarray(out.lengths).sum())}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--parts", default="dots,model")
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # one model process
  args = parser.parse_args()
  if args.way:
    return model_call(args.way, args.repeats)
  from ksjax import machine  # pylint: disable=import-outside-toplevel
  print(f"CPU: {machine.describe()}; bfloat16 dot instructions: "
        f"{'no' if machine.lacks_bfloat16_dots() else 'yes'}", flush=True)
  if "dots" in args.parts:
    dots(args.repeats)
  if "model" in args.parts:
    print("\n| way | sampling s (10,240 tokens) | KL reference forward s |\n|---|---|---|")
    for way in WAYS:
      out = subprocess.run([sys.executable, __file__, f"--way={way}", f"--repeats={args.repeats}"],
                           capture_output=True, text=True, check=True).stdout.split()
      print(f"| {way} | {float(out[1]):.2f} | {float(out[3]):.2f} |", flush=True)
  return None


if __name__ == "__main__":
  main()
