"""Pieces the sampling benchmarks share (benchmarks/sampling.py at the toy shape,
benchmarks/real_model.py at SmolLM2's): random prompts, and the sampler's decode loop timed alone."""

from __future__ import annotations

import functools
import os
import sys
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from ksjax import sampling  # pylint: disable=wrong-import-position
from ksjax.sampling import batching, sampler  # pylint: disable=wrong-import-position


def random_prompts(vocab: int, count: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
  rng = np.random.RandomState(seed)
  return [rng.randint(1, vocab, rng.randint(lo, hi + 1)).tolist() for _ in range(count)]


def decode_program(llama, prompts, num_samples: int, new_tokens: int, cache_phases: int = 3,
                   weights_first: bool = False):
  """(run, steps): run(seed) times the decode loop alone (prefill excluded), in seconds, and with
  `trace_dir` profiles it there; run.hlo() is the decode program's optimised HLO text.
  `weights_first`: the loop is given the transposed weight copies `sampler.sample` makes for a
  batch of at most `SamplerConfig.weights_first_rows` rows (`sampler.weights_first`), made
  before the timing as the sampler makes them before its loop; False: the plain products."""
  cfg = sampling.SamplerConfig(max_new_tokens=new_tokens, temperature=1.0,
                               cache_phases=cache_phases)
  batch = batching.pad_prompts(batching.validate_prompts(prompts, llama.cfg.vocab_size),
                               num_samples, 1, cfg.pad_id)
  shapes = sampler.Shapes(batch.tokens_pt.shape[0], num_samples, batch.tokens_pt.shape[1])
  graphdef, params = nnx.split(llama)
  params = sampler.operand_params(params, llama.cfg)  # as `sampler.sample`: once per call
  prefill, decode = sampler.programs(graphdef, cfg, sampler.model_mesh(llama), shapes)
  if weights_first:
    decode = functools.partial(decode, weights_t=jax.block_until_ready(
        sampler.weights_first(params, llama.cfg)))
  rows = np.int32(len(prompts) * num_samples)

  def run(seed: int = 0, trace_dir: str | None = None) -> float:
    prompt, state = jax.block_until_ready(prefill(params, batch.tokens_pt, batch.mask_pt, rows,
                                                  np.uint32(seed)))
    if trace_dir is not None:  # the decode call alone under the JAX profiler
      jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    start = time.perf_counter()
    jax.block_until_ready(decode(params, prompt, state, np.int32(-1)))
    seconds = time.perf_counter() - start
    if trace_dir is not None:
      jax.profiler.stop_trace()
    return seconds

  run.hlo = lambda: decode.lower(params, *prefill(params, batch.tokens_pt, batch.mask_pt, rows,
                                                  np.uint32(0)), np.int32(-1)).compile().as_text()
  return run, new_tokens - 1


def seconds_per_step(run, steps: int, repeats: int) -> float:
  """Fastest decode-loop seconds per step of `run` (from `decode_program`) over `repeats` calls
  after one that compiles. Its own timing, not the call's: the call also runs the prefill."""
  runs = [run(i) for i in range(repeats + 1)]
  return min(runs[1:]) / steps
