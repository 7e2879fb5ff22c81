"""What the step checkpoints' checksum manifests cost, next to the save and restore they guard.

  python benchmarks/checkpoint_checksum.py                 # the default run's state and 135M
  python benchmarks/checkpoint_checksum.py --sizes=tiny --repeats=5

For each size it builds a trainer-shaped state (random parameters, AdamW's two moments, a step
counter; `ksjax.run.checkpoints.Checkpointer` saves exactly such a pytree with the data iterator
and the config) and, `--repeats` times, measures in one process:
  save:    Orbax's save of a new step until it is finalised (what `Checkpointer.save` starts),
  write:   `write_manifest` of that step (sha256 of every file, written atomically),
  restore: Orbax's restore of the step onto the abstract state,
  verify:  `verify_manifest` of the step (what `restore_latest` and the eval binary run first),
and prints the medians and the ratios write/save and verify/restore. The files are hashed right
after they were written or read, so they come from the page cache: the ratios are the hashing's
CPU cost, the part a faster disk does not shrink.

The trainer writes a manifest in a background thread as soon as Orbax has finished the step, so
a training step waits for it only when the next save is due before the hashing is done; the
restore-side cost is paid once per resume, and by the eval binary once per checkpoint.

Sizes: "tiny" is the state of the default run (configs/pass_at_k.py: the embedded task's
tokenizer and its model); "135m" has SmolLM2-135M's shape (30 layers, width 576, 49152
tokens; about 1.6 GB of float32 state), with random parameters: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from ksjax import model
from ksjax.model import checkpoint as model_checkpoint
from ksjax.run import checkpoints
from ksjax.run.directory import CONFIG_ITEM, DATA_ITEM, STATE_ITEM

# SmolLM2-135M (HuggingFaceTB/SmolLM2-135M config.json), as a LlamaConfig.
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                    head_dim=64, intermediate_size=1536, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_embeddings=True)


def default_run_config() -> model.LlamaConfig:
  """The LlamaConfig of the default run (configs/pass_at_k.py), as the trainer builds it."""
  from ksjax.run import config as defaults  # pylint: disable=g-import-not-at-top
  from ksjax.run import policy, spec as spec_lib  # pylint: disable=g-import-not-at-top
  from ksjax.run import tasks as run_tasks  # pylint: disable=g-import-not-at-top
  spec = spec_lib.from_config(defaults.embedded_task_config())
  task = run_tasks.make_task(spec.task, spec.model, spec.eval.split)
  return policy.policy_config(spec.model, task.tokenizer.vocab_size,
                              value_head=spec.loss.value_head)


def random_state(cfg: model.LlamaConfig, seed: int = 0) -> dict:
  """Random parameters of `cfg`'s shapes with AdamW's state: a TrainState's arrays."""
  shapes = nnx.to_pure_dict(nnx.state(model_checkpoint.abstract_model(cfg), nnx.Param))
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape, np.float32)), shapes)
  opt_state = optax.adamw(1e-4).init(params)
  # Moments of zeros would compress to nothing; after a few steps they are as random as params.
  opt_state = jax.tree.map(
      lambda x: jnp.asarray(rng.standard_normal(x.shape, np.float32)) if x.ndim else x, opt_state)
  return {"params": params, "opt_state": opt_state, "step": jnp.int32(1)}


def _bytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def measure(state: dict, repeats: int) -> dict[str, float]:
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  times: dict[str, list[float]] = {"save": [], "write": [], "restore": [], "verify": []}
  with tempfile.TemporaryDirectory(prefix="ksjax_checksum_bench_") as directory:
    manager = ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True),
        item_names=(STATE_ITEM, DATA_ITEM, CONFIG_ITEM))
    for step in range(1, repeats + 1):
      iterator = iter(grain.MapDataset.source(list(range(64))).batch(4).to_iter_dataset())
      next(iterator)
      t0 = time.perf_counter()
      manager.save(step, args=ocp.args.Composite(**{
          STATE_ITEM: ocp.args.StandardSave(state),
          DATA_ITEM: grain.checkpoint.CheckpointSave(iterator),
          CONFIG_ITEM: ocp.args.JsonSave({"step": step})}))
      manager.wait_until_finished()
      t1 = time.perf_counter()
      step_dir = os.path.join(directory, str(step))
      checkpoints.write_manifest(step_dir)
      t2 = time.perf_counter()
      restored = manager.restore(step, args=ocp.args.Composite(**{
          STATE_ITEM: ocp.args.StandardRestore(abstract)}))
      jax.block_until_ready(restored[STATE_ITEM])
      t3 = time.perf_counter()
      assert checkpoints.verify_manifest(step_dir)
      t4 = time.perf_counter()
      for name, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
        times[name].append(seconds)
      del restored
    on_disk = sum(os.path.getsize(os.path.join(root, f))
                  for root, _, names in os.walk(os.path.join(directory, str(repeats)))
                  for f in names)
    manager.close()
  out = {name: statistics.median(values) for name, values in times.items()}
  out["bytes_on_disk"] = on_disk
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="tiny,135m", help="comma-separated: tiny, 135m")
  parser.add_argument("--repeats", type=int, default=3, help="saves per size (medians reported)")
  args = parser.parse_args()
  configs = {"tiny": default_run_config, "135m": lambda: model.LlamaConfig(**SMOLLM2_135M)}
  print(f"{'size':>5} {'params':>11} {'on disk':>10} {'save s':>8} {'write s':>8} "
        f"{'write/save':>10} {'restore s':>9} {'verify s':>8} {'verify/restore':>14}")
  for size in args.sizes.split(","):
    if size not in configs:
      raise SystemExit(f"--sizes: {size!r} is not accepted; expected tiny or 135m")
    cfg = dataclasses.replace(configs[size](), param_dtype="float32", dtype="float32")
    state = random_state(cfg)
    r = measure(state, args.repeats)
    print(f"{size:>5} {cfg.num_params:>11,} {r['bytes_on_disk'] / 2**20:>8.1f}Mi "
          f"{r['save']:>8.3f} {r['write']:>8.3f} {r['write'] / r['save']:>10.3f} "
          f"{r['restore']:>9.3f} {r['verify']:>8.3f} {r['verify'] / r['restore']:>14.3f}",
          flush=True)
    del state


if __name__ == "__main__":
  main()
