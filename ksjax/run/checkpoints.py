"""A run's step checkpoints (Orbax): written by the trainer, read by anyone.

"Checkpoint" in ksjax means one of these: a step directory `<workdir>/checkpoints/<s>` (names in
`ksjax.run.directory`) holding everything needed to continue exactly, three items:
  * state:  the TrainState (parameters, optimizer state, step, skipped-step count, random key),
            restored straight onto the mesh shardings of an abstract target;
  * data:   the grain iterator's position, through grain's own Orbax handler (one file per JAX
            process, so every host resumes its own shard);
  * config: the run's config as JSON, so that a checkpoint says what produced it.

Saves are asynchronous (the device-to-host copy blocks, the writing does not) every
`save_every` steps and at a fresh run's first step (Orbax's initial save: a crash before the first
interval loses no warm-up and no start evaluation), keeping the last `keep` ones. The state is
written uncompressed (`_state_handler`). Orbax writes into a temporary directory and
renames it when every item is complete, so a run killed mid-save leaves no step behind (the
temporary directory is removed when the manager is next opened). A step directory that is
complete but unreadable (a file lost or truncated afterwards) is skipped with a warning by
`restore_latest`, moved aside as `corrupt_<step>`, and the previous good one is used.

Checksums. A step can also be readable and wrong: a flipped bit in the parameters or the optimizer
state restores without complaint (Orbax and tensorstore keep no content checksum of the arrays).
So every step directory carries `checksums.sha256.json`, the sha256 and size of each of its files
(state, data and config items and Orbax's metadata), written atomically once Orbax has finalised
the step: right away for a synchronous save; for an asynchronous one, in a background thread as
soon as the next save, `wait` or `close` finds Orbax done (Orbax offers no hook after its final
rename; its post-finalization callback runs before it and is told neither the step nor the path).
`restore_latest` checks the manifest before restoring and treats a mismatch as it treats an
unreadable step; the eval binary checks it before reading any step (`check_shapes`). A step
without a manifest (saved before ksjax wrote them, or the process died between Orbax's rename and
the manifest) is restored unverified, with a note.

A full disk. A save that fails for want of space (ENOSPC, EDQUOT, EFBIG) is raised as
`ksjax.files.DiskFull`, one line naming the step, the state's size and the checkpoint left
whole: Orbax had been writing into a temporary directory that it never renamed, so the previous
step is still the newest one, and a resume after space is freed continues from it. The failure
of an asynchronous save is raised at the first `save` call after Orbax has given up, or by
`wait` and `close`; after it the Checkpointer writes nothing more.

Under LoRA the state's parameters are what trains alone (the adapters, and PPO's value head) and
the config item records the frozen base (`LORA_BASE_KEY`: its name and sha256); a reader builds
the base itself and checks the record (`check_shapes` with `lora_base`, `restore_policy` with
`frozen`).

Reading without touching (`steps`, `check_shapes`, `restore_policy`): evaluation needs only the
parameters, so it restores `state.params` alone (Orbax's partial restore), each array straight
onto its sharding on the evaluation mesh: the optimizer state, twice the parameters' size under
Adam, is never read. It does not use the `Checkpointer`, which opens a CheckpointManager that
creates the directory, removes temporary step directories and moves unreadable steps aside: the
right things for the process that owns the run and the wrong ones for a second process following
it while it trains. The step list comes from Orbax's listing of finalized step directories (a save
in progress is a temporary directory and is not listed).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from flax import nnx

from ksjax import errors, files, model
from ksjax.model import checkpoint as model_checkpoint
from ksjax.model import lora, sharding
from ksjax.run import policy
from ksjax.run.directory import (CONFIG_ITEM, DATA_ITEM, LORA_BASE_KEY,
                                 PARAMS_FIELD, STATE_ITEM, RunDirectory)


class CheckpointError(RuntimeError):
  """No checkpoint in the directory can be restored."""


class CheckpointInputError(ValueError):
  """The checkpoint directory, or a checkpoint in it, is not what evaluation can read."""


class ChecksumError(CheckpointInputError):
  """A step directory whose files differ from its checksum manifest."""


class CheckpointDiskFull(files.DiskFull):
  """A checkpoint save failed for want of space; the message names the checkpoint left whole."""


def resume_note(directory: str) -> str:
  """What a resume continues from after a failure: the newest whole checkpoint in `directory`."""
  whole = ocp.utils.checkpoint_steps(directory) if os.path.isdir(directory) else []
  if not whole:
    return "no checkpoint was saved before it: free space and start the run again"
  return (f"checkpoint {max(whole)} is whole, and --config.resume=True continues from it once "
          "space is freed")


# ---------------------------------------------------------------------------------------------
# Checksum manifests
# ---------------------------------------------------------------------------------------------

MANIFEST = "checksums.sha256.json"
_MANIFEST_FORMAT = 1


def _manifest_files(step_dir: str) -> list[str]:
  """The step directory's files, relative, sorted: all but the manifest and hidden temporaries
  (ksjax.files' `.<name>.tmp` files of a write that died)."""
  out = []
  for root, dirs, names in os.walk(step_dir):
    dirs.sort()
    for name in names:
      rel = os.path.relpath(os.path.join(root, name), step_dir)
      if rel != MANIFEST and not name.startswith("."):
        out.append(rel)
  return sorted(out)


# Files are hashed in parallel (hashlib releases the GIL while it hashes a large buffer) when
# enough bytes lie outside the largest file to be worth the threads: one whole-file sha256 cannot
# be split, so the largest file bounds the time (SmolLM2-135M's state: one 1.2 GB OCDBT data file
# of 1.5 GB; the default run's: 1.5 MB in all). benchmarks/checkpoint_checksum.py times both.
_HASH_THREADS = min(4, os.cpu_count() or 1)
_PARALLEL_MIN_BYTES = 32 << 20


def _sha256(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


@contextlib.contextmanager
def _sha256s(paths: list[str]) -> Iterator[Iterator[str]]:
  """The sha256 of each of `paths`, in order; a few threads hash them, the largest files first
  (so that no thread is left with a big one at the end). Leaving the block cancels what has not
  started and waits for what has: no thread reads on after a mismatch has been reported."""
  sizes = {path: _size_or_zero(path) for path in paths}
  largest_first = sorted(sizes, key=sizes.get, reverse=True)
  if (_HASH_THREADS < 2 or len(largest_first) < 2
      or sum(sizes.values()) - sizes[largest_first[0]] < _PARALLEL_MIN_BYTES):
    yield map(_sha256, paths)
    return
  pool = concurrent.futures.ThreadPoolExecutor(_HASH_THREADS, thread_name_prefix="ksjax-sha256")
  try:
    futures = {path: pool.submit(_sha256, path) for path in largest_first}
    yield (futures[path].result() for path in paths)
  finally:
    pool.shutdown(wait=True, cancel_futures=True)


def _size_or_zero(path: str) -> int:
  try:
    return os.path.getsize(path)
  except OSError:  # reported by the hashing itself, in order
    return 0


def write_manifest(step_dir: str) -> None:
  """Writes `<step_dir>/checksums.sha256.json`: the sha256 and size of every file (atomically)."""
  entries = {}
  rels = _manifest_files(step_dir)
  paths = [os.path.join(step_dir, rel) for rel in rels]
  with _sha256s(paths) as digests:
    for rel, path, digest in zip(rels, paths, digests):
      entries[rel] = {"sha256": digest, "bytes": os.path.getsize(path)}
  files.write_json(os.path.join(step_dir, MANIFEST),
                   {"format": _MANIFEST_FORMAT, "algorithm": "sha256", "files": entries},
                   sort_keys=True)


def verify_manifest(step_dir: str, prefix: str = "") -> bool:
  """Checks the files of `step_dir` (those under `prefix`, or all) against its manifest.

  Returns True when they match and False when the step has no manifest; raises ChecksumError
  naming the first file that is missing, of another size or of other content, or an unreadable
  manifest. Sizes are compared first: a truncated file costs no hashing.
  """
  path = os.path.join(step_dir, MANIFEST)
  if not os.path.isfile(path):
    return False
  try:
    with open(path, encoding="utf-8") as f:
      listed = json.load(f)["files"]
    listed = {str(rel): (str(e["sha256"]), int(e["bytes"])) for rel, e in listed.items()}
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise ChecksumError(f"{path}: unreadable checksum manifest ({type(e).__name__})") from None
  selected = sorted(rel for rel in listed if rel.startswith(prefix))
  for rel in selected:
    full = os.path.join(step_dir, rel)
    if not os.path.isfile(full):
      raise ChecksumError(f"{full} is missing; the checksum manifest lists it")
    digest, size = listed[rel]
    if os.path.getsize(full) != size:
      raise ChecksumError(f"{full} has {os.path.getsize(full)} bytes; the checksum manifest says "
                          f"{size}")
  paths = [os.path.join(step_dir, rel) for rel in selected]
  with _sha256s(paths) as digests:
    for rel, full, digest in zip(selected, paths, digests):
      if digest != listed[rel][0]:
        raise ChecksumError(f"{full}: content differs from the checksum manifest's sha256")
  return True


def _state_bytes(state: Any) -> int:
  """The bytes of `state`'s arrays (their whole, global values): a checkpoint's size, less
  Orbax's metadata and the data iterator's position, both small."""
  return sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(state))


def _state_handler() -> ocp.PyTreeCheckpointHandler:
  """The state item's handler: Orbax's PyTree handler, without compression.

  Orbax's default (and its StandardCheckpointHandler's, which offers no switch) compresses each
  array with zstd while it writes, buffering the compressed chunks: weights and Adam moments
  hardly compress, so that bought a few percent of disk for about a GiB of buffers held through
  the write (an asynchronous save overlaps the next step's sampling, so it lifted the run's peak)
  and CPU time the run's budget counts. Figures: docs/benchmarks.md, "A run's peak memory".
  Tensorstore reads the codec from each array's metadata, so compressed checkpoints (saved before
  this) restore as before."""
  return ocp.PyTreeCheckpointHandler(use_compression=False)


class Checkpointer:
  """Saves and restores (TrainState, data iterator, config) under `directory`.

  Args:
    directory: where step directories go (created on first use).
    save_every: save when step % save_every == 0, at the first step saved into an empty directory
      (Orbax's initial save), and always when asked with force=True.
    keep: how many of the most recent checkpoints to keep.
    use_async: write in a background thread.
  """

  def __init__(self, directory: str, *, save_every: int, keep: int, use_async: bool = True):
    self.directory = os.path.abspath(directory)
    self._options = ocp.CheckpointManagerOptions(
        save_interval_steps=save_every, max_to_keep=keep, create=True,
        enable_async_checkpointing=use_async, cleanup_tmp_directories=True)
    self._manager = self._open()
    self._use_async = use_async
    self._owed: list[int] = []  # saved steps whose checksum manifest is not written yet
    self._hasher: threading.Thread | None = None
    self._needs = 0  # the bytes of the last save's state, for the line a full disk gives
    self._failed = False  # a save failed for want of space: nothing more is written

  def _open(self) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        self.directory, options=self._options,
        item_handlers={STATE_ITEM: _state_handler(),
                       DATA_ITEM: grain.checkpoint.CheckpointHandler(),
                       CONFIG_ITEM: ocp.JsonCheckpointHandler()})

  def steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def due(self, step: int, *, force: bool = False) -> bool:
    """Whether `save(step, ..., force=force)` saves: Orbax's decision (the interval, a fresh
    run's first step, a preemption), asked before the save by whoever must ready something that
    belongs in the same checkpoint (the rollouts sampled ahead, `ksjax.trainer.async_rollouts`)."""
    return step not in self._manager.all_steps() and (force or self._manager.should_save(step))

  def save(self, step: int, state: Any, data_iterator: grain.DatasetIterator,
           config: Mapping[str, Any], *, force: bool = False) -> bool:
    """Starts saving step `step` if it is due (or `force`); returns whether it did.

    Called every step, it also starts writing the manifest of the previous save as soon as
    Orbax has finished it, and waits for that manifest before a new save begins (the new
    save's finalisation may delete old steps, this one included when keep=1)."""
    if step in self._manager.all_steps():
      return False
    due = self.due(step, force=force)
    if due:
      self._wait()  # Orbax's save would wait for it anyway
    self._settle_manifests()
    if due:
      self._join_hasher()
    self._needs = _state_bytes(state)
    with self._disk_full(step):  # a synchronous save fails here
      saved = self._manager.save(
          step, force=force,
          args=ocp.args.Composite(**{
              STATE_ITEM: ocp.args.PyTreeSave(state),
              DATA_ITEM: grain.checkpoint.CheckpointSave(data_iterator),
              CONFIG_ITEM: ocp.args.JsonSave(dict(config))}))
    if saved:
      self._owed.append(step)
      if not self._use_async:  # finalised already: the checkpoint is whole when save returns
        self._settle_manifests()
        self._join_hasher()
    return saved

  def _settle_manifests(self) -> None:
    """Starts writing the owed manifests in a background thread once Orbax has finished (and
    raises the failure of a save that did not, `_wait`)."""
    if not self._owed or self._manager.is_saving_in_progress():
      return
    self._wait()  # returns at once, or raises what failed the save
    owed, self._owed = self._owed, []
    if jax.process_index() != 0:  # one writer; the step directories are shared
      return
    self._join_hasher()
    self._hasher = threading.Thread(target=self._write_manifests, args=(owed,),
                                    name="ksjax-checkpoint-checksums", daemon=True)
    self._hasher.start()

  def _write_manifests(self, owed: list[int]) -> None:
    for step in owed:
      step_dir = os.path.join(self.directory, str(step))
      try:
        write_manifest(step_dir)
      except OSError as e:
        if os.path.isdir(step_dir):  # else removed by the keep policy: nothing to vouch for
          logging.warning("checksum manifest of checkpoint %d not written (%s); it will be "
                          "restored unverified", step, e)

  def _join_hasher(self) -> None:
    if self._hasher is not None:
      self._hasher.join()
      self._hasher = None

  def restore_latest(self, abstract_state: Any,
                     data_iterator: grain.DatasetIterator) -> tuple[int, Any, dict] | None:
    """(step, state, config) of the newest readable checkpoint, with `data_iterator` moved to
    its position; None when there is no checkpoint at all.

    An unreadable checkpoint is logged, moved aside and the next older one tried; CheckpointError
    if none can be read.
    """
    steps = self.steps()
    if not steps:
      return None
    failures = []
    for step in reversed(steps):
      step_dir = os.path.join(self.directory, str(step))
      try:
        verified = verify_manifest(step_dir)
        if not verified:
          print(f"note: checkpoint {step} in {self.directory} has no checksum manifest (saved "
                "before ksjax wrote them, or the run stopped before writing it); restoring it "
                "unverified", flush=True)
        with errors.quiet_if_it_fails():  # Orbax's log lines about a damaged step: in `reason`
          restored = self._manager.restore(
              step, args=ocp.args.Composite(**{
                  STATE_ITEM: ocp.args.PyTreeRestore(
                      item=abstract_state,
                      restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state)),
                  DATA_ITEM: grain.checkpoint.CheckpointRestore(data_iterator),
                  CONFIG_ITEM: ocp.args.JsonRestore()}))
      except Exception as e:  # pylint: disable=broad-except
        # Orbax, tensorstore and grain raise many types for a damaged directory; any of them
        # means this step cannot be resumed from, and the next older one may be whole.
        reason = str(e) if isinstance(e, ChecksumError) else f"{type(e).__name__}: {str(e)[:300]}"
        # One line (stdout, with the trainer's other messages; not also the log).
        print(f"warning: checkpoint {step} cannot be restored ({reason}); moved aside, using the "
              "previous one", flush=True)
        failures.append((step, reason))
        self._quarantine(step)
        continue
      return step, restored[STATE_ITEM], dict(restored[CONFIG_ITEM] or {})
    raise CheckpointError(f"no checkpoint in {self.directory} can be restored: " + "; ".join(
        f"step {s}: {r}" for s, r in failures))

  def _quarantine(self, step: int) -> None:
    """Moves a damaged step directory aside so that later saves of that step do not collide."""
    self._manager.wait_until_finished()
    path = os.path.join(self.directory, str(step))
    if os.path.isdir(path):
      os.rename(path, os.path.join(self.directory, f"corrupt_{step}_{int(time.time())}"))
    self._manager.close()
    self._manager = self._open()

  def _wait(self) -> None:
    """Orbax's wait for the save in flight, whose failure for want of space is a DiskFull."""
    with self._disk_full(self._owed[-1] if self._owed else None):
      self._manager.wait_until_finished()

  @contextlib.contextmanager
  def _disk_full(self, step: int | None) -> Iterator[None]:
    """Turns a save of `step` that failed for want of space into `files.DiskFull`: what failed,
    the state's size, and the checkpoint left whole (Orbax wrote into a temporary directory, which
    it never renamed, and removes when the manager is next opened)."""
    try:
      yield
    except Exception as e:  # pylint: disable=broad-except
      if self._failed:
        raise
      full = files.disk_full(
          f"saving checkpoint {step} in {self.directory}", e, needs=self._needs,
          where=self.directory, left=resume_note(self.directory))
      if full is None:
        raise
      self._failed = True
      self._owed = []
      raise CheckpointDiskFull(str(full)) from None

  def wait(self) -> None:
    """Until every started save, and its checksum manifest, is on disk."""
    if self._failed:
      return
    self._wait()
    self._settle_manifests()
    self._join_hasher()

  def close(self) -> None:
    self.wait()
    try:
      self._manager.close()
    except Exception:  # pylint: disable=broad-except
      if not self._failed:  # else Orbax raises again the failure already reported
        raise


# ---------------------------------------------------------------------------------------------
# Reading without touching (the eval binary, the studies)
# ---------------------------------------------------------------------------------------------

def steps(run: RunDirectory) -> list[int]:
  """The finalized checkpoint steps, ascending."""
  return sorted(ocp.utils.checkpoint_steps(run.steps_dir))


def abstract_policy(cfg: model.LlamaConfig, mesh: jax.sharding.Mesh,
                    adapted: model.Llama | None = None) -> tuple[nnx.GraphDef, nnx.State]:
  """The policy's graph and what a step checkpoint holds of it (its `PARAMS_FIELD`), as
  ShapeDtypeStructs carrying their mesh shardings: every parameter; or under LoRA, given
  `adapted` (the run's base on `mesh` with its adapters, `ksjax.run.policy.adapt`), what the
  trainer trains and saves alone (`lora.trainable_filter`: the adapters, and PPO's value head).
  The frozen rest is `lora.split(adapted)[2]`, for `restore_policy`."""
  sharding.check_divisible(cfg, mesh)
  if adapted is None:
    graphdef, state = nnx.split(model_checkpoint.abstract_model(cfg))
  else:
    graphdef, state, _ = lora.split(adapted)
  shardings = sharding.state_shardings(state, mesh)
  target = jax.tree.map(
      lambda variable, s: variable.replace(
          jax.ShapeDtypeStruct(variable.shape, variable.dtype, sharding=s)),
      state, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return graphdef, target


def _shapes(tree) -> dict[str, tuple[int, ...]]:
  """Parameter name ("layers.0.mlp.up_proj") -> shape, from a state or Orbax's metadata tree."""
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
  out = {}
  for path, leaf in flat:
    keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    if keys and keys[-1] == "value":  # nnx.Variable's own level
      keys = keys[:-1]
    out[".".join(keys)] = tuple(leaf.shape)
  return out


def _verify_item(run: RunDirectory, step: int, item: str) -> None:
  """The checksums of one item of step `step`: a ChecksumError saying what to do if it fails."""
  try:
    verify_manifest(run.step_dir(step), prefix=item + os.sep)
  except ChecksumError as e:
    raise ChecksumError(f"checkpoint step {step} in {run.steps_dir} fails its checksums ({e}); "
                        "expected an intact checkpoint (it was damaged after it was written: "
                        "evaluate another step)") from None


def _is_adapter(name: str) -> bool:
  return name.endswith(("_lora_a", "_lora_b"))


def check_shapes(run: RunDirectory, step: int, target: nnx.State, what: str,
                 lora_base: Mapping[str, str] | None = None) -> None:
  """One clear error for the first parameter that the checkpoint lacks, has in another shape,
  or has in excess of the model `what` describes. Under LoRA (`target` the adapters,
  `lora_base` the record of the base they are evaluated on, `ksjax.run.policy.base_record`),
  also one for a checkpoint whose config records another base."""
  path = run.state_dir(step)
  _verify_item(run, step, STATE_ITEM)  # the state item only: that is all evaluation reads
  try:
    with errors.quiet_if_it_fails():  # Orbax's log lines: the error below says it
      stored = ocp.PyTreeCheckpointHandler().metadata(epath.Path(path))
  except (FileNotFoundError, ValueError, KeyError, OSError, AttributeError, TypeError,
          IndexError) as e:  # (Orbax reads metadata JSON of another shape with .get and [])
    raise CheckpointInputError(f"checkpoint {path!r} cannot be read ({type(e).__name__}: "
                               f"{errors.one_line(e)[:200]}); expected a ksjax trainer "
                               "checkpoint") from None
  if stored is None or PARAMS_FIELD not in stored:
    raise CheckpointInputError(f"checkpoint {path!r} holds no {PARAMS_FIELD!r}; expected a ksjax "
                               "trainer checkpoint")
  have = _shapes(dict(stored[PARAMS_FIELD]))
  want = _shapes(target)
  where = f"checkpoint step {step} in {run.steps_dir}"
  # A LoRA run's checkpoint read as a full fine-tuning run's, or the reverse, fails on its first
  # parameter below; this says which setting to change.
  kind = ""
  if any(map(_is_adapter, have)) != any(map(_is_adapter, want)):
    kind = (" (it holds LoRA adapters: set config.run.lora as the run did)"
            if any(map(_is_adapter, have)) else
            " (it holds a whole model, from a run without LoRA: config.run.lora.rank=0)")
  for name, shape in want.items():
    if name not in have:
      raise CheckpointInputError(f"{where} lacks parameter {name!r} of {what}{kind}; expected a "
                                 "checkpoint of that model (evaluate with the run's config)")
    if have[name] != shape:
      raise CheckpointInputError(f"{where} has parameter {name!r} of shape {have[name]}; {what} "
                                 f"implies {shape} (evaluate with the run's config)")
  extra = sorted(set(have) - set(want))
  if extra:
    raise CheckpointInputError(f"{where} has parameter {extra[0]!r}, which {what} lacks{kind} "
                               "(evaluate with the run's config)")
  if lora_base is not None:
    _check_base(run, step, lora_base)


def _check_base(run: RunDirectory, step: int, base: Mapping[str, str]) -> None:
  """CheckpointInputError unless step `step`'s config item records `base` (`LORA_BASE_KEY`): its
  adapters were trained on other weights, and on these compute nonsense."""
  _verify_item(run, step, CONFIG_ITEM)  # a damaged record is a damaged checkpoint, not a base
  path = os.path.join(run.step_dir(step), CONFIG_ITEM)
  try:
    with errors.quiet_if_it_fails():
      config = ocp.JsonCheckpointHandler().restore(epath.Path(path))
  except (FileNotFoundError, ValueError, OSError) as e:
    raise CheckpointInputError(f"checkpoint {path!r} cannot be read ({type(e).__name__}: "
                               f"{errors.one_line(e)[:200]}); expected a ksjax trainer "
                               "checkpoint's config item") from None
  recorded = config.get(LORA_BASE_KEY) if isinstance(config, Mapping) else None
  # The checkpoint is the input at fault, as for its shapes.
  policy.check_base(recorded, dict(base), f"checkpoint step {step} in {run.steps_dir}",
                    base_is="config.run's base", error=CheckpointInputError)


def restore_policy(run: RunDirectory, step: int, graphdef: nnx.GraphDef, target: nnx.State,
                   frozen: nnx.State | None = None) -> model.Llama:
  """The policy at `step`, its parameters restored onto the shardings `target` carries; under
  LoRA (`abstract_policy` with `adapted`), the adapters alone, merged with the `frozen` base
  (shared, not copied: every step's policy uses the same base arrays)."""
  item = {PARAMS_FIELD: target}
  # The item's handler itself, not a Checkpointer: the trainer's step-level metadata sits one
  # directory up, and a Checkpointer would warn that the item directory lacks it.
  restored = ocp.PyTreeCheckpointHandler().restore(
      epath.Path(run.state_dir(step)),
      args=ocp.args.PyTreeRestore(item=item,
                                  restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                                  partial_restore=True))
  return lora.join(graphdef, restored[PARAMS_FIELD], frozen)
