"""Forward+backward throughput of the Llama as a fraction of this machine's dense matmul FLOP/s.

  python benchmarks/model.py [--presets=tiny,small25m] [--batch=2] [--seq=512] [--reps=5]

Both numbers come from the same run on the same device, so the ratio is meaningful on a shared,
noisy machine where absolute FLOP/s are not. Model FLOPs are counted analytically (6 per parameter
per token for every matmul weight, plus the causal attention score and value products, forward and
backward; the embedding gather is not a matmul) and, as a cross-check, by XLA's cost analysis of
the compiled step. On an accelerator the same script reports MFU against the matmul roofline it
measures (pass --dtype=bfloat16 --presets=llama3.2-1b there).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import optax
from absl import app, flags
from flax import nnx

from ksjax import model

_PRESETS = flags.DEFINE_list("presets", ["tiny", "small25m"], "Model presets to time.")
_BATCH = flags.DEFINE_integer("batch", 2, "Sequences per step.")
_SEQ = flags.DEFINE_integer("seq", 512, "Tokens per sequence.")
_REPS = flags.DEFINE_integer("reps", 10, "Timed repetitions (the fastest is reported).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Params and compute.")
_MATMUL_N = flags.DEFINE_integer("matmul_n", 2048, "Side of the square matmul roofline.")


def _best_seconds(fn, reps: int) -> float:
  """Fastest of `reps` runs: on a shared machine slower runs measure the neighbours, not us."""
  jax.block_until_ready(fn())  # compile and warm up
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return min(times)


def matmul_flops_per_second(n: int, dtype: str, reps: int) -> float:
  a = jax.random.normal(jax.random.key(0), (n, n), dtype)
  b = jax.random.normal(jax.random.key(1), (n, n), dtype)
  mm = jax.jit(lambda a, b: a @ b)
  return 2 * n ** 3 / _best_seconds(lambda: mm(a, b), reps)


def analytic_train_flops(cfg: model.LlamaConfig, batch: int, seq: int) -> float:
  """Forward + backward FLOPs of one step (3x the forward's 2 per multiply-add)."""
  d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  per_layer_weights = d * h * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * d * f
  matmul_weights = cfg.num_layers * per_layer_weights + cfg.vocab_size * d  # + lm head
  tokens = batch * seq
  # Scores and weighted values over the full T x T (the mask is applied, not skipped).
  attention = cfg.num_layers * 2 * 2 * batch * seq * seq * cfg.num_heads * h
  return 3 * (2 * matmul_weights * tokens + attention)


def train_step_seconds(cfg: model.LlamaConfig, batch: int, seq: int, reps: int):
  llama = model.Llama(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(llama)
  tokens = jax.random.randint(jax.random.key(2), (batch, seq), 0, cfg.vocab_size)

  def loss(params, tokens):
    logits = nnx.merge(graphdef, params)(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

  step = jax.jit(jax.value_and_grad(loss))
  compiled = step.lower(params, tokens).compile()
  cost = compiled.cost_analysis()
  xla_flops = float((cost[0] if isinstance(cost, list) else cost).get("flops", float("nan")))
  return _best_seconds(lambda: step(params, tokens), reps), xla_flops


def main(argv):
  del argv
  dtype = _DTYPE.value
  device = jax.devices()[0]
  peak = matmul_flops_per_second(_MATMUL_N.value, dtype, _REPS.value)
  print(f"device: {device.device_kind} ({jax.default_backend()}), dtype {dtype}, "
        f"{_BATCH.value}x{_SEQ.value} tokens per step")
  print(f"dense matmul {_MATMUL_N.value}^3: {peak / 1e9:.1f} GFLOP/s (measured now)")
  header = (f"{'preset':<12} {'params':>10} {'step s':>8} {'GFLOP/step':>11} {'XLA GFLOP':>10} "
            f"{'GFLOP/s':>9} {'of matmul':>9}")
  print(header)
  print("-" * len(header))
  for name in _PRESETS.value:
    cfg = dataclasses.replace(model.preset(name), param_dtype=dtype, dtype=dtype)
    seconds, xla_flops = train_step_seconds(cfg, _BATCH.value, _SEQ.value, _REPS.value)
    flops = analytic_train_flops(cfg, _BATCH.value, _SEQ.value)
    rate = flops / seconds
    print(f"{name:<12} {cfg.num_params / 1e6:>9.2f}M {seconds:>8.4f} {flops / 1e9:>11.2f} "
          f"{xla_flops / 1e9:>10.2f} {rate / 1e9:>9.1f} {rate / peak:>8.1%}")


if __name__ == "__main__":
  app.run(main)
