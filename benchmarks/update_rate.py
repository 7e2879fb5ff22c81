"""The update's FLOP rate on SmolLM2-135M's shape against the machine's dense matmul rate.

    python benchmarks/update_rate.py [--rows=32,4] [--columns=128] [--parts=model,head,kernels]
        [--matmul_dtypes=float32,bfloat16] [--baseline=REV] [--repeats=3]

In one run, after the CPU line (`ksjax.machine.describe`), the allocator line and jax's version:
  model    the forward (`model.token_logprobs`, the trainer's reference forward) and the forward +
           backward (the gradient of a weighted sum of those log-probs with respect to every
           parameter, the update without its optimizer) of a randomly initialised model of
           SmolLM2-135M's shape, for each of --rows x --columns tokens and each matmul operand
           dtype (`LlamaConfig.matmul_dtype`; the weights stay float32, as the SmolLM2 configs
           keep them). Model FLOPs are `LlamaConfig.forward_flops` (forward + backward 3x the
           forward), printed as a share of the dense 2048^3 matmul rate with the same operand
           dtype (float32 accumulation), timed in the same alternating rounds as the model, by
           wall time and by CPU time (`shares` says why both).
  head     the head alone (`logprobs.chunked_logprobs`, forward + backward, at the largest of
           --rows) with its default blocks and with the [B * 128, 8192] ones it had before.
  kernels  each weight's product of a decoder layer alone at --kernel_rows rows, with its input
           gradient dy W^T and its weight gradient x^T dy as `layers._mixed_matmul` writes them
           (x^T a row-major copy, `layers.transposed`), each a share of the dense rate of its
           operand dtype by wall time; and one layer's float32 attention, forward + backward
           (`layers.attend`). What these reach bounds what the model can.
  depth    (not in the default --parts) the forward + backward at 1, 8 and 30 layers, the slope
           being a layer's cost inside the model, and the MLP alone against a chain of 30 of
           them (`part_depth`): how much of the gap to the parts' own rates is composition.
--baseline=REV runs the model part again in a child process on revision REV's `ksjax` package
(`git archive`; the working tree is not touched) and prints its lines marked [REV], for the
side-by-side with the code before a change.

The script re-executes itself with the entry points' allocator (`ksjax.allocator`; KSJAX_MALLOC
chooses). Timings are the fastest of --repeats rounds after a warm-up call; on a shared machine
they are noisy, so compare the shares, which are ratios within one round.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)


def _package_root() -> str:
  """The directory `ksjax` is imported from: --package_root (a baseline's child) or the repo."""
  for i, arg in enumerate(sys.argv):
    if arg.startswith("--package_root="):
      return arg.split("=", 1)[1]
    if arg == "--package_root" and i + 1 < len(sys.argv):
      return sys.argv[i + 1]
  return ROOT


sys.path.insert(0, _package_root())

import jax  # noqa: E402  pylint: disable=wrong-import-position
import jax.numpy as jnp  # noqa: E402  pylint: disable=wrong-import-position
import numpy as np  # noqa: E402  pylint: disable=wrong-import-position
from flax import nnx  # noqa: E402  pylint: disable=wrong-import-position

from ksjax import allocator, machine, model  # noqa: E402  pylint: disable=wrong-import-position

# SmolLM2-135M (HuggingFaceTB/SmolLM2-135M config.json).
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                    head_dim=64, intermediate_size=1536, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_embeddings=True)
DENSE = 2048


def fastest(fns: dict, repeats: int) -> tuple[dict[str, float], dict[str, float]]:
  """One warm-up call each, then `repeats` alternating rounds; the fastest wall seconds and the
  fewest CPU seconds (this process's threads together) of each."""
  for fn in fns.values():
    fn()
  wall, cpu = {}, {}
  for _ in range(repeats):
    for name, fn in fns.items():
      start, start_cpu = time.perf_counter(), time.process_time()
      fn()
      wall[name] = min(wall.get(name, float("inf")), time.perf_counter() - start)
      cpu[name] = min(cpu.get(name, float("inf")), time.process_time() - start_cpu)
  return wall, cpu


def dense_product(operand_dtype: str):
  """A call of the dense [n, n] x [n, n] product with `operand_dtype` operands and a float32
  result, and its FLOPs (2 n^3)."""
  a = jax.random.normal(jax.random.key(0), (DENSE, DENSE), jnp.float32).astype(operand_dtype)
  dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  return (lambda: dot(a, a).block_until_ready()), 2 * DENSE ** 3


def shares(calls: dict, repeats: int, dtypes=("float32", "bfloat16")) -> dict:
  """Times `calls` ({name: (call, flops)}) in alternating rounds with the dense product of each
  of `dtypes`. Returns {name: (wall seconds, FLOP/s, {dtype: share of that dense rate by wall
  time}, {dtype: the same by CPU time})}, and for "dense <dtype>" its rate.

  Why CPU time too: on a machine shared with other work the process gets a varying part of the
  cores, and the dense product, short, may find them free where a long program does not; FLOPs
  per CPU second of each program are what a quiet machine's shares would be, as long as both
  keep every core busy."""
  dense = {d: dense_product(d) for d in dtypes}
  fns = {**{n: c for n, (c, _) in calls.items()},
         **{f"dense {d}": c for d, (c, _) in dense.items()}}
  wall, cpu = fastest(fns, repeats)
  out = {f"dense {d}": flops / wall[f"dense {d}"] for d, (_, flops) in dense.items()}
  for name, (_, flops) in calls.items():
    by_wall = {d: flops / wall[name] / (df / wall[f"dense {d}"]) for d, (_, df) in dense.items()}
    by_cpu = {d: flops / cpu[name] / (df / cpu[f"dense {d}"]) for d, (_, df) in dense.items()}
    out[name] = (wall[name], flops / wall[name], by_wall, by_cpu)
  return out


def share_line(name: str, result, dtype: str, width: int = 17) -> str:
  seconds, rate, by_wall, by_cpu = result
  return (f"{name:{width}s} {seconds:8.3f} s {rate / 1e9:7.1f} GFLOP/s = {by_wall[dtype]:4.0%} of "
          f"the {dtype} dense rate ({by_cpu[dtype]:4.0%} by CPU time)")


def model_programs(cfg: model.LlamaConfig, rows: int, columns: int):
  """The jitted forward and forward + backward over random tokens, as argument-less calls."""
  llama = model.Llama(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(llama)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (rows, columns)), jnp.int32)
  mask = jnp.ones((rows, columns), jnp.int32)
  weights = jnp.asarray(rng.standard_normal((rows, columns)), jnp.float32)

  def logp(params):
    return model.token_logprobs(nnx.merge(graphdef, params), tokens, mask)[0]

  forward = jax.jit(logp)
  gradient = jax.jit(jax.grad(lambda params: (weights * logp(params)).sum()))
  return ((lambda: forward(params).block_until_ready()),
          (lambda: jax.block_until_ready(gradient(params))))


def part_model(rows_list, columns: int, matmul_dtypes, repeats: int, tag: str = "") -> None:
  for matmul_dtype in matmul_dtypes:
    cfg = model.LlamaConfig(**SMOLLM2_135M,
                            matmul_dtype=None if matmul_dtype == "float32" else matmul_dtype)
    for rows in rows_list:
      forward, gradient = model_programs(cfg, rows, columns)
      flops = cfg.forward_flops(rows, columns, logit_columns=columns - 1)
      out = shares({"forward": (forward, flops), "forward+backward": (gradient, 3 * flops)},
                   repeats)
      print(f"{tag}[model] matmul_dtype {matmul_dtype}, {rows} x {columns} tokens; dense "
            f"{DENSE}^3 this round: {out['dense float32'] / 1e9:.1f} GFLOP/s float32, "
            f"{out['dense bfloat16'] / 1e9:.1f} with bfloat16 operands", flush=True)
      for name in ("forward", "forward+backward"):
        print(f"{tag}  {share_line(name, out[name], matmul_dtype)}", flush=True)
      del forward, gradient


def part_head(rows: int, columns: int, matmul_dtypes, repeats: int) -> None:
  """The head alone (`chunked_logprobs`, forward + backward, SmolLM2's tied [49152, 576] head)
  with its default blocks and with the [rows * 128, 8192] blocks it had before."""
  from ksjax.model import logprobs  # pylint: disable=import-outside-toplevel
  cfg = model.LlamaConfig(**SMOLLM2_135M)
  v, d, n = cfg.vocab_size, cfg.hidden_size, columns - 1
  rng = np.random.default_rng(0)
  h = jnp.asarray(rng.standard_normal((rows, n, d)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((v, d)) * 0.05, jnp.float32)
  targets = jnp.asarray(rng.integers(0, v, (rows, n)), jnp.int32)
  weights = jnp.asarray(rng.standard_normal((rows, n)), jnp.float32)
  flops = 3 * 2 * rows * n * d * v
  for matmul_dtype in matmul_dtypes:
    calls = {}
    for name, chunks in (("default blocks", {}),
                         ("128 x 8192 blocks", {"seq_chunk": 128, "vocab_chunk": 8192})):
      def loss(h, w, chunks=chunks):
        logp, ent = logprobs.chunked_logprobs(h, w, 0, targets, operand_dtype=matmul_dtype,
                                              **chunks)
        return (weights * logp).sum() + 0.1 * ent.sum()
      grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
      calls[name] = ((lambda grad=grad: jax.block_until_ready(grad(h, w))), flops)
    out = shares(calls, repeats, (matmul_dtype,))
    for name in calls:
      print(f"[head] {matmul_dtype} {rows} x {n} positions, forward+backward, "
            f"{share_line(name, out[name], matmul_dtype)}", flush=True)


def part_kernels(rows: int, matmul_dtypes, repeats: int) -> None:
  """Each weight product of a decoder layer and its two gradient products, and the attention
  (float32, as the model computes it), each timed alone."""
  from ksjax.model import layers  # pylint: disable=import-outside-toplevel
  cfg = model.LlamaConfig(**SMOLLM2_135M)
  d, f, qh, kh = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim,
                  cfg.num_kv_heads * cfg.head_dim)
  shapes = {"q, o [576, 576]": (d, qh), "k, v [576, 192]": (d, kh),
            "gate, up [576, 1536]": (d, f), "down [1536, 576]": (f, d),
            "head slice [576, 2048]": (d, 2048)}
  f32 = jnp.float32
  products = {  # as `layers._mixed_matmul` and its backward write them
      "x W": jax.jit(lambda x, w, dy: jnp.dot(x, w, preferred_element_type=f32)),
      "dy W^T": jax.jit(lambda x, w, dy: jnp.einsum("mn,kn->mk", dy, w,
                                                    preferred_element_type=f32)),
      "x^T dy": jax.jit(lambda x, w, dy: jnp.dot(layers.transposed(x), dy,
                                                 preferred_element_type=f32)),
  }
  for matmul_dtype in matmul_dtypes:
    for name, (k, n) in shapes.items():
      keys = jax.random.split(jax.random.key(1), 3)
      args = (jax.random.normal(keys[0], (rows, k), matmul_dtype),
              jax.random.normal(keys[1], (k, n), matmul_dtype),
              jax.random.normal(keys[2], (rows, n), matmul_dtype))
      calls = {p: ((lambda fn=fn: fn(*args).block_until_ready()), 2 * rows * k * n)
               for p, fn in products.items()}
      out = shares(calls, repeats, (matmul_dtype,))
      print(f"[kernels] {matmul_dtype} operands, {rows} rows, {name:22s}: " + ", ".join(
          f"{p} {out[p][2][matmul_dtype]:4.0%}" for p in calls) + " of the dense rate",
          flush=True)
  b, t = rows // 128, 128
  keys = jax.random.split(jax.random.key(2), 4)
  q, dout = (jax.random.normal(kk, (b, t, cfg.num_heads, cfg.head_dim)) for kk in keys[:2])
  k_, v_ = (jax.random.normal(kk, (b, t, cfg.num_kv_heads, cfg.head_dim)) for kk in keys[2:])
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  attention = jax.jit(jax.grad(lambda q, k, v: (layers.attend(q, k, v, mask) * dout).sum(),
                               argnums=(0, 1, 2)))
  flops = 3 * 4 * b * cfg.num_heads * cfg.head_dim * t * t  # as `LlamaConfig.forward_flops`
  out = shares({"attention": ((lambda: jax.block_until_ready(attention(q, k_, v_))), flops)},
               repeats)
  print(f"[kernels] one layer's attention (float32), {b} x {t} tokens, forward+backward: "
        f"{share_line('', out['attention'], 'bfloat16', 0)}; "
        f"{out['attention'][2]['float32']:.0%} of the float32 dense rate", flush=True)


def part_depth(rows: int, columns: int, matmul_dtypes, repeats: int,
               depths=(1, 8, 30)) -> None:
  """What a decoder layer costs inside the model against the same work alone: the forward +
  backward of the model at each of `depths` layers (the rest of SmolLM2's shape kept), the
  slope between consecutive depths being one layer's cost there (the intercept is the head and
  the embedding); and the MLP (`layers.swiglu`, its hand-written backward) alone and as a chain
  of the model's depth, each block with its own weights and a residual add, unrolled as the
  model runs its layers."""
  from ksjax.model import layers  # pylint: disable=import-outside-toplevel
  d, f = SMOLLM2_135M["hidden_size"], SMOLLM2_135M["intermediate_size"]
  for matmul_dtype in matmul_dtypes:
    operand = None if matmul_dtype == "float32" else matmul_dtype
    calls, flops_of = {}, {}
    for n in depths:
      cfg = model.LlamaConfig(**{**SMOLLM2_135M, "num_layers": n}, matmul_dtype=operand)
      flops_of[n] = 3 * cfg.forward_flops(rows, columns, logit_columns=columns - 1)
      calls[f"{n} layers"] = (model_programs(cfg, rows, columns)[1], flops_of[n])
    keys = jax.random.split(jax.random.key(3), 4)
    x = jax.random.normal(keys[0], (rows, columns, d)) * 0.05
    mlp_flops = 3 * 2 * 3 * rows * columns * d * f
    for n in (1, max(depths)):
      ws = [jax.random.normal(k, (n,) + shape) * 0.05
            for k, shape in zip(keys[1:], ((d, f), (d, f), (f, d)))]

      def chain(x, gate, up, down, n=n):
        for i in range(n):
          x = x + layers.swiglu(x, gate[i], up[i], down[i], jnp.float32, operand)
        return x.sum()
      grad = jax.jit(jax.grad(chain, argnums=(0, 1, 2, 3)))
      calls[f"{n} MLPs"] = ((lambda grad=grad, ws=ws: jax.block_until_ready(grad(x, *ws))),
                            n * mlp_flops)
    out = shares(calls, repeats, (matmul_dtype,))
    print(f"[depth] {matmul_dtype} operands, {rows} x {columns} tokens, forward+backward; dense "
          f"{DENSE}^3 this round {out[f'dense {matmul_dtype}'] / 1e9:.1f} GFLOP/s", flush=True)
    for name in calls:
      print(f"  {share_line(name, out[name], matmul_dtype)}", flush=True)
    for a, b in zip(depths, depths[1:]):
      seconds = (out[f"{b} layers"][0] - out[f"{a} layers"][0]) / (b - a)
      rate = (flops_of[b] - flops_of[a]) / (b - a) / seconds
      print(f"  a layer in the model between {a} and {b} layers: {seconds * 1e3:.1f} ms, "
            f"{rate / out[f'dense {matmul_dtype}']:.0%} of the dense rate", flush=True)
    deep = max(depths)
    print(f"  an MLP alone {out['1 MLPs'][0] * 1e3:.1f} ms, in a chain of {deep} "
          f"{out[f'{deep} MLPs'][0] / deep * 1e3:.1f} ms each", flush=True)
    del calls


def model_children(args, baseline_root: str | None) -> None:
  """The model part, each matmul dtype and row count in its own child process: one
  configuration's buffers are handed back before the next one's (the entry points' allocator
  keeps what a process frees). With a baseline, its child runs just before this tree's for the
  same configuration, so that both meet much the same load on a shared machine."""
  for matmul_dtype in args.matmul_dtypes.split(","):
    for rows in args.rows.split(","):
      child = [sys.executable, os.path.abspath(__file__), "--parts=model", "--child",
               f"--rows={rows}", f"--matmul_dtypes={matmul_dtype}", f"--columns={args.columns}",
               f"--repeats={args.repeats}"]
      if baseline_root:
        subprocess.run(child + [f"--package_root={baseline_root}", f"--tag=[{args.baseline}] "],
                       check=True)
      subprocess.run(child, check=True)


def with_baseline(rev: str, fn) -> None:
  """fn(package_root) with revision `rev`'s ksjax package unpacked into a temporary directory."""
  with tempfile.TemporaryDirectory(prefix="update-rate-") as tmp:
    archive = os.path.join(tmp, "ksjax.tar")
    subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", "-o", archive, rev, "ksjax"],
                   check=True)
    with tarfile.open(archive) as tar:
      tar.extractall(tmp, filter="data")
    fn(tmp)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rows", default="32,4")
  parser.add_argument("--columns", type=int, default=128)
  parser.add_argument("--matmul_dtypes", default="float32,bfloat16")
  parser.add_argument("--parts", default="model,head,kernels")
  parser.add_argument("--kernel_rows", type=int, default=4096)
  parser.add_argument("--baseline", default=None, help="a git revision to compare against")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--package_root", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--tag", default="", help=argparse.SUPPRESS)
  args = parser.parse_args()
  dtypes = args.matmul_dtypes.split(",")
  parts = args.parts.split(",")
  if args.child:
    part_model([int(r) for r in args.rows.split(",")], args.columns, dtypes, args.repeats,
               args.tag)
    return
  print(f"CPU: {machine.describe()}; jax {jax.__version__}; {allocator.allocator_line()}",
        flush=True)
  if "model" in parts:
    if args.baseline:
      with_baseline(args.baseline, lambda root: model_children(args, root))
    else:
      model_children(args, None)
  if "head" in parts:
    part_head(max(int(r) for r in args.rows.split(",")), args.columns, dtypes, args.repeats)
  if "kernels" in parts:
    part_kernels(args.kernel_rows, dtypes, args.repeats)
  if "depth" in parts:
    part_depth(max(int(r) for r in args.rows.split(",")), args.columns, dtypes, args.repeats)


if __name__ == "__main__":
  allocator.reexec_with_allocator("update_rate.py")  # as the entry points do (malloc_environment)
  main()
