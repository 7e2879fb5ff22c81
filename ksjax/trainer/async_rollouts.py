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
So at most L + 1 rollouts are started ahead, and the worker idles when it is L steps ahead: the
rollouts run ahead of the learner by at most L steps.

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
are waited for and written beside it (`save_pending`, `<workdir>/rollouts/<step>.rollouts`) before
Orbax saves the data iterator, which the idle worker no longer moves; a resumed run takes them
back (`load_pending`) and continues the key chain after them. Rollouts are started L steps ahead
whatever num_steps is, so that a run stopped at num_steps (or by its CPU budget) and resumed with
more steps continues exactly as one run would; the price is L rollouts sampled and not used at
the end of a run.

The rollouts file holds data only, so that a run directory (copied, shared, downloaded) cannot
run code in the process that resumes from it: a header line `ksjax-rollouts 3 sha256 <hex>`, then
an npz archive (`np.savez`, read back with `allow_pickle=False`) whose member "structure" is UTF-8
JSON, {"step": s, "objects": [...], "pending": [{"step", "params_step", "result"}, ...]}, and
whose other members, "0", "1", ..., are the arrays it names. In the JSON, null, booleans, ints,
strings, lists and finite floats (Python's repr, which reads back to the same bits) stand for
themselves, and an object with one key is a node: {"tuple": [...]}, {"dict": [[key, value], ...]}
(keys of any type), {"float": "nan"} (or "inf", "-inf"), {"array": i} (member i, dtype and bits as
saved; arrays of Python objects are neither written nor read), {"scalar": i} (a numpy scalar,
member i 0-d) or {"object": i}, entry i of "objects": an instance of one of a fixed list of
dataclasses (`Drawn`, `Rollout`, `Prompt`) as its class name and fields, listed after the entries
it refers to, so that an object met twice (a `Drawn` whose `update` is its `sampled`) is written
once and read back as one. That is all a step's rollout holds: arrays, prompts (whose `reference`
is task data: strings, numbers, lists and dicts of them) and the worker's seconds per phase. A
value of any other type fails the save by name instead of being written in a form whose reading
would run code; a file of any other form is refused by name, unread, the pickled `<step>.pkl` that
ksjax wrote before this format included. So is a file of format 2, whose `Drawn`s lack the k their
weights were computed with (`Drawn.k`, which the step logs).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import glob
import hashlib
import io
import json
import math
import os
import zipfile
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from ksjax import files, model
from ksjax.config_validation import ConfigError
from ksjax.run.checkpoints import CheckpointInputError, ChecksumError
from ksjax.run.spec import TrainSpec
from ksjax.tasks.base import Prompt
from ksjax.trainer import draw as draw_lib
from ksjax.trainer.rollout import Rollout

ROLLOUTS_DIR = "rollouts"  # beside `checkpoints` in the work directory
SUFFIX = ".rollouts"
_PICKLED_SUFFIX = ".pkl"  # what ksjax wrote before the data-only format: refused, never read
# A rollouts file is this header line with the sha256 of the npz archive that follows it, so that
# a file changed after it was written (a disk error, a copy cut short) is refused by name instead
# of read into a wrong resume. Checkpoints carry a manifest (run/checkpoints.py); this file lives
# beside them, written at the same step, so it carries its own digest. The digest detects damage,
# not tampering (whoever can edit the file can edit the digest too): that the file cannot run
# code comes from its format, data only (module docstring).
_HEADER = b"ksjax-rollouts 3 sha256 "
_FORMAT_2 = b"ksjax-rollouts 2 "  # format 3 less each step's k: refused by name
_STRUCTURE = "structure"  # the npz member holding the JSON; the arrays are "0", "1", ...
# The only classes a rollouts file can make, by name: what a step's rollout is built of.
_CLASSES: dict[str, type] = {"Drawn": draw_lib.Drawn, "Rollout": Rollout, "Prompt": Prompt}
_NAMES = {cls: name for name, cls in _CLASSES.items()}


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

  def get(self) -> tuple[draw_lib.Drawn, dict[str, float]]:
    """(the step's Drawn, the worker's seconds per phase), waiting for the worker if need be."""
    if isinstance(self.result, concurrent.futures.Future):
      return self.result.result()
    return self.result

  @property
  def lag(self) -> int:
    return self.step - self.params_step


# draw(step, sampler policy, sampling key, mesh) -> (Drawn, seconds per phase)
DrawFn = Callable[[int, Any, jax.Array, jax.sharding.Mesh], tuple[draw_lib.Drawn, dict]]


class Rollouts:
  """Step s's completions sampled with the parameters of step max(0, s - max_lag) (module
  docstring), on a worker thread.

  Args:
    draw: samples one step (the lockstep loop's `StepSampler.draw`: prompts from the data stream,
      `ksjax.trainer.draw.draw_step`).
    policy: pushed parameters (on the sampler's mesh) -> the model that samples with them (the
      graph merged with them, and under LoRA with the frozen base).
    max_lag: L >= 1.
    mesh: where the sampler runs (its own sub-mesh, or the learner's).
    rng: the run's random key at `step` (the learner's `TrainState.rng`).
    step: the step the learner is at.
    restored: rollouts a checkpoint saved (`load_pending`), steps step, step + 1, ...
  """

  def __init__(self, draw: DrawFn, policy: Callable[[nnx.State], Any], *, max_lag: int,
               mesh: jax.sharding.Mesh, rng: jax.Array, step: int,
               restored: list[Pending] = ()):
    self._draw, self._policy, self._lag, self._mesh = draw, policy, max_lag, mesh
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
    sampler = self._policy(copy)
    while self._next <= step + self._lag:
      self._rng, sample_key, _ = next_keys(self._rng)
      s = self._next
      self._pending[s] = Pending(s, step, self._executor.submit(
          self._draw, s, sampler, sample_key, self._mesh))
      self._next += 1

  def take(self, step: int) -> tuple[draw_lib.Drawn, dict[str, float], int]:
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
  return os.path.join(workdir, ROLLOUTS_DIR, f"{step}{SUFFIX}")


class _Encoder:
  """Turns values into the JSON nodes of the module docstring, collecting arrays and objects."""

  def __init__(self):
    self.arrays: list[np.ndarray] = []
    self.objects: list[dict[str, Any]] = []
    self._array_index: dict[int, int] = {}   # id(array) -> member; `arrays` keeps them alive
    self._object_index: dict[int, int] = {}  # id(object) -> entry of `objects`
    self._alive: list[Any] = []               # the objects indexed by id, kept alive likewise

  def node(self, x: Any) -> Any:
    kind = type(x)
    if x is None or kind in (bool, int, str):
      return x
    if kind is float:
      return x if math.isfinite(x) else {"float": repr(x)}  # repr: 'nan', 'inf' or '-inf'
    if kind is list:
      return [self.node(v) for v in x]
    if kind is tuple:
      return {"tuple": [self.node(v) for v in x]}
    if kind is dict:
      return {"dict": [[self.node(k), self.node(v)] for k, v in x.items()]}
    if kind is np.ndarray:
      if id(x) not in self._array_index:
        self._array_index[id(x)] = self._array(x)
      return {"array": self._array_index[id(x)]}
    if isinstance(x, np.generic):
      return {"scalar": self._array(np.asarray(x))}
    if kind in _NAMES:
      if id(x) not in self._object_index:
        fields = {f.name: self.node(getattr(x, f.name)) for f in dataclasses.fields(x)}
        self.objects.append({"class": _NAMES[kind], "fields": fields})
        self._object_index[id(x)] = len(self.objects) - 1
        self._alive.append(x)
      return {"object": self._object_index[id(x)]}
    raise TypeError(f"a rollout holds a {kind.__module__}.{kind.__qualname__}, which a rollouts "
                    "file does not store; it stores None, bool, int, float, str, list, tuple, "
                    f"dict, numpy arrays (not of objects) and scalars, and {', '.join(_CLASSES)}")

  def _array(self, x: np.ndarray) -> int:
    if x.dtype.hasobject:
      raise TypeError(f"a rollout holds an array of dtype {x.dtype}, which a rollouts file does "
                      "not store (its elements are Python objects); expected numeric, bool or "
                      "string arrays")
    self.arrays.append(x)
    return len(self.arrays) - 1


class _Decoder:
  """The values of the JSON nodes of a rollouts file, whose arrays are `archive`'s members."""

  def __init__(self, archive: np.lib.npyio.NpzFile):
    self._archive = archive
    self._arrays: dict[int, np.ndarray] = {}  # one array object per member, as it was saved
    self.objects: list[Any] = []

  def node(self, node: Any) -> Any:
    kind = type(node)
    if node is None or kind in (bool, int, float, str):
      return node
    if kind is list:
      return [self.node(v) for v in node]
    if kind is not dict or len(node) != 1:
      raise ValueError(f"a JSON object of keys {sorted(node)} is not a node" if kind is dict
                       else f"a {kind.__name__} is not a node")
    (tag, value), = node.items()
    if tag == "tuple" and type(value) is list:
      return tuple(self.node(v) for v in value)
    if tag == "dict" and type(value) is list and all(
        type(pair) is list and len(pair) == 2 for pair in value):
      return {self.node(k): self.node(v) for k, v in value}
    if tag == "float" and value in ("nan", "inf", "-inf"):
      return float(value)
    if tag == "array" and type(value) is int:
      return self._array(value)
    if tag == "scalar" and type(value) is int and self._array(value).ndim == 0:
      return self._array(value)[()]
    if tag == "object" and type(value) is int and 0 <= value < len(self.objects):
      return self.objects[value]  # only objects listed earlier: no cycles, no forward references
    raise ValueError(f"node {{{tag!r}: ...}} is not one of tuple, dict, float, array, scalar, "
                     "object (of an earlier entry)")

  def add_object(self, entry: Any) -> None:
    if type(entry) is not dict or set(entry) != {"class", "fields"}:
      raise ValueError("an entry of 'objects' is not {'class': ..., 'fields': ...}")
    cls = _CLASSES.get(entry["class"]) if type(entry["class"]) is str else None
    if cls is None:
      raise ValueError(f"class {str(entry['class'])[:80]!r} is not one of {', '.join(_CLASSES)}")
    names = [f.name for f in dataclasses.fields(cls)]
    fields = entry["fields"]
    if type(fields) is not dict or sorted(fields) != sorted(names):
      raise ValueError(f"the fields of a {entry['class']} are not {', '.join(names)}")
    self.objects.append(cls(**{name: self.node(v) for name, v in fields.items()}))

  def _array(self, member: int) -> np.ndarray:
    if member not in self._arrays:
      array = self._archive[str(member)]  # KeyError if absent; ValueError for an object array
      if type(array) is not np.ndarray:
        raise ValueError(f"member {member} is not an .npy array")
      self._arrays[member] = array
    return self._arrays[member]


def save_pending(workdir: str, step: int, pending: list[Pending], keep_from: int | None) -> None:
  """Writes the rollouts started ahead of checkpoint `step` (atomically, data only: module
  docstring), and removes those of checkpoints older than `keep_from` (the oldest step the
  checkpointer keeps)."""
  os.makedirs(os.path.join(workdir, ROLLOUTS_DIR), exist_ok=True)
  encoder = _Encoder()
  rollouts = [{"step": p.step, "params_step": p.params_step, "result": encoder.node(p.get())}
              for p in pending]
  # ensure_ascii (the default) escapes every non-ASCII character, lone surrogates included, so
  # any str reads back as it was.
  structure = json.dumps({"step": step, "objects": encoder.objects, "pending": rollouts},
                         allow_nan=False).encode()
  buffer = io.BytesIO()
  np.savez(buffer, **{_STRUCTURE: np.frombuffer(structure, np.uint8)},
           **{str(i): a for i, a in enumerate(encoder.arrays)})
  payload = buffer.getvalue()

  header = _HEADER + hashlib.sha256(payload).hexdigest().encode() + b"\n"

  def write(tmp: str) -> None:
    with open(tmp, "wb") as f:
      f.write(header)
      f.write(payload)

  files.atomic_write(rollouts_path(workdir, step), write, size=len(header) + len(payload))
  if keep_from is None:
    return
  for suffix in (SUFFIX, _PICKLED_SUFFIX):  # old pickles too: no resume reads them any more
    for path in glob.glob(os.path.join(workdir, ROLLOUTS_DIR, f"*{suffix}")):
      name = os.path.basename(path)[:-len(suffix)]
      if name.isdigit() and int(name) < keep_from:
        os.remove(path)


def load_pending(workdir: str, step: int) -> list[Pending] | None:
  """The rollouts checkpoint `step` saved, or None if it has none (a lockstep checkpoint).

  Raises CheckpointInputError (ChecksumError for a damaged file), one line naming the file: for
  a file that is not the data-only format `save_pending` writes, a pickled one included, which
  is refused unread, since unpickling a file can run any code it names."""
  path = rollouts_path(workdir, step)
  fix = (f"; expected the file the run wrote at checkpoint {step}. Delete it to resume from "
         f"step {step} with rollouts sampled afresh (not an exact resume)")
  if not os.path.exists(path):
    pickled = os.path.join(workdir, ROLLOUTS_DIR, f"{step}{_PICKLED_SUFFIX}")
    if os.path.exists(pickled):
      raise CheckpointInputError(
          f"{pickled}: pickled rollouts are not accepted (unpickling a file can run any code it "
          f"names), so it was not read; expected {path}, the data-only rollouts file ksjax "
          f"writes now. Delete it to resume from step {step} with rollouts sampled afresh (not "
          "an exact resume)")
    return None
  with open(path, "rb") as f:
    raw = f.read()
  head, _, payload = raw.partition(b"\n")
  if head.startswith(_FORMAT_2):
    raise CheckpointInputError(
        f"{path}: rollouts of format 2, written by an earlier ksjax, are not accepted (their "
        "steps do not record the k their weights were computed with); expected format 3. Delete "
        f"it to resume from step {step} with rollouts sampled afresh (not an exact resume)")
  if not head.startswith(_HEADER):
    raise ChecksumError(f"{path}: not a ksjax rollouts file (no '{_HEADER.decode().strip()}' "
                        f"header){fix}")
  if hashlib.sha256(payload).hexdigest().encode() != head[len(_HEADER):]:
    raise ChecksumError(f"{path}: the rollouts differ from their sha256 (changed or cut short "
                        f"after they were written){fix}")
  try:
    if not payload.startswith(b"PK\x03\x04"):  # else np.load would take it for .npy or a pickle
      raise ValueError("not an npz archive")
    with np.load(io.BytesIO(payload), allow_pickle=False) as archive:
      structure = json.loads(bytes(archive[_STRUCTURE]).decode())
      if type(structure) is not dict or set(structure) != {"step", "objects", "pending"}:
        raise ValueError("its JSON is not {'step': ..., 'objects': [...], 'pending': [...]}")
      if structure["step"] != step:
        raise ValueError(f"it holds the rollouts of checkpoint {structure['step']!r}")
      decoder = _Decoder(archive)
      for entry in structure["objects"]:
        decoder.add_object(entry)
      out = []
      for entry in structure["pending"]:
        if (type(entry) is not dict or set(entry) != {"step", "params_step", "result"}
            or type(entry["step"]) is not int or type(entry["params_step"]) is not int):
          raise ValueError("an entry of 'pending' is not {'step': int, 'params_step': int, "
                           "'result': ...}")
        out.append(Pending(entry["step"], entry["params_step"], decoder.node(entry["result"])))
  except (ValueError, TypeError, KeyError, IndexError, OSError, EOFError, RecursionError,
          zipfile.BadZipFile) as e:  # (JSON and UTF-8 errors are ValueErrors)
    reason = " ".join(str(e).split())[:200] or type(e).__name__
    raise CheckpointInputError(f"{path}: not the data-only rollouts file ksjax writes ({reason})"
                               f"{fix}") from None
  return out


__all__ = ["Pending", "Rollouts", "load_pending", "meshes", "next_keys", "save_pending"]
