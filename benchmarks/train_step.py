"""Trainer update speed: throughput, FLOP/s against the machine's matmul rate, sparse vs dense.

    python benchmarks/train_step.py [--repeats 5] [--split_steps 12]

In one run:
  1. The machine's dense float32 matmul rate: a jitted [2048, 2048] x [2048, 2048] product,
     FLOP/s = 2 n^3 / time (best of the repeats).
  2. Update throughput (one optimizer step: forward, backward, AdamW) for two models on the
     default config's batch (configs/pass_at_k.py: B prompts x n completions, prompt + completion
     columns): the default tiny model and a wider one (hidden 256, 4 layers). Tokens per second
     (non-padding tokens of the batch over the step time) and model FLOP/s
     (`LlamaConfig.forward_flops`, the update 3x the forward), as a fraction of (1); XLA's cost
     analysis of the compiled program, printed beside it, counts each loop body once.
  3. The sparse update's speed-up for pass@k leave-one-out at k = n = 8, on the same batch: the
     dense update of all B x 8 rows against the sparse one (rows with a non-zero advantage only,
     packed into a power-of-two bucket). Two reward kinds: +-1, correct with probability 0.3 (a
     group has one non-zero weight when exactly one completion is correct, else none), and
     continuous rewards, where every group has exactly one (the densest case of this estimator,
     1/8 of the rows). Both paths update the same parameters to within 1e-5 (asserted).
  4. The time split of a step of the default config (sampling / reward / reference / update),
     from a short run of the trainer itself (no warm-up, no evaluation), the first step
     (compilation) left out.

Timings are medians over `--repeats` calls after a warm-up call; on a shared machine they are
noisy, so compare ratios within one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from ksjax import model  # pylint: disable=wrong-import-position
from ksjax.tasks import synthetic  # pylint: disable=wrong-import-position
from ksjax.run import policy  # pylint: disable=wrong-import-position
from ksjax.run import spec as spec_lib  # pylint: disable=wrong-import-position
from ksjax.run.directory import RunDirectory  # pylint: disable=wrong-import-position
from ksjax.trainer import learner, loop, metrics, rollout, update  # pylint: disable=wrong-import-position
from ksjax.trainer.batch import MicroBatch  # pylint: disable=wrong-import-position

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "configs",
                      "pass_at_k.py")


def median_seconds(fn, repeats: int) -> float:
  fn()  # compile / warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def matmul_rate(repeats: int, n: int = 2048) -> float:
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
  f = jax.jit(lambda a, b: a @ b)
  f(a, b).block_until_ready()
  best = min(_time(lambda: f(a, b).block_until_ready()) for _ in range(repeats))
  return 2 * n ** 3 / best


def _time(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def default_config():
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("pass_at_k", CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def synthetic_rollout(config, n: int, vocab: int, p_correct: float, seed: int = 0,
                      continuous: bool = False):
  """A rollout shaped like the default config's (prompt bucket 32 + max_new_tokens columns),
  with random tokens, completion lengths between half and all of max_new_tokens, and +-1 (or
  standard normal) rewards."""
  rng = np.random.default_rng(seed)
  b, prompt_len, new = config.batch_prompts, 32, config.max_new_tokens
  r, t = b * n, prompt_len + new
  tokens = rng.integers(4, vocab, size=(r, t)).astype(np.int32)
  prompt_lengths = np.repeat(rng.integers(8, 21, size=b), n)
  lengths = rng.integers(new // 2, new + 1, size=r)
  cols = np.arange(t)[None]
  prompt_mask = (cols < prompt_len) & (cols >= prompt_len - prompt_lengths[:, None])
  completion_mask = (cols >= prompt_len) & (cols < prompt_len + lengths[:, None])
  correct = rng.random((b, n)) < p_correct
  rewards = (rng.normal(size=(b, n)) if continuous else np.where(correct, 1.0, -1.0))
  return rollout.Rollout(
      prompts=(), tokens_rt=tokens, attention_mask_rt=prompt_mask | completion_mask,
      completion_mask_rt=completion_mask,
      behaviour_logp_rt=np.where(completion_mask, -1.0, 0.0).astype(np.float32),
      prompt_len=prompt_len, finished_r=np.ones(r, bool), texts=("",) * r,
      rewards_bn=rewards.astype(np.float32), correct_bn=correct,
      answer_ids_bn=(~correct).astype(np.int32))


def build(config, cfg: model.LlamaConfig, sparse: bool):
  """The trainer's own update program for `config` (constant learning rate from step 0)."""
  config.sparse_updates = sparse
  spec = spec_lib.from_config(config)
  spec = dataclasses.replace(spec, optimizer=dataclasses.replace(spec.optimizer,
                                                                 lr_warmup_steps=0))
  mesh = model.make_mesh((1, 1, 1))
  llama = model.shard(model.Llama(cfg, rngs=nnx.Rngs(0)), mesh)
  graphdef, params = nnx.split(llama)
  return update.build_updater(spec, graphdef, mesh), params


def throughput(config, cfg, n: int, repeats: int, peak: float) -> dict[str, float]:
  """Dense update of every row (all advantages non-zero): tokens/s and FLOP/s."""
  updater, params = build(config, cfg, sparse=False)
  batch = synthetic_rollout(config, n, cfg.vocab_size, p_correct=0.5)
  adv = np.random.default_rng(1).normal(size=batch.rewards_bn.size).astype(np.float32)
  state = updater.init_state(params, jax.random.PRNGKey(0))
  key = np.asarray(jax.random.PRNGKey(0))

  def step():
    nonlocal state
    state, _ = learner.learn(updater, state, batch, adv, key)
    jax.block_until_ready(state.step)

  seconds = median_seconds(step, repeats)
  rows = MicroBatch(tokens=batch.tokens_rt, attention_mask=batch.attention_mask_rt,
                    token_weight=np.ones(batch.tokens_rt.shape, np.float32),
                    behaviour_logp=batch.behaviour_logp_rt, advantage=adv)
  placed = updater.place(rows.split(len(adv)))
  program = updater.step_program(state, placed, batch.prompt_len)
  xla_flops = program.lower(state, placed).compile().cost_analysis().get("flops", float("nan"))
  rows_n, columns = batch.tokens_rt.shape
  flops = 3 * cfg.forward_flops(rows_n, columns, logit_columns=columns - 1)
  tokens = float(batch.attention_mask_rt.sum())
  return {"params": cfg.num_params, "rows": len(adv), "columns": columns,
          "seconds": seconds, "tokens_per_s": tokens / seconds, "flops": flops,
          "xla_flops": xla_flops, "flops_per_s": flops / seconds,
          "fraction_of_matmul": flops / seconds / peak}


def sparse_speedup(config, cfg, repeats: int, continuous: bool) -> dict[str, float]:
  config.k, config.n = 8, None
  spec = spec_lib.from_config(config)
  batch = synthetic_rollout(config, spec.sampling.n, cfg.vocab_size, p_correct=0.3, seed=2,
                            continuous=continuous)
  adv = spec_lib.EstimatorSpec(aggregator="pass_at_k", baseline="loo", k=8).advantages(
      batch.rewards_bn, batch.answer_ids_bn).reshape(-1)
  key = np.asarray(jax.random.PRNGKey(0))
  out = {}
  finals = {}
  for name, sparse in (("dense", False), ("sparse", True)):
    updater, params = build(config, cfg, sparse=sparse)
    start = updater.init_state(params, jax.random.PRNGKey(0))
    once, _ = learner.learn(updater, start, batch, adv, key)
    finals[name] = jax.tree.map(np.asarray, once.params)
    state = once

    def step():
      nonlocal state
      state, m = learner.learn(updater, state, batch, adv, key)
      jax.block_until_ready(state.step)
      out[f"{name}_rows_fraction"] = m["update/rows_fraction"]

    out[f"{name}_seconds"] = median_seconds(step, repeats)
  diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(finals["dense"]),
                                                          jax.tree.leaves(finals["sparse"])))
  assert diff < 1e-5, f"sparse and dense updates differ by {diff}"
  out["max_param_difference"] = diff
  out["nonzero_fraction"] = float(np.mean(adv != 0))
  out["speedup"] = out["dense_seconds"] / out["sparse_seconds"]
  return out


def time_split(steps: int) -> dict[str, float]:
  config = default_config()
  with tempfile.TemporaryDirectory() as workdir:
    config.workdir = workdir
    config.num_steps = steps
    config.sft_warmup.steps = 0
    config.eval.at_start = config.eval.at_end = False
    config.progress_bar = False
    config.checkpoint_every = steps
    loop.run(config)
    lines = metrics.read_jsonl(RunDirectory(workdir).metrics_jsonl)[1:]
  keys = ("time/sampling", "time/reward", "time/reference", "time/update", "time/other",
          "time/step", "throughput/tokens_per_s")
  return {k: statistics.median(line[k] for line in lines) for k in keys}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--split_steps", type=int, default=12)
  args = parser.parse_args()
  config = default_config()
  vocab = synthetic.make_tokenizer().vocab_size
  tiny = policy.policy_config(spec_lib.from_config(config).model, vocab, value_head=False)
  wide = model.preset("tiny", vocab_size=vocab, hidden_size=256, num_layers=4, num_heads=8,
                      num_kv_heads=4, head_dim=32, intermediate_size=1024)
  print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}, "
        f"{os.cpu_count()} CPU cores visible")
  peak = matmul_rate(args.repeats)
  print(f"1. dense float32 matmul 2048^3: {peak / 1e9:.1f} GFLOP/s")
  n = spec_lib.from_config(config).sampling.n
  print(f"2. update throughput on the default batch ({config.batch_prompts} prompts x "
        f"{n} completions):")
  for name, cfg in (("default (tiny)", tiny), ("wide (h256, 4 layers)", wide)):
    r = throughput(default_config(), cfg, n, args.repeats, peak)
    print(f"   {name}: {r['params']:,} params, [{r['rows']}, {r['columns']}] rows x columns: "
          f"{r['seconds'] * 1e3:.1f} ms/step, {r['tokens_per_s']:,.0f} tokens/s, "
          f"{r['flops'] / 1e9:.2f} GFLOP/step, {r['flops_per_s'] / 1e9:.2f} GFLOP/s = "
          f"{100 * r['fraction_of_matmul']:.1f}% of the matmul rate (XLA's count, loop bodies "
          f"once: {r['xla_flops'] / 1e9:.2f} GFLOP/step)")
  for (name, cfg), continuous in itertools.product(
      (("default (tiny)", tiny), ("wide (h256, 4 layers)", wide)), (False, True)):
    s = sparse_speedup(default_config(), cfg, args.repeats, continuous)
    rewards = "continuous rewards" if continuous else "+-1 rewards"
    print(f"3. sparse vs dense, pass@k leave-one-out k = 8, {name}, {rewards}: non-zero advantages "
          f"{100 * s['nonzero_fraction']:.1f}% of rows, sparse update on "
          f"{100 * s['sparse_rows_fraction']:.1f}% of rows: dense {s['dense_seconds'] * 1e3:.1f} "
          f"ms, sparse {s['sparse_seconds'] * 1e3:.1f} ms, speed-up {s['speedup']:.1f}x "
          f"(parameters equal to {s['max_param_difference']:.1e})")
  split = time_split(args.split_steps)
  total = split["time/step"]
  parts = ", ".join(f"{k.split('/')[1]} {split[k]:.3f}s ({100 * split[k] / total:.0f}%)"
                    for k in ("time/sampling", "time/reward", "time/reference", "time/update",
                              "time/other"))
  print(f"4. default config step (median of {args.split_steps - 1} steps after the first): "
        f"{total:.3f}s = {parts}; {split['throughput/tokens_per_s']:,.0f} generated tokens/s")


if __name__ == "__main__":
  main()

