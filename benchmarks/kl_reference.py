"""The KL reference forward at SmolLM2-135M's shape: each prompt once against once per sample,
in the eval binary (default) or in the trainer (--trainer).

    python benchmarks/kl_reference.py [--prompts=8] [--samples=16] [--prompt_len=128]
                                      [--new_tokens=80] [--matmul_dtype=float32] [--repeats=2]
                                      [--trainer --micro_batch=2]

One sampler call of the evaluation (`ksjax.evaluation.runner.Evaluator.kl`): --prompts problems x
--samples rows, each row its problem's left-padded prompt (--prompt_len columns, prompts of
60-100% of it) and a completion of 25-100% of --new_tokens, scored by a randomly initialised
model of SmolLM2-135M's shape (`update_rate.SMOLLM2_135M`):
  full     `model.sharded_token_logprobs`, the forward over every row's prompt and completion (the
           eval binary's reference before 8a98efe);
  shared   `logprobs.sharded_continuation_logprobs`, each prompt once into a KV cache its rows
           share, the completions once over it (the eval binary's reference since).
With --trainer the same rows are one step's rollout (use --samples=4, the SmolLM2 configs' n) and
the two ways are the trainer's reference forward (`ksjax.trainer.learner`) at the loss's
micro-batch size --micro_batch:
  full     `forward_rows` of every row, --micro_batch rows at a time (the trainer's reference
           before `reference_rows`);
  shared   `reference_rows`, whole groups in each micro-batch and each prompt once.
After the CPU line (`ksjax.machine.describe`), each is compiled and called once, then timed over
--repeats rounds in alternation (fastest of each), and the largest difference of their log-probs
is printed beside the ratio. On a shared machine compare the ratio, which is of the same rounds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ksjax import machine, model  # noqa: E402  pylint: disable=wrong-import-position
from ksjax.model import logprobs  # noqa: E402  pylint: disable=wrong-import-position
from update_rate import SMOLLM2_135M  # noqa: E402  pylint: disable=wrong-import-position


def batch(args, vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Tokens and mask [P * n, T + N] laid out as `SampleOutput.sequences` lays out a call."""
  rng = np.random.default_rng(seed)
  p, n, t, new = args.prompts, args.samples, args.prompt_len, args.new_tokens
  prompt = rng.integers(0, vocab, (p, t))
  prompt_lengths = rng.integers(int(0.6 * t), t + 1, p)
  pmask = np.arange(t)[None] >= (t - prompt_lengths)[:, None]
  lengths = rng.integers(max(1, new // 4), new + 1, p * n)
  tokens = np.concatenate([np.repeat(prompt, n, 0), rng.integers(0, vocab, (p * n, new))], 1)
  mask = np.concatenate([np.repeat(pmask, n, 0), np.arange(new)[None] < lengths[:, None]], 1)
  return tokens.astype(np.int32), mask


def trainer_ways(args, llama, mesh, tokens, mask) -> dict:
  """The trainer's reference forward both ways, on a rollout of these rows (only its tokens and
  masks are read) and the trainer's own programs (an `update.Updater` of that micro-batch)."""
  import optax  # pylint: disable=import-outside-toplevel
  from ksjax.run.spec import LossSpec  # pylint: disable=import-outside-toplevel
  from ksjax.trainer import learner, rollout, update  # pylint: disable=import-outside-toplevel

  graphdef, params = nnx.split(llama)
  updater = update.Updater(graphdef, optax.adamw(1e-5),
                           LossSpec(micro_batch_size=args.micro_batch), mesh)
  t, rows = args.prompt_len, len(tokens)
  completion = mask & (np.arange(tokens.shape[1]) >= t)[None]
  zeros = np.zeros((args.prompts, args.samples), np.float32)
  batch = rollout.Rollout(
      prompts=(), tokens_rt=tokens, attention_mask_rt=mask, completion_mask_rt=completion,
      behaviour_logp_rt=np.zeros(tokens.shape, np.float32), prompt_len=t,
      finished_r=np.ones(rows, bool), texts=("",) * rows, rewards_bn=zeros,
      correct_bn=zeros.astype(bool), answer_ids_bn=zeros.astype(np.int32))
  every = np.arange(rows)
  return {"full": lambda: learner.forward_rows(updater, params, batch, every,
                                               args.micro_batch)["logp"][:, t:],
          "shared": lambda: learner.reference_rows(updater, params, batch, args.micro_batch)[:, t:]}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--prompts", type=int, default=8)
  parser.add_argument("--samples", type=int, default=16)
  parser.add_argument("--prompt_len", type=int, default=128)
  parser.add_argument("--new_tokens", type=int, default=80)
  parser.add_argument("--matmul_dtype", choices=("float32", "bfloat16"), default="float32")
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--trainer", action="store_true",
                      help="the trainer's reference forward instead of the eval binary's")
  parser.add_argument("--micro_batch", type=int, default=2, help="with --trainer")
  args = parser.parse_args()
  print(f"CPU: {machine.describe()}; jax {jax.__version__}; {args.prompts} prompts x "
        f"{args.samples} samples, {args.prompt_len} + {args.new_tokens} columns, matmul operands "
        f"{args.matmul_dtype}", flush=True)
  cfg = model.LlamaConfig(**SMOLLM2_135M, matmul_dtype=args.matmul_dtype)
  llama = model.Llama(cfg, rngs=nnx.Rngs(0))
  mesh = model.make_mesh((1, 1, 1), jax.devices()[:1])
  tokens, mask = batch(args, cfg.vocab_size)
  t = args.prompt_len
  if args.trainer:
    ways = trainer_ways(args, llama, mesh, tokens, mask)
  else:
    full_fn = model.sharded_token_logprobs(llama, mesh)
    shared_fn = logprobs.sharded_continuation_logprobs(llama, mesh, args.samples)
    ways = {"full": lambda: full_fn(tokens, mask)[:, t:],
            "shared": lambda: shared_fn(tokens, mask, t)}
  out, best = {}, {}
  for name, fn in ways.items():
    start = time.perf_counter()
    out[name] = np.asarray(jax.block_until_ready(fn()))
    print(f"  {name:6s} first call (compiling) {time.perf_counter() - start:7.2f} s", flush=True)
  for _ in range(args.repeats):
    for name, fn in ways.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      best[name] = min(best.get(name, np.inf), time.perf_counter() - start)
  for name in ways:
    print(f"  {name:6s} {best[name]:7.2f} s per call (fastest of {args.repeats})")
  print(f"shared is {best['full'] / best['shared']:.2f}x faster; largest log-prob difference "
        f"{np.abs(out['full'] - out['shared']).max():.2e}")


if __name__ == "__main__":
  main()
