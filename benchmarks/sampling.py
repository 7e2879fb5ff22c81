"""Sampling speed: ksjax's jitted KV-cache sampler against transformers' `generate` (PyTorch, CPU).

    python benchmarks/sampling.py [--repeats 2] [--vocab 16384]

One run, one random Llama (4 layers, hidden 256, 4 heads of 64, 2 kv heads, MLP 1024, untied,
float32; ~12M parameters at the default 16k vocabulary) written with `model.save_hf` and read by
transformers, so both sides hold the same weights:

  1. 16 prompts (32..64 tokens) x 8 samples x exactly 128 new tokens at temperature 1, top-k and
     top-p off, no EOS: generated tokens per second of ksjax (`sampling.generate`, steady state)
     and of transformers (`generate(do_sample=True, num_return_sequences=8)`), and their ratio.
     ksjax's compile time (first call minus a steady call) is reported apart.
  2. ksjax's decode time per generated token (the while loop only, prefill excluded) with 128 and
     with 1024 prompt tokens of context, for the 128 rows of (1) and for 8 rows.
  3. The prefill of (1) with `prefill_once` (prefill each prompt, copy its cache 8 times) against
     prefilling every row.

Each figure is the fastest of `--repeats` timed calls after a warm-up call (slower calls on a shared
machine measure the neighbours); in (1) the two sides' calls alternate, so both meet the same
neighbours, and process CPU seconds are given too. Run the script more than once.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time

import jax
import numpy as np
import torch
import transformers
from flax import nnx

from ksjax import model, sampling
from ksjax.sampling import batching, sampler

from decoding import decode_program, random_prompts, seconds_per_step  # benchmarks/decoding.py

PROMPTS, SAMPLES, NEW_TOKENS = 16, 8, 128


def make_config(vocab: int) -> model.LlamaConfig:
  return model.LlamaConfig(vocab_size=vocab, hidden_size=256, num_layers=4, num_heads=4,
                           num_kv_heads=2, head_dim=64, intermediate_size=1024,
                           max_position_embeddings=2048, rope_theta=10000.0,
                           tie_embeddings=False)


@dataclasses.dataclass(frozen=True)
class Timing:
  first: float  # seconds of the first call (compiles)
  wall: float   # fastest wall-clock seconds of the repeated calls
  cpu: float    # process CPU seconds (all threads) of that call


def timed_side_by_side(fns: dict, repeats: int) -> dict[str, Timing]:
  """Calls each function once (compiling, warming up), then `repeats` rounds of one call each,
  interleaved so that every side meets the same neighbours; keeps each side's fastest call.

  The fastest, because on a shared machine slower calls measure the neighbours; CPU seconds are
  reported beside wall seconds since they are less disturbed by them.
  """
  first, best = {}, {}
  for name, fn in fns.items():
    start = time.perf_counter()
    fn()
    first[name] = time.perf_counter() - start
  for _ in range(repeats):
    for name, fn in fns.items():
      wall, cpu = time.perf_counter(), time.process_time()
      fn()
      wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
      if name not in best or wall < best[name][0]:
        best[name] = (wall, cpu)
  return {name: Timing(first[name], *best[name]) for name in fns}


def ksjax_generate(llama, prompts, **kwargs):
  out = sampling.generate(llama, prompts, num_samples=SAMPLES, max_new_tokens=NEW_TOKENS,
                          temperature=1.0, **kwargs)
  jax.block_until_ready(out)
  assert (np.asarray(out.lengths) == NEW_TOKENS).all()
  return out


def hf_generate(hf, prompts):
  t = max(len(p) for p in prompts)
  ids = torch.tensor([[0] * (t - len(p)) + p for p in prompts])
  mask = torch.tensor([[0] * (t - len(p)) + [1] * len(p) for p in prompts])
  config = transformers.GenerationConfig(
      do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=NEW_TOKENS,
      num_return_sequences=SAMPLES, pad_token_id=0, eos_token_id=None)
  with torch.no_grad():
    out = hf.generate(input_ids=ids, attention_mask=mask, generation_config=config)
  assert out.shape == (len(prompts) * SAMPLES, t + NEW_TOKENS), out.shape
  return out


def decode_seconds_per_token(llama, prompt_len: int, num_prompts: int, repeats: int,
                             new_tokens: int = 64) -> float:
  """Fastest seconds per decode step (rows advance together) of the while loop alone."""
  prompts = random_prompts(llama.cfg.vocab_size, num_prompts, prompt_len, prompt_len, seed=1)
  return seconds_per_step(*decode_program(llama, prompts, SAMPLES, new_tokens), repeats)


def prefill_seconds(llama, prompts, prefill_once: bool, repeats: int) -> float:
  cfg = sampling.SamplerConfig(max_new_tokens=NEW_TOKENS, temperature=1.0,
                               prefill_once=prefill_once)
  batch = batching.pad_prompts(batching.validate_prompts(prompts, llama.cfg.vocab_size),
                               SAMPLES, 1, cfg.pad_id)
  shapes = sampler.Shapes(batch.tokens_pt.shape[0], SAMPLES, batch.tokens_pt.shape[1])
  graphdef, params = nnx.split(llama)
  prefill, _ = sampler.programs(graphdef, cfg, sampler.model_mesh(llama), shapes)
  rows = np.int32(len(prompts) * SAMPLES)
  run = lambda: jax.block_until_ready(prefill(params, batch.tokens_pt, batch.mask_pt, rows,
                                              np.uint32(0)))
  return timed_side_by_side({"prefill": run}, repeats)["prefill"].wall


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--vocab", type=int, default=16384)
  args = parser.parse_args()

  cfg = make_config(args.vocab)
  llama = model.Llama(cfg, rngs=nnx.Rngs(0))
  with tempfile.TemporaryDirectory() as tmp:
    model.save_hf(llama, cfg, f"{tmp}/llama")
    hf = transformers.LlamaForCausalLM.from_pretrained(
        f"{tmp}/llama", torch_dtype=torch.float32, attn_implementation="eager").eval()
  print(f"model: {dataclasses.asdict(cfg)}")
  print(f"parameters: {cfg.num_params / 1e6:.1f}M; devices: {jax.devices()}; "
        f"torch threads: {torch.get_num_threads()}")

  prompts = random_prompts(cfg.vocab_size, PROMPTS, 32, 64, seed=0)
  tokens = PROMPTS * SAMPLES * NEW_TOKENS
  torch.manual_seed(0)
  times = timed_side_by_side({"ksjax": lambda: ksjax_generate(llama, prompts),
                              "transformers": lambda: hf_generate(hf, prompts)}, args.repeats)
  ours, theirs = times["ksjax"], times["transformers"]
  print(f"\n[1] {PROMPTS} prompts x {SAMPLES} samples x {NEW_TOKENS} new tokens, temperature 1")
  for name, t in times.items():
    print(f"  {name:12s} {tokens / t.wall:7.0f} tokens/s wall ({t.wall:6.2f} s), "
          f"{tokens / t.cpu:7.0f} tokens per CPU-second ({t.cpu:6.2f} s)")
  print(f"  ratio ksjax / transformers: {theirs.wall / ours.wall:.2f}x wall, "
        f"{theirs.cpu / ours.cpu:.2f}x CPU")
  print(f"  ksjax compile (first call {ours.first:.2f} s minus a steady call): "
        f"{ours.first - ours.wall:.2f} s")

  print("\n[2] ksjax decode time per generated token (while loop only, 64 new tokens)")
  for num_prompts in (PROMPTS, 1):
    short = decode_seconds_per_token(llama, 128, num_prompts, args.repeats)
    long = decode_seconds_per_token(llama, 1024, num_prompts, args.repeats)
    print(f"  {num_prompts * SAMPLES:4d} rows: context 128: {short * 1e3:7.2f} ms/token, "
          f"1024: {long * 1e3:7.2f} ms/token, ratio {long / short:.2f}")

  print("\n[3] prefill of [1] (16 prompts, 8 samples each)")
  once = prefill_seconds(llama, prompts, True, args.repeats)
  every = prefill_seconds(llama, prompts, False, args.repeats)
  print(f"  prefill once + copy cache: {once * 1e3:.1f} ms; prefill every row: {every * 1e3:.1f} ms")


if __name__ == "__main__":
  main()
