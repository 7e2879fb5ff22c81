"""Asynchronous rollouts: the sampler runs ahead of the learner (the paper's asynchronous training).

In lockstep (config.max_lag = 0, the default) step s samples with the parameters it then updates,
and the loop does not use this module. With max_lag = L > 0, the completions of step s come from
the parameters of step max(0, s - L) (the learner's after that many updates): a worker thread
samples them while the learner still updates on earlier steps' completions, and the lag is L
after the first L steps (the first ones use the start parameters; their lag is s).

The schedule is fixed, not "whatever is ready", so that a run is reproducible:
  * at the start of step s the learner pushes its parameters theta_s (`Rollouts.push`), which
    starts every rollout up to s + L not started yet, each with the parameters it was given;
  * the learner then takes step s's rollout (`Rollouts.take`), waiting if it is not done;
  * rollouts run one at a time, in step order, on one worker thread, which alone draws prompts
    from the data iterator; each derives its sampling key from the run's random key exactly as
    the lockstep loop does (`split(rng, 3)` per step), so a rollout's seed depends on its step
    only.
So at most L + 1 rollouts are started ahead, and the worker idles when it is L steps ahead (the
"rollouts run ahead" of the issue, bounded by L).

Where it samples. With config.sampler_devices = D > 0 the last D devices form the sampler's own
sub-mesh (shaped by config.sampler_mesh) and the learner's config.mesh takes the others
(`meshes`); pushed parameters move there device to device (`jax.device_put` onto the sampler's
shardings). With D = 0 the sampler shares the learner's devices and holds a copy of the
parameters (the update donates its state, so the learner's own buffers cannot be lent). Either
way the sampler holds its own parameter copy, which the memory plan counts
(`ksjax.trainer.memory_plan`). One process only: with several, the worker's collectives would
interleave with the learner's in a different order on each host.

The correction. The sampler's log-probabilities are already recorded (`Rollout.behaviour_logp_rt`)
and the losses already weigh by truncated importance weights (config.is_cap; config.is_level
"group" for the weight that is unbiased for k-sample estimators, `ksjax.trainer.losses`); the
loop logs the lag (async/lag) and the weights' mean, max and truncated fraction (is/*).

Exact resume. At a checkpoint the rollouts started ahead (steps s..s+L-1 after step s's update)
are waited for and written beside it (`save_pending`, `<workdir>/rollouts/<step>.pkl`) before
Orbax saves the data iterator, which the idle worker no longer moves; a resumed run takes them
back (`load_pending`) and continues the key chain after them. They are pickled because a rollout
holds the task's `Prompt` objects, whose `reference` is whatever the task scores against. Rollouts
are started L steps ahead whatever num_steps is, so that a run stopped at num_steps (or by its
CPU budget) and resumed with more steps continues exactly as one run would; the price is L
rollouts sampled and not used at the end of a run.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import glob
import hashlib
import math
import os
import pickle
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from ksjax import files, model
from ksjax.config_validation import ConfigError
from ksjax.run.checkpoints import ChecksumError
from ksjax.run.spec import TrainSpec
from ksjax.trainer import dynamic

ROLLOUTS_DIR = "rollouts"  # beside `checkpoints` in the work directory
# A rollouts file is this header line with the sha256 of the pickle that follows it, so that a
# file changed after it was written (a disk error, a copy cut short) is refused by name instead
# of unpickled into a wrong resume. Checkpoints carry a manifest (run/checkpoints.py); this file
# lives beside them, written at the same step, so it carries its own digest.
_HEADER = b"ksjax-rollouts 1 sha256 "


def meshes(spec: TrainSpec) -> tuple[jax.sharding.Mesh, jax.sharding.Mesh | None]:
  """(the learner's mesh, the sampler's own sub-mesh or None when it shares the learner's)."""
  s = spec.sampling
  if s.max_lag and jax.process_count() > 1:
    raise ConfigError(f"config.max_lag={s.max_lag} is not accepted on {jax.process_count()} "
                      "processes; asynchronous rollouts run in one process; expected max_lag=0")
  devices = jax.devices()
  if not s.sampler_devices:
    return model.make_mesh(spec.run.mesh), None
  total = len(devices)
  if s.sampler_devices >= total:
    raise ConfigError(f"config.sampler_devices={s.sampler_devices} is not accepted on {total} "
                      f"devices; expected fewer than {total}, the rest being the learner's")
  split = total - s.sampler_devices
  sampler_shape = s.sampler_mesh
  known = math.prod(d for d in sampler_shape if d != -1)
  resolved = tuple(s.sampler_devices // known if d == -1 else d for d in sampler_shape)
  if math.prod(resolved) != s.sampler_devices or s.sampler_devices % known:
    raise ConfigError(f"config.sampler_mesh={sampler_shape!r} is not accepted with "
                      f"config.sampler_devices={s.sampler_devices}; expected a shape of exactly "
                      "that many devices")
  try:
    learner = model.make_mesh(spec.run.mesh, devices[:split])
  except ConfigError as e:
    raise ConfigError(f"config.{e} (the learner's {split} devices: {total} less "
                      f"config.sampler_devices={s.sampler_devices})") from None
  if learner.devices.size != split:
    raise ConfigError(f"config.mesh={spec.run.mesh!r} is not accepted with "
                      f"config.sampler_devices={s.sampler_devices}; expected a mesh of the other "
                      f"{split} devices (e.g. (-1, 1, 1))")
  return learner, model.make_mesh(resolved, devices[split:])


def next_keys(rng: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(the next step's rng, this step's sampling key, its mini-batch order key): the split the
  loop makes of the run's random key once per step."""
  rng, sample_key, order_key = jax.random.split(rng, 3)
  return rng, sample_key, order_key


@dataclasses.dataclass
class Pending:
  """A rollout started ahead: step s's, sampled with the parameters of step `params_step`."""
  step: int
  params_step: int
  result: concurrent.futures.Future | Any  # a Future of (Drawn, worker seconds), or those

  def get(self) -> tuple[dynamic.Drawn, dict[str, float]]:
    """(the step's Drawn, the worker's seconds per phase), waiting for the worker if need be."""
    if isinstance(self.result, concurrent.futures.Future):
      return self.result.result()
    return self.result

  @property
  def lag(self) -> int:
    return self.step - self.params_step


# draw(step, sampler policy, sampling key, mesh) -> (Drawn, seconds per phase)
DrawFn = Callable[[int, Any, jax.Array, jax.sharding.Mesh], tuple[dynamic.Drawn, dict]]


class Rollouts:
  """Step s's completions sampled with the parameters of step max(0, s - max_lag) (module
  docstring), on a worker thread.

  Args:
    draw: samples one step (prompts from the data stream, `dynamic.draw_step`).
    graphdef: the policy's graph (the sampler merges pushed parameters into it).
    max_lag: L >= 1.
    mesh: where the sampler runs (its own sub-mesh, or the learner's).
    rng: the run's random key at `step` (the learner's `TrainState.rng`).
    step: the step the learner is at.
    restored: rollouts a checkpoint saved (`load_pending`), steps step, step + 1, ...
  """

  def __init__(self, draw: DrawFn, graphdef: nnx.GraphDef, *, max_lag: int,
               mesh: jax.sharding.Mesh, rng: jax.Array, step: int,
               restored: list[Pending] = ()):
    self._draw, self._graphdef, self._lag, self._mesh = draw, graphdef, max_lag, mesh
    self._pending = {p.step: p for p in restored}
    self._next = step + len(restored)  # the next step to start
    rng = jax.device_get(rng)  # the key chain runs on the host: the same bits as on devices
    for _ in range(len(restored)):
      rng, _, _ = next_keys(rng)
    self._rng = rng
    self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollouts")
    self._shardings = None

  def push(self, step: int, params: nnx.State) -> None:
    """The learner's parameters at `step`: starts every rollout up to step + max_lag."""
    if self._next > step + self._lag:
      return
    if self._shardings is None:
      self._shardings = jax.tree.map(
          lambda x: jax.sharding.NamedSharding(self._mesh, x.sharding.spec), params)
    # Device to device onto the sampler's shardings; on the learner's own mesh a copy, since the
    # update donates (and so frees) the buffers it is given.
    copy = jax.device_put(params, self._shardings, donate=False, may_alias=False)
    sampler = nnx.merge(self._graphdef, copy)
    while self._next <= step + self._lag:
      self._rng, sample_key, _ = next_keys(self._rng)
      s = self._next
      self._pending[s] = Pending(s, step, self._executor.submit(
          self._draw, s, sampler, sample_key, self._mesh))
      self._next += 1

  def take(self, step: int) -> tuple[dynamic.Drawn, dict[str, float], int]:
    """Step `step`'s rollout (waiting for it), the worker's seconds per phase, and its lag."""
    pending = self._pending.pop(step)
    drawn, seconds = pending.get()
    return drawn, seconds, pending.lag

  def settle(self) -> list[Pending]:
    """Waits for every started rollout (the worker is then idle until the next push) and
    returns them, done, in step order."""
    out = []
    for s in sorted(self._pending):
      p = self._pending[s]
      p.result = p.get()
      out.append(p)
    return out

  def close(self) -> None:
    for p in self._pending.values():
      if isinstance(p.result, concurrent.futures.Future):
        p.result.cancel()
    self._executor.shutdown(wait=True)


def rollouts_path(workdir: str, step: int) -> str:
  return os.path.join(workdir, ROLLOUTS_DIR, f"{step}.pkl")


def save_pending(workdir: str, step: int, pending: list[Pending], keep_from: int | None) -> None:
  """Writes the rollouts started ahead of checkpoint `step` (atomically), and removes those of
  checkpoints older than `keep_from` (the oldest step the checkpointer keeps)."""
  os.makedirs(os.path.join(workdir, ROLLOUTS_DIR), exist_ok=True)
  data = [(p.step, p.params_step, p.get()) for p in pending]
  payload = pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)

  def write(tmp: str) -> None:
    with open(tmp, "wb") as f:
      f.write(_HEADER + hashlib.sha256(payload).hexdigest().encode() + b"\n")
      f.write(payload)

  files.atomic_write(rollouts_path(workdir, step), write)
  for path in glob.glob(os.path.join(workdir, ROLLOUTS_DIR, "*.pkl")):
    name = os.path.basename(path)[:-4]
    if name.isdigit() and keep_from is not None and int(name) < keep_from:
      os.remove(path)


def load_pending(workdir: str, step: int) -> list[Pending] | None:
  """The rollouts checkpoint `step` saved, or None if it has none (a lockstep checkpoint)."""
  path = rollouts_path(workdir, step)
  if not os.path.exists(path):
    return None
  with open(path, "rb") as f:
    raw = f.read()
  head, _, payload = raw.partition(b"\n")
  fix = (f"; expected the file the run wrote at checkpoint {step}. Delete it to resume from "
         f"step {step} with rollouts sampled afresh (not an exact resume)")
  if not head.startswith(_HEADER):
    raise ChecksumError(f"{path}: not a ksjax rollouts file (no '{_HEADER.decode().strip()}' "
                        f"header){fix}")
  if hashlib.sha256(payload).hexdigest().encode() != head[len(_HEADER):]:
    raise ChecksumError(f"{path}: the rollouts differ from their sha256 (changed or cut short "
                        f"after they were written){fix}")
  data = pickle.loads(payload)  # the run's own file, written by `save_pending`, digest checked
  return [Pending(s, params_step, result) for s, params_step, result in data]


__all__ = ["Pending", "Rollouts", "load_pending", "meshes", "next_keys", "save_pending"]
