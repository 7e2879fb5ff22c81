"""One optimizer step of full fine-tuning, LoRA and QLoRA side by side, on SmolLM2-135M's shape.

    python benchmarks/lora_update.py [--variants=full,lora,qlora_int4] [--rows=32] \
        [--columns=128] [--prompt_len=0] [--micro_batch=2] [--rank=16] [--targets=all] \
        [--matmul_dtype=bfloat16] [--repeats=3] [--num_layers=30] [--shares=1] [--group=4]

After the CPU line (`ksjax.machine.describe`), jax's version and the allocator line, each variant
runs in a child process of its own, so that its peak resident memory is its own (the entry points'
allocator keeps what a process frees), one after the other:
  full        every parameter trains (AdamW on all of them), as the trainer does today;
  lora        rank --rank adapters on every linear layer of the blocks (q/k/v/o, gate/up/down,
              alpha = rank; --targets=attention or mlp: on those alone), the base frozen
              (`ksjax.model.lora`);
  qlora_int8  the same adapters on a base quantized to int8 by qwix;
  qlora_int4  the same adapters on a base quantized to int4 (groups of 64) by qwix;
  frozen      no adapters at all: the base frozen as LoRA freezes it (its weight matrices stored
              in the operand dtype), only the RMSNorm scales training. Its backward still carries
              the input gradient through every layer but forms no weight gradient, so its step is
              the floor of any adapter method at this shape: the forward plus the input
              gradients, what LoRA's step costs without its adapters.
The step is the trainer's update itself (`ksjax.trainer.update.Updater`, plain policy gradient)
on --rows x --columns random tokens, every row weighted (with --prompt_len P the first P columns
are a prompt, as in a run: weight 0, and the head runs on the columns after them), accumulated
over micro-batches of --micro_batch rows (2, the SmolLM2 configs' size; 4 before it), then one
AdamW update of what trains. The model is randomly initialised with SmolLM2-135M's shape (30
layers, width 576, tied 49152-token head; --num_layers fewer for a quick check), weights float32,
matmul operands --matmul_dtype as the SmolLM2 configs set it.

Each child prints its step's fastest wall time over --repeats (after a warm-up step that
compiles), its peak resident memory during those steps and, apart, during the set-up (building,
quantizing, compiling: `allocator.reset_peak_resident` says why apart), and the bytes of what
trains, of the optimizer's state and of the frozen base (an int4 array counts a byte per value here, as jax's
`nbytes` does), and what XLA's compiled step says it takes (`Compiled.memory_analysis`: its
arguments, the state and the batch, and its temporaries, the activations, gradients and dequantized
weights; as the memory plan, `ksjax.trainer.memory_plan`, counts). The resident memory counts
what the allocator keeps of the set-up too (QLoRA frees its float base there), so the compiled
bytes are the cleaner comparison. Then the parent prints each variant's ratios to the first one's.
On a shared machine the times are noisy: compare the ratios, which are of the same run.

--shares=1,2,4 runs each variant once per value (with --prompt_len > 0): the rows come in groups
of --group that share their prompt, as a rollout's do, and the update runs each prompt once per
block of that many rows (`Updater.step`'s `group`, `config.share_prompts`; 1: every row its own
prompt, as before). The same gradient in fewer positions: the share must divide --micro_batch
and --group.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, ROOT)

# SmolLM2-135M (HuggingFaceTB/SmolLM2-135M config.json).
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                    head_dim=64, intermediate_size=1536, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_embeddings=True)
TARGETS = {"attention": "q/k/v/o", "mlp": "gate/up/down", "all": "q/k/v/o/gate/up/down"}
VARIANTS = {  # name -> lora.LoraSpec fields (None: full fine-tuning; "frozen": no adapters)
    "full": None,
    "frozen": "frozen",
    "lora": dict(quantize_base="none"),
    "qlora_int8": dict(quantize_base="int8"),
    "qlora_int4": dict(quantize_base="int4"),
}


def nbytes(tree) -> int:
  import jax  # pylint: disable=import-outside-toplevel
  return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def child(args) -> None:
  """One variant's step, timed; prints one JSON line."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from ksjax import allocator, model  # pylint: disable=import-outside-toplevel
  from ksjax.model import lora  # pylint: disable=import-outside-toplevel
  from ksjax.run.spec import LossSpec  # pylint: disable=import-outside-toplevel
  from ksjax.trainer import update  # pylint: disable=import-outside-toplevel
  from ksjax.trainer.batch import MicroBatch  # pylint: disable=import-outside-toplevel

  shape = dict(SMOLLM2_135M, num_layers=args.num_layers or SMOLLM2_135M["num_layers"])
  matmul_dtype = None if args.matmul_dtype == "float32" else args.matmul_dtype
  cfg = model.LlamaConfig(**shape, matmul_dtype=matmul_dtype)
  llama = model.Llama(cfg, rngs=nnx.Rngs(0))
  fields = VARIANTS[args.variant]
  if fields is None:
    graphdef, trainable, frozen = nnx.split(llama, nnx.Param, ...)
  elif fields == "frozen":
    for layer in llama.layers:
      for module in (layer.self_attn, layer.mlp):
        for name in lora.ATTENTION_WEIGHTS if module is layer.self_attn else lora.MLP_WEIGHTS:
          setattr(module, name, nnx.Param(module.weight(name).astype(cfg.operand_dtype)))
    norms = nnx.All(nnx.Param, nnx.Any(nnx.PathContains("input_layernorm"),
                                        nnx.PathContains("post_attention_layernorm")))
    graphdef, trainable, frozen = nnx.split(llama, norms, ...)
  else:
    spec = lora.LoraSpec(rank=args.rank, alpha=float(args.rank), targets=args.targets, **fields)
    adapted = lora.apply(llama, spec, rngs=nnx.Rngs(1))
    del llama  # the float base, where QLoRA replaced it by the quantized one
    graphdef, trainable, frozen = lora.split(adapted)
    del adapted
  # The trainer's own update (`ksjax.trainer.update.Updater`): plain policy gradient with every
  # row's weight non-zero (a dense step), micro-batches of --micro_batch rows, AdamW at 1e-5 on
  # what trains; under LoRA the frozen base is the program's argument, as in a run.
  loss_spec = LossSpec(algorithm="pg", loss_aggregation="token_sum", loss_constant=1.0,
                       micro_batch_size=args.micro_batch, sparse_updates=False)
  mesh = model.make_mesh((1, 1, 1))
  frozen_mib = 0.0 if fields is None else nbytes(frozen) / 2**20
  updater = update.Updater(graphdef, optax.adamw(1e-5), loss_spec, mesh,
                           frozen=None if fields is None else frozen)
  if fields is None:
    trainable = nnx.merge_state(trainable, frozen)  # every parameter trains
  state = updater.init_state(trainable, jax.random.key(0))
  del trainable, frozen

  rng = np.random.default_rng(0)
  shape = (args.rows, args.columns)
  rows = MicroBatch(tokens=rng.integers(0, cfg.vocab_size, shape).astype(np.int32),
                    attention_mask=np.ones(shape, bool),
                    token_weight=np.where(np.arange(args.columns) >= args.prompt_len,
                                          rng.random(shape) / args.rows, 0).astype(np.float32),
                    behaviour_logp=np.zeros(shape, np.float32),
                    advantage=rng.standard_normal(args.rows).astype(np.float32))
  # Groups of --group rows share a prompt, as a rollout's do (whatever --share runs).
  rows.tokens[:, :args.prompt_len] = np.repeat(rows.tokens[::args.group, :args.prompt_len],
                                               args.group, axis=0)
  batch = updater.place(rows.split(args.micro_batch))
  prompt_len = max(args.prompt_len, 1)
  memory = updater.step_program(state, batch, prompt_len, args.share).lower(
      state, batch).compile().memory_analysis()
  state, _ = updater.step(state, batch, prompt_len, group=args.share)  # compiles
  jax.block_until_ready(state.params)
  gc.collect()
  setup_peak = allocator.peak_resident_gib()
  reset = allocator.reset_peak_resident()
  best = float("inf")
  for _ in range(args.repeats):
    start = time.perf_counter()
    state, _ = updater.step(state, batch, prompt_len, group=args.share)
    jax.block_until_ready(state.params)
    best = min(best, time.perf_counter() - start)
  print(json.dumps({
      "variant": args.variant, "share": args.share, "seconds": best,
      "peak_rss_gib": allocator.peak_resident_gib(),
      "setup_peak_rss_gib": setup_peak, "reset": reset,
      "arguments_mib": memory.argument_size_in_bytes / 2**20,
      "temporaries_mib": memory.temp_size_in_bytes / 2**20,
      "trainable_params": sum(x.size for x in jax.tree.leaves(state.params)),
      "trainable_mib": nbytes(state.params) / 2**20, "frozen_mib": frozen_mib,
      "optimizer_mib": nbytes(state.opt_state) / 2**20}), flush=True)


def _name(variant: str, share: int, shares: list[int]) -> str:
  return variant if shares == [1] else f"{variant}/share{share}"


def _program_mib(result: dict) -> float:
  return result["arguments_mib"] + result["temporaries_mib"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--variants", default="full,lora,qlora_int4")
  parser.add_argument("--rows", type=int, default=32)
  parser.add_argument("--columns", type=int, default=128)
  parser.add_argument("--prompt_len", type=int, default=0,
                      help="columns that are a prompt (weight 0), as the trainer lays a row out")
  parser.add_argument("--micro_batch", type=int, default=2)
  parser.add_argument("--rank", type=int, default=16)
  parser.add_argument("--targets", default="all", choices=("attention", "mlp", "all"),
                      help="the layers given adapters (the base's others are frozen too)")
  parser.add_argument("--matmul_dtype", default="bfloat16", choices=("float32", "bfloat16"))
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--num_layers", type=int, default=None,
                      help="fewer layers than SmolLM2's 30, for a quick check")
  parser.add_argument("--shares", default="1",
                      help="rows per prompt in the update, each a run of every variant")
  parser.add_argument("--group", type=int, default=4,
                      help="rows per prompt in the batch (a rollout's samples per prompt)")
  parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # a child's
  parser.add_argument("--share", type=int, default=1, help=argparse.SUPPRESS)  # a child's
  args = parser.parse_args()
  if args.variant:
    child(args)
    return
  variants = args.variants.split(",")
  unknown = [v for v in variants if v not in VARIANTS]
  try:
    shares = [int(v) for v in args.shares.split(",")]
  except ValueError:
    shares = []
  if (unknown or args.rows % args.micro_batch or args.rows % args.group or not shares
      or any(v < 1 or args.micro_batch % v or args.group % v or (v > 1 and args.prompt_len < 1)
             for v in shares)):
    parser.error(f"--variants takes {', '.join(VARIANTS)} (got {unknown}); --rows must be a "
                 "multiple of --micro_batch and of --group; --shares takes integers dividing "
                 f"both (got {args.shares!r}), above 1 only with --prompt_len")

  import jax  # pylint: disable=import-outside-toplevel

  from ksjax import allocator, machine  # pylint: disable=import-outside-toplevel
  print(f"CPU: {machine.describe()}; jax {jax.__version__}; {allocator.allocator_line()}",
        flush=True)
  layers = args.num_layers or SMOLLM2_135M["num_layers"]
  print(f"SmolLM2-135M's shape ({layers} layers), {args.rows} rows x {args.columns} tokens "
        f"({args.prompt_len} of them a prompt) in micro-batches of {args.micro_batch}, matmul "
        f"operands {args.matmul_dtype}, LoRA rank {args.rank} on {TARGETS[args.targets]}; "
        f"fastest of {args.repeats} steps", flush=True)
  results = []
  for variant, share in [(v, s) for v in variants for s in shares]:
    command = [sys.executable, os.path.abspath(__file__), f"--variant={variant}",
               f"--share={share}"] + [a for a in sys.argv[1:]
                                      if not a.startswith(("--variants", "--shares"))]
    out = subprocess.run(command, check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["variant"] = _name(variant, share, shares)
    results.append(result)
    print(f"  {result['variant']:11s} step {result['seconds']:6.2f} s, peak RSS "
          f"{result['peak_rss_gib']:5.2f} GiB in the steps"
          + ("" if result["reset"] else " (and the set-up: no /proc/self/clear_refs)")
          + f", {result['setup_peak_rss_gib']:5.2f} GiB in the set-up and compilation; trains "
          f"{result['trainable_params'] / 1e6:6.2f} M params, optimizer state "
          f"{result['optimizer_mib']:6.1f} MiB, frozen {result['frozen_mib']:6.1f} MiB; the "
          f"compiled step takes {result['arguments_mib']:6.1f} MiB of arguments and "
          f"{result['temporaries_mib']:6.1f} MiB of temporaries", flush=True)
  first = results[0]
  for result in results[1:]:
    print(f"  {result['variant']} / {first['variant']}: step time "
          f"{result['seconds'] / first['seconds']:.2f}x, peak RSS "
          f"{result['peak_rss_gib'] / first['peak_rss_gib']:.2f}x, compiled arguments + "
          f"temporaries {_program_mib(result) / _program_mib(first):.2f}x, optimizer state "
          f"{result['optimizer_mib'] / first['optimizer_mib']:.3f}x", flush=True)


if __name__ == "__main__":
  from ksjax import allocator as _allocator  # pylint: disable=wrong-import-position
  _allocator.reexec_with_allocator("lora_update.py")  # as the entry points do
  main()
