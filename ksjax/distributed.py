"""Multi-host runs: one process per host, all of them running the same program over one mesh.

ksjax uses JAX's multi-controller runtime. Every process (one per TPU VM worker or GPU host)
runs `python -m ksjax.main` with the same config; `initialize()` joins them into one runtime whose
devices form the global mesh, and every jitted program (sampler, update) then runs SPMD over all
of them. What stays on the host is kept identical on every process, so that all of them pass the
same arguments to every program:

  * data:    each process reads only its shard of the prompt stream (grain's
             `ShardByJaxProcess` in `ksjax.tasks.data.batch_iterator`); `gather` exchanges the
             step's prompts (token ids, a few kilobytes) so every process holds the global batch,
             in process order, which is exactly the batch a single process would have read;
  * outputs: the sampler's and the learner's outputs are global arrays of which each process
             holds some shards; `to_host` makes their whole value a host array on every process;
  * rewards: `ShardedScoring` has each process score only its own prompts' completions (the
             expensive part: running programs, checking answers) and gathers the scores;
  * files:   `is_writer()` (process 0) writes logs, metrics and JSON; Orbax checkpoints are
             written by all processes together (each its own shards; the data iterator's state
             one file per process), so checkpoint calls are made on every process.

How processes find each other (`initialize`):
  * KSJAX_COORDINATOR_ADDRESS (host:port of process 0), KSJAX_NUM_PROCESSES and
    KSJAX_PROCESS_ID, when set (plain ssh launches, tests: `experiments/launch_gpu_cluster.sh`);
  * otherwise JAX's own detection: Cloud TPU pod slices, SLURM, Open MPI, Kubernetes;
  * otherwise one process.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from ksjax.config_validation import ConfigError
from ksjax.model import sharding

ENV_COORDINATOR = "KSJAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "KSJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "KSJAX_PROCESS_ID"


def environment_settings() -> tuple[str, int, int] | None:
  """(coordinator address, process count, process id) from the environment, or None if unset.

  Raises ConfigError naming the variable when only some are set or one is malformed.
  """
  names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
  values = [os.environ.get(name) for name in names]
  if not any(values):
    return None
  missing = [n for n, v in zip(names, values) if not v]
  if missing:
    raise ConfigError(f"{', '.join(missing)} not set; a multi-process run needs all of "
                      f"{', '.join(names)}")
  address, count, index = values
  if ":" not in address:
    raise ConfigError(f"{ENV_COORDINATOR}={address!r} is not accepted; expected host:port of "
                      "process 0")
  try:
    count, index = int(count), int(index)
  except ValueError:
    raise ConfigError(f"{ENV_NUM_PROCESSES}={values[1]!r} and {ENV_PROCESS_ID}={values[2]!r}: "
                      "expected integers") from None
  if count < 1 or not 0 <= index < count:
    raise ConfigError(f"{ENV_PROCESS_ID}={index} with {ENV_NUM_PROCESSES}={count} is not "
                      f"accepted; expected a count >= 1 and 0 <= id < count")
  return address, count, index


def _backend_started() -> bool:
  # JAX has no public way to ask whether its backend is up; jax.distributed.initialize() must
  # come before it is.
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  return xla_bridge.backends_are_initialized()


def initialize() -> None:
  """Joins this process to the multi-process runtime, if the run has several processes.

  Call first thing, before any JAX computation. Does nothing if already joined, or if JAX is
  already in use by this process (a single-process caller, e.g. a test that then calls the
  trainer).
  """
  if jax.distributed.is_initialized():
    return
  settings = environment_settings()
  if settings is not None:
    address, count, index = settings
    if count > 1:
      jax.distributed.initialize(address, count, index)
    return
  if _backend_started():
    return
  try:
    jax.distributed.initialize()  # TPU pods, SLURM, Open MPI, Kubernetes
  except ValueError:
    pass  # JAX found no cluster environment (it asks for a coordinator address): one process


def is_writer() -> bool:
  """Whether this process writes logs, metrics and other single files (process 0)."""
  return jax.process_index() == 0


# ---------------------------------------------------------------------------------------------
# Host values across processes
# ---------------------------------------------------------------------------------------------

def gather(obj: Any) -> list[Any]:
  """[obj of process 0, obj of process 1, ...] on every process (any picklable value).

  multihost_utils moves arrays only; objects travel as their pickles, padded to a common length.
  Pickles are safe here, unlike in a file: the bytes go from one process of this job to another
  (the same program, in memory, over the job's own collectives) and are never written to or read
  from disk, so nothing outside the job can supply them.
  """
  if jax.process_count() == 1:
    return [obj]
  data = np.frombuffer(pickle.dumps(obj), np.uint8)
  lengths = multihost_utils.process_allgather(np.asarray([len(data)], np.int64))
  padded = np.zeros(int(lengths.max()), np.uint8)
  padded[:len(data)] = data
  rows = multihost_utils.process_allgather(padded)  # [processes, max length]
  return [pickle.loads(row[:n].tobytes()) for row, n in zip(rows, lengths.ravel())]


def gather_list(items: Sequence[Any]) -> list[Any]:
  """The concatenation, in process order, of every process's `items`."""
  return [item for part in gather(list(items)) for item in part]


def to_host(tree: Any) -> Any:
  """Every jax.Array leaf of `tree` as a numpy array of its whole (global) value, on every
  process; other leaves unchanged."""

  def one(x):
    if not isinstance(x, jax.Array):
      return x
    if x.is_fully_addressable:
      return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  return jax.tree.map(one, tree)


def create_sharded(make: Callable[[], nnx.Module], mesh: jax.sharding.Mesh) -> nnx.Module:
  """`make()` with every parameter created directly in its partition-spec sharding.

  Creating the module on one device and then moving it is not possible across processes (a
  process cannot place its local arrays on another's devices), and would need the whole model on
  one device; jit with out_shardings creates each shard where it lives.
  """
  graphdef, abstract = nnx.split(nnx.eval_shape(make))
  shardings = sharding.state_shardings(abstract, mesh)
  state = jax.jit(lambda: nnx.state(make()), out_shardings=shardings)()
  return nnx.merge(graphdef, state)


# ---------------------------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------------------------

class ShardedScoring:
  """A task whose `score` has each process score an equal share of the groups.

  Every process calls `score` with the same (global) prompts and completions; process p scores
  the groups [p * G / P, (p + 1) * G / P) (its own data shard's prompts, when G is the step's
  batch) and the scores are gathered, so every process returns all G in order. Everything else
  is the wrapped task's.
  """

  def __init__(self, task):
    self._task = task

  def __getattr__(self, name: str):
    return getattr(self._task, name)

  def score(self, prompts: Sequence[Any], completions: Sequence[Sequence[str]]) -> list[Any]:
    processes, index = jax.process_count(), jax.process_index()
    if processes == 1:
      return self._task.score(prompts, completions)
    bounds = np.linspace(0, len(prompts), processes + 1).round().astype(int)
    lo, hi = bounds[index], bounds[index + 1]
    mine = self._task.score(prompts[lo:hi], completions[lo:hi]) if hi > lo else []
    return gather_list(mine)


__all__ = ["ENV_COORDINATOR", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "ShardedScoring",
           "create_sharded", "environment_settings", "gather", "gather_list", "initialize",
           "is_writer", "to_host"]
